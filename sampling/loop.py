"""The one chunk loop of causal (chunk-autoregressive, KV-cached) few-step sampling, and its eager executor.

for each chunk of frames_per_block latent frames:
    xt = noise[chunk]
    for each step k: flow = model(xt, t_k); x0 = xt - sigma(t_k) * flow (float64)
                     if not last: xt = (1 - sigma(t_{k+1})) * x0 + sigma(t_{k+1}) * eps
    on_chunk_latents(chunk, x0): the chunk's frames, handed over before its refresh (a decode runs first)
    output[chunk] = x0; then one pass with t = refresh_t (0) on x0 rewrites the chunk's cache slots.

An executor runs the model calls: ``EagerExecutor`` calls ``model.forward_chunk`` (the reference path: every call
visible, a patched or whole-compiled ``forward_chunk`` honoured); the optimized ``runner.Run`` replays CUDA graphs
over static buffers. Both use the model's one block forward; the loop, the schedule, the noise order, the refresh
pass, the rolling window and the hooks are the same for both, and for text-to-video and Matrix-Game-2 alike.

Before each chunk, ``recache.PromptSwitcher`` follows the run's per-chunk contexts (a prompt schedule): at a switch
the executor takes the new prompt and, LongLive-style, the window's KV is re-cached; a cache policy runs there too.
"""
from __future__ import annotations

import torch

from ..model.kv_cache import CrossAttnCache, KVCache
from .recache import PromptSwitcher, conditioning
from .request import RunInputs, SamplingHooks, SamplingRequest
from .scheduler import FlowMatchScheduler

__all__ = ["EagerExecutor", "run_chunks"]


class _Rewrite:
    """A KV cache whose next ``plan`` is a rewrite of cached tokens (``KVCache.rewrite``): the re-cache pass of
    ``forward_chunk``, which plans its own writes."""

    def __init__(self, kv: KVCache):
        self.kv, self.layers = kv, kv.layers

    def plan(self, start: int, num_tokens: int):
        return self.kv.rewrite(start, num_tokens)


class EagerExecutor:
    """The reference executor: one ``model.forward_chunk`` per call over a plain KV cache."""

    def __init__(self, model, req: SamplingRequest, inputs: RunInputs):
        self.model, self.req = model, req
        self.kv = inputs.kv_cache if inputs.kv_cache is not None else KVCache.for_model(
            model, req.batch, req.frame_tokens, req.num_frames, req.kv_window, req.sink)
        self.cross = CrossAttnCache(model.config.num_layers)
        self.extra = dict(inputs.model_kwargs)
        self.text = self.image = None

    def prepare(self, text, image, timesteps, batch: int) -> None:
        self.text, self.image = text, image

    def begin_chunk(self, start_frame: int, frames: int):
        return None                 # forward_chunk plans its own cache writes

    begin_recache = begin_chunk     # forward("recache") plans a rewrite of the cached frames

    def set_text(self, embedded) -> None:
        """Condition the next calls on ``embedded`` (an EmbeddedText): the cross-attention cache is dropped."""
        self.text = embedded
        self.cross.reset()

    def forward(self, kind: str, xt, t: float, start_frame: int, step, y=None, want_output: bool = True):
        tt = torch.full(xt.shape[:2], t, dtype=torch.float32, device=xt.device)
        kv = _Rewrite(self.kv) if kind == "recache" else self.kv
        return self.model.forward_chunk(xt, tt, self.text, kv, self.cross, start_frame * self.req.frame_tokens,
                                        clip_fea=self.image, y=y, return_output=want_output, **self.extra)

    def on_oom(self) -> None:
        pass

    def finish(self, completed: bool = True) -> dict:
        return {"path": "reference"}


def run_chunks(model, executor, req: SamplingRequest, inputs: RunInputs, hooks: SamplingHooks
               ) -> tuple[torch.Tensor, dict]:
    """Sample every chunk of ``req`` through ``executor``; returns (latents [B, F, C, H, W] float32 from the first
    chunk's frame on: all F, or a continued run's new frames, report)."""
    device = model.device
    steps = list(req.schedule.timesteps)
    gen = inputs.generator
    ok = False
    try:
        with torch.no_grad():
            # the frames this run makes (a continued run starts at its first chunk: memory flat in video length)
            base = 0 if inputs.prefix is not None or not req.chunks else req.chunks[0][0]
            out = torch.empty((req.shape[0], req.shape[1] - base) + tuple(req.shape[2:]), dtype=torch.float32,
                              device=device)
            prompts = PromptSwitcher(model, executor, req, inputs, out, base)
            executor.prepare(prompts.text, inputs.clip_fea, steps + [float(req.refresh_t)], req.batch)
            if hasattr(executor, "warm"):
                executor.warm(req)         # attention plans of every length the run meets, before the first chunk
            if inputs.prefix is not None:
                _prefix(executor, req, inputs.prefix.to(device, req.latent_dtype), out)
            ready = _ReadyOnce(hooks.on_chunk_latents, len(req.chunks))
            for ci, (f0, n) in enumerate(req.chunks):
                pos = prompts.before_chunk(ci, f0, n).position    # a prompt switch (re-cache), the cache policy
                state = gen.get_state() if gen is not None and hooks.chunk_guard is not None else None

                def attempt(ci=ci, f0=f0, n=n, state=state):
                    if state is not None:
                        gen.set_state(state)
                    return _chunk(executor, req, inputs, hooks, ci, f0, n, device, pos, ready)

                x0 = attempt() if hooks.chunk_guard is None else hooks.chunk_guard(attempt, executor.on_oom)
                out[:, f0 - base:f0 - base + n] = x0.float()
                if hooks.on_chunk is not None:
                    hooks.on_chunk(ci, len(req.chunks))
        ok = True
    finally:
        report = executor.finish(ok)
    if prompts.switches:
        report["prompt_switches"] = prompts.switches
    return out, report


class _ReadyOnce:
    """``hooks.on_chunk_latents`` called once per chunk: a chunk an out-of-memory retry redoes (the same draws, the
    same latents) is not handed over again once the hook has returned for it."""

    def __init__(self, hook, num_chunks: int):
        self.hook, self.num_chunks, self.done = hook, num_chunks, set()

    def __call__(self, ci: int, x0: torch.Tensor) -> None:
        if self.hook is None or ci in self.done:
            return
        self.hook(ci, self.num_chunks, x0)
        self.done.add(ci)


def _prefix(executor, req: SamplingRequest, prefix: torch.Tensor, out: torch.Tensor) -> None:
    """Known clean first frames: one refresh pass writes them into the cache; they are the output's first frames."""
    n = prefix.shape[1]
    step = executor.begin_chunk(0, n)
    executor.forward("refresh", prefix, float(req.refresh_t), 0, step, want_output=False)
    out[:, :n] = prefix.float()


def _chunk(executor, req: SamplingRequest, inputs: RunInputs, hooks: SamplingHooks, ci: int, f0: int, n: int,
           device, pos: int | None, ready: _ReadyOnce):
    sched, tracer, callback = req.schedule, hooks.tracer, hooks.callback
    steps = sched.timesteps
    at = f0 if pos is None else pos                # the model's frame position (a cache policy may cap it)
    start = at * req.frame_tokens
    step = executor.begin_chunk(at, n)             # one write plan for every call of the chunk
    y = conditioning(req, inputs, f0, f0 + n, device)
    dtype = req.latent_dtype
    if inputs.noise is not None:
        xt = inputs.noise[:, f0:f0 + n].to(device, dtype)
    else:
        xt = inputs.noise_provider(ci, -1, req.chunk_shape(n), dtype, device)
    x0 = None
    last = len(steps) - 1
    for k, t in enumerate(steps):
        flow = executor.forward("denoise", xt, t, at, step, y=y)
        x0 = FlowMatchScheduler.to_x0(xt, flow, sched.x0_sigmas[k])
        if tracer is not None:
            tracer(dict(chunk=ci, kind="denoise", step=k, current_start=start, t=t, xt=xt, flow=flow.clone(), x0=x0))
        if callback is not None:
            callback(ci, k, len(req.chunks), len(steps), x0)
        if k < last:
            eps = inputs.noise_provider(ci, k, tuple(xt.shape), xt.dtype, xt.device)
            a, s = sched.renoise[k + 1]
            xt = FlowMatchScheduler.renoise(x0, eps, a, s, dtype=xt.dtype)
    ready(ci, x0)                                  # the chunk's frames, before its refresh pass is enqueued
    if req.refreshes(ci):
        flow = executor.forward("refresh", x0, float(req.refresh_t), at, step, y=y, want_output=tracer is not None)
        if tracer is not None:
            ctx = FlowMatchScheduler.to_x0(x0, flow, sched.x0_sigma_at(req.refresh_t))
            tracer(dict(chunk=ci, kind="context", step=None, current_start=start, t=req.refresh_t, xt=x0,
                        flow=flow.clone(), x0=ctx))
    return x0
