"""`python -m wan_accel bench sampler`: the reference sampler path vs the optimized one, side by side.

reference: float32 weights and math, torch SDPA, every cache refresh run (the parity configuration).
optimized: the load dtype (bf16 on CUDA) with the 'self_forcing' policy, attention 'auto', last refresh skipped.
Both run the same model source (tiny random model or a checkpoint), sizes and seed; the first run of each
variant is a warm-up and the median of the following runs is reported.
"""
from __future__ import annotations

import json
import statistics
import time

import torch

VARIANTS = {
    "reference": {"dtype": "fp32", "precision": "float32", "attention": "sdpa", "skip_last_refresh": False},
    "optimized": {"dtype": None, "precision": "self_forcing", "attention": "auto", "skip_last_refresh": True},
}


def add_arguments(parser) -> None:
    parser.add_argument("--checkpoint", help=".safetensors DiT (default: built-in tiny random model)")
    parser.add_argument("--frames", type=int, help="video frames (default 33 tiny / 81 checkpoint)")
    parser.add_argument("--height", type=int, help="pixels (default 128 tiny / 480 checkpoint)")
    parser.add_argument("--width", type=int, help="pixels (default 128 tiny / 832 checkpoint)")
    parser.add_argument("--device", help="cuda / cpu (default: cuda if available)")
    parser.add_argument("--repeat", type=int, default=2, help="timed runs per variant after one warm-up")
    parser.add_argument("--variants", default="reference,optimized", help="comma list of: " + ", ".join(VARIANTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")


def _time_variant(name: str, args, device, frames, height, width) -> dict:
    from .handle import load_model_handle
    from .job import _peak_memory, _sync, latent_frames, sample_latents
    v = VARIANTS[name]
    dtype = v["dtype"] or ("bf16" if device.type == "cuda" else "fp32")
    handle = load_model_handle(args.checkpoint, dtype, v["precision"], v["attention"], device)
    context = torch.zeros(1, 0, handle.config.text_dim)
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(1 + max(1, args.repeat)):
        _sync(device)
        t0 = time.perf_counter()
        sample_latents(handle.model, context, width, height, frames, args.seed,
                       skip_last_refresh=v["skip_last_refresh"])
        _sync(device)
        times.append(time.perf_counter() - t0)
    steady = statistics.median(times[1:])
    lf = latent_frames(frames)
    row = {"variant": name, "dtype": dtype, "precision": handle.precision, "attention": v["attention"],
           "first_s": round(times[0], 4), "steady_s": round(steady, 4), "latent_fps": round(lf / steady, 2),
           "video_fps": round(frames / steady, 2), "peak_memory": _peak_memory(device)}
    del handle
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def run(args) -> int:
    from .handle import default_device
    from .job import MODEL_DEFAULTS, TINY_DEFAULTS
    device = torch.device(args.device) if args.device else default_device()
    d = MODEL_DEFAULTS if args.checkpoint else TINY_DEFAULTS
    frames, height, width = args.frames or d["frames"], args.height or d["height"], args.width or d["width"]
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        print(f"error: unknown variants {unknown}; choose from {list(VARIANTS)}")
        return 2
    rows = [_time_variant(n, args, device, frames, height, width) for n in names]
    base = rows[0]["steady_s"]
    for r in rows:
        r["speedup_vs_first"] = round(base / r["steady_s"], 3) if r["steady_s"] else None
    result = {"device": str(device), "model": args.checkpoint or "tiny", "frames": frames, "height": height,
              "width": width, "rows": rows}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"sampler bench on {device}, {result['model']}, {frames} frames {width}x{height}")
    cols = ["variant", "dtype", "precision", "attention", "first_s", "steady_s", "video_fps", "speedup_vs_first"]
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(r[c]).ljust(w) for c, w in zip(cols, widths)))
    return 0
