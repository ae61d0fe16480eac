"""Prompt switches inside the one chunk loop: the new prompt's cross-attention cache, LongLive's KV re-cache, and the
``cache_policy`` hook.

At a chunk whose context differs from the previous chunk's (``PromptSwitcher.before_chunk``):

1. every executor's ``set_text(embedded)`` replaces the prompt: the cross-attention keys/values are dropped and
   computed from the new prompt;
2. with ``recache='switch'``, ``recache_window`` recomputes the self-attention keys/values of the frames still in
   the window under the new prompt, as LongLive v1.0's interactive inference does (``_recache_after_switch`` with its
   configured ``global_sink: true``, ``context_noise: 0``):

   * the frames: with a global cache every frame so far; with a window of W frames and S sink frames, the last
     min(W, frames so far) frames. When they begin at frame 0 (the window has not rolled yet) all of them are
     rewritten, the sink included; once the window has rolled, the sink keeps the keys/values it was cached with
     (under the earlier prompt) and only the W - S newest frames are rewritten (LongLive passes the W frames but
     protects the sink slots of a recomputation, so its first S frames are computed and dropped: their queries
     reach no kept key or value);
   * one model pass over those clean latents at timestep 0, each frame at its own RoPE position (its frame index),
     written to the slots the frames already hold; the cache's end does not move;
   * attention within the pass is full (not block-causal) over the recomputed frames plus the sink: LongLive builds
     a block-causal mask but its KV-cached self-attention does not apply it. So a re-cache is not a sequence of
     per-chunk refresh passes;
   * the cross-attention cache is dropped before and after the pass: the pass and the chunks after it read the new
     prompt;
3. ``inputs.cache_policy.before_chunk(state)`` runs before every chunk (switch or not), after the above; when it
   returns a frame position, the chunk is sampled there (RoPE positions and cache slots) instead of at its first
   frame (``krea.KreaRecompute``).

Chunks before a switch are untouched: a run with a switch makes the same frames, bit for bit, up to it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .request import RunInputs, SamplingRequest

RECACHE_MODES = ("switch", "none")


def text_batch(context, batch: int):
    """A [1, L, D] context expanded to the run's batch (other contexts unchanged)."""
    if isinstance(context, torch.Tensor) and context.dim() == 3 and context.shape[0] == 1 and batch > 1:
        return context.expand(batch, -1, -1)
    return context


@dataclass
class ChunkState:
    """What a cache policy or a re-cache sees before a chunk. out: float32 clean latents made so far (frames from
    ``base`` on); text: the embedded context in effect; switched: whether the context changed at this chunk."""
    executor: Any
    req: SamplingRequest
    inputs: RunInputs
    chunk_index: int
    first_frame: int
    frames: int
    out: torch.Tensor
    base: int
    text: Any
    switched: bool = False
    position: int | None = None     # the frame position the chunk is sampled at (RoPE and cache slots), when a
    # cache policy's before_chunk returned one (Krea Realtime caps it); None: the chunk's own first frame

    def clean(self, start: int, end: int) -> torch.Tensor:
        """Clean latents [B, end - start, C, H, W] float32 of frames [start, end) made before this chunk (frames
        before the run's first chunk come from ``inputs.history``)."""
        if end > self.first_frame or start < 0:
            raise ValueError(f"frames [{start}, {end}) are not all made before chunk {self.chunk_index}")
        parts = []
        if start < self.base:
            hist = self.inputs.history
            have = 0 if hist is None else hist.shape[1]
            if self.base - start > have:
                raise ValueError(f"re-caching frames from {start} needs the clean latents of frames [{start}, "
                                 f"{self.base}) of the earlier run; continue from a state that keeps them")
            parts.append(hist[:, have - (self.base - start):have - max(0, self.base - end)])
        if end > self.base:
            parts.append(self.out[:, max(start, self.base) - self.base:end - self.base])
        return parts[0] if len(parts) == 1 else torch.cat([p.to(self.out.device) for p in parts], dim=1)


def conditioning(req: SamplingRequest, inputs: RunInputs, start: int, end: int, device):
    """The i2v conditioning y of frames [start, end) on ``device``, or None. ``inputs.y`` covers every frame, or (a
    continued run) the frames from its first chunk on."""
    y = inputs.y
    if y is None:
        return None
    off = req.num_frames - y.shape[1]
    if start < off:
        raise ValueError(f"re-caching frames from {start} needs their conditioning latents (y); give y for all "
                         f"{req.num_frames} frames")
    return y[:, start - off:end - off].to(device)


def recache_range(req: SamplingRequest, first_frame: int) -> tuple:
    """(first, end) frames whose self-attention KV a switch at ``first_frame`` rewrites (see the module doc)."""
    if first_frame <= 0:
        return 0, 0
    window = req.kv_window
    if window <= 0 or window >= req.num_frames or first_frame <= window:
        return 0, first_frame                                # not rolled: every frame, the sink included
    return first_frame - (window - req.sink), first_frame    # rolled: the non-sink part of the window


def recache_window(state: ChunkState) -> int:
    """Recompute the window's self-attention KV under the prompt now in effect; returns the frames rewritten."""
    req, ex = state.req, state.executor
    start, end = recache_range(req, state.first_frame)
    if end <= start:
        return 0
    clean = state.clean(start, end).to(req.latent_dtype)
    y = conditioning(req, state.inputs, start, end, clean.device)
    step = ex.begin_recache(start, end - start)  # (the switch dropped the cross cache before the pass)
    ex.forward("recache", clean, float(req.refresh_t), start, step, y=y, want_output=False)
    ex.set_text(state.text)                      # ... and it is dropped after it
    return end - start


def same_context(a, b) -> bool:
    if a is b:
        return True
    if a is None or b is None:
        return False
    ta = getattr(a, "tensor", a)
    tb = getattr(b, "tensor", b)
    return ta.shape == tb.shape and ta.dtype == tb.dtype and ta.device == tb.device and torch.equal(ta, tb)


class PromptSwitcher:
    """Follows the run's per-chunk contexts: embeds each new one once, switches the executor to it, re-caches."""

    def __init__(self, model, executor, req: SamplingRequest, inputs: RunInputs, out: torch.Tensor, base: int):
        # recache mode and one context per chunk: checked where the inputs are made (sampler.build_request)
        self.model, self.executor, self.req, self.inputs, self.out, self.base = model, executor, req, inputs, out, base
        self.contexts = inputs.chunk_contexts
        self.raw = self.context_of(0)
        self.text = model.embed_text(text_batch(self.raw, req.batch))
        self.switches: list = []

    def context_of(self, ci: int):
        return self.inputs.context if self.contexts is None else self.contexts[ci]

    def before_chunk(self, ci: int, f0: int, n: int) -> ChunkState:
        """Switch the prompt when chunk ``ci``'s context differs from the one in effect; run the cache policy."""
        raw = self.context_of(ci)
        if ci == 0:
            prev = self.inputs.previous_context
            switched = prev is not None and not same_context(prev, raw)
        else:
            switched = not same_context(self.raw, raw)
            if switched:
                self.raw = raw
                self.text = self.model.embed_text(text_batch(raw, self.req.batch))
        state = ChunkState(self.executor, self.req, self.inputs, ci, f0, n, self.out, self.base, self.text, switched)
        if switched:
            self.executor.set_text(self.text)
            rewritten = recache_window(state) if self.req.recache == "switch" else 0
            self.switches.append({"chunk": ci, "frame": f0, "recached_frames": rewritten})
        policy = self.inputs.cache_policy
        if policy is not None:
            pos = policy.before_chunk(state)
            state.position = None if pos is None else int(pos)
        return state


__all__ = ["ChunkState", "text_batch", "PromptSwitcher", "recache_window", "recache_range", "same_context", "RECACHE_MODES"]
