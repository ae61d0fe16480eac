"""One door for every run: a face describes its run as one frozen ``RunSpec`` and its ``RunInputs``;
``prepare(model, spec, inputs)`` (``prepare_video`` from pixel sizes) does, once and before the first chunk,
everything the run needs, and returns a ``Run`` the face samples (``latents()``) and, when continuable, goes on with
(``extend``) without preparing again.

``prepare_model`` applies, in one fixed order: (1) the run rules (``sampling.sampler.path_for_linear``: fp8 linear
layers exist on the optimized path only); (2) the block swap: the spec's, else the one its VRAM plan asks for, else
the model's own (``KEEP``), without its prefetch stream where the doctor judged block swap unsafe here (CUDA); (3)
compile: the spec's settings (or the model's own), dropped where the doctor judged compiled blocks wrong or slower
here, none on the reference path; (4) the fast options, with ``switched_off`` naming every feature the doctor switched
off for this model (its device, dtype and head size). The doctor judges a run whose path resolves to the optimized
one (on CUDA, what 'auto' means). Then ``prepare`` checks the inputs, picks the out-of-memory guard and builds the
loop's request (``sampling.sampler.build_request``); ``RunSpec``, ``Setup`` and ``Run`` are ``app/run.py``'s.

Every face goes through here: the CausalWan Sampler node and ``generate``, the native AR sampler, Matrix-Game-2,
play sessions and prompt steering, the benches, the ranks of a sequence-parallel run and ``profile``; the replay tools
(check-reference, bench fidelity, bench compile, the self-test, the doctor's probes) with ``RunSpec(doctor=False)``.
"""
from __future__ import annotations

import torch

from ..sampling.request import RunInputs, SamplingHooks
from ..sampling.sampler import path_for_linear, resolve_path
from .run import KEEP, Run, RunSpec, Setup  # noqa: F401 - the faces' names too
from .validate import VAE_SPACE_STRIDE, VAE_TIME_STRIDE


def prepare_model(model, spec: RunSpec, *, log=None, notes: list | None = None, record: dict | None = None) -> Setup:
    """Apply ``spec`` to ``model`` in the one fixed order (the module's doc) and return what the loop runs with.
    ``log``: where the doctor's lines go (else the log); ``notes`` receives them too (a node's text)."""
    from ..compile import uncompile_model
    from ..compile.apply import compile_handle
    from ..memory.block_swap import active_swap, ensure_block_swap
    from .doctor.gate import gate_compile, gate_options, gate_swap, new_record
    from .jobs.handle import _planned_swap
    lines = notes if notes is not None else []
    record = record if record is not None else new_record()
    path, note = path_for_linear(spec.path, spec.linear)                                   # (1) the run rules
    if note:
        lines.append(note)
        if log is not None:
            log(note)
    cuda = torch.device(model.device).type == "cuda"
    optimized = resolve_path(path, model.device, model=model) == "optimized"
    judged = bool(spec.doctor) and optimized
    swap = spec.swap                                                                       # (2) VRAM plan, swap
    if isinstance(swap, str) and swap == KEEP:
        swap = getattr(active_swap(model), "settings", None)
    elif swap is None:
        swap = _planned_swap(spec.plan)
    if judged and cuda:
        swap = gate_swap(model, swap, log_fn=log, lines=lines, record=record)
    if cuda or swap is None:
        ensure_block_swap(model, swap, device=model.device)
    settings = spec.compile                                                                # (3) compile
    if isinstance(settings, str) and settings == KEEP:
        settings = getattr(compile_handle(model), "settings", None)
    if not optimized:
        if uncompile_model(model) and log is not None:
            log("reference sampler: removed the regional compile of an earlier optimized run")
        return Setup(path, None, lines, record)
    if judged and settings is not None:
        settings = gate_compile(model, settings, log_fn=log, lines=lines, record=record)
    if settings is None:
        uncompile_model(model)       # eager: asked for, or the doctor judged compiled blocks wrong or slower here
    compile_for_sampling(model, settings, log=log)
    options = spec.fast_options()                                                          # (4) fast options
    if judged:
        options, switched = gate_options(model, options, log_fn=log, record=record)
        lines.extend(line for line in switched if line not in lines)
    return Setup(path, options, lines, record)


def prepare(model, spec: RunSpec, inputs: RunInputs, hooks: SamplingHooks | None = None, *,
            setup: Setup | None = None, keep_state: bool = False, continuable: bool = False, state_device=None,
            log=None, notes: list | None = None) -> Run:
    """The one call of every run: ``prepare_model`` (unless ``setup`` says it was done: a rank pool, a replay tool
    that keeps the model as it is), then the inputs checked and the loop's request built. inputs: ``RunInputs``
    (noise: the initial noise [B, F, C, H, W], or its shape, each chunk's noise then drawn from the generator, by
    default seeded with ``spec.seed``); hooks: the face's, its chunk_guard else the out-of-memory retry of
    ``spec.oom_retry``. keep_state: the run keeps the state it ends in (``Run.state``, its caches on
    ``state_device``, default the model's device) and can be extended; continuable: a run that builds its cache as a
    continuation does, keeping no state; ``inputs.state``: go on from that state. log / notes: where the doctor's
    lines go."""
    setup = setup if setup is not None else prepare_model(model, spec, log=log, notes=notes)
    return Run(model, spec, setup, inputs, hooks, keep_state=keep_state, continuable=continuable,
               state_device=state_device)


def prepare_video(model, spec: RunSpec, inputs: RunInputs, width: int, height: int, num_frames: int, *,
                  names: dict | None = None, **kwargs) -> Run:
    """``prepare`` of a video given in pixels (``num_frames`` 4k+1 video frames): the one geometry check and memory
    estimate of every entry point (``latent_geometry``; ``names``: the face's names of its inputs), then the noise
    drawn per chunk from the generator (``inputs.noise`` is set to its shape)."""
    lf, lh, lw = latent_geometry(model, width, height, num_frames, spec, names=names)
    return prepare(model, spec, inputs.replace(noise=(spec.batch, lf, model.config.out_dim, lh, lw)), **kwargs)


def sample_video(model, spec: RunSpec, inputs: RunInputs, width: int, height: int, num_frames: int,
                 **kwargs) -> torch.Tensor:
    """Pixel-space request -> model-space latents [B, F, 16, H/8, W/8] (``prepare_video``, then the loop)."""
    return prepare_video(model, spec, inputs, width, height, num_frames, **kwargs).latents()


def latent_frames(video_frames: int) -> int:
    """Video frames -> latent frames, (n - 1) / 4 + 1; clear error when n is not 4k + 1."""
    if video_frames < 1 or (video_frames - 1) % VAE_TIME_STRIDE:
        k = max(0, (video_frames - 1) // VAE_TIME_STRIDE)
        raise ValueError(f"{video_frames} video frames is not 4k+1 (the Wan VAE packs 4 frames per latent "
                         f"frame after the first); use {VAE_TIME_STRIDE * k + 1} or "
                         f"{VAE_TIME_STRIDE * (k + 1) + 1}")
    return (video_frames - 1) // VAE_TIME_STRIDE + 1


def latent_size(height: int, width: int, patch=(2, 2)) -> tuple[int, int]:
    """Pixel size -> latent size (/8); must be divisible by 8 * patch (16 for Wan 2.1)."""
    mh, mw = VAE_SPACE_STRIDE * patch[0], VAE_SPACE_STRIDE * patch[1]
    if height % mh or width % mw or height <= 0 or width <= 0:
        raise ValueError(f"width x height {width}x{height} must be positive multiples of {mw}x{mh}")
    return height // VAE_SPACE_STRIDE, width // VAE_SPACE_STRIDE


def latent_geometry(model, width: int, height: int, num_frames: int, spec: RunSpec, names: dict | None = None
                    ) -> tuple:
    """(latent frames, latent height, latent width), after the one geometry check of every entry point (4k+1
    frames, multiples of 16, whole blocks, window and sink; its advice passes it) and the memory estimate of the
    run on the model's device (``validate.check_fits``: refused before any tensor is made), in the words of the
    face's ``names`` (default: this function's)."""
    from ..model.attachments import seq_parallel_of
    from .validate import check_fits, check_geometry
    names = dict(names or {"frames": "num_frames"})
    check_geometry(num_frames, height, width, spec.frames_per_block, spec.kv_window, spec.sink, names=names,
                   recache=spec.recache)
    sp = seq_parallel_of(model)
    check_fits(model.config.to_dict(), num_frames, height, width, device=model.device,
               dtype=str(model.compute_dtype), frames_per_block=spec.frames_per_block, kv_window=spec.kv_window,
               batch=spec.batch, names=names, world=sp.world if sp is not None else 1)
    return latent_frames(num_frames), *latent_size(height, width, model.config.patch_size[1:])


def compile_for_sampling(model, settings, log=None) -> str | None:
    """Regional compile of the blocks for the optimized sampler (None settings: nothing); returns the mode."""
    if settings is None:
        return None
    from ..compile import uncompile_model
    from ..compile.apply import compile_handle, compile_model
    from ..compile.presets import graph_safe_settings
    from ..compile.settings import coerce_settings
    s = coerce_settings(settings)
    if s.scope != "blocks":
        if log is not None:
            log("compile scope set to 'blocks' (the optimized path calls the blocks directly)")
        s = s.replace(scope="blocks")
    safe, note = graph_safe_settings(s)         # the sampler's own CUDA graphs stay in charge of capture
    if note and log is not None:
        log(note)
    if safe is None:
        uncompile_model(model)
        return s.backend
    handle = compile_handle(model)
    if handle is None or handle.settings != safe:
        compile_model(model, safe)
    return safe.mode if safe.backend == "inductor" else safe.backend
