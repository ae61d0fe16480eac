"""Causal (chunk-autoregressive, KV-cached) few-step sampler of Self-Forcing / CausVid models.

for each chunk of frames_per_block latent frames:
    xt = noise[chunk]
    for each step k: flow = model(xt, t_k); x0 = xt - sigma(t_k) * flow (float64)
                     if not last: xt = (1 - sigma(t_{k+1})) * x0 + sigma(t_{k+1}) * eps (float32)
    output[chunk] = x0; then one pass with t = refresh_t (0) on x0 rewrites the chunk's cache slots.
"""
from __future__ import annotations

import contextlib
import contextvars

import torch

from ..model.kv_cache import CrossAttnCache, KVCache
from ..model.rope import check_positions
from .scheduler import FlowMatchScheduler, Schedule, resolve_schedule


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


def chunk_plan(num_frames: int, frames_per_block: int, independent_first_frame: bool = False) -> list:
    """[(first_frame, num_frames), ...] covering all latent frames; clear error when they do not divide."""
    if frames_per_block < 1:
        raise ValueError(f"frames_per_block must be >= 1, got {frames_per_block}")
    first = 1 if independent_first_frame else 0
    rest = num_frames - first
    if rest < 0 or rest % frames_per_block:
        raise ValueError(
            f"{num_frames} latent frames are not a whole number of {frames_per_block}-frame blocks"
            + (" after the independent first frame" if first else "")
            + f"; use a latent frame count like {max(1, rest // frames_per_block) * frames_per_block + first}"
            " (video frames = 4 * (latent frames - 1) + 1)")
    plan = [(0, 1)] if first else []
    plan += [(f, frames_per_block) for f in range(first, num_frames, frames_per_block)]
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


def _text_batch(context, batch):
    if isinstance(context, torch.Tensor) and context.dim() == 3 and context.shape[0] == 1 and batch > 1:
        return context.expand(batch, -1, -1)
    return context


def sample_causal(model, context, noise, schedule="self_forcing", frames_per_block: int = 3,
                  generator: torch.Generator | None = None, noise_provider=None, kv_window: int = -1,
                  sink: int = 0, skip_last_refresh: bool = False, callback=None, *, refresh_t: float = 0.0,
                  independent_first_frame: bool = False, tracer=None, on_chunk=None, clip_fea=None, y=None,
                  kv_cache: KVCache | None = None, model_kwargs: dict | None = None, path: str = "auto",
                  fast_options=None, report: dict | None = None):
    """Sample latents [B, F, C, H, W] (float32) from initial noise [B, F, C, H, W].

    noise may also be just the shape (B, F, C, H, W): each chunk's initial noise is then drawn from the noise
    provider (step index -1) when the chunk starts, so every random draw happens in chunk order and a longer
    video starts with exactly the frames of a shorter one with the same seed.

    context: [B or 1, L, text_dim] text embedding of the prompt (or an EmbeddedText).
    schedule: preset name, dict for resolve_schedule, or a Schedule.
    noise_provider(chunk, step, shape, dtype, device) -> eps used to go from step k to k+1; defaults to
    draws from ``generator`` (a fresh generator seeded 0 when none is given).
    callback(chunk_index, step_index, num_chunks, num_steps, x0_chunk) after every step (may raise to stop).
    tracer(dict) receives every model call (chunk, kind, step, current_start, t, xt, flow, x0) for checks.
    on_chunk(chunk_index, num_chunks) after each chunk including its cache refresh.
    y [B, F, C_y, H, W] (i2v conditioning latents, concatenated on channels) and clip_fea are optional.
    kv_cache: a fresh KVCache to use (e.g. to inspect it afterwards); built from kv_window/sink when None.
    model_kwargs: extra keyword arguments of every forward_chunk call (e.g. ``actions`` for Matrix-Game-2).
    path: 'reference' (the plain loop over ``forward_chunk``), 'optimized' (``wan.fast_sampler``: static buffers,
    fused kernels, CUDA graphs, compile; same results within rounding) or 'auto' (see ``resolve_path``).
    fast_options: FastOptions (or dict) of the optimized path. report: a dict that receives what the run did.
    """
    sched = _as_schedule(schedule)
    shape = tuple(noise.shape) if isinstance(noise, torch.Tensor) else tuple(int(v) for v in noise)
    b, num_frames, _, h, w = shape
    plan = chunk_plan(num_frames, frames_per_block, independent_first_frame)
    ph, pw = model.config.patch_size[1:]
    if h % ph or w % pw:
        raise ValueError(f"latent height/width {h}x{w} must be divisible by the patch size {ph}x{pw}")
    frame_tokens = (h // ph) * (w // pw)
    check_positions(0, num_frames, h // ph, w // pw)
    device, dtype = model.device, model.stream_dtype
    generator = generator if generator is not None or noise_provider is not None else \
        torch.Generator(device=device).manual_seed(0)
    if noise_provider is None:
        noise_provider = generator_noise(generator)
    chosen, ctx_options = resolve_path(path, device, tracer, model)
    if report is not None:
        report["path"] = chosen
    if chosen == "optimized":
        from .fast_sampler import sample_fast
        return sample_fast(model, context, noise, sched, plan, frame_tokens, (h // ph, w // pw), noise_provider,
                           generator=generator, kv_window=kv_window, sink=sink, skip_last_refresh=skip_last_refresh,
                           callback=callback, refresh_t=refresh_t, tracer=tracer, on_chunk=on_chunk,
                           clip_fea=clip_fea, y=y, kv_cache=kv_cache, model_kwargs=model_kwargs,
                           options=fast_options if fast_options is not None else ctx_options, report=report)
    kv = kv_cache if kv_cache is not None else KVCache.for_model(model, b, frame_tokens, num_frames,
                                                                   kv_window, sink)
    cross = CrossAttnCache(model.config.num_layers)
    with torch.no_grad():
        text = model.embed_text(_text_batch(context, b))
        image = clip_fea
        out = torch.empty(shape, dtype=torch.float32, device=device)
        for ci, (f0, n) in enumerate(plan):
            ctx = _ChunkCall(model, text, kv, cross, f0 * frame_tokens, image,
                             None if y is None else y[:, f0:f0 + n].to(device), model_kwargs or {})
            if isinstance(noise, torch.Tensor):
                xt = noise[:, f0:f0 + n].to(device, dtype)
            else:
                xt = noise_provider(ci, -1, (b, n) + shape[2:], dtype, device)
            x0 = _denoise_chunk(ctx, sched, xt, ci, len(plan), noise_provider, callback, tracer)
            out[:, f0:f0 + n] = x0.float()
            if not (skip_last_refresh and ci == len(plan) - 1):
                _refresh(ctx, sched, x0, refresh_t, ci, tracer)
            if on_chunk is not None:
                on_chunk(ci, len(plan))
    return out


class _ChunkCall:
    """Everything the model calls of one chunk share."""

    def __init__(self, model, text, kv, cross, start, image, y, extra):
        self.model, self.text, self.kv, self.cross, self.start, self.image, self.y, self.extra = (
            model, text, kv, cross, start, image, y, extra)

    def __call__(self, xt, t: float, return_output=True):
        tt = torch.full(xt.shape[:2], t, dtype=torch.float32, device=xt.device)
        return self.model.forward_chunk(xt, tt, self.text, self.kv, self.cross, self.start, clip_fea=self.image,
                                        y=self.y, return_output=return_output, **self.extra)


def _denoise_chunk(call: _ChunkCall, sched: Schedule, xt, ci, num_chunks, noise_provider, callback, tracer):
    n = sched.num_steps
    x0 = None
    for k, t in enumerate(sched.timesteps):
        flow = call(xt, t)
        x0 = FlowMatchScheduler.to_x0(xt, flow, sched.x0_sigmas[k])
        if tracer is not None:
            tracer(dict(chunk=ci, kind="denoise", step=k, current_start=call.start, t=t, xt=xt, flow=flow, x0=x0))
        if callback is not None:
            callback(ci, k, num_chunks, n, x0)
        if k < n - 1:
            eps = noise_provider(ci, k, tuple(xt.shape), xt.dtype, xt.device)
            a, s = sched.renoise[k + 1]
            xt = FlowMatchScheduler.renoise(x0, eps, a, s, dtype=xt.dtype)
    return x0


def _refresh(call: _ChunkCall, sched: Schedule, x0, refresh_t: float, ci, tracer):
    """Cache refresh: rewrite the chunk's KV slots with the keys/values of the clean x0."""
    if tracer is None:
        call(x0, refresh_t, return_output=False)
        return
    flow = call(x0, refresh_t)
    x0_ctx = FlowMatchScheduler.to_x0(x0, flow, sched.x0_sigma_at(refresh_t))
    tracer(dict(chunk=ci, kind="context", step=None, current_start=call.start, t=refresh_t,
                xt=x0, flow=flow, x0=x0_ctx))


def generate_latents(model, context, num_frames: int, height: int, width: int, seed: int = 0, batch: int = 1,
                     schedule="self_forcing", frames_per_block: int = 3, **kwargs) -> torch.Tensor:
    """Seeded sampling of [batch, num_frames, out_channels, height, width] latents. All noise (each chunk's
    initial noise, then its re-noising draws, chunk by chunk) comes from one generator on the model's device:
    no global RNG, no host transfers. Same seed and device type give the same latents, and a longer video
    begins with the frames of a shorter one."""
    gen = torch.Generator(device=model.device).manual_seed(int(seed))
    shape = (batch, num_frames, model.config.out_dim, height, width)
    return sample_causal(model, context, shape, schedule, frames_per_block, generator=gen, **kwargs)
