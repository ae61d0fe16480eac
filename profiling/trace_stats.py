"""Pure functions over Chrome/Perfetto trace events (the JSON ``torch.profiler`` exports).

Nothing here imports torch: the functions take the list of ``traceEvents`` and return plain dicts, so they are
easy to test with synthetic events and work the same on traces written by any torch version.
"""
from __future__ import annotations

from statistics import median

# Event categories the profiler gives GPU-side activity (CUDA and ROCm traces use the same names).
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")

# A GPU idle for this share of the wall time or more is worth a remark.
IDLE_REMARK_FRACTION = 0.30
# Median kernel duration (microseconds) below which idle time points at launch overhead.
SHORT_KERNEL_US = 20.0


def complete_events(events: list[dict], categories) -> list[dict]:
    """Complete ("X") events whose category is in ``categories`` and that carry a duration."""
    cats = set(categories)
    return [e for e in events
            if e.get("ph", "X") == "X" and e.get("cat") in cats and "ts" in e and "dur" in e]


def merge_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of [start, end) intervals, sorted and non-overlapping."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _run_windows(events: list[dict], window_names) -> list[tuple[float, float]]:
    """Union of the spans of the annotations named in ``window_names`` (the per-run annotations)."""
    names = set(window_names or ())
    return merge_intervals([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                            if names and e.get("name") in names and e.get("cat") == "user_annotation"
                            and "ts" in e and "dur" in e])


def _clip(intervals, windows):
    out = []
    for s, e in intervals:
        for ws, we in windows:
            lo, hi = max(s, ws), min(e, we)
            if hi > lo:
                out.append((lo, hi))
    return out


def gpu_idle_stats(events: list[dict], window_names=None) -> dict | None:
    """How much of the profiled wall time the GPU spent idle between kernels.

    The wall time is the union of the events named in ``window_names`` (the per-run annotations); when none
    is given or found, it is the span from the first to the last event of the trace. Returns None when the
    trace holds no GPU activity (a CPU run): the caller reports N/A.
    """
    gpu = complete_events(events, GPU_CATEGORIES)
    if not gpu:
        return None
    kernels = [e for e in gpu if e.get("cat") == "kernel"]
    windows = _run_windows(events, window_names)
    if not windows:
        timed = [e for e in events if "ts" in e and e.get("ph", "X") == "X"]
        start = min(float(e["ts"]) for e in timed)
        end = max(float(e["ts"]) + float(e.get("dur", 0.0)) for e in timed)
        windows = merge_intervals([(start, end)])
    wall_us = sum(e - s for s, e in windows)
    busy = merge_intervals(_clip([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu], windows))
    busy_us = sum(e - s for s, e in busy)
    gaps = [b[0] - a[1] for a, b in zip(busy, busy[1:])]
    durations = [float(e["dur"]) for e in kernels] or [0.0]
    idle_us = max(wall_us - busy_us, 0.0)
    idle_fraction = idle_us / wall_us if wall_us > 0 else 0.0
    med = float(median(durations))
    stats = {
        "wall_us": round(wall_us, 3),
        "busy_us": round(busy_us, 3),
        "idle_us": round(idle_us, 3),
        "idle_fraction": round(idle_fraction, 4),
        "kernel_count": len(kernels),
        "median_kernel_us": round(med, 3),
        "gap_count": len(gaps),
        "largest_gap_us": round(max(gaps), 3) if gaps else 0.0,
        "launch_bound": bool(idle_fraction >= IDLE_REMARK_FRACTION and med < SHORT_KERNEL_US),
    }
    stats["verdict"] = idle_verdict(stats)
    return stats


def idle_verdict(stats: dict) -> str:
    """One sentence that says what the idle numbers mean and what to try."""
    pct = 100.0 * stats["idle_fraction"]
    if stats["launch_bound"]:
        return (f"launch-bound: the GPU is idle {pct:.0f}% of the wall time between {stats['kernel_count']} short "
                f"kernels (median {stats['median_kernel_us']:.1f} us). Try compile mode 'reduce-overhead' (CUDA "
                "graphs), a larger batch or frames per block, or fewer, fused kernels.")
    if stats["idle_fraction"] >= IDLE_REMARK_FRACTION:
        return (f"the GPU is idle {pct:.0f}% of the wall time while kernels are long: the host is the bottleneck "
                "(Python work, host syncs such as .item()/.cpu(), data loading or CPU<->GPU copies).")
    return f"the GPU is busy {100.0 - pct:.0f}% of the wall time."


def top_kernels(events: list[dict], limit: int = 10) -> list[dict]:
    """GPU kernels aggregated by name, largest total time first."""
    agg: dict[str, list[float]] = {}
    for e in complete_events(events, ("kernel",)):
        agg.setdefault(str(e.get("name", "?")), []).append(float(e["dur"]))
    rows = [{"name": name, "count": len(d), "total_us": round(sum(d), 3), "mean_us": round(sum(d) / len(d), 3)}
            for name, d in agg.items()]
    rows.sort(key=lambda r: r["total_us"], reverse=True)
    return rows[:limit]


# Kernel classes of the per-call breakdown, by kernel name (CUDA libraries and Triton name their kernels this way;
# a name matching none of the patterns is memory-bound/elementwise work: norms, RoPE, modulation, copies, casts).
KERNEL_CLASSES = ("attention", "gemm", "memory-bound", "memcpy/memset")
_ATTENTION_MARKS = ("flash", "fmha", "sdpa", "attention", "attn", "_fwd_kernel")
_GEMM_MARKS = ("gemm", "xmma", "cutlass", "nvjet", "cublas", "scaled_mm", "_mm_", "triton_tem", "matmul",
               "s16816", "wgmma", "splitk", "dot_")


def kernel_class(name: str, category: str = "kernel") -> str:
    """Which of ``KERNEL_CLASSES`` a GPU event belongs to, from its category and name."""
    if category in ("gpu_memcpy", "gpu_memset"):
        return "memcpy/memset"
    low = name.lower()
    if any(m in low for m in _ATTENTION_MARKS):
        return "attention"
    if any(m in low for m in _GEMM_MARKS) or low.startswith(("sm80_", "sm90_", "sm100_", "ampere_", "hopper_")):
        return "gemm"
    return "memory-bound"


def kernel_breakdown(events: list[dict], window_names=None, *, model_calls: int | None = None,
                     flops: dict | None = None, runs: int = 1, idle: dict | None = None) -> dict | None:
    """GPU time per kernel class inside the profiled windows, with the idle time between kernels.

    model_calls: model forward calls per run (the per-call column); flops: {class: FLOPs per run} for the classes
    whose achieved TFLOP/s is shown (attention, gemm); runs: profiled runs in the trace; idle: the trace's
    ``gpu_idle_stats`` when the caller has them already. None on a trace without GPU activity."""
    idle = idle if idle is not None else gpu_idle_stats(events, window_names)
    if idle is None:
        return None
    windows = _run_windows(events, window_names)
    per: dict[str, list] = {c: [0.0, 0] for c in KERNEL_CLASSES}
    for e in complete_events(events, GPU_CATEGORIES):
        span = [(float(e["ts"]), float(e["ts"]) + float(e["dur"]))]
        inside = sum(b - a for a, b in (_clip(span, windows) if windows else span))
        if inside <= 0:
            continue
        row = per[kernel_class(str(e.get("name", "")), str(e.get("cat")))]
        row[0] += inside
        row[1] += 1
    runs = max(int(runs), 1)
    wall = idle["wall_us"]
    rows = []
    for cls in (*KERNEL_CLASSES, "idle"):
        us, count = (idle["idle_us"], idle["gap_count"]) if cls == "idle" else per[cls]
        row = {"class": cls, "ms_per_run": round(us / runs / 1000.0, 3), "kernels": count // runs,
               "share": round(us / wall, 4) if wall > 0 else 0.0}
        if model_calls:
            row["ms_per_call"] = round(us / runs / model_calls / 1000.0, 4)
        work = (flops or {}).get(cls)
        if work and us > 0:
            row["tflops"] = round(work / (us / runs / 1e6) / 1e12, 1)
        rows.append(row)
    return {"rows": rows, "wall_ms_per_run": round(wall / runs / 1000.0, 3), "model_calls": model_calls}


def breakdown_table(breakdown: dict, ceilings: dict | None = None) -> str:
    """The breakdown as a markdown table (docs/benchmarks.md takes it as it is)."""
    per_call = breakdown.get("model_calls")
    head = "| class | ms per run | share of wall | kernels per run |" + (" ms per model call |" if per_call else "")
    head += " achieved TFLOP/s |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in breakdown["rows"]:
        cells = [r["class"], f"{r['ms_per_run']:.2f}", f"{100 * r['share']:.1f} %", str(r["kernels"])]
        if per_call:
            cells.append(f"{r.get('ms_per_call', 0.0):.3f}")
        cells.append(f"{r['tflops']:.0f}" if "tflops" in r else "")
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    if ceilings:
        text += "\n\nmeasured ceilings: " + ", ".join(f"{k} {v}" for k, v in ceilings.items())
    return text
