"""`python -m wan_accel bench sampler --world-size N`: one process against N sequence-parallel ranks.

The same model (random weights from ``--seed``, or ``--checkpoint``), inputs and seed on 1 rank and on N ranks
(``model/seq_parallel.py``). The N ranks are this machine's first N GPUs (NCCL) when it has them, else N CPU
processes (gloo); under ``torchrun --nproc-per-node N`` the launched processes are the ranks. Per world size:
first and steady seconds (median of --repeat runs), per-chunk latency, video FPS, and

  parity_max_abs        its latents against the one-process latents (float32 runs: within float32 rounding)
  kv_bytes_per_rank     the self-attention KV cache one rank holds (its heads only: 1/N of one process's)
  comm_bytes_per_chunk  bytes one rank sends to the others per chunk (all-to-alls around self-attention and the
                        all-gather of the head's output), counted over one run
  collectives_per_chunk collectives one rank waits on per chunk

On a CPU the ranks are processes with one thread each, the one-process run uses this process's threads: CPU times
show the mechanism working, not what GPUs gain.
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch

from ..cache.json_out import to_json
from ..cache.fingerprint import cpu_name
from . import print_columns, sampler as bs
from ..app.validate import UsageError
from ..app.jobs.generate import ChunkTimer
from ..app.ranks.parallel import check_world, enable_parallel, group_from_env, kv_bytes, run_ranks, stop_group
from .options import parallel as add_arguments  # noqa: F401  (defined without torch)
from .sampler_setup import run_geometry, shape_config


def model_heads(args) -> int:
    """Attention heads of the model the bench runs (the checkpoint's header, or the random shape's config)."""
    if getattr(args, "checkpoint", None):
        from ..memory.weights import weights_from_checkpoint
        return int(weights_from_checkpoint(args.checkpoint).num_heads)
    return int(shape_config(getattr(args, "model_kind", "wan"), getattr(args, "shape", None) or "tiny").num_heads)


# bench sampler's options the sequence-parallel comparison does not use, with their defaults: given with
# --world-size they would be ignored, so they are refused (one variant, tiny or 1.3b, the run dtype, the seed,
# frames/height/width, the model kind and checkpoint and --repeat are what it takes)
ONE_PROCESS_ONLY = {"attention": None, "linear": None, "weights": "bf16", "memory_cap_gb": None,
                    "peak_tflops": None, "vae": None, "no_parity": False, "decode": "none"}
WORLD_SHAPES = ("tiny", "1.3b")


def _ignored_with_world(args) -> str | None:
    """The first bench sampler option a --world-size run would ignore, in words, or None."""
    for name, default in ONE_PROCESS_ONLY.items():
        if getattr(args, name, default) != default:
            return f"--{name.replace('_', '-')}"
    if len([v for v in (getattr(args, "variants", None) or "").split(",") if v.strip()]) > 1:
        return "a second variant in --variants (one variant runs against its ranks)"
    shape = getattr(args, "shape", None)
    if shape is not None and shape not in WORLD_SHAPES:
        return f"--shape {shape} (the ranks run {' or '.join(WORLD_SHAPES)})"
    return None


def check_world_args(args) -> None:
    """--world-size and torchrun's variables, checked before any process starts (``ranks/parallel.py``); an option
    the parallel comparison would ignore is refused, never dropped."""
    from ..app.ranks.parallel import check_rank_env
    world = int(getattr(args, "world_size", 1) or 1) > 1 or int(os.environ.get("WORLD_SIZE", "1") or 1) > 1
    ignored = _ignored_with_world(args) if world else None
    if ignored == "--decode":
        raise UsageError("--decode is measured in one process: leave --world-size out to time the decode")
    if ignored:
        raise UsageError(f"{ignored} is not used by the sequence-parallel comparison (--world-size): leave it out, "
                         f"or leave --world-size out to run it in one process")
    if world:                           # the model and dtype rules of one process hold for the ranks too
        from ..app.jobs.handle import default_device
        from .sampler_setup import check_model_options
        device = torch.device(args.device) if args.device else default_device()
        check_model_options(args, [_variant(args, device)], bs.VARIANTS)
    heads = model_heads(args)
    check_rank_env(heads, device=args.device)
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        check_world(args.world_size, heads, name="--world-size", device=args.device)


def _variant(args, device) -> str:
    if args.variants:
        return args.variants.split(",")[0].strip()
    return "optimized" if device.type == "cuda" else "reference"


def _rank_run(sp, opts: dict) -> dict:
    """One rank's (or, sp None, the one process's) timed runs: figures and, on rank 0, the latents."""
    args = argparse.Namespace(**opts)
    device = torch.device(opts["devices"][sp.rank] if sp is not None else opts["devices"][0])
    from ..app.jobs.handle import parse_dtype
    v = bs.VARIANTS[opts["variant"]]
    dtype = parse_dtype(v["dtype"] or opts["run_dtype"])
    precision = "float32" if dtype == torch.float32 else v["precision"]
    model = bs._base_model(args, opts["kind"], opts["shape"]).set_precision(precision, dtype).to(device)
    model.set_attention_backend(v["attention"])
    enable_parallel(model, sp)
    inp = bs._inputs(model, opts["kind"], opts["shape"], *opts["geometry"], args.seed)
    times, chunks = [], []
    for _ in range(1 + max(1, args.repeat)):
        if sp is not None:
            sp.barrier("the barrier before a timed run")
            sp.reset_stats()
        timer = ChunkTimer(device, lambda _text: None)      # each chunk from the previous one's end
        timer.start()
        with torch.no_grad():
            out = bs._sample(model, opts["kind"], inp, v, args.seed, timer)
        times.append(timer.stop())
        chunks.append(timer.seconds)
    n = len(chunks[-1])
    lat = (inp["latent_frames"], 16, inp["lh"], inp["lw"])
    mine, whole = kv_bytes(model, (1,) + lat, model.config.local_attn_size if opts["kind"] == "matrix-game2" else -1)
    steady = statistics.median(times[1:])
    res = {"world_size": 1 if sp is None else sp.world, "rank": 0 if sp is None else sp.rank,
           "device": str(device), "threads": torch.get_num_threads(), "variant": opts["variant"], "dtype": str(dtype).replace("torch.", ""),
           "first_s": round(times[0], 4), "steady_s": round(steady, 4),
           "chunk_ms_mean": round(1e3 * statistics.mean(statistics.median(c[i] for c in chunks[1:])
                                                        for i in range(n)), 2),
           "video_fps": round(opts["geometry"][0] / steady, 2), "kv_bytes_per_rank": mine,
           "kv_bytes_one_process": whole,
           "comm_bytes_per_chunk": 0 if sp is None else sp.stats["bytes_sent"] // n,
           "collectives_per_chunk": 0 if sp is None else round(sp.stats["collectives"] / n, 1)}
    if sp is None or sp.rank == 0:
        res["latents"] = out.float().cpu()
    return res


def run(args) -> int:
    from ..app.jobs.handle import default_device
    world = int(args.world_size)
    under_torchrun = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if not under_torchrun and world < 2:
        return bs.run(args)
    device = torch.device(args.device) if args.device else default_device()
    kind, shape = args.model_kind, args.shape or "tiny"
    geometry = run_geometry(args, kind, shape)
    run_dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    opts = dict(vars(args), kind=kind, shape=shape, geometry=geometry, run_dtype=run_dtype,
                variant=_variant(args, device))
    if opts["variant"] not in bs.VARIANTS:
        raise UsageError(f"--variants: unknown {opts['variant']}; choose from {', '.join(bs.VARIANTS)}")
    bs._check_host_fit(args, device, kind, shape, *geometry)      # off CUDA: the estimate before any model is built
    if under_torchrun:
        sp, dev = group_from_env(args.device)
        opts["devices"] = [str(dev)] * sp.world
        try:
            mine = _rank_run(sp, opts)
        finally:
            stop_group()
        if sp.rank != 0:
            return 0
        ranks = [mine]
        world = sp.world
    else:
        if device.type == "cuda":
            check_world(world, model_heads(args), name="--world-size", device=device)   # one GPU per rank
            opts["devices"] = [f"cuda:{i}" for i in range(world)]
        else:
            opts["devices"] = ["cpu"] * world
        ranks = run_ranks(_rank_run, world, (opts,), timeout_s=args.timeout)
    one = _rank_run(None, dict(opts, devices=[opts["devices"][0]]))
    rows, reference = [one, ranks[0]], one["latents"]
    for r in rows:
        r["parity_max_abs"] = float((r.pop("latents") - reference).abs().max())
    result = {"device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
              "threads": torch.get_num_threads(), "model": args.checkpoint or f"random {shape}", "model_kind": kind,
              "frames": geometry[0], "height": geometry[1], "width": geometry[2], "world_size": world,
              "torch": torch.__version__, "rows": rows}
    if args.json:
        print(to_json(result))
        return 0
    print(f"sequence-parallel sampler bench on {result['device_name']}, {kind} {result['model']}, "
          f"{geometry[0]} frames {geometry[2]}x{geometry[1]}, {opts['variant']} path")
    cols = ["world_size", "device", "threads", "dtype", "first_s", "steady_s", "chunk_ms_mean", "video_fps", "parity_max_abs",
            "kv_bytes_per_rank", "comm_bytes_per_chunk", "collectives_per_chunk"]
    print_columns(cols, [[f"{r[c]:.2e}" if c == "parity_max_abs" else str(r[c]) for c in cols] for r in rows])
    return 0
