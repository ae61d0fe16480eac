"""Krea Realtime's cache policy: before every block the self-attention KV cache is rebuilt from a short clean
context, and the block is sampled at a capped position.

Krea Realtime (a causal, few-step Wan 2.1 14B) keeps no rolling cache. Before block ``b`` (first frame ``f0``):

* the clean context is at most ``K = kv_cache_num_frames`` latent frames: the first frame of the video and the newest
  ``K - 1`` frames while ``f0 - frames_per_block < K`` (or always, with ``keep_first_frame``); once the window has
  passed the first frame, the frame just before the newest ``K - 1`` is re-encoded as a stand-in first frame
  (the official server decodes it to pixels and encodes its last pixel frame again with the VAE: ``reencode``);
* the cache is emptied and the context is run once at t = 0 at positions 0 .. len-1 under a block-causal mask
  (blocks of ``frames_per_block`` frames counted from the context's first frame), with the prompt of the previous
  block (the cross-attention cache is only replaced afterwards);
* the block is then sampled at frame position ``min(f0, K)``: RoPE positions and cache slots are capped, so the
  model never sees a position past ``K + frames_per_block``.

A prompt change in Krea interpolates over ``N`` blocks with ``torch.lerp(old, new, linspace(0, 1, N))``, one step
per block and a fresh cross-attention cache each: the first of those blocks still uses the old prompt. In a prompt
schedule that is ``(b + 1): new (blend N - 1)`` for a change requested at block ``b`` (``krea_schedule_entry``).

``KreaRecompute`` is a ``cache_policy`` of the one chunk loop (``loop.py``): its ``before_chunk(state)`` does the
rebuild and returns the position the chunk is sampled at. Use it with ``recache='none'`` (it replaces the switch
re-cache) and a self-attention cache of at least ``K + frames_per_block`` frames.

``cache_setup(mode, ...)`` is the one mapping of a cache mode ('switch', 'none', 'krea') to the sampler's
``recache`` / ``cache_policy`` and the KV window it needs; the command line, the nodes and the play session all call
it. With 'krea' the context size is ``K = kv_window - frames_per_block`` (kv_window -1: Krea's K = 3).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .recache import RECACHE_MODES
from .scheduler import resolve_schedule

KREA_CONTEXT_FRAMES = 3          # Krea's default kv_cache_num_frames (release_server.py GenerationParams)
KREA_FRAMES_PER_BLOCK = 3
CACHE_MODES = RECACHE_MODES + ("krea",)
IDENTITY_REENCODE_NOTE = ("recache krea: no VAE at hand, so the frame standing in for the first frame is used as it "
                          "is (no decode/encode round trip as Krea's server does); frames after the first "
                          "K + frames_per_block can differ slightly from Krea's")


def krea_schedule(steps: int = 4, strength: float = 1.0, shift: float = 5.0):
    """Krea's step list: ``linspace(strength * 1000, 0, steps)`` truncated to integers, warped by the shifted
    training timesteps; it ends with a model call at timestep 0 (sigma the smallest training sigma, not 0)."""
    if int(steps) != steps or steps < 2:
        raise ValueError(f"steps must be an integer >= 2, got {steps!r}")
    if not 0 < float(strength) <= 1:
        raise ValueError(f"strength must be in (0, 1], got {strength!r}")
    grid = torch.linspace(float(strength) * 1000, 0, int(steps), dtype=torch.float32).to(torch.long)
    return resolve_schedule("custom", steps=[int(v) for v in grid], shift=shift, warp=True)


def krea_schedule_entry(block: int, interp_steps: int) -> tuple:
    """(chunk, blend) of the prompt-schedule entry equal to Krea's prompt change at ``block`` interpolated over
    ``interp_steps`` blocks (the first interpolated block keeps the old prompt). One step never reaches the new
    prompt in Krea (``linspace(0, 1, 1) == [0]``), so it is refused here."""
    if interp_steps < 2:
        raise ValueError(f"interp_steps must be at least 2 (Krea's one-step interpolation stays on the old prompt), "
                         f"got {interp_steps}")
    return block + 1, interp_steps - 1


def interpolated_contexts(old: torch.Tensor, new: torch.Tensor, steps: int) -> list:
    """Krea's per-block prompt embeddings of one change: ``torch.lerp(old, new, linspace(0, 1, steps))``."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    w = torch.linspace(0, 1, steps=steps).view(-1, 1, 1).to(old)
    return list(torch.lerp(old, new, w).chunk(steps, dim=0))


def context_frames(first_frame: int, kv_cache_num_frames: int, frames_per_block: int,
                   keep_first_frame: bool = False) -> list:
    """The context of the block starting at ``first_frame``: frame indices, with ``-1 - i`` meaning "frame ``i``
    re-encoded as a first frame". Empty for the first block."""
    k, f0 = kv_cache_num_frames, first_frame
    if f0 <= 0:
        return []
    recent = list(range(max(1, f0 - (k - 1)), f0))
    if keep_first_frame or f0 - frames_per_block < k:
        return [0] + recent
    return [-1 - (f0 - k)] + recent


class KreaRecompute:
    """``cache_policy`` of the chunk loop reproducing Krea Realtime's per-block KV recomputation.

    kv_cache_num_frames K (>= 2; Krea's default 3), frames_per_block (Krea: 3; must match the run's chunks),
    reencode(frames [B, 1, C, H, W]) -> [B, 1, C, H, W] the VAE round trip of the frame that stands in for the
    first frame (None: the frame itself, i.e. no round trip), keep_first_frame never re-encode.
    The policy remembers the clean frames it may still need and the previous block's prompt, so a continued run
    (``continuation.sample_continuable``) with the same policy object goes on as one long run would: the frames of
    the earlier run come from the state's history (the window, K + frames_per_block frames: frame 0 while
    f0 < K + frames_per_block, else frame f0 - K, and the newest K - 1), and the continued run's cache need not
    hold the earlier frames (``rebuilds_self_kv``). ``mark()`` / ``rewind(mark)`` undo a run that failed."""

    rebuilds_self_kv = True             # before every chunk: the sampler skips its "cache holds every frame" check

    def __init__(self, kv_cache_num_frames: int = 3, frames_per_block: int = 3,
                 reencode: Callable | None = None, keep_first_frame: bool = False):
        if int(kv_cache_num_frames) != kv_cache_num_frames or kv_cache_num_frames < 2:
            raise ValueError(f"kv_cache_num_frames must be an integer >= 2, got {kv_cache_num_frames!r}")
        if int(frames_per_block) != frames_per_block or frames_per_block < 1:
            raise ValueError(f"frames_per_block must be an integer >= 1, got {frames_per_block!r}")
        if reencode is not None and not callable(reencode):
            raise ValueError("reencode must be a callable frames -> frames (or None for no VAE round trip)")
        self.k, self.fpb = int(kv_cache_num_frames), int(frames_per_block)
        self.reencode, self.keep_first_frame = reencode, bool(keep_first_frame)
        self.frames: dict = {}          # frame index -> clean latent [B, 1, C, H, W] float32
        self.prev_text = None           # embedded text of the previous block (the recompute's prompt)
        self.positions: list = []       # (first_frame, position) of every block, for reports and checks

    def mark(self) -> tuple:
        """What a continued run changes in the policy, to ``rewind`` to when that run fails part way."""
        return dict(self.frames), self.prev_text, len(self.positions)

    def rewind(self, mark: tuple) -> None:
        frames, self.prev_text, n = mark
        self.frames = dict(frames)
        del self.positions[n:]

    @property
    def window_frames(self) -> int:
        """Frames the self-attention cache must hold: the context plus one block."""
        return self.k + self.fpb

    def _remember(self, state) -> None:
        f0 = state.first_frame
        keep_first = self.keep_first_frame or f0 - self.fpb < self.k
        wanted = set(range(max(0, f0 - self.k), f0)) | ({0} if keep_first and f0 > 0 else set())
        for i in sorted(wanted):
            if i >= state.base:
                self.frames[i] = state.out[:, i - state.base:i - state.base + 1].detach().clone()
            elif i not in self.frames and state.inputs.history is not None:
                try:                                # a continued run: frames of the earlier run from its history
                    self.frames[i] = state.clean(i, i + 1).detach().clone()
                except ValueError:
                    pass
        for i in [i for i in self.frames if i < f0 - self.k and not (i == 0 and keep_first)]:
            del self.frames[i]

    def _frame(self, i: int) -> torch.Tensor:
        if i not in self.frames:
            raise ValueError(f"the Krea context needs clean latent frame {i}, which this run has not seen; "
                             "continue with the same KreaRecompute object that sampled it")
        return self.frames[i]

    def context(self, first_frame: int) -> torch.Tensor | None:
        """The clean context latents [B, n, C, H, W] float32 of the block at ``first_frame`` (None: none)."""
        idx = context_frames(first_frame, self.k, self.fpb, self.keep_first_frame)
        if not idx:
            return None
        parts = []
        for i in idx:
            if i >= 0:
                parts.append(self._frame(i))
            else:
                src = self._frame(-1 - i)
                parts.append(src if self.reencode is None else self.reencode(src).to(src))
        return torch.cat(parts, dim=1)

    def before_chunk(self, state) -> int:
        """Empty the self-attention cache, run the clean context into it; returns the block's frame position."""
        f0, ex, req = state.first_frame, state.executor, state.req
        if state.frames > self.fpb:
            raise ValueError(f"a chunk of {state.frames} frames is longer than the Krea block of {self.fpb} frames; "
                             "use the same frames_per_block for the run and the policy")
        self._remember(state)
        ex.reset_self_kv()
        ctx = self.context(f0)
        prev, text = self.prev_text, state.text
        self.prev_text = text
        if ctx is None:
            self.positions.append((f0, 0))
            return 0
        swap = prev is not None and prev is not text
        if swap:
            ex.set_text(prev)                # Krea recomputes under the previous block's cross-attention cache
        ctx = ctx.to(req.latent_dtype)
        n = ctx.shape[1]
        for j in range(0, n, self.fpb):      # block-causal over the context: one cached pass per block
            m = min(self.fpb, n - j)
            step = ex.begin_chunk(j, m)
            ex.forward("refresh", ctx[:, j:j + m], float(req.refresh_t), j, step, want_output=False)
        if swap:
            ex.set_text(text)
        self.positions.append((f0, n))
        return n


@dataclass
class CacheSetup:
    """What a cache mode asks of a run: the sampler's ``recache`` and ``cache_policy``, the KV window (latent frames,
    -1 global) the run must use, and a note to log (None: nothing to say)."""
    mode: str
    recache: str
    cache_policy: object
    kv_window: int
    note: str | None = None

    def sampler_kwargs(self) -> dict:
        """``recache`` / ``cache_policy`` of ``sample_causal`` (and everything that forwards to it)."""
        return {"recache": self.recache, "cache_policy": self.cache_policy}


def cache_setup(mode: str, frames_per_block: int, kv_window: int = -1, reencode: Callable | None = None,
                names: dict | None = None, sink: int = 0) -> CacheSetup:
    """The one mapping of a cache mode to the run's settings. 'switch' / 'none': LongLive's re-cache at a prompt
    switch or none, the window as given. 'krea': ``KreaRecompute`` with ``K = kv_window - frames_per_block``
    (kv_window -1: Krea's K = 3, window K + frames_per_block), ``recache='none'``; ``reencode`` the VAE round trip
    of the stand-in first frame (None: the frame itself, said in ``note``). ``names`` maps 'recache', 'kv_window',
    'frames_per_block' (and 'sink') to the input names of messages (ValueError naming the input and the fix).
    ``sink``: the run's sink frames, refused with 'krea' (it keeps none): ``validate.check_window``."""
    n = {"recache": "recache", "kv_window": "kv_window", "frames_per_block": "frames_per_block", **(names or {})}
    if mode not in CACHE_MODES:
        raise ValueError(f"{n['recache']} must be one of {', '.join(CACHE_MODES)}, got {mode!r}")
    if isinstance(kv_window, bool) or int(kv_window) != kv_window or isinstance(frames_per_block, bool) \
            or int(frames_per_block) != frames_per_block or frames_per_block < 1:
        raise ValueError(f"{n['kv_window']} and {n['frames_per_block']} must be whole numbers of latent frames, got "
                         f"{kv_window!r} and {frames_per_block!r}")
    fpb, window = int(frames_per_block), int(kv_window)
    if mode != "krea":
        return CacheSetup(mode, mode, None, window)
    from ..app.validate import check_window
    check_window(fpb, window, sink, mode, names=n)       # the one window / sink / mode check (ValueError)
    k = KREA_CONTEXT_FRAMES if window < 0 else window - fpb
    if reencode is not None and not callable(reencode):
        raise ValueError("reencode must be a callable latents -> latents (or None for no VAE round trip)")
    policy = KreaRecompute(k, fpb, reencode=reencode)
    return CacheSetup(mode, "none", policy, policy.window_frames,
                      None if reencode is not None else IDENTITY_REENCODE_NOTE)


def vae_reencode(decode: Callable, encode: Callable) -> Callable:
    """Krea's first-frame re-encode from a VAE: ``decode(latents [B, 1, C, H, W]) -> pixels [B, T, ...]`` (model
    space in, any pixel layout with time second), the last pixel frame kept, ``encode(pixels [B, 1, ...]) ->
    latents [B, 1, C, H, W]`` (model space) as the new first frame."""
    def reencode(frames: torch.Tensor) -> torch.Tensor:
        pixels = decode(frames)
        return encode(pixels[:, -1:])
    return reencode


__all__ = ["CACHE_MODES", "CacheSetup", "KREA_CONTEXT_FRAMES", "cache_setup", "vae_reencode", "KreaRecompute", "context_frames", "interpolated_contexts", "krea_schedule", "krea_schedule_entry"]
