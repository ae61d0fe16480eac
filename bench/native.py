"""`python -m wan_accel bench native`: ComfyUI's own MODEL sampled by core's SamplerARVideo and by the Wan Accel AR
Sampler in one process, beside the pack's own path on the same weights.

Run it with ComfyUI's Python, ComfyUI's folder importable (the cwd, ``--comfyui DIR`` or ``COMFYUI_DIR``); where
ComfyUI does not import it prints one line and a "skipped" JSON and exits 0. Per weights variant (``--weights``):

1. a random causal Wan checkpoint is written in the layout ComfyUI's Load Diffusion Model reads (bare DiT keys,
   bf16, ComfyUI's ``config`` metadata marking it ``causal_ar``: ``model/checkpoint.core_causal_metadata``); its
   random weights are drawn on the target device when that is CUDA;
   ``fp8_scaled``: every block linear weight in float8 e4m3fn with a float32 per-tensor ``<layer>.weight_scale`` and
   the ``_quantization_metadata`` header ComfyUI writes now; ``fp8_scaled_legacy``: the same weights with
   ``<layer>.scale_weight`` and the ``scaled_fp8`` marker key of the fp8_scaled files in circulation (ComfyUI
   converts them at load: ``comfy.utils.convert_old_quants``); ``+lora``: one random LoRA on every block linear,
   in the key layout ComfyUI maps on a WAN model, applied by ComfyUI's LoraLoaderModelOnly path
   (``comfy.sd.load_lora_for_models``) and merged by the pack's own loader for its own path;
2. ComfyUI loads the file (``comfy.sd.load_diffusion_model``, as ``WAN21_CausalAR``) and samples it with a Basic
   Guider through core's ``SamplerARVideo`` (``core``) and the Wan Accel AR Sampler (``native``), alternately, one
   warm-up each then ``--repeat`` timed runs;
3. the pack's own loader loads the same file and ``sampling.sampler.sample_causal`` samples it (``own``), after
   ComfyUI's copy is unloaded.

Per sampler: seconds per video (median of the timed runs), first chunk seconds (from the start to the first
chunk's last denoising step, synchronized), peak memory (``torch.cuda.max_memory_allocated`` over a timed run, the
weights included; None on a CPU). Parity: ``native_vs_own``, the largest difference of the final latents of the
native and own paths (same weights, same noise draws); ``native_vs_core``, of one more native run fed core's own
re-noising draws (``torch.manual_seed(seed + 1000 * block + step)``, as ``sample_ar_video`` draws them) against
core's output. One untimed run of each sampler under ``profiling.dispatch_counts`` gives ``ops_per_step`` (aten ops
of one steady-state denoising step) and ``syncs_per_video``; where the native path is slower than the own path,
``why_slower`` lists them side by side with the op kinds the native step dispatches more of.

The ComfyUI side (imports of ``comfy``, the nodes) lives in ``nodes/comfy/native_bench.py``, registered here by the
command line (``app/`` imports neither ComfyUI nor the nodes).
"""
from __future__ import annotations

import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from ..cache.json_out import to_json
from . import print_columns
from .options import COMFYUI_ENV, LORA, NATIVE_SHAPES as SHAPES, NATIVE_WEIGHTS as WEIGHTS
from .options import native as add_arguments  # noqa: F401  (defined without torch: --help answers at once)

SKIP_LINE = ("ComfyUI is not importable here: run it with ComfyUI's Python from the ComfyUI folder, or set "
             "COMFYUI_DIR")
FRAMES_PER_BLOCK = 3
SLOWER = 1.03                   # native slower than own by more than this: the breakdown says why

_COMFY_SIDE = []                # the registered ComfyUI side (nodes/comfy/native_bench.py)


def register_comfy_side(side) -> None:
    """Called by nodes/comfy/native_bench.py at import: the object that loads and samples with ComfyUI."""
    _COMFY_SIDE[:] = [side]


# ----------------------------------------------------------------------------- ComfyUI, or a skip
def comfy_dir(args) -> str | None:
    """The ComfyUI folder asked for (--comfyui, else $COMFYUI_DIR), put first on sys.path; None when neither."""
    folder = getattr(args, "comfyui", None) or os.environ.get(COMFYUI_ENV) or None
    if folder:
        folder = str(Path(folder).expanduser().resolve())
        if folder not in sys.path:
            sys.path.insert(0, folder)
    return folder


def comfy_side(args, device):
    """(the ComfyUI side, None) where ComfyUI imports (its model management on ``device``), else (None, why)."""
    folder = comfy_dir(args)
    if not _COMFY_SIDE:
        return None, "the ComfyUI side of the bench is not registered (run it as `python -m wan_accel bench native`)"
    side = _COMFY_SIDE[0]
    why = side.unavailable(device)
    if why and folder and not (Path(folder) / "comfy").is_dir():
        why = f"{folder} holds no comfy/ folder ({why})"
    return (None, why) if why else (side, None)


def skipped(why: str, args) -> int:
    result = {"bench": "native", "skipped": True, "reason": SKIP_LINE, "detail": why}
    print(SKIP_LINE, file=sys.stderr if getattr(args, "json", False) else sys.stdout)    # JSON alone on stdout
    print(to_json(result, indent=None))
    return 0


# ----------------------------------------------------------------------------- checkpoint files
def shape_config(shape: str):
    from ..model import config as cfgmod
    spec = SHAPES[shape][0]
    return getattr(cfgmod, spec) if isinstance(spec, str) else cfgmod.WanConfig(**spec)


def parse_weights(text: str) -> list:
    from ..app.validate import UsageError
    names = [n.strip() for n in str(text).split(",") if n.strip()]
    if not names:
        raise UsageError("--weights: name at least one of " + ", ".join(WEIGHTS))
    for n in names:
        if n.removesuffix(LORA) not in WEIGHTS:
            raise UsageError(f"--weights: unknown {n!r}; choose from {', '.join(WEIGHTS)} (each optionally "
                             f"with '{LORA}')")
    return list(dict.fromkeys(names))


# ----------------------------------------------------------------------------- timing
def timed(run, device, steps: int) -> tuple:
    """(output, seconds, first chunk seconds, peak MiB) of ``run(on_step)``; ``on_step()`` is called once per
    denoising step and marks the first chunk at its last step (a device sync there)."""
    from ..profiling.runner import sync_device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    calls, marks = [0], []

    def on_step(*_a, **_k):
        calls[0] += 1
        if calls[0] == steps:
            sync_device(device)
            marks.append(time.perf_counter())
    sync_device(device)
    t0 = time.perf_counter()
    out = run(on_step)
    sync_device(device)
    total = time.perf_counter() - t0
    peak = round(torch.cuda.max_memory_allocated(device) / 2 ** 20, 1) if device.type == "cuda" else None
    return out, total, (marks[0] - t0) if marks else None, peak


def summarize(times: list, firsts: list, peaks: list) -> dict:
    return {"seconds_per_video": round(statistics.median(times), 4), "times_s": [round(t, 4) for t in times],
            "first_chunk_s": round(statistics.median(f for f in firsts if f is not None), 4)
            if any(f is not None for f in firsts) else None,
            "peak_memory_mb": max(peaks) if peaks and peaks[0] is not None else None}


def core_noise(seed: int, shape, steps: int, device) -> dict:
    """The re-noising draws of core's ``sample_ar_video`` for a latent [B, C, T, H, W], keyed as the Wan Accel AR
    Sampler's recorded noise (``extra_noise.block{b}.step{i}``, [B, F, C, H, W]): ``torch.manual_seed(seed + 1000 *
    block + step)`` then a float32 normal draw of the block's shape on the run's device."""
    b, c, t, h, w = shape
    out = {}
    for block, f0 in enumerate(range(0, t, FRAMES_PER_BLOCK)):
        bf = min(FRAMES_PER_BLOCK, t - f0)
        for i in range(steps - 1):
            torch.manual_seed(int(seed) + block * 1000 + i)
            draw = torch.randn((b, c, bf, h, w), dtype=torch.float32, device=device)
            out[f"extra_noise.block{block}.step{i}"] = draw.movedim(1, 2).contiguous()
    return out


def _max_abs(a, b):
    if a is None or b is None:
        return None
    return float((a.float().cpu() - b.float().cpu()).abs().max())


# ----------------------------------------------------------------------------- the pack's own path
def own_rows(path: Path, lora: Path | None, args, dtype, device, inputs: dict, profile: bool) -> tuple:
    """(row, final latents [B, C, T, H, W], structure) of the pack's own loader and sampler on the file."""
    from ..app.prepare import RunInputs, RunSpec, SamplingHooks, prepare, prepare_model
    from ..model.loader import load_wan_checkpoint
    from ..sampling.runner import release_buffers
    from ..sampling.scheduler import schedule_from_sigmas
    model = load_wan_checkpoint(str(path), device=device, dtype=dtype, lora=None if lora is None else str(lora),
                                lora_strength=args.lora_strength)
    sched = schedule_from_sigmas(inputs["sigmas"].tolist())
    spec = RunSpec(path=args.path, schedule=sched, frames_per_block=FRAMES_PER_BLOCK, seed=inputs["seed"],
                   partial_last_block=True, oom_retry="off")
    setup = prepare_model(model, spec)      # the doctor's verdicts, as the native sampler's run gets them
    run_inputs = RunInputs(context=inputs["context"].to(device), noise=inputs["noise"].to(device).movedim(1, 2))
    steps = len(sched.timesteps)

    def run(on_step, callback=None):
        cb = callback or (lambda ci, k, nc, ns, x0: on_step())
        with torch.no_grad():
            return prepare(model, spec, run_inputs, SamplingHooks(callback=cb), setup=setup).latents()
    runs, structure = [], None
    for rep in range(1 + args.repeat):
        out, *figures = timed(run, device, steps)
        runs += [figures] if rep else []
    if profile:
        from ..profiling.dispatch_counts import DispatchCounts
        counts = DispatchCounts()
        with counts:
            run(None, callback=counts.step_callback())
        structure = _structure(counts, counts.steady_step())
    release_buffers(model)
    del model
    return summarize(*zip(*runs)), out.movedim(1, 2).float().cpu(), structure


def _structure(counts, step) -> dict:
    return {"ops_per_step": step.ops, "syncs_per_video": counts.syncs, "sync_names": dict(counts.sync_names),
            "step_op_names": dict(step.op_names)}


def why_slower(rows: dict, structure: dict) -> dict | None:
    """Where the native path is slower than the own one: the two paths' dispatch figures side by side, and the op
    kinds one native step dispatches more of than one own step (the largest differences first)."""
    native, own = rows.get("native", {}), rows.get("own", {})
    if not native.get("seconds_per_video") or not own.get("seconds_per_video"):
        return None
    ratio = native["seconds_per_video"] / own["seconds_per_video"]
    if ratio <= SLOWER:
        return None
    out = {"native_over_own": round(ratio, 3)}
    n, o = (structure or {}).get("native"), (structure or {}).get("own")
    if n and o:
        names = set(n["step_op_names"]) | set(o["step_op_names"])
        extra = sorted(((n["step_op_names"].get(k, 0) - o["step_op_names"].get(k, 0), k) for k in names),
                       reverse=True)
        out.update({"ops_per_step": {"native": n["ops_per_step"], "own": o["ops_per_step"]},
                    "syncs_per_video": {"native": n["syncs_per_video"], "own": o["syncs_per_video"]},
                    "native_extra_ops_per_step": dict((k, d) for d, k in extra[:12] if d > 0),
                    "own_extra_ops_per_step": dict((k, -d) for d, k in sorted(extra)[:12] if d < 0)})
    else:
        out["note"] = "run without --no-profile for the dispatch breakdown"
    return out


# ----------------------------------------------------------------------------- one weights variant
def run_variant(name: str, side, args, config, device, workdir: Path, base_weights: dict, inputs: dict) -> dict:
    import gc

    from ..model.checkpoint import core_causal_metadata
    from ..model.random_checkpoint import fp8_scaled, random_lora, write_file
    weights = name.removesuffix(LORA)
    lora = name.endswith(LORA)
    meta = dict(core_causal_metadata(config))
    if weights == "bf16":
        tensors = base_weights
    else:
        tensors, extra = fp8_scaled(base_weights, legacy=weights == "fp8_scaled_legacy",
                                    device=device if device.type == "cuda" else None)
        meta.update(extra)
    path = workdir / f"wan_{args.shape}_{weights}_s{args.seed}.safetensors"    # reused only for the same contents
    file_mb = write_file(path, tensors, meta) if not path.exists() else round(path.stat().st_size / 2 ** 20, 2)
    lora_path = None
    if lora:
        lora_path = workdir / f"lora_{args.shape}_r{args.lora_rank}_s{args.seed}.safetensors"
        if not lora_path.exists():
            write_file(lora_path, random_lora(base_weights, args.lora_rank, args.seed), {})
    del tensors
    steps = len(inputs["sigmas"]) - 1
    result = {"weights": name, "file_mb": file_mb, "rows": {}, "parity": {}}
    rows, outs, structure = result["rows"], {}, {}
    profile = not args.no_profile
    run_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32    # until ComfyUI's model says
    model = guider = samplers = None
    try:
        model = side.load(path, lora_path, args.lora_strength)
        result.update(side.describe(model))
        run_dtype = side.run_dtype(model)
        samplers = {"core": side.core_sampler(FRAMES_PER_BLOCK),
                    "native": side.native_sampler(FRAMES_PER_BLOCK, args.path)}
        guider = side.guider(model, inputs["context"])
        runs = {k: [] for k in samplers}
        for rep in range(1 + args.repeat):           # alternately: the first round warms both up
            for key, sampler in samplers.items():
                def run(on_step, sampler=sampler):
                    return side.sample(guider, sampler, inputs, on_step)
                outs[key], *figures = timed(run, device, steps)
                runs[key] += [figures] if rep else []
        for key, figures in runs.items():
            rows[key] = summarize(*zip(*figures))
        recorded = core_noise(inputs["seed"], tuple(inputs["noise"].shape), steps, device)
        fed = side.sample(guider, samplers["native"], inputs, None, recorded=recorded)
        result["parity"]["native_vs_core_max_abs"] = _max_abs(fed, outs["core"])
        result["parity"]["native_vs_core_own_draws_max_abs"] = _max_abs(outs["native"], outs["core"])
        if profile:
            structure.update(side.structure(guider, samplers, inputs))
    except Exception as exc:  # noqa: BLE001 - a variant that fails is a row with its error, the others still run
        result["error"] = f"ComfyUI side: {type(exc).__name__}: {str(exc)[:400]}"
        result["error_trace"] = traceback.format_exc(limit=-4)[-3000:]
    model = guider = samplers = None
    side.unload()
    gc.collect()
    try:
        rows["own"], outs["own"], own_structure = own_rows(path, lora_path, args, run_dtype, device, inputs, profile)
        if own_structure:
            structure["own"] = own_structure
    except Exception as exc:  # noqa: BLE001
        rows["own"] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}",
                       "error_trace": traceback.format_exc(limit=-4)[-3000:]}
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    result["parity"]["native_vs_own_max_abs"] = _max_abs(outs.get("native"), outs.get("own"))
    native_s = rows.get("native", {}).get("seconds_per_video")
    for other in ("core", "own"):
        s = rows.get(other, {}).get("seconds_per_video")
        result.setdefault("ratios", {})[f"native_speedup_vs_{other}"] = \
            round(s / native_s, 3) if s and native_s else None
    if structure:
        result["structure"] = {k: {kk: vv for kk, vv in v.items() if kk != "step_op_names"}
                               for k, v in structure.items()}
    result["why_slower"] = why_slower(rows, structure)
    return result


def _inputs(config, shape: str, seed: int, device) -> dict:
    from ..sampling.scheduler import resolve_schedule
    _spec, frames, lh, lw, tokens = SHAPES[shape]
    g = torch.Generator().manual_seed(int(seed) + 1)
    context = torch.randn(1, tokens, config.text_dim, generator=g)
    noise = torch.randn(1, config.in_dim, frames, lh, lw, generator=g)
    sigmas = torch.tensor(resolve_schedule("self_forcing").sigmas(), dtype=torch.float32)
    return {"context": context, "noise": noise, "latent": torch.zeros_like(noise), "sigmas": sigmas,
            "seed": int(seed) + 7}


def _versions(side) -> dict:
    import platform
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton
        out["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        out["triton"] = None
    from .. import __version__
    out["comfyui-wan-accel"] = __version__
    out.update(side.versions())
    return out


def run(args) -> int:
    import datetime
    import shutil
    import tempfile

    from ..cache.fingerprint import cpu_name
    from ..model.checkpoint import expected_shapes
    from ..model.tiny import draw_weights
    from ..app.validate import UsageError, check_float, check_int
    names = parse_weights(args.weights)
    given = [o for o, v in (("--lora-rank", args.lora_rank), ("--lora-strength", args.lora_strength)) if v is not None]
    if given and not any(n.endswith(LORA) for n in names):   # it would be ignored: no variant applies a LoRA
        raise UsageError(f"{given[0]} sets the random LoRA, and --weights {args.weights} has no '{LORA}' variant: "
                         f"add one (e.g. bf16{LORA}), or leave out {' and '.join(given)}")
    args.lora_rank = 16 if args.lora_rank is None else args.lora_rank
    args.lora_strength = 1.0 if args.lora_strength is None else args.lora_strength
    check_int("--lora-rank", args.lora_rank, 1, 4096)
    check_float("--lora-strength", args.lora_strength, -100.0, 100.0)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))   # checked: cli/bench.py
    side, why = comfy_side(args, device)
    if side is None:
        return skipped(why, args)
    config = shape_config(args.shape)
    _spec, frames, lh, lw, _tokens = SHAPES[args.shape]
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="wan_accel_native_"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    gen_device = device if device.type == "cuda" else torch.device("cpu")
    base = {k: v.cpu() for k, v in draw_weights(expected_shapes(config), args.seed, gen_device, torch.bfloat16)}
    if device.type == "cuda":          # drawn there (fast), kept on the host: no sampler's peak holds them
        torch.cuda.empty_cache()
    inputs = _inputs(config, args.shape, args.seed, device)
    result = {"bench": "native", "skipped": False, "shape": args.shape,
              "config": {k: getattr(config, k) for k in ("dim", "ffn_dim", "num_heads", "num_layers", "text_len")},
              "latent": list(inputs["noise"].shape), "pixels": [4 * (frames - 1) + 1, 8 * lh, 8 * lw],
              "steps": len(inputs["sigmas"]) - 1, "frames_per_block": FRAMES_PER_BLOCK, "repeat": args.repeat,
              "path": args.path, "device": str(device),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
              "threads": torch.get_num_threads(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "versions": _versions(side), "variants": []}
    try:
        for name in names:
            result["variants"].append(run_variant(name, side, args, config, device, work, base, inputs))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.json:
        print(to_json(result, indent=1))
    else:
        print_table(result)
    return 0


def print_table(result: dict) -> None:
    v = result["versions"]
    print(f"native bench on {result['device_name']} ({result['device']}), shape {result['shape']} "
          f"{result['pixels'][0]} frames {result['pixels'][2]}x{result['pixels'][1]}, {result['steps']} steps, "
          f"path {result['path']}; torch {v['torch']}, ComfyUI {v.get('comfyui')}, comfy-kitchen "
          f"{v.get('comfy-kitchen')}")
    cols = ["weights", "sampler", "s/video", "first chunk s", "peak MiB", "native speedup", "parity"]
    table = []
    for var in result["variants"]:
        for key in ("core", "native", "own"):
            r = var["rows"].get(key)
            if r is None:
                continue
            par = {"core": var["parity"].get("native_vs_core_max_abs"),
                   "own": var["parity"].get("native_vs_own_max_abs")}.get(key)
            ratio = var.get("ratios", {}).get(f"native_speedup_vs_{key}")
            table.append([var["weights"], key, r.get("seconds_per_video", "error"),
                          r.get("first_chunk_s"), r.get("peak_memory_mb"),
                          f"{ratio}x" if ratio else None, None if par is None else f"{par:.2e}"])
    print_columns(cols, table)
    for var in result["variants"]:
        if var.get("why_slower"):
            print(f"{var['weights']}: native slower than own: {to_json(var['why_slower'], indent=None)}")
    for var in result["variants"]:
        for what in [var.get("error")] + [f"{k}: {r['error']}" for k, r in var["rows"].items() if r.get("error")]:
            if what:
                print(f"{var['weights']}: {what}")
