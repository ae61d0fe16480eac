"""``python -m wan_accel bench play``: Matrix-Game-2 play-mode chunks with the session's caches written in place,
against the same chunks with the caches copied in and out (as a continuation from a kept state runs), side by side.

One process; the same model, start latent, CLIP tokens and keys for both modes. Per mode, after --warmup chunks
(at least enough to fill the cache window, so the in-place path is the one timed):

  chunk ms            median wall time of --chunks chunks (synchronized on CUDA)
  new per chunk       bytes of the new tensors one chunk makes (counted in one more, untimed chunk)
  peak per chunk      CUDA only: the allocator's peak during a chunk above what was allocated before it
  same frames         whether the two modes made the same latents, bit for bit

--model tiny (default; any device), --model released (the released 1.3B shape with an action module in every block,
random weights; CUDA only) or --checkpoint FILE (a Matrix-Game-2 checkpoint). Times are the device's; the ratios are
measured side by side in one run.
"""
from __future__ import annotations

import statistics
import time

import torch

from ..profiling.runner import sync_device
from ..cache.json_out import to_json
from .options import PLAY_SIZES as SIZES, play as add_arguments  # noqa: E402,F401  (defined without torch)


def _model(args, device, dtype):
    from ..app.jobs.handle import parse_dtype
    from ..app.jobs.mg2 import load_mg2_handle
    from ..model.config import WanConfig
    from ..model.mg2_model import tiny_mg2_model

    if args.checkpoint or args.model == "tiny":        # no checkpoint: the generate job's tiny model
        return load_mg2_handle(args.checkpoint, dtype, "self_forcing", "auto", device).model
    config = WanConfig(model_type="i2v", in_dim=36, local_attn_size=6,
                       extra={"action_config": {"blocks": list(range(30))}})
    return tiny_mg2_model(seed=0, device=device, dtype=parse_dtype(dtype), config=config)


def _run_mode(model, image, tokens, keys, in_place: bool, warmup: int, chunks: int, device, progress=None) -> dict:
    from ..app.play.registry import PlaySession
    from ..profiling.dispatch_counts import DispatchCounts

    play = PlaySession(model, image, tokens, seed=0, in_place=in_place)
    times, peaks = [], []
    with torch.inference_mode():
        for i in range(warmup + chunks):
            held = keys[i % len(keys)]
            sync_device(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            play.step(held)
            sync_device(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
                if device.type == "cuda":
                    peaks.append(torch.cuda.max_memory_allocated(device) - before)
            if progress is not None:        # after the chunk's clock stopped
                progress(f"warm-up chunk {i + 1}/{warmup} done" if i < warmup else
                         f"timed chunk {i - warmup + 1}/{chunks} done")
        with DispatchCounts() as counts:
            play.step(keys[(warmup + chunks) % len(keys)])
    latents = play.latent_video()
    play.free("benchmark done")
    return {"mode": "in place" if in_place else "copies", "chunk_ms": statistics.median(times) * 1e3,
            "new_bytes_per_chunk": counts.alloc_bytes, "largest_new_bytes": counts.largest_alloc_bytes,
            "peak_bytes_per_chunk": max(peaks) if peaks else None, "latents": latents}


def _mb(n) -> str:
    return "n/a" if n is None else f"{n / 2 ** 20:.1f} MB"


def run(args) -> int:
    from ..app.validate import UsageError, check_int
    from ..sampling.actions_script import MODES

    # --device, --warmup and a given --width / --height were checked with every bench's values (cli/bench.py)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if (args.model == "released" and not args.checkpoint) and device.type != "cuda":
        raise UsageError("--model released builds the 1.3B shape: it needs a CUDA GPU (a chunk takes minutes on a "
                         "CPU); use --model tiny here")
    check_int("--chunks", args.chunks, 1, 10000)
    width, height = args.width or SIZES[args.model][0], args.height or SIZES[args.model][1]
    if args.dtype not in (None, "fp32") and device.type != "cuda":     # it would be ignored: a CPU runs float32
        raise UsageError(f"--dtype {args.dtype}: bench play runs float32 on a {device.type}; leave out --dtype, or "
                         f"run on a CUDA device")
    dtype = (args.dtype or "bf16") if device.type == "cuda" else "fp32"
    from ..app.progress import Progress
    progress = Progress("bench play")
    progress(f"loading {args.checkpoint}" if args.checkpoint else f"building the {args.model} model")
    model = _model(args, device, dtype)
    c = model.config
    gen = torch.Generator().manual_seed(0)
    image = torch.randn(1, 16, 1, height // 8, width // 8, generator=gen).to(device)
    tokens = torch.randn(1, c.clip_tokens, c.clip_dim, generator=gen).to(device)
    mode = "templerun" if not model.action_config.enable_mouse else (
        "gta_drive" if model.action_config.keyboard_dim_in == 2 else "universal")
    names = MODES[mode]["keys"]
    keys = [{names[0]}, {names[0], names[-1]}, set(), {names[-1]}]
    rows = [_run_mode(model, image, tokens, keys, flag, args.warmup, args.chunks, device,
                      lambda text, flag=flag: progress(f"caches {'in place' if flag else 'copied'}: {text}"))
            for flag in (True, False)]
    same = torch.equal(rows[0].pop("latents"), rows[1].pop("latents"))
    inplace, copies = rows
    ratio = lambda a, b: None if not a or not b else b / a
    summary = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "model": args.checkpoint or args.model, "size": f"{width}x{height}", "dtype": str(model.compute_dtype),
               "timed_chunks": args.chunks, "warmup_chunks": args.warmup, "same_frames": same, "rows": rows,
               "time_ratio": ratio(inplace["chunk_ms"], copies["chunk_ms"]),
               "new_bytes_ratio": ratio(inplace["new_bytes_per_chunk"], copies["new_bytes_per_chunk"]),
               "peak_ratio": ratio(inplace["peak_bytes_per_chunk"], copies["peak_bytes_per_chunk"])}
    if args.json:
        print(to_json(summary))
        return 0
    print(f"Matrix-Game-2 play chunks: {summary['model']}, {width}x{height}, {summary['device']}, {summary['dtype']}, "
          f"{args.chunks} timed chunks after {args.warmup}")
    print(f"{'mode':<10}{'chunk ms':>10}{'new per chunk':>16}{'peak per chunk':>16}")
    for r in rows:
        print(f"{r['mode']:<10}{r['chunk_ms']:>10.2f}{_mb(r['new_bytes_per_chunk']):>16}"
              f"{_mb(r['peak_bytes_per_chunk']):>16}")
    fmt = lambda v: "n/a" if v is None else f"{v:.2f}x"
    print(f"copies / in place: time {fmt(summary['time_ratio'])}, new bytes {fmt(summary['new_bytes_ratio'])}, "
          f"peak {fmt(summary['peak_ratio'])}; same frames: {'yes' if same else 'NO'}")
    return 0 if same else 1
