"""The speed goals of a GPU run, read from the output of the self-test's bench stages.

Each goal names the stage whose JSON output holds its figure and how to read it there; the table says, per goal,
the measured figure, the target, whether it is met, and which row of which stage gave it. A goal whose stage did not
run (no GPU, a stage not chosen, a failed stage) or whose row is missing is "unmeasured": a figure is never
estimated here. The targets are those of the 1.3B causal video (480x832, 81 frames, 4 steps per 3-frame chunk, bf16,
random weights) on one H100 or H200; on any other GPU the table still reads its figures, against the same targets.
The native goals are read from ``bench native``'s bf16 variant at that shape on CUDA only (ComfyUI's MODEL through
the Wan Accel AR Sampler against the pack's own path and against core's SamplerARVideo); its tiny CPU run leaves them
unmeasured.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

MET, SHORT, UNMEASURED = "met", "short", "unmeasured"
EXACT_VARIANTS = ("optimized", "optimized-no-graphs", "optimized-compiled")   # exact paths of the optimized sampler
# "exact" is within the run dtype's rounding of the float32 reference: an optimized row counts when its latents are
# no further from the float32 reference than twice what the reference path itself makes in the same dtype
# (``reference-same-dtype``: the official loop's bf16 rounding); without that row, its variant being exact by
# construction (check-reference and the parity tests hold the math)
ROUNDING_FACTOR = 2.0
# ... and never a bound under the float32 one of the exact paths (the fixtures' 1e-4): a float32 run's
# reference-same-dtype is the float32 reference itself (distance 0), which would otherwise admit no optimized row
FLOAT32_EXACT = 1e-4


@dataclass(frozen=True)
class Goal:
    name: str
    unit: str
    target: float
    better: str                              # "<=" (lower is better) or ">="
    stage: str                               # the self-test stage whose JSON holds the figure
    read: Callable[[dict], tuple | None]     # stage JSON -> (value, which row) or None


def _rows(data: dict) -> dict:
    return {r.get("variant"): r for r in data.get("rows", []) if isinstance(r, dict)}


def _best(data: dict, names, key: str, ran: Callable[[dict], bool] = lambda r: True):
    """(the lowest ``key`` of the rows ``names`` that ``ran``, '<variant> <key>'), or None."""
    found = [(r[key], n) for n, r in _rows(data).items() if n in names and r.get(key) is not None and ran(r)]
    return (min(found)[0], f"{min(found)[1]} {key}") if found else None


def exact_video(data: dict):
    same = (_rows(data).get("reference-same-dtype") or {}).get("parity_max_abs")

    def exact(r: dict) -> bool:
        parity = r.get("parity_max_abs")
        return same is None or parity is None or parity <= max(ROUNDING_FACTOR * same, FLOAT32_EXACT)
    return _best(data, EXACT_VARIANTS, "steady_s", exact)


def fp8_video(data: dict):
    """The fastest row that really ran fp8 (linear layers in fp8, or attention in fp8): a twin that fell back to
    exact is not an fp8 figure."""
    def ran_fp8(r):
        return r.get("linear_ran") == "fp8" or str(r.get("attention_ran", "")).startswith("fp8")
    return _best(data, [n for n in _rows(data) if n.startswith("optimized")], "steady_s", ran_fp8)


def sixth_chunk(data: dict):
    r = _rows(data).get("optimized")
    ready = (r or {}).get("denoise_ms") or []
    return (ready[5], "optimized denoise_ms[5]") if len(ready) > 5 else None


def first_chunk(data: dict):
    r = _rows(data).get("optimized") or {}
    ready = r.get("denoise_ms") or []
    if ready:
        return ready[0], "optimized denoise_ms[0] (its latents ready, before the refresh)"
    chunks = r.get("chunk_ms") or []
    return (chunks[0], "optimized chunk_ms[0]") if chunks else None


def peak_gb(data: dict):
    r = _rows(data).get("optimized") or {}
    mb = (r.get("peak_memory") or {}).get("cuda_max_allocated_mb")
    return (round(mb / 1024, 2), "optimized peak_memory") if mb else None


def attention_rate(data: dict):
    value = data.get("fastest_exact_tflops")
    if value is None:
        return None
    call = data.get("largest_call") or ["?", "?"]
    return value, f"{data.get('fastest_exact')} at {call[0]} x {call[1]}"


def decode_fps(data: dict):
    r = _rows(data).get("optimized") or {}
    value = r.get("video_fps_with_decode")
    return (value, f"optimized video_fps_with_decode ({r.get('decode')})") if value is not None else None


NATIVE_SHAPE, NATIVE_WEIGHTS = "1.3b", "bf16"     # the bench native run the native goals are read from


def _native_seconds(data: dict):
    """{sampler: seconds per video} of bench native's bf16 variant at the 1.3B shape on CUDA; None for any other
    run (the tiny shape, a CPU, a skipped bench), whose figures say nothing about the goals' targets."""
    if data.get("shape") != NATIVE_SHAPE or not str(data.get("device", "")).startswith("cuda"):
        return None
    variant = next((v for v in data.get("variants", []) if isinstance(v, dict) and v.get("weights") == NATIVE_WEIGHTS),
                   None)
    rows = (variant or {}).get("rows") or {}
    return {k: r.get("seconds_per_video") for k, r in rows.items() if isinstance(r, dict)}


def _native_ratio(over: str, under: str):
    """The reader of seconds per video of the sampler ``over`` over the sampler ``under`` (bench native's rows)."""
    def read(data: dict):
        s = _native_seconds(data) or {}
        if not s.get(over) or not s.get(under):
            return None
        return round(s[over] / s[under], 3), f"{NATIVE_WEIGHTS}: {over} {s[over]} s / {under} {s[under]} s per video"
    return read


native_over_own = _native_ratio("native", "own")     # the Wan Accel AR Sampler on ComfyUI's MODEL over the pack's
native_vs_core = _native_ratio("core", "native")     # own path on the same file; core's SamplerARVideo over it


GOALS = (
    Goal("exact bf16 video (DiT only)", "s", 1.5, "<=", "bench sampler", exact_video),
    Goal("6th chunk, 4 denoising steps", "ms", 280.0, "<=", "bench sampler", sixth_chunk),
    Goal("attention at the largest call", "TFLOP/s", 550.0, ">=", "bench attention", attention_rate),
    Goal("fp8 mode video (DiT only)", "s", 1.0, "<=", "bench sampler", fp8_video),
    Goal("first chunk (DiT)", "ms", 150.0, "<=", "bench sampler", first_chunk),
    Goal("video FPS with decode, Wan 2.1 VAE", "FPS", 25.0, ">=", "bench decode wan", decode_fps),
    Goal("video FPS with decode, tiny decoder", "FPS", 35.0, ">=", "bench decode tiny", decode_fps),
    Goal("peak memory, exact bf16", "GB", 10.0, "<=", "bench sampler", peak_gb),
    Goal("native path vs the pack's own path, 1.3B", "x", 1.03, "<=", "bench native", native_over_own),
    Goal("native path vs core's SamplerARVideo, same MODEL", "x", 1.5, ">=", "bench native", native_vs_core),
)
STAGES = tuple(dict.fromkeys(g.stage for g in GOALS))


def judge(outputs: dict) -> list:
    """Rows of the goal table from ``outputs`` {stage name: its parsed JSON output (absent: it did not run)}."""
    rows = []
    for g in GOALS:
        data = outputs.get(g.stage)
        found = None
        if isinstance(data, dict):
            try:
                found = g.read(data)
            except (TypeError, ValueError, KeyError, IndexError):     # output of another shape: not a figure
                found = None
        row = {"goal": g.name, "target": f"{g.better} {g.target:g} {g.unit}", "stage": g.stage}
        if not found:
            rows.append(dict(row, value=None, status=UNMEASURED, source=None))
            continue
        value, source = found
        met = value <= g.target if g.better == "<=" else value >= g.target
        rows.append(dict(row, value=value, unit=g.unit, status=MET if met else SHORT, source=source))
    return rows


def markdown(rows: list) -> str:
    lines = ["| goal | measured | target | status | from |", "|---|---|---|---|---|"]
    for r in rows:
        value = "" if r["value"] is None else f"{r['value']:g} {r['unit']}"
        source = f"{r['stage']}: {r['source']}" if r["source"] else f"{r['stage']} (did not give it)"
        lines.append(f"| {r['goal']} | {value} | {r['target']} | {r['status']} | {source} |")
    return "\n".join(lines) + "\n"
