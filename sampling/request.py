"""A sampling run as data: the request (resolved once, frozen) and the hooks (progress, interrupt, preview, traces,
out-of-memory policy).

A face describes a run as a spec (``app.prepare.RunSpec``) and its ``RunInputs``; the app floor's one prepare step
(``app/prepare.py``) hands them to ``sampler.build_request``, which checks them once into a frozen
``SamplingRequest`` and the run's checked ``RunInputs``; the chunk loop, the executors and the policies read those
instead of having parameters threaded through them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .scheduler import Schedule


class Replaceable:
    """``replace(**changes)`` of a dataclass: a copy with those fields changed."""

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class SamplingRequest(Replaceable):
    """What to sample. shape (B, F, C, H, W) of the latents; chunks [(first_frame, frames), ...]; grid_hw the token
    grid of a frame after patching; path 'reference' | 'optimized' (resolved); options the optimized path's
    FastOptions (None on the reference path); latent_dtype the dtype of the loop's latent state (xt, x0); recache
    'switch' (LongLive: re-cache the window's self-attention KV under the new prompt at every switch, ``recache.py``)
    or 'none' (only the cross-attention cache follows the prompt)."""
    shape: tuple
    schedule: Schedule
    chunks: tuple
    grid_hw: tuple
    kv_window: int = -1
    sink: int = 0
    refresh_t: float = 0.0
    skip_last_refresh: bool = False
    path: str = "reference"
    options: Any = None
    latent_dtype: torch.dtype = torch.float32
    recache: str = "switch"

    @property
    def batch(self) -> int:
        return self.shape[0]

    @property
    def num_frames(self) -> int:
        return self.shape[1]

    @property
    def frame_tokens(self) -> int:
        return self.grid_hw[0] * self.grid_hw[1]

    def chunk_shape(self, frames: int) -> tuple:
        return (self.shape[0], frames) + tuple(self.shape[2:])

    def refreshes(self, chunk_index: int) -> bool:
        """Whether the chunk's clean output is written back to the cache (every chunk but a skipped last one)."""
        return not (self.skip_last_refresh and chunk_index == len(self.chunks) - 1)


@dataclass(frozen=True)
class SamplingHooks(Replaceable):
    """Observers and policies of a run (all optional).

    callback(chunk_index, step_index, num_chunks, num_steps, x0_chunk) after every step (may raise to stop: interrupt);
    on_chunk(chunk_index, num_chunks) after each chunk including its cache refresh (progress, per-chunk timing);
    on_chunk_latents(chunk_index, num_chunks, x0_chunk) once per chunk with its final latents [B, n, C, H, W] (the
    loop's latent dtype), as soon as they exist: after the last step's callback and before the chunk's cache-refresh
    pass is enqueued, so what it enqueues on the same stream (a decode) runs before the refresh; an out-of-memory
    retry of the chunk does not call it again once it has returned;
    tracer(dict) receives every model call (chunk, kind, step, current_start, t, xt, flow, x0) for checks;
    chunk_guard(attempt, on_oom) runs one chunk: ``attempt()`` computes it (and may be called again: the noise
    generator is rewound), ``on_oom()`` drops the executor's state that a retry must not reuse. The memory floor
    provides the out-of-memory guard (swap more blocks, redo the chunk);
    report: a dict that receives what the run did (its path, the executor's report; the app floor's prepare step
    adds ``switched_off``, the doctor's verdicts it applied).
    """
    callback: Callable | None = None
    on_chunk: Callable | None = None
    tracer: Callable | None = None
    chunk_guard: Callable | None = None
    on_chunk_latents: Callable | None = None
    report: dict | None = None


@dataclass(frozen=True)
class RunInputs(Replaceable):
    """What a run samples from, typed (``app.prepare.prepare`` takes it beside the run's spec).

    context [B or 1, L, text_dim] (or an EmbeddedText); or prompt_schedule (a ``prompts.PromptSchedule`` or its text,
    over the chunks of the whole video) with prompt_embeddings {text: raw context}; or chunk_contexts, the raw context
    of every chunk of this run. noise [B, F, C, H, W], or that shape: each chunk's initial noise is then drawn when the
    chunk starts (step index -1), so every draw happens in chunk order and a longer video begins with the frames of a
    shorter one of the same seed. generator: the draws' (default: seeded with the spec's seed on the model's device);
    noise_provider(chunk, step, shape, dtype, device) -> eps replaces it. prefix: clean first frames [B, P, C, H, W]
    (an encoded start image) written into the cache before the first chunk. y [B, F (or F - start_frame), C_y, H, W]
    and clip_fea: image conditioning. model_kwargs: extra forward arguments (``actions`` for Matrix-Game-2).
    kv_cache: a caller-made KVCache. state: a ``continuation.SamplerState`` to go on from (its frames are not sampled
    again; the cache, generator, context in effect and history come from it). start_frame / previous_context /
    history: a continuation given by hand (``mg2_continuation``); previous_context the raw context in effect before
    the first chunk (a different first one is a prompt switch), history the clean latents [B, H, C, H, W] float32
    of the H frames just before the run's first chunk (what a re-cache at the first chunk reads). cache_policy:
    ``before_chunk(state)`` before every chunk (Krea's re-cache).

    ``sampler.build_request`` returns the copy the chunk loop reads: noise a tensor or None (then drawn per chunk
    from noise_provider), noise_provider and generator set, model_kwargs a dict, chunk_contexts the raw context of
    every chunk of the run (a prompt schedule resolved; None: ``context`` for all) and context the first one's."""
    context: Any = None
    noise: Any = None
    generator: torch.Generator | None = None
    noise_provider: Callable | None = None
    prefix: torch.Tensor | None = None
    y: torch.Tensor | None = None
    clip_fea: torch.Tensor | None = None
    model_kwargs: dict | None = None
    kv_cache: Any = None
    prompt_schedule: Any = None
    prompt_embeddings: dict | None = None
    chunk_contexts: list | None = None
    state: Any = None
    start_frame: int = 0
    previous_context: Any = None
    history: torch.Tensor | None = None
    cache_policy: Any = None
