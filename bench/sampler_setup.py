"""``bench sampler``'s model shapes, weight storage and memory cap: what each ``--shape`` is, the option checks made
before any work, the VRAM plan of the run (``memory/plan.py``, on the capped card under ``--memory-cap-gb``) and
the random full-size models drawn on the device.

Shapes (``--shape``; ``options.SAMPLER_SHAPES`` gives frames and size):

  tiny      the built-in tiny model (float32 weights on the CPU, copied per variant)
  1.3b      Wan 2.1 1.3B, Self-Forcing 4 steps, global KV cache (float32 weights on the CPU, copied per variant)
  longlive  the 1.3B with LongLive's schedule, a rolling window of 12 latent frames and 3 sink frames
  14b       Wan 2.1 14B (dim 5120, 40 layers, 40 heads, ffn 13824), Self-Forcing 4 steps, global KV cache
  krea      Krea Realtime 14B: the 14B with Krea's 4-step schedule and its per-block KV recompute (K = 3 context
            frames + the 3-frame block: window 6), the first-frame re-encode as identity (no VAE)

The 14B shapes are drawn on the device in the run dtype (``model/random_weights.py``), once: no float32 copy, so
no float32 'reference' variant and no parity run. ``--weights fp8`` stores every block linear weight as e4m3 with
one scale per tensor (the pack's ``FP8Linear``, as loaded from a scaled fp8 checkpoint).

``--memory-cap-gb N`` (CUDA only): ``memory.system.apply_vram_cap`` caps the caching allocator at N GiB before
anything is allocated and sets ``WAN_ACCEL_VRAM_CAP_GB``, so ``detect_system`` (and the plan) see an N GiB card;
the run then takes the plan's block swap and KV window. Out of memory in a variant is caught: its row says so.
"""
from __future__ import annotations

import torch

from ..app.validate import UsageError
from .options import SAMPLER_SHAPES

ON_DEVICE_SHAPES = ("14b", "krea")          # drawn on the device in the run dtype (model/random_weights.py)
SHAPE_PRESETS = {"tiny": "self_forcing", "1.3b": "self_forcing", "14b": "self_forcing", "krea": "krea",
                 "longlive": "longlive"}   # schedule preset of each shape (sampling/scheduler.py)
FRAMES_PER_BLOCK = 3


def shape_config(kind: str, shape: str):
    """The WanConfig of a random-weight shape of the model kind (wan or matrix-game2)."""
    from ..model.config import KREA_14B, WAN_1_3B, WAN_14B
    from ..model.tiny import TINY_CONFIG
    if kind == "matrix-game2":
        from ..model.mg2_model import tiny_mg2_config
        if shape == "tiny":
            return tiny_mg2_config()
        action = {"blocks": list(range(15)), "mouse_dim_in": 2, "keyboard_dim_in": 4, "heads_num": 16,
                  "mouse_hidden_dim": 1024, "keyboard_hidden_dim": 1024, "hidden_size": 128, "img_hidden_size": 1536,
                  "vae_time_compression_ratio": 4, "windows_size": 3, "rope_theta": 256,
                  "mouse_qk_dim_list": [8, 28, 28]}
        return WAN_1_3B.replace(model_type="i2v", in_dim=36, clip_dim=1280, clip_tokens=257, local_attn_size=6,
                                extra={"action_config": action})
    from ..sampling.scheduler import PRESET_CHUNKING
    longlive = PRESET_CHUNKING["longlive"]
    return {"tiny": TINY_CONFIG, "1.3b": WAN_1_3B, "14b": WAN_14B, "krea": KREA_14B,
            "longlive": WAN_1_3B.replace(local_attn_size=longlive["kv_window"], sink_size=longlive["sink"])}[shape]


def shape_window(shape: str) -> tuple:
    """(kv_window, sink) the shape's sampler runs with (-1, 0: a global cache)."""
    from ..sampling.scheduler import PRESET_CHUNKING
    c = PRESET_CHUNKING.get(SHAPE_PRESETS.get(shape, ""), {})
    return int(c.get("kv_window", -1)), int(c.get("sink", 0))


def run_geometry(args, kind: str, shape: str) -> tuple:
    """(video frames, height, width) of a run: the options given, else the shape's (a checkpoint: its kind's 1.3B
    video)."""
    d = SAMPLER_SHAPES[kind]["1.3b" if args.checkpoint else shape]
    return args.frames or d[0], args.height or d[1], args.width or d[2]


def shape_schedule(kind: str, shape: str):
    if kind == "matrix-game2":
        from ..sampling.mg2 import resolve_preset
        return resolve_preset("universal")
    from ..sampling.scheduler import resolve_schedule
    return resolve_schedule(SHAPE_PRESETS.get(shape, "self_forcing"))


def sampler_kwargs(shape: str, kv_window: int | None = None):
    """A callable giving the extra run settings of one run (``RunSpec`` fields, and a fresh Krea ``cache_policy``):
    the window and sink of the shape (``kv_window``: the VRAM plan's instead), Krea's recompute for 'krea'."""
    window, sink = shape_window(shape)
    if kv_window is not None:
        window = kv_window
    if SHAPE_PRESETS.get(shape) == "krea":
        def krea():
            from ..sampling.krea import cache_setup
            setup = cache_setup("krea", FRAMES_PER_BLOCK, window, preset="krea")
            return {"kv_window": setup.kv_window, "recache": setup.recache, "cache_policy": setup.cache_policy}
        return krea
    if window < 0 and not sink:
        return lambda: {}
    return lambda: {"kv_window": window, "sink": sink if window > 0 else 0}


# ----------------------------------------------------------------------------- option checks (before any work)
def check_model_options(args, names: list, variants: dict) -> None:
    """The model and dtype a bench sampler run takes, for one process and for --world-size alike: --shape with
    --checkpoint, a shape the model kind lacks, and --dtype where every chosen variant runs its own float32 (and
    nothing decodes) are refused, never dropped."""
    kind, shape = args.model_kind, args.shape or "tiny"
    if args.shape is not None and args.checkpoint:      # the checkpoint's own size is run: --shape would be ignored
        raise UsageError(f"--shape {args.shape} picks a random-weight model, and --checkpoint runs the file's model: "
                         f"leave out one of them")
    if shape not in SAMPLER_SHAPES[kind]:
        raise UsageError(f"--shape {shape}: {kind} has the shapes {', '.join(SAMPLER_SHAPES[kind])}")
    if args.dtype is not None and getattr(args, "decode", "none") == "none" and names \
            and all(variants[n]["dtype"] is not None for n in names if n in variants):
        raise UsageError(f"--dtype {args.dtype} sets the run dtype, and every chosen variant ({', '.join(names)}) "
                         f"runs in its own float32: add a run-dtype variant (e.g. optimized) to --variants, or "
                         f"leave --dtype out")


def check_options(args, device: torch.device, names: list, variants: dict) -> None:
    """UsageError (exit 2, one line) for a combination the bench cannot run, before any model is built."""
    kind, shape = args.model_kind, args.shape or "tiny"
    cap = getattr(args, "memory_cap_gb", None)
    weights = getattr(args, "weights", None) or "bf16"
    check_model_options(args, names, variants)
    off = parity_off(args)
    if getattr(args, "no_parity", False) and off:       # nothing to skip: --no-parity would be ignored
        raise UsageError(f"--no-parity skips the float32 parity run, and this run has none ({off}): leave "
                         f"--no-parity out")
    if weights != "bf16" and args.checkpoint:
        raise UsageError("--weights fp8 stores random weights as fp8; a --checkpoint keeps the storage of its file "
                         "(load an fp8 scaled checkpoint instead)")
    if weights != "bf16" and kind != "wan":
        raise UsageError(f"--weights fp8: random fp8 weights exist for the wan model kind, not {kind}")
    if cap is not None:                 # a positive number of GiB: cli/bench.py's POSITIVE_NUMBERS
        if device.type != "cuda":
            raise UsageError(f"--memory-cap-gb caps CUDA memory (the caching allocator's per-process fraction); the "
                             f"device is {device.type}: leave it out, or run on a CUDA device")
        total = torch.cuda.get_device_properties(device).total_memory / 1024 ** 3
        if cap > total:
            raise UsageError(f"--memory-cap-gb {cap:g} is more than the card's {total:.1f} GiB; use at most that")
    if shape in ON_DEVICE_SHAPES and not args.checkpoint and device.type != "cuda":
        raise UsageError(f"--shape {shape}: a 14B model is drawn on a CUDA device in the run dtype (28 GB in bf16, "
                         f"56 GB in float32 on a {device.type}); run it on a CUDA device, or use --shape 1.3b / tiny")
    if off:             # no float32 copy (a 14B shape), or only the run dtype planned (--memory-cap-gb)
        fp32 = [n for n in names if variants[n]["dtype"] == "fp32"]
        if fp32 or (args.dtype or "bf16") == "fp32":
            raise UsageError(f"--variants {(fp32 or names)[0]}: {off}; run float32 at --shape 1.3b without "
                             f"--memory-cap-gb, or choose --variants optimized")


def parity_off(args) -> str | None:
    """Why this run has no float32 parity run (None: it has one, unless --no-parity)."""
    if (args.shape or "tiny") in ON_DEVICE_SHAPES and not args.checkpoint:
        return "the 14B shapes have no float32 copy"
    if getattr(args, "memory_cap_gb", None) is not None:
        return "under --memory-cap-gb only the run dtype is planned"
    return None


# ----------------------------------------------------------------------------- the VRAM plan
def make_run_plan(config, weights: str, frames: int, height: int, width: int, system=None, kv_window=None,
                  checkpoint=None):
    """The VRAM plan of one bench run, of ``config``'s weights or a ``checkpoint`` file's (learned limits left out: a
    bench measures the estimate's decisions)."""
    import math

    from ..memory.estimate import Workload
    from ..memory.plan import fp8_weights, make_plan
    from ..memory.weights import TensorInfo, weights_from_checkpoint, weights_from_tensors
    from ..model.checkpoint import config_dict, expected_shapes
    if checkpoint:
        table = weights_from_checkpoint(checkpoint)
    else:       # the byte table of config's weights (memory/weights.py), block linears fp8 with --weights fp8
        table = weights_from_tensors({n: TensorInfo(n, "BF16", s, 2 * math.prod(s))
                                      for n, s in expected_shapes(config).items()}, source="random",
                                     config=config_dict(config))
        table = fp8_weights(table) if weights == "fp8" else table
    return make_plan(table, Workload(width, height, frames, frames_per_block=FRAMES_PER_BLOCK), system,
                     kv_window=kv_window)


def plan_report(plan, cap_gb) -> dict:
    """The plan's decisions and reasons as the bench JSON gives them."""
    from ..memory.system import GiB as gib
    return {"memory_cap_gb": cap_gb, "card": plan.system.get("gpu_name"),
            "total_gb": round(plan.system.get("total_vram", 0) / gib, 2),
            "fits": plan.fits, "dtype": plan.dtype, "blocks_to_swap": plan.blocks_to_swap,
            "blocks_total": plan.blocks_total, "prefetch": plan.prefetch, "pinned_blocks": plan.pinned_blocks,
            "offload_embeddings": plan.offload_embeddings, "kv_window": plan.kv_window,
            "vae_chunk_frames": plan.vae_chunk_frames,
            "estimated_peak_gb": round(plan.estimated_peak_bytes / gib, 3), "budget_gb": round(plan.budget_bytes / gib, 3),
            "breakdown_gb": {k: round(v / gib, 3) for k, v in plan.breakdown.items()},
            "reasons": dict(plan.reasons)}


# ----------------------------------------------------------------------------- models
def device_model(config, device, dtype: torch.dtype, seed: int, weights: str, swap=None):
    """The random model drawn on ``device`` in ``dtype`` (``model/random_weights.py``), with the plan's block swap:
    the swapped blocks are moved to the host as they are drawn, then streamed (``memory/block_swap.py``)."""
    from ..model.random_weights import random_model
    n = swap.blocks_to_swap if swap is not None else 0
    model = random_model(config, device, dtype, seed=seed, weights=weights, host_blocks=n,
                         precision="float32" if dtype == torch.float32 else "self_forcing")
    place(model, device, swap)
    return model


def place(model, device, swap=None):
    """Put ``model`` on ``device``: all of it, or with block swap where ``swap`` (SwapSettings) swaps blocks."""
    if swap is not None and (swap.blocks_to_swap > 0 or swap.offload_embeddings) and torch.device(device).type == "cuda":
        from ..memory.block_swap import apply_block_swap
        apply_block_swap(model, swap, device=device)
        return model
    return model.to(device)


def model_bytes(model) -> dict:
    """Bytes of the model's parameters by where they are (device type) and their dtype."""
    out: dict = {}
    seen = set()
    for p in model.parameters():
        key = p.data.untyped_storage().data_ptr(), p.device
        if key in seen:
            continue
        seen.add(key)
        k = f"{p.device.type}:{str(p.dtype).replace('torch.', '')}"
        out[k] = out.get(k, 0) + p.numel() * p.element_size()
    return out


def prepare_memory(args, device: torch.device, kind: str, shape: str, frames: int, height: int, width: int) -> dict:
    """Before anything is allocated: the cap (``--memory-cap-gb``) and, on CUDA, the run's VRAM plan. Returns
    {'memory': what the JSON reports, 'swap': SwapSettings or None, 'kv_window': the plan's window or None,
    'refused': the message when the plan finds nothing that fits, else None}."""
    cap = getattr(args, "memory_cap_gb", None)
    weights = getattr(args, "weights", None) or "bf16"
    out = {"memory": {"memory_cap_gb": cap, "weights": weights, "plan": None}, "swap": None, "kv_window": None,
           "refused": None}
    if cap is not None:
        from ..memory.system import GiB, apply_vram_cap
        applied = apply_vram_cap(cap, device)
        out["memory"].update(cap_bytes=applied["cap_bytes"], card_total_gb=round(applied["total_bytes"] / GiB, 2),
                             memory_fraction=round(applied["fraction"], 5))
    if device.type != "cuda" or kind != "wan":
        return out
    from ..memory.system import GiB, detect_system
    own, _sink = shape_window(shape)
    plan = make_run_plan(shape_config(kind, shape), weights, frames, height, width, detect_system(device),
                         kv_window=own if own > 0 else None, checkpoint=args.checkpoint)
    out["memory"]["plan"] = plan_report(plan, cap)
    if not plan.fits:
        out["refused"] = (f"the VRAM plan finds nothing that fits {shape} ({weights} weights) at {width}x{height}, "
                          f"{frames} frames on this {plan.system.get('total_vram', 0) / GiB:.1f} GiB card: "
                          f"{plan.reasons.get('fits', '')}")
        return out
    if plan.blocks_to_swap or plan.offload_embeddings:
        out["swap"] = plan.swap_settings()
    keep = plan.kv_window == own or (plan.kv_window < 0 and own < 0)     # the plan keeps the shape's own window
    out["kv_window"] = None if args.checkpoint or keep else int(plan.kv_window)
    return out
