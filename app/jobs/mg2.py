"""The Matrix-Game-2 `generate` job: start latent + CLIP tokens + scripted actions -> latents, preview, report.

Without a checkpoint it runs the built-in tiny action model on random (seeded) conditioning, end to end on
CPU in seconds; with one, pass the start image latent and CLIP tokens as safetensors files.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

DEFAULT_SCRIPT = "W*20, W+A*8, mouse(0.1,0)*12, idle*4"
TINY_LATENT = (16, 16)          # latent height, width of the tiny run (128x128 pixels)


@dataclass
class MG2Options:
    out_dir: str = "wan_accel_out"
    checkpoint: str | None = None        # .safetensors MG2 checkpoint; None = built-in tiny model
    conditioning: str | None = None      # .safetensors with 'image_latent' [1,16,1|F,H,W] and 'visual_context'
    actions: str = DEFAULT_SCRIPT        # action script (see docs/matrix_game2.md)
    preset: str = "universal"
    frames: int = 0                      # latent frames; 0 = every whole chunk the actions cover
    window: int | None = None            # rolling window override (latent frames)
    steps: str | None = None             # step list override, e.g. "1000,666,333" (warped)
    shift: float | None = None           # timestep shift override
    num_heads: int | None = None         # for checkpoints whose dim is not a multiple of 128
    seed: int = 0
    device: str | None = None
    dtype: str | None = None
    precision: str = "self_forcing"
    attention: str = "auto"
    skip_last_refresh: bool = False
    preview: bool = True
    out_option: str = "out_dir"          # how out_dir is named in messages (the command line: --out)


def load_mg2_handle(checkpoint=None, dtype="bf16", precision="self_forcing", attention="auto", device=None,
                    seed: int = 0, num_heads: int | None = None, mode: str = "universal"):
    """ModelHandle of a Matrix-Game-2 checkpoint, or of the tiny model (action layout ``mode``) for None / the
    tiny name."""
    from .handle import TINY_NAME, ModelHandle, default_device, load_model_handle, parse_dtype
    from ...model.mg2_model import MatrixGameModel, tiny_mg2_model
    device = torch.device(device) if device is not None else default_device()
    if checkpoint in (None, "", TINY_NAME):
        torch_dtype = parse_dtype(dtype)
        if torch_dtype == torch.float32:
            precision = "float32"
        model = tiny_mg2_model(seed, device, torch_dtype, precision, mode=mode).set_attention_backend(attention)
        return ModelHandle(model, TINY_NAME, torch_dtype, model.precision, attention)
    handle = load_model_handle(checkpoint, dtype, precision, attention, device, num_heads=num_heads)
    if not isinstance(handle.model, MatrixGameModel):
        raise ValueError(f"{checkpoint} has no action modules: it is not a Matrix-Game-2 checkpoint")
    return handle


def _conditioning(opts: MG2Options, model, device):
    c = model.config
    if opts.conditioning:
        from safetensors.torch import load_file
        t = load_file(opts.conditioning)
        missing = {"image_latent", "visual_context"} - set(t)
        if missing:
            raise ValueError(f"{opts.conditioning}: missing tensors {sorted(missing)} (need 'image_latent' "
                             f"[1, 16, 1, H, W] model space and 'visual_context' [1, tokens, {c.clip_dim}])")
        for key in ("image_latent", "visual_context"):
            floating = t[key].is_floating_point()
            if not floating or not bool(torch.isfinite(t[key].float()).all()):
                got = "NaN or inf values" if floating else f"{t[key].dtype} values"
                raise ValueError(f"{opts.conditioning}: '{key}' must hold finite floating-point numbers, got "
                                 f"{got} (they would give a NaN video); encode the start image again")
        return t["image_latent"].float().to(device), t["visual_context"].float().to(device)
    gen = torch.Generator().manual_seed((int(opts.seed) + 1) % 2 ** 64)  # the largest seed wraps to 0
    h, w = TINY_LATENT
    image = torch.randn(1, 16, 1, h, w, generator=gen)
    ctx = torch.randn(1, c.clip_tokens, c.clip_dim, generator=gen)
    return image.to(device), ctx.to(device)


def run_mg2_generate(opts: MG2Options, progress=None, log=print, parallel=None) -> dict:
    """Run the job; progress(chunk, num_chunks) per chunk. Returns the report dict. parallel: this rank's
    ``SeqParallel`` to sample sequence-parallel (``app/ranks/parallel.py``); rank 0 writes the files."""
    from ..ranks.parallel import enable_parallel, parallel_report
    from ...sampling.actions_script import parse_action_script
    from .generate import (ChunkTimer, _jsonable, _peak_memory, _sync, _write_outputs, _write_report, _writes,
                           check_outputs)
    from ...sampling.mg2 import generate_mg2, resolve_preset
    from ..prepare import prepared_sampling
    from .handle import default_device
    device = torch.device(opts.device) if opts.device else default_device()
    dtype = opts.dtype or ("bf16" if device.type == "cuda" else "fp32")
    from ...sampling.scheduler import parse_steps
    steps = parse_steps(opts.steps) if opts.steps else None
    settings = resolve_preset(opts.preset, steps=steps, shift=opts.shift, window=opts.window)
    actions = parse_action_script(opts.actions, settings.mode)
    if _writes(parallel):
        check_outputs(opts.out_dir, opts.out_option)
    t0 = time.perf_counter()
    handle = load_mg2_handle(opts.checkpoint, dtype, opts.precision, opts.attention, device,
                             seed=opts.seed if not opts.checkpoint else 0, num_heads=opts.num_heads,
                             mode=settings.mode)
    load_s = time.perf_counter() - t0
    enable_parallel(handle.model, parallel)
    notes = []
    if handle.is_tiny:
        log("using the built-in tiny Matrix-Game-2 model (random weights; output is not a real video)")
        notes.append("tiny random model, random start latent and CLIP tokens")
    elif not opts.conditioning:
        raise ValueError("a real checkpoint needs --conditioning FILE (image_latent + visual_context)")
    image, ctx = _conditioning(opts, handle.model, device)
    on_chunk = ChunkTimer(device, log, progress)
    chunk_seconds = on_chunk.seconds
    t_start = on_chunk.start()
    sampler_report: dict = {}
    with prepared_sampling(handle.model, notes=notes, log=log):      # the doctor's verdicts, the one prepare step
        latents = generate_mg2(handle.model, image, ctx, actions, opts.frames, opts.seed, settings,
                               on_chunk=on_chunk, skip_last_refresh=opts.skip_last_refresh, report=sampler_report)
    _sync(device)
    sample_s = time.perf_counter() - t_start
    files = _write_outputs(latents.transpose(1, 2), opts, parallel)
    report = {
        "model": handle.source, "model_kind": "matrix-game2", "tiny_random_model": handle.is_tiny,
        "config": handle.config.to_dict() | {"action_config": handle.model.action_config.to_dict()},
        "device": str(device), "dtype": dtype, "precision": handle.precision,
        "settings": asdict(opts), "actions": actions.summary(),
        "schedule": {"preset": settings.preset, "timesteps": settings.schedule.timesteps,
                     "shift": settings.schedule.shift, "window": settings.window},
        "latent_shape": list(latents.shape), "latent_layout": "[B, C, F, H, W] model space",
        "load_seconds": load_s, "sample_seconds": sample_s, "chunk_seconds": chunk_seconds,
        "peak_memory": _peak_memory(device), "files": files, "notes": notes, "torch": torch.__version__,
        "sampler": _jsonable(sampler_report),
    }
    if parallel is not None:
        report["parallel"] = parallel_report(handle.model, parallel, latents.transpose(1, 2).shape, settings.window,
                                             0, len(chunk_seconds))
    _write_report(report, opts, parallel)
    return report
