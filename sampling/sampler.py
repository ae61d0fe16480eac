"""The causal sampler's entry point: ``causal_request`` checks a run's arguments once into its frozen request, its
inputs and its hooks; ``sample_causal(model, request, inputs, hooks)`` runs the one chunk loop (``loop.py``) with the
executor of the chosen path (reference: ``loop.EagerExecutor``; optimized: ``runner.Run``). The pack's faces build
the three through the app floor's prepare step (``app/prepare.py``). ``path_for_linear`` is the one rule between a
run's path and its linear mode.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import torch

from ..cache import open_cache
from ..model.finite import check_output, context_flags
from ..model.kv_cache import KVCache
from ..model.rope import check_positions
from .loop import EagerExecutor, run_chunks, text_batch
from .prompts import PromptSchedule
from .recache import RECACHE_MODES
from .request import SamplingHooks, SamplingInputs, SamplingRequest
from .runner import FastOptions, get_runner
from .scheduler import Schedule, resolve_schedule


PATHS = ("auto", "optimized", "reference")
_PATH_DEFAULT: contextvars.ContextVar = contextvars.ContextVar("wan_accel_sampler_path", default=None)


@contextlib.contextmanager
def sampler_path(path: str = "auto", options=None):
    """Within the block, ``sample_causal`` calls that leave ``path='auto'`` use ``path`` and ``options`` (FastOptions
    or dict): routes callers that do not take these arguments (e.g. the Matrix-Game-2 loop)."""
    if path not in PATHS:
        raise ValueError(f"sampler path must be one of {PATHS}, got {path!r}")
    token = _PATH_DEFAULT.set((path, options))
    try:
        yield
    finally:
        _PATH_DEFAULT.reset(token)


def current_path() -> tuple | None:
    """(path, options) of the enclosing ``sampler_path`` block, or None outside one."""
    return _PATH_DEFAULT.get()


def resolve_path(path: str, device, tracer=None, model=None) -> tuple[str, object]:
    """('optimized' | 'reference', options): 'auto' takes a ``sampler_path`` block's choice, else the optimized
    path on CUDA. 'auto' means the reference path on other devices, when a tracer records every call, and when
    ``model.forward_chunk`` is replaced on the instance (a whole-model compile, a capture hook): only the
    reference path calls it."""
    if path not in PATHS:
        raise ValueError(f"sampler path must be one of {PATHS}, got {path!r}")
    options = None
    if path == "auto":
        ctx = _PATH_DEFAULT.get()
        if ctx is not None:
            path, options = ctx
    if path == "auto":
        patched = model is not None and "forward_chunk" in getattr(model, "__dict__", {})
        path = "optimized" if torch.device(device).type == "cuda" and tracer is None and not patched else "reference"
    return path, options


LINEAR_PATH_NOTE = "linear fp8: the optimized sampler path runs (the only one with fp8 linear layers)"


def path_for_linear(path: str, linear: str | None = "exact", names: tuple = ("sampler", "linear")) -> tuple:
    """(path, note or None): the one rule between a run's path and its linear mode. fp8 linear layers exist on the
    optimized path only, so 'auto' means 'optimized' with them (the note says so) and 'reference' is refused
    (ValueError naming the fix in the caller's option ``names``: (path, linear))."""
    if linear in (None, "exact"):
        return path, None
    if path == "reference":
        p, lin = names
        raise ValueError(f"{lin} {linear} runs on the optimized sampler path only (the reference path keeps every "
                         f"layer exact): use {p} optimized (or auto), or {lin} exact")
    return ("optimized", LINEAR_PATH_NOTE) if path == "auto" else (path, None)


def chunk_plan(num_frames: int, frames_per_block: int, independent_first_frame: bool = False,
               partial_last: bool = False) -> list:
    """[(first_frame, num_frames), ...] covering all latent frames; clear error when they do not divide, unless
    ``partial_last``: then the last chunk holds the frames left over (fewer than frames_per_block, as ComfyUI's
    own AR video sampler does)."""
    if frames_per_block < 1:
        raise ValueError(f"frames_per_block must be >= 1, got {frames_per_block}")
    first = 1 if independent_first_frame else 0
    rest = num_frames - first
    if rest < 0 or (rest % frames_per_block and not partial_last):
        raise ValueError(
            f"{num_frames} latent frames are not a whole number of {frames_per_block}-frame blocks"
            + (" after the independent first frame" if first else "")
            + f"; use a latent frame count like {max(1, rest // frames_per_block) * frames_per_block + first}"
            " (video frames = 4 * (latent frames - 1) + 1)")
    plan = [(0, 1)] if first else []
    plan += [(f, min(frames_per_block, num_frames - f)) for f in range(first, num_frames, frames_per_block)]
    return plan


def generator_noise(generator: torch.Generator):
    """noise_provider drawing float32 normal noise from a seeded generator (never the global RNG)."""
    def provide(chunk_index, step_index, shape, dtype, device):
        eps = torch.randn(shape, generator=generator, device=generator.device, dtype=torch.float32)
        return eps.to(device=device, dtype=dtype)
    return provide


def _as_schedule(schedule) -> Schedule:
    if isinstance(schedule, Schedule):
        return schedule
    if isinstance(schedule, str):
        return resolve_schedule(schedule)
    if isinstance(schedule, dict):
        return resolve_schedule(**schedule)
    raise TypeError(f"schedule must be a preset name, a dict of resolve_schedule arguments or a Schedule, "
                    f"got {type(schedule).__name__}")


def sample_causal(model, request, inputs=None, hooks: SamplingHooks | None = None, *legacy, cache=None,
                  **keywords):
    """Sample latents [B, F, C, H, W] (float32): ``sample_causal(model, request, inputs, hooks=None)``.

    request (``SamplingRequest``), inputs (``SamplingInputs``) and hooks (``SamplingHooks``, with its ``report``
    dict) come from ``causal_request`` or, for a face of the pack, from the app floor's prepare step
    (``app/prepare.py``), which applies the doctor's verdicts, the VRAM plan, block swap and compile first.
    cache: the LimitCache of the optimized path (recorded graph failures); None: the default one.

    The keyword form of earlier versions, ``sample_causal(model, context, noise, schedule, frames_per_block,
    ...)``, still runs (tests and tools): it builds the objects with ``causal_request`` (its arguments) and
    runs them."""
    if not isinstance(request, SamplingRequest):
        given = (request, inputs) + ((hooks,) if hooks is not None else ()) + legacy
        request, inputs, hooks = causal_request(model, *given, **keywords)
    elif legacy or keywords:
        raise TypeError(f"sample_causal(model, request, inputs, hooks) takes no other arguments; got "
                        f"{len(legacy)} more positional and {sorted(keywords)}")
    if not isinstance(inputs, SamplingInputs):
        raise TypeError(f"sample_causal needs the run's SamplingInputs beside its request, got "
                        f"{type(inputs).__name__}")
    hooks = hooks if hooks is not None else SamplingHooks()
    req, report = request, hooks.report
    given = [inputs.context] if inputs.chunk_contexts is None else list(inputs.chunk_contexts)
    pending = context_flags(given + [inputs.previous_context])   # where the conditioning enters; read with the output
    if report is not None:
        report["path"] = req.path
    if req.path == "optimized":
        executor = get_runner(model).start(req.options, batch=req.batch, num_frames=req.num_frames,
                                           grid_hw=req.grid_hw, kv_window=req.kv_window, sink=req.sink,
                                           kv_cache=inputs.kv_cache, actions=inputs.model_kwargs.get("actions"),
                                           cache=open_cache(cache), chunks=req.chunks)
    else:
        executor = EagerExecutor(model, req, inputs)
    out, info = run_chunks(model, executor, req, inputs, hooks)
    if report is not None:
        report.update(info, skipped_last_refresh=req.skip_last_refresh)
    check_output(out, dtype=getattr(model, "compute_dtype", None), contexts=given, model=model,
                 pending=pending)                             # once, at the end: one host sync per run
    return out                                                # a continued run: its new frames only


def causal_request(model, context, noise, schedule="self_forcing", frames_per_block: int = 3,
                   generator: torch.Generator | None = None, noise_provider=None, kv_window: int = -1,
                   sink: int = 0, skip_last_refresh: bool = False, callback=None, *, refresh_t: float = 0.0,
                   independent_first_frame: bool = False, tracer=None, on_chunk=None, clip_fea=None, y=None,
                   kv_cache: KVCache | None = None, model_kwargs: dict | None = None, path: str = "auto",
                   fast_options=None, report: dict | None = None, chunk_guard=None, prefix=None,
                   start_frame: int = 0, partial_last_block: bool = False, prompt_schedule=None,
                   prompt_embeddings: dict | None = None, recache: str = "switch", cache_policy=None,
                   chunk_contexts: list | None = None, previous_context=None, history=None,
                   on_chunk_latents=None) -> tuple[SamplingRequest, SamplingInputs, SamplingHooks]:
    """The arguments of a run checked once: (request, inputs, hooks) for ``sample_causal``.

    noise [B, F, C, H, W], or just that shape (B, F, C, H, W): each chunk's initial noise is then drawn from the
    noise provider (step index -1) when the chunk starts, so every random draw happens in chunk order and a longer
    video starts with exactly the frames of a shorter one with the same seed.

    context: [B or 1, L, text_dim] text embedding of the prompt (or an EmbeddedText).
    schedule: preset name, dict for resolve_schedule, or a Schedule.
    noise_provider(chunk, step, shape, dtype, device) -> eps used to go from step k to k+1; defaults to
    draws from ``generator`` (a fresh generator seeded 0 when none is given).
    callback / on_chunk / on_chunk_latents / tracer / chunk_guard / report: see ``request.SamplingHooks`` (a
    streaming consumer, e.g. a decode, takes each chunk's frames from on_chunk_latents: before the chunk's refresh
    pass).
    y [B, F, C_y, H, W] (i2v conditioning latents, concatenated on channels) and clip_fea are optional; a continued
    run's y may cover its frames only ([B, F - start_frame, ...]), so its memory does not grow with the video.
    kv_cache: a fresh KVCache to use (e.g. to inspect it afterwards); built from kv_window/sink when None.
    model_kwargs: extra keyword arguments of every forward call (``actions`` for Matrix-Game-2).
    path: 'reference' (``loop.EagerExecutor``: one ``forward_chunk`` per call), 'optimized' (``runner.Run``: static
    buffers, fused parts, CUDA graphs; same results within rounding) or 'auto' (see ``resolve_path``).
    fast_options: FastOptions (or dict) of the optimized path.
    prefix: clean latent frames [B, P, C, H, W] that begin the video (e.g. an encoded start image): written into the
    KV cache by one refresh pass before the first chunk and returned as the first P frames; the chunks cover the
    frames after them.
    start_frame: sample only the chunks from this latent frame on (a chunk boundary of the F-frame plan) and return
    [B, F - start_frame, C, H, W]; ``kv_cache`` must then hold frames [0, start_frame) and the generator be where
    the earlier frames left it (``continuation.sample_continuable`` does both: continue a video later).
    partial_last_block: accept a frame count that is not whole chunks; the last chunk is shorter (``chunk_plan``).
    prompt_schedule: a ``prompts.PromptSchedule`` (or its text) over the chunks of the whole F-frame plan, with
    prompt_embeddings {text: raw context [B or 1, L, text_dim]} for every text of it (``context`` is then unused);
    chunk_contexts: the raw context of each chunk of this run, given directly. recache: 'switch' (LongLive: re-cache
    the window's KV at every switch) or 'none'; cache_policy: ``before_chunk(state)`` before every chunk (see
    ``recache.py``). previous_context / history: a continued run's context in effect before its first chunk and the
    clean latents of the frames before it (``continuation.sample_continuable`` passes both).
    """
    if recache not in RECACHE_MODES:
        raise ValueError(f"recache must be one of {RECACHE_MODES}, got {recache!r}")
    if prompt_schedule is not None and chunk_contexts is not None:
        raise ValueError("give a prompt schedule or chunk contexts, not both")
    req, inputs = resolve_request(model, context, noise, schedule, frames_per_block, generator, noise_provider,
                                  kv_window, sink, skip_last_refresh, refresh_t, independent_first_frame, tracer,
                                  clip_fea, y, kv_cache, model_kwargs, path, fast_options, prefix, start_frame,
                                  partial_last_block, getattr(cache_policy, "rebuilds_self_kv", False))
    if prompt_schedule is not None:
        chunk_contexts, prev = schedule_contexts(prompt_schedule, prompt_embeddings, req, frames_per_block,
                                                 start_frame, independent_first_frame)
        previous_context = previous_context if previous_context is not None else prev
    if chunk_contexts is not None:
        if len(chunk_contexts) != len(req.chunks):
            raise ValueError(f"{len(chunk_contexts)} chunk contexts for the {len(req.chunks)} chunks of this run; "
                             f"give one per chunk")
        context = chunk_contexts[0]
    inputs = dataclasses.replace(inputs, context=context, chunk_contexts=None if chunk_contexts is None else list(chunk_contexts),
                                 cache_policy=cache_policy, recache=recache, previous_context=previous_context,
                                 history=history)
    return req, inputs, SamplingHooks(callback, on_chunk, tracer, chunk_guard, on_chunk_latents, report)


def schedule_contexts(schedule, embeddings, req: SamplingRequest, frames_per_block: int, start_frame: int = 0,
                      independent_first_frame: bool = False) -> tuple:
    """(raw context of each chunk of ``req``, of the chunk before its first or None) from a prompt schedule over
    the chunks of the whole plan (a continued run's request holds the chunks from ``start_frame`` on)."""
    schedule = PromptSchedule.coerce(schedule)
    if not isinstance(embeddings, dict):
        raise ValueError("a prompt schedule needs prompt_embeddings: {text: context [B or 1, L, text_dim]} for every "
                         "text of schedule.texts()")
    skip = 0
    if start_frame:
        skip = len(chunk_plan(start_frame, frames_per_block, independent_first_frame, partial_last=True))
    total = skip + len(req.chunks)
    schedule.validate(total)
    contexts = schedule.contexts(embeddings, total)
    return contexts[skip:], contexts[skip - 1] if skip else None


def resolve_request(model, context, noise, schedule, frames_per_block, generator, noise_provider, kv_window, sink,
                    skip_last_refresh, refresh_t, independent_first_frame, tracer, clip_fea, y, kv_cache,
                    model_kwargs, path, fast_options, prefix=None, start_frame: int = 0,
                    partial_last_block: bool = False, rebuilds_self_kv: bool = False
                    ) -> tuple[SamplingRequest, SamplingInputs]:
    """Validate the arguments of ``sample_causal`` once: (the frozen request, the run's tensors).
    ``rebuilds_self_kv``: the cache policy rebuilds the self-attention cache before every chunk (Krea), so a
    continued run's cache need not hold the frames before ``start_frame``."""
    sched = _as_schedule(schedule)
    shape = tuple(noise.shape) if isinstance(noise, torch.Tensor) else tuple(int(v) for v in noise)
    if len(shape) != 5:
        raise ValueError(f"noise must be [B, F, C, H, W] (or that shape), got {shape}")
    b, num_frames, _, h, w = shape
    first = 0
    if prefix is not None:
        first = int(prefix.shape[1])
        if prefix.dim() != 5 or prefix.shape[0] != b or tuple(prefix.shape[2:]) != tuple(shape[2:]) or \
                not 0 < first < num_frames:
            raise ValueError(f"the start latent {tuple(prefix.shape)} does not fit the video latent {shape}: it "
                             f"needs the same batch, channels and size, and fewer frames")
        if start_frame:
            raise ValueError("a start latent (prefix) begins a video; a continued run (start_frame) already has it")
    plan = [(f + first, n) for f, n in chunk_plan(num_frames - first, frames_per_block, independent_first_frame,
                                                  partial_last_block)]
    if start_frame:
        starts = [f0 for f0, _ in plan]
        if start_frame not in starts:
            raise ValueError(f"start_frame {start_frame} is not the first frame of a chunk of the {num_frames}-frame "
                             f"plan (chunks start at {starts[:8]}{'...' if len(starts) > 8 else ''})")
        if kv_cache is None or not rebuilds_self_kv and kv_cache.end < start_frame * (
                h // model.config.patch_size[1]) * (w // model.config.patch_size[2]):
            raise ValueError(f"starting at latent frame {start_frame} needs a KV cache holding the frames before it")
        plan = [c for c in plan if c[0] >= start_frame]
    if y is not None and y.shape[1] not in (num_frames, num_frames - start_frame):
        raise ValueError(f"y covers {y.shape[1]} latent frames: give all {num_frames}, or (continuing) the "
                         f"{num_frames - start_frame} from start_frame {start_frame} on")
    ph, pw = model.config.patch_size[1:]
    if h % ph or w % pw:
        raise ValueError(f"latent height/width {h}x{w} must be divisible by the patch size {ph}x{pw}")
    check_positions(0, num_frames, h // ph, w // pw)
    check_window(num_frames, frames_per_block, kv_window, sink)
    from .krea import official_problem      # the rule every face meets: LongLive's sink, whatever the preset's form
    problem = official_problem("switch", frames_per_block, kv_window, sink, sched, {"preset": "schedule"})
    if problem:
        raise ValueError(problem)
    device = model.device
    generator = generator if generator is not None or noise_provider is not None else \
        torch.Generator(device=device).manual_seed(0)
    if noise_provider is None:
        noise_provider = generator_noise(generator)
    chosen, ctx_options = resolve_path(path, device, tracer, model)
    extra = dict(model_kwargs or {})
    if chosen == "optimized":
        options = FastOptions.coerce(fast_options if fast_options is not None else ctx_options)
        unknown = sorted(set(extra) - {"actions"})
        if unknown:
            raise ValueError(f"the optimized sampler does not take model arguments {unknown}; use path='reference'")
        skip_last = skip_last_refresh or (options.skip_last_refresh and kv_cache is None and tracer is None)
        latent_dtype = options.latent_dtype_for(model)
    else:
        asked = fast_options if fast_options is not None else ctx_options
        if asked is not None:
            path_for_linear("reference", FastOptions.coerce(asked).linear, names=("path", "linear"))
        options, skip_last, latent_dtype = None, bool(skip_last_refresh), model.stream_dtype
    req = SamplingRequest(shape, sched, tuple(plan), (h // ph, w // pw), int(kv_window), int(sink), float(refresh_t),
                          skip_last, chosen, options, latent_dtype)
    inputs = SamplingInputs(context, noise if isinstance(noise, torch.Tensor) else None, noise_provider, generator,
                            clip_fea, y, extra, kv_cache, prefix)
    return req, inputs


def check_window(num_frames: int, frames_per_block: int, kv_window: int, sink: int) -> None:
    """A rolling window must hold the sink frames plus one chunk; said in latent frames, before anything runs."""
    if sink < 0:
        raise ValueError(f"sink must be >= 0 latent frames, got {sink}")
    if sink and kv_window <= 0:
        raise ValueError(f"sink ({sink} latent frames) needs a rolling KV window (kv_window > 0); with a global "
                         f"cache every frame is kept anyway: use sink 0")
    if kv_window > 0 and sink + frames_per_block > kv_window:      # whether or not this video reaches the window
        raise ValueError(f"a rolling KV window of {kv_window} latent frames cannot hold {sink} sink frame(s) plus "
                         f"one {frames_per_block}-frame chunk; use kv_window >= {sink + frames_per_block} or "
                         f"sink <= {max(0, kv_window - frames_per_block)}")


def generate_latents(model, context, num_frames: int, height: int, width: int, seed: int = 0, batch: int = 1,
                     schedule="self_forcing", frames_per_block: int = 3, **kwargs) -> torch.Tensor:
    """Seeded sampling of [batch, num_frames, out_channels, height, width] latents. All noise (each chunk's
    initial noise, then its re-noising draws, chunk by chunk) comes from one generator on the model's device:
    no global RNG, no host transfers. Same seed and device type give the same latents, and a longer video
    begins with the frames of a shorter one."""
    gen = torch.Generator(device=model.device).manual_seed(int(seed))
    shape = (batch, num_frames, model.config.out_dim, height, width)
    return sample_causal(model, *causal_request(model, context, shape, schedule, frames_per_block, generator=gen,
                                                **kwargs))
