"""The Matrix-Game-2 `generate` job: start latent + CLIP tokens + scripted actions -> latents, preview, report; and
the Matrix-Game-2 runs through the one prepare call (``sample_mg2``, ``generate_mg2``).

Without a checkpoint it runs the built-in tiny action model on random (seeded) conditioning, end to end on
CPU in seconds; with one, pass the start image latent and CLIP tokens as safetensors files.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from ...sampling.mg2 import FRAMES_PER_BLOCK, MG2Settings, channels_first, check_actions, mg2_run, resolve_preset
from ...sampling.mg2_continuation import mg2_continuation
from ...sampling.request import SamplingHooks
from ..prepare import RunSpec
from .generate import JobOptions

DEFAULT_SCRIPT = "W*20, W+A*8, mouse(0.1,0)*12, idle*4"
TINY_LATENT = (16, 16)          # latent height, width of the tiny run (128x128 pixels)


@dataclass
class MG2Options(JobOptions):            # checkpoint: a Matrix-Game-2 one; steps: warped, e.g. "1000,666,333"
    conditioning: str | None = None      # .safetensors with 'image_latent' [1,16,1|F,H,W] and 'visual_context'
    actions: str = DEFAULT_SCRIPT        # action script (see docs/matrix_game2.md)
    preset: str = "universal"
    frames: int = 0                      # latent frames; 0 = every whole chunk the actions cover
    window: int | None = None            # rolling window override (latent frames)


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


def sample_mg2(model, noise, cond_concat: torch.Tensor, visual_context: torch.Tensor, mouse: torch.Tensor | None,
               keyboard: torch.Tensor | None, schedule, window: int, noise_provider=None,
               generator: torch.Generator | None = None, kv_cache=None, actions=None, start_frame: int = 0,
               *, hooks: SamplingHooks | None = None, spec: RunSpec | None = None, setup=None) -> torch.Tensor:
    """The Matrix-Game-2 loop through ``app.prepare.prepare``: x0 latents ``[B, 16, F, H, W]`` (float32, model space).

    noise ``[B, 16, F, H, W]`` or its shape (each chunk's noise then drawn when it starts, from
    noise_provider(chunk, step, shape [B, 3, 16, H, W], dtype, device), else ``generator``); cond_concat
    ``[B, 20, F (or F - start_frame), H, W]``; visual_context ``[B or 1, tokens, clip_dim]``; mouse/keyboard
    ``[B or 1, video frames, dims]`` (``1 + 4*(F-1)`` as released); schedule: a Schedule or preset name; window:
    every cache's rolling window in latent frames; start_frame: only the chunks from there on, over caches holding
    the earlier frames (``sampling.mg2_continuation``). hooks: ``SamplingHooks`` (on_chunk_latents in this layout);
    kv_cache / actions: caches to inspect afterwards. spec: the run's path and options (skip_last_refresh too; its
    loop fields are Matrix-Game-2's); setup: ``prepare_model`` already done (a replay tool, a play session)."""
    from ..prepare import prepare
    fields, inputs = mg2_run(model, noise, cond_concat, visual_context, mouse, keyboard, schedule, window,
                             noise_provider, generator, kv_cache, actions, start_frame)
    spec = (spec if spec is not None else RunSpec()).replace(**fields)
    hooks = hooks if hooks is not None else SamplingHooks()
    hooks = hooks.replace(on_chunk_latents=channels_first(hooks.on_chunk_latents))
    return prepare(model, spec, inputs, hooks, setup=setup).latents().transpose(1, 2)


def generate_mg2(model, image_latent: torch.Tensor, visual_context: torch.Tensor, actions, num_frames: int = 0,
                 seed: int = 0, preset: str = "universal", window: int | None = None, steps=None,
                 *, hooks: SamplingHooks | None = None, spec: RunSpec | None = None, setup=None) -> torch.Tensor:
    """Seeded end-to-end sampling; returns latents ``[B, 16, F, H, W]`` (float32, model space).

    image_latent: model-space start latent ``[B, 16, 1 or >=F, H, W]``; visual_context: CLIP tokens
    ``[B or 1, tokens, clip_dim]``; actions: a GameActions or a (mouse, keyboard) pair of tensors
    ``[B or 1, video frames, dims]``; num_frames: latent frames (0: every whole chunk the actions cover);
    preset: a preset name (``steps``/``window`` override it) or resolved :class:`MG2Settings`.
    Batch element i draws its noise from its own generator seeded ``seed + i`` (chunk by chunk), so a batch
    gives the same latents as separate batch-1 runs with those seeds, and a longer video starts with
    exactly the frames of a shorter one. hooks: the run's ``SamplingHooks`` (its report receives what the run did;
    on_chunk_latents: each chunk's latents ``[B, 16, 3, H, W]`` before its refresh pass); spec / setup as
    ``sample_mg2``'s.
    """
    settings = preset if isinstance(preset, MG2Settings) else resolve_preset(preset, steps=steps, window=window)
    mouse, keyboard = actions.tensors(batch=1) if hasattr(actions, "tensors") else actions
    seq = keyboard if keyboard is not None else mouse
    frames_avail = 1 + (seq.shape[1] - 1) // 4
    check_actions(model, mouse, keyboard)
    if num_frames <= 0:
        num_frames = (frames_avail // FRAMES_PER_BLOCK) * FRAMES_PER_BLOCK
        if num_frames == 0:
            raise ValueError(f"the actions cover {frames_avail} latent frame(s); a chunk needs "
                             f"{FRAMES_PER_BLOCK} (13 video frames)")
    run, _ = mg2_continuation(model, image_latent, visual_context, mouse, keyboard, num_frames, seed, settings,
                              keep_state=False)
    return sample_mg2(model, **run, hooks=hooks, spec=spec, setup=setup)


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


def run_mg2_generate(opts: MG2Options, progress=None, log=print, parallel=None, spec: RunSpec | None = None
                     ) -> dict:
    """Run the job; progress(chunk, num_chunks) per chunk. Returns the report dict. parallel: this rank's
    ``SeqParallel`` to sample sequence-parallel (``app/ranks/parallel.py``); rank 0 writes the files. spec: the
    run's path and options (the command line's ``--sampler``, ``--linear``...; default ``RunSpec()``)."""
    from ..ranks.parallel import enable_parallel, parallel_report
    from ...sampling.actions_script import parse_action_script
    from .generate import ChunkTimer, _write_outputs, _write_report, _writes, check_outputs, job_report
    from ..prepare import prepare_model
    device, dtype = opts.device_dtype()
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
    timer = ChunkTimer(device, log, progress)
    timer.start()
    sampler_report: dict = {}
    spec = (spec or RunSpec()).replace(skip_last_refresh=opts.skip_last_refresh)
    setup = prepare_model(handle.model, spec, log=log, notes=notes)   # the doctor's verdicts, logged
    latents = generate_mg2(handle.model, image, ctx, actions, opts.frames, opts.seed, settings,
                           hooks=SamplingHooks(on_chunk=timer, report=sampler_report), spec=spec, setup=setup)
    sample_s = timer.stop()
    files = _write_outputs(latents.transpose(1, 2), opts, parallel)
    report = job_report(handle, device, dtype, asdict(opts),
                        {"preset": settings.preset, "timesteps": settings.schedule.timesteps,
                         "shift": settings.schedule.shift, "window": settings.window},
                        latents.shape, (load_s, sample_s, timer.seconds), files, notes, sampler_report)
    report["config"]["action_config"] = handle.model.action_config.to_dict()
    report |= {"model_kind": "matrix-game2", "actions": actions.summary(),
               "latent_layout": "[B, C, F, H, W] model space"}
    if parallel is not None:
        report["parallel"] = parallel_report(handle.model, parallel, latents.transpose(1, 2).shape, settings.window,
                                             0, len(timer.seconds))
    _write_report(report, opts, parallel)
    return report
