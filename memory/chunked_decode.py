"""Temporal chunked VAE decode with overlap and a linear cross-fade.

A causal video VAE (Wan: ``t`` latent frames -> ``1 + r (t - 1)`` video frames, r = 4) decodes a chunk of latent
frames ``[s, e)`` into the video frames ``r*s .. r*(e-1)``: the chunk's first latent frame is decoded like a
first frame (one video frame), the others give ``r`` frames each. Consecutive chunks share ``overlap`` latent
frames, i.e. ``r (overlap - 1) + 1`` video frames, which are cross-faded linearly from the earlier chunk to the
later one (the later chunk's cold-start frames get the least weight). A decoder that is chunk-invariant gives
exactly the full decode; otherwise each blended frame lies between the two chunk decodes.

``decode_fn(latent_chunk [B, C, t, h, w]) -> frames`` with time on ``time_dim`` (ComfyUI's ``VAE.decode`` for Wan
returns ``[B, T, H, W, 3]``, time_dim 1).
"""
from __future__ import annotations

from typing import Callable

import torch

from .oom import run_chunks


def min_chunk(overlap: int, time_ratio: int) -> int:
    """Smallest useful chunk: it must advance past the overlap; with r > 1 an overlap of 1 is needed so that no
    video frame is missing between chunks."""
    return max(1, overlap + 1) if time_ratio > 1 or overlap > 0 else 1


class _Blender:
    def __init__(self, latent_frames: int, time_ratio: int | None, time_dim: int):
        self.t, self.r, self.dim = latent_frames, time_ratio, time_dim
        self.out: torch.Tensor | None = None
        self.covered = 0   # video frames written so far

    def add(self, s: int, e: int, frames: torch.Tensor) -> None:
        x = frames.movedim(self.dim, 1)
        n = x.shape[1]
        if self.r is None:
            if e - s > 1:
                if (n - 1) % (e - s - 1):
                    raise ValueError(f"decoder returned {n} frames for {e - s} latent frames; cannot infer its "
                                     "time ratio (expected 1 + r (t - 1))")
                self.r = (n - 1) // (e - s - 1)
            elif self.t == 1:
                self.r = 1
            else:
                raise ValueError("the first chunk has a single latent frame; pass time_ratio")
        if n != 1 + self.r * (e - s - 1):
            raise ValueError(f"decoder returned {n} frames for latent frames {s}..{e - 1}; expected "
                             f"{1 + self.r * (e - s - 1)} (time ratio {self.r})")
        if self.out is None:
            total = 1 + self.r * (self.t - 1)
            self.out = torch.empty((x.shape[0], total) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device)
        g0 = self.r * s
        m = max(0, self.covered - g0)   # video frames shared with what is already written
        if g0 > self.covered:
            raise ValueError(f"chunk starting at latent {s} leaves video frames {self.covered}..{g0 - 1} uncovered; "
                             "use an overlap of at least 1 latent frame")
        x = x.to(self.out.device, self.out.dtype)
        if m:
            w = torch.arange(1, m + 1, dtype=torch.float32, device=x.device) / (m + 1)
            w = w.view((1, m) + (1,) * (x.dim() - 2)).to(x.dtype)
            old = self.out[:, g0:g0 + m]
            self.out[:, g0:g0 + m] = old * (1 - w) + x[:, :m] * w
        self.out[:, g0 + m:g0 + n] = x[:, m:]
        self.covered = g0 + n

    def result(self) -> torch.Tensor:
        return self.out.movedim(1, self.dim)


def decode_chunked(latent: torch.Tensor, decode_fn: Callable, *, chunk_frames: int, overlap: int = 1,
                   time_ratio: int | None = None, time_dim: int = 1, key: str | None = None, cache=None,
                   on_oom: Callable | None = None, hint=None,
                   between: Callable[[int, int], None] | None = None) -> tuple[torch.Tensor, int]:
    """Decode ``latent [B, C, T, h, w]`` in temporal chunks of at most ``chunk_frames`` latent frames.

    On out-of-memory the chunk is halved and redone (never below ``overlap + 1``); with ``key`` the size that
    worked is learned in the limit cache and the next run starts there. ``between(done, total)`` runs after
    each chunk (progress, interrupt). Returns ``(frames, chunk_used)``; frames keep the decoder's layout.
    """
    if latent.dim() != 5:
        raise ValueError(f"expected a video latent [B, C, T, h, w], got shape {tuple(latent.shape)}")
    t = latent.shape[2]
    overlap = max(0, int(overlap))
    r_guess = time_ratio if time_ratio is not None else 4
    floor = min(min_chunk(overlap, r_guess), t)
    start = max(floor, min(int(chunk_frames), t)) if chunk_frames and chunk_frames > 0 else t
    blender = _Blender(t, time_ratio, time_dim)
    done = [0]

    def step(pos: int, size: int) -> int:
        e = min(pos + max(size, floor), t)
        frames = decode_fn(latent[:, :, pos:e])
        blender.add(pos, e, frames)
        del frames
        done[0] = e
        return t if e >= t else e - min(overlap, e - pos - 1)

    def report(_pos: int) -> None:
        if between is not None:
            between(done[0], t)

    used = run_chunks(t, step, key=key, start=start, cache=cache, minimum=floor, unit="latent frames",
                      on_oom=on_oom, hint=hint, what="VAE decode", between=report)
    return blender.result(), used
