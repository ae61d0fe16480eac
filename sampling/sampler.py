"""The causal sampler's loop entry: ``build_request`` checks a run's spec and ``RunInputs`` once into its frozen
request and its inputs; ``sample_causal(model, request, inputs, hooks)`` runs the one chunk loop (``loop.py``) with
the executor of the chosen path (reference: ``loop.EagerExecutor``; optimized: ``runner.Run``). Every face reaches
both through the app floor's one prepare step (``app/prepare.py``: ``prepare(model, spec, inputs).latents()``).
``path_for_linear`` is the one rule between a run's path and its linear mode.
"""
from __future__ import annotations

import torch

from ..cache import open_cache
from ..model.finite import check_output, context_flags
from ..model.rope import check_positions
from .loop import EagerExecutor, run_chunks
from .prompts import PromptSchedule
from .request import RunInputs, SamplingHooks, SamplingRequest
from .runner import FastOptions, get_runner
from .scheduler import Schedule, resolve_schedule


PATHS = ("auto", "optimized", "reference")


def resolve_path(path: str, device, tracer=None, model=None) -> str:
    """'optimized' | 'reference': 'auto' is the optimized path on CUDA; the reference path on other devices, when a
    tracer records every call, and when ``model.forward_chunk`` is replaced on the instance (a whole-model compile,
    a capture hook): only the reference path calls it."""
    if path not in PATHS:
        raise ValueError(f"sampler path must be one of {PATHS}, got {path!r}")
    if path == "auto":
        patched = model is not None and "forward_chunk" in getattr(model, "__dict__", {})
        path = "optimized" if torch.device(device).type == "cuda" and tracer is None and not patched else "reference"
    return path


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


def as_schedule(schedule) -> Schedule:
    if isinstance(schedule, Schedule):
        return schedule
    if isinstance(schedule, str):
        return resolve_schedule(schedule)
    if isinstance(schedule, dict):
        return resolve_schedule(**schedule)
    raise TypeError(f"schedule must be a preset name, a dict of resolve_schedule arguments or a Schedule, "
                    f"got {type(schedule).__name__}")


def sample_causal(model, request: SamplingRequest, inputs: RunInputs, hooks: SamplingHooks | None = None
                  ) -> torch.Tensor:
    """The chunk loop over a checked run: latents [B, F, C, H, W] (the loop's latent dtype; a continued run: its new
    frames only). request / inputs come from ``build_request`` (through ``app.prepare.prepare``); hooks: the run's
    observers and policies (its ``report`` dict receives what the run did). The optimized path reads recorded graph
    failures from the default LimitCache."""
    if not isinstance(request, SamplingRequest) or not isinstance(inputs, RunInputs):
        raise TypeError(f"sample_causal(model, request, inputs, hooks) takes a SamplingRequest and its RunInputs "
                        f"(made by app.prepare.prepare), got {type(request).__name__} and {type(inputs).__name__}")
    hooks = hooks if hooks is not None else SamplingHooks()
    req, report = request, hooks.report
    given = [inputs.context] if inputs.chunk_contexts is None else list(inputs.chunk_contexts)
    pending = context_flags(given + [inputs.previous_context])   # where the conditioning enters; read with the output
    if report is not None:
        report["path"] = req.path
    if req.path == "optimized":
        executor = get_runner(model).start(req, inputs, open_cache())
    else:
        executor = EagerExecutor(model, req, inputs)
    out, info = run_chunks(model, executor, req, inputs, hooks)
    if report is not None:
        report.update(info, skipped_last_refresh=req.skip_last_refresh)
    check_output(out, dtype=getattr(model, "compute_dtype", None), contexts=given, model=model,
                 pending=pending)                             # once, at the end: one host sync per run
    return out


def build_request(model, spec, inputs: RunInputs, path: str = "auto", options=None, tracer=None
                  ) -> tuple[SamplingRequest, RunInputs]:
    """A run's spec and inputs checked once: (the frozen request, the inputs the loop reads) for ``sample_causal``.

    spec: the loop's settings (``app.prepare.RunSpec``, checked: schedule, frames_per_block, kv_window, sink,
    skip_last_refresh, refresh_t, independent_first_frame, partial_last_block, recache, seed); inputs: ``RunInputs``
    (its ``state`` already turned into a cache, generator and start frame: ``continuation.continued``); path:
    'reference' (``loop.EagerExecutor``: one ``forward_chunk`` per call), 'optimized' (``runner.Run``: static
    buffers, fused parts, CUDA graphs; same results within rounding) or 'auto' (``resolve_path``); options: the
    optimized path's FastOptions (or dict); tracer: the hooks' tracer (it makes 'auto' the reference path)."""
    if inputs.prompt_schedule is not None and inputs.chunk_contexts is not None:
        raise ValueError("give a prompt schedule or chunk contexts, not both")
    fpb, start_frame = spec.frames_per_block, int(inputs.start_frame)
    noise, prefix, y, kv_cache = inputs.noise, inputs.prefix, inputs.y, inputs.kv_cache
    sched = as_schedule(spec.schedule)
    shape = tuple(noise.shape) if isinstance(noise, torch.Tensor) else tuple(int(v) for v in noise)  # run.check_noise
    b, num_frames, _, h, w = shape
    ph, pw = model.config.patch_size[1:]
    first = 0
    if prefix is not None:
        first = int(prefix.shape[1])
        if prefix.dim() != 5 or prefix.shape[0] != b or tuple(prefix.shape[2:]) != tuple(shape[2:]) or \
                not 0 < first < num_frames:
            raise ValueError(f"the start latent {tuple(prefix.shape)} does not fit the video latent {shape}: it "
                             f"needs the same batch, channels and size, and fewer frames")
        if start_frame:
            raise ValueError("a start latent (prefix) begins a video; a continued run (start_frame) already has it")
    plan = [(f + first, n) for f, n in chunk_plan(num_frames - first, fpb, spec.independent_first_frame,
                                                  spec.partial_last_block)]
    if start_frame:
        starts = [f0 for f0, _ in plan]
        if start_frame not in starts:
            raise ValueError(f"start_frame {start_frame} is not the first frame of a chunk of the {num_frames}-frame "
                             f"plan (chunks start at {starts[:8]}{'...' if len(starts) > 8 else ''})")
        rebuilds_self_kv = getattr(inputs.cache_policy, "rebuilds_self_kv", False)
        if kv_cache is None or not rebuilds_self_kv and kv_cache.end < start_frame * (h // ph) * (w // pw):
            raise ValueError(f"starting at latent frame {start_frame} needs a KV cache holding the frames before it")
        plan = [c for c in plan if c[0] >= start_frame]
    if y is not None and y.shape[1] not in (num_frames, num_frames - start_frame):
        raise ValueError(f"y covers {y.shape[1]} latent frames: give all {num_frames}, or (continuing) the "
                         f"{num_frames - start_frame} from start_frame {start_frame} on")
    if h % ph or w % pw:
        raise ValueError(f"latent height/width {h}x{w} must be divisible by the patch size {ph}x{pw}")
    check_positions(0, num_frames, h // ph, w // pw)
    check_window(num_frames, fpb, spec.kv_window, spec.sink)
    from .krea import official_problem      # the rule every face meets: LongLive's sink, whatever the preset's form
    problem = official_problem(fpb, spec.sink, sched, {"preset": "schedule"})
    if problem:
        raise ValueError(problem)
    generator, noise_provider = inputs.generator, inputs.noise_provider
    if generator is None and noise_provider is None:
        generator = torch.Generator(device=model.device).manual_seed(int(spec.seed))
    if noise_provider is None:
        noise_provider = generator_noise(generator)
    chosen = resolve_path(path, model.device, tracer, model)
    extra = dict(inputs.model_kwargs or {})
    if chosen == "optimized":
        options = FastOptions.coerce(options)
        unknown = sorted(set(extra) - {"actions"})
        if unknown:
            raise ValueError(f"the optimized sampler does not take model arguments {unknown}; use path='reference'")
        skip_last = spec.skip_last_refresh or (options.skip_last_refresh and kv_cache is None and tracer is None)
        latent_dtype = options.latent_dtype_for(model)
    else:
        if options is not None:
            path_for_linear("reference", FastOptions.coerce(options).linear, names=("path", "linear"))
        options, skip_last, latent_dtype = None, bool(spec.skip_last_refresh), model.stream_dtype
    req = SamplingRequest(shape, sched, tuple(plan), (h // ph, w // pw), int(spec.kv_window), int(spec.sink),
                          float(spec.refresh_t), skip_last, chosen, options, latent_dtype, spec.recache)
    context, chunk_contexts, previous_context = inputs.context, inputs.chunk_contexts, inputs.previous_context
    if inputs.prompt_schedule is not None:      # over the chunks of the whole plan: skip those before start_frame
        schedule = PromptSchedule.coerce(inputs.prompt_schedule)
        if not isinstance(inputs.prompt_embeddings, dict):
            raise ValueError("a prompt schedule needs prompt_embeddings: {text: context [B or 1, L, text_dim]} for "
                             "every text of schedule.texts()")
        skip = len(chunk_plan(start_frame, fpb, spec.independent_first_frame, partial_last=True)) if start_frame else 0
        total = skip + len(req.chunks)
        contexts = schedule.validate(total).contexts(inputs.prompt_embeddings, total)
        chunk_contexts = contexts[skip:]
        if previous_context is None and skip:       # the context of the chunk before the run's first
            previous_context = contexts[skip - 1]
    if chunk_contexts is not None:
        if len(chunk_contexts) != len(req.chunks):
            raise ValueError(f"{len(chunk_contexts)} chunk contexts for the {len(req.chunks)} chunks of this run; "
                             f"give one per chunk")
        context = chunk_contexts[0]
    return req, inputs.replace(context=context, noise=noise if isinstance(noise, torch.Tensor) else None,
                               noise_provider=noise_provider, generator=generator, model_kwargs=extra,
                               chunk_contexts=None if chunk_contexts is None else list(chunk_contexts),
                               previous_context=previous_context)


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
