"""Krea Realtime's cache policy: before every block the self-attention KV cache is rebuilt from a short clean
context, and the block is sampled at a capped position.

Krea Realtime (a causal, few-step Wan 2.1 14B) keeps no rolling cache. Before block ``b`` (first frame ``f0``):

* the clean context is at most ``K = kv_cache_num_frames`` latent frames: the first frame of the video and the newest
  ``K - 1`` frames while ``f0 - frames_per_block < K`` (or always, with ``keep_first_frame``); once the window has
  passed the first frame, the frame just before the newest ``K - 1`` is re-encoded as a stand-in first frame
  (the official server decodes it to pixels and encodes its last pixel frame again with the VAE: ``reencode``);
* the cache is emptied and the context is run once at t = 0 at positions 0 .. len-1 under a block-causal mask
  (blocks of ``frames_per_block`` frames counted from the context's first frame), with the prompt of the previous
  block (the cross-attention cache is only replaced afterwards); Krea pads the context to a multiple of 128 tokens
  and its mask lets a partial last block (K not a multiple of ``frames_per_block``) attend the zero padding keys
  too, which the policy reproduces (``padding_keys``, ``KVCache.pad_next``);
* the block is then sampled at frame position ``min(f0, K)``: RoPE positions and cache slots are capped, so the
  model never sees a position past ``K + frames_per_block``.

A prompt change in Krea interpolates over ``N`` blocks with ``torch.lerp(old, new, linspace(0, 1, N))``, one step
per block and a fresh cross-attention cache each: the first of those blocks still uses the old prompt, and a change
that interrupts a running interpolation starts from the embedding in effect. In a prompt schedule that is
``b: new (blend N, krea)`` for a change requested at block ``b`` (``krea_schedule_line``, from
``krea_schedule_entry``'s ``(b, "N, krea")``; exact whether or not the change interrupts another). Krea's server interpolates a prompt sent without a
step count over ``KREA_INTERP_STEPS`` = 4 blocks, also when it interrupts a running interpolation; a prompt sent
before the first block is that block's prompt, and a prompt equal to the one in effect changes nothing. A live
session under 'krea' does the same (``CacheSetup.live_line``): a prompt typed without a blend becomes
``<chunk>: <prompt> (blend 4, krea)`` (the first chunk's prompt is its prompt), ``(blend N, krea)`` picks another
length, and ``(blend 0)`` is a hard switch, which Krea's server has no way to ask for. A ``(blend N)`` / slerp blend
typed during a running blend is refused (``CacheSetup.live_prompt_problem``).

Settings the official code runs differently are refused by ``cache_setup`` (``official_problem``).

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

from .prompts import ends_in_blend
from .recache import RECACHE_MODES
from .scheduler import resolve_schedule

KREA_CONTEXT_FRAMES = 3          # Krea's default kv_cache_num_frames (release_server.py GenerationParams)
KREA_INTERP_STEPS = 4            # blocks Krea's server interpolates a prompt sent without interp_steps over
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
    """(chunk, blend) of the prompt-schedule entry equal to Krea's prompt change requested before ``block`` and
    interpolated over ``interp_steps`` blocks: ``(block, "N, krea")``, so ``f"{chunk}: {prompt} (blend {blend})"``
    is ``krea_schedule_line``'s line (one implementation), exact also when the change interrupts a running one
    (Krea restarts from the embedding in effect; a plain ``(blend N - 1)`` from ``block + 1`` matches only an
    uninterrupted change, so it is never given). One step never reaches the new prompt in Krea
    (``linspace(0, 1, 1) == [0]``), so it is refused."""
    if isinstance(interp_steps, bool) or int(interp_steps) != interp_steps or interp_steps < 2:
        raise ValueError(f"interp_steps must be a whole number of at least 2 (Krea's one-step interpolation stays on "
                         f"the old prompt), got {interp_steps!r}")
    if isinstance(block, bool) or int(block) != block or block < 0:
        raise ValueError(f"block must be a whole number >= 0, got {block!r}")
    return int(block), f"{int(interp_steps)}, krea"


def krea_schedule_line(block: int, prompt: str, interp_steps: int) -> str:
    """The prompt-schedule line equal to Krea's prompt change requested before ``block`` and interpolated over
    ``interp_steps`` blocks, also when it interrupts a running interpolation: ``<block>: <prompt> (blend N, krea)``
    (``prompts``: the block repeats the embedding in effect, then ``torch.lerp`` steps to the new prompt)."""
    chunk, blend = krea_schedule_entry(block, interp_steps)
    return f"{chunk}: {prompt} (blend {blend})"


def padding_keys(frames: int, frame_tokens: int, frames_per_block: int) -> int:
    """The zero keys the last block of a context of ``frames`` frames attends in Krea's recompute: the context is
    padded with zero queries/keys/values to a multiple of 128 tokens, and the block mask lets a block's queries
    attend every key before the block's end, ``frames_per_block`` frames after its start, padding included; only a
    partial last block reaches past the real tokens. 0 for whole blocks."""
    total = frames * frame_tokens
    block_end = -(-frames // frames_per_block) * frames_per_block * frame_tokens
    return max(0, min(-(-total // 128) * 128, block_end) - total)


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
    (``RunInputs.state``) with the same policy object goes on as one long run would: the frames of
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

    def _feed_stream(self, state) -> None:
        """A ``StreamReencode``: every clean frame before the block, once and in order, into its stream decoder."""
        stream = self.reencode
        if not isinstance(stream, StreamReencode):
            return
        f0 = state.first_frame
        if stream.frames_in < f0:
            try:
                latents = state.clean(stream.frames_in, f0)
            except ValueError:
                raise ValueError(f"the Krea re-encode decodes the video as a stream: it has decoded "
                                 f"{stream.frames_in} latent frames but this run starts at frame {f0} without the "
                                 f"ones between; continue with the same KreaRecompute object that sampled them"
                                 ) from None
            stream.push_frames(stream.frames_in, latents)
        stream.forget_before(f0 - self.k)

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
                if isinstance(self.reencode, StreamReencode):     # the frame as the stream decoded it
                    parts.append(self.reencode.reencode(-1 - i).to(src))
                else:
                    parts.append(src if self.reencode is None else self.reencode(src).to(src))
        return torch.cat(parts, dim=1)

    def _context_pass(self, ex, req, ctx: torch.Tensor) -> None:
        """The context at t = 0 into the emptied cache, block-causal (blocks of ``frames_per_block`` frames from the
        context's first frame): one cached pass per block. A last, partial block also attends the zero padding keys
        Krea's padded block mask gives it (``padding_keys``)."""
        n = ctx.shape[1]
        for j in range(0, n, self.fpb):
            m = min(self.fpb, n - j)
            pad = padding_keys(n, req.frame_tokens, self.fpb) if j + m == n else 0
            if pad:
                kv = getattr(ex, "kv", None)
                if kv is None or not hasattr(kv, "pad_next"):
                    raise ValueError(f"a Krea context of {n} frames (not whole {self.fpb}-frame blocks) needs the "
                                     f"zero padding keys of Krea's recompute, which this sampler cannot attend; "
                                     f"use a context of whole blocks")
                kv.pad_next(pad)
            step = ex.begin_chunk(j, m)
            ex.forward("refresh", ctx[:, j:j + m], float(req.refresh_t), j, step, want_output=False)

    def before_chunk(self, state) -> int:
        """Empty the self-attention cache, run the clean context into it; returns the block's frame position."""
        f0, ex, req = state.first_frame, state.executor, state.req
        if state.frames > self.fpb:
            raise ValueError(f"a chunk of {state.frames} frames is longer than the Krea block of {self.fpb} frames; "
                             "use the same frames_per_block for the run and the policy")
        self._remember(state)
        self._feed_stream(state)
        ex.kv.reset()                    # the executor's self-attention cache: its next write starts at token 0
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
        self._context_pass(ex, req, ctx)
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
        """``recache`` (a ``RunSpec`` field) and ``cache_policy`` (a ``RunInputs`` field) of a run."""
        return {"recache": self.recache, "cache_policy": self.cache_policy}

    def live_line(self, chunk: int, prompt: str) -> str:
        """The schedule line of ``prompt`` typed live for chunk ``chunk`` (a new prompt, one line). Under 'krea' a
        prompt after the first chunk that gives no blend is Krea's default change, interpolated over
        ``KREA_INTERP_STEPS`` blocks: ``<chunk>: <prompt> (blend 4, krea)``; one that gives a blend, ``(blend 0)``
        (a hard switch) included, is taken as typed, and so is every prompt under the other modes."""
        if self.mode == "krea" and chunk > 0 and not ends_in_blend(prompt):
            return krea_schedule_line(chunk, prompt, KREA_INTERP_STEPS)
        return f"{chunk}: {prompt}"

    def live_prompt_problem(self, schedule, chunk: int) -> str | None:
        """Why the prompt a live session adds at ``chunk`` (the last entry of ``schedule``) cannot follow Krea
        Realtime, or None. Under 'krea' a ``(blend N)`` / slerp blend typed while a blend is still running is
        refused: Krea restarts from the embedding in effect and the first block of the new change repeats it,
        which those blends do not do. A prompt without a blend (``live_line``: Krea's default), a
        ``(blend N, krea)`` one and a hard switch asked for with ``(blend 0)`` are taken."""
        entries = schedule.entries
        if self.mode != "krea" or chunk <= 0 or entries[-1].chunk != chunk or len(entries) < 2:
            return None
        new, running = entries[-1], entries[-2]
        if new.mode == "krea" or not new.blend or chunk not in type(schedule)(entries[:-1]).switch_chunks(chunk + 1):
            return None
        text = new.prompt_text()[:80]
        return (f"prompt {new.line().split(': ', 1)[1][:80]!r} at chunk {chunk}: the blend to chunk {running.chunk}'s "
                f"prompt is still running (it ends at chunk {running.chunk + running.blend - 1}). Krea Realtime "
                f"restarts an interrupted interpolation from the embedding in effect and the first block of the new "
                f"change repeats it; under recache krea a (blend {new.blend}, {new.mode}) blend does not. Type "
                f"'{text}' (Krea's default: {KREA_INTERP_STEPS} blocks), '{text} (blend {max(new.blend, 2)}, krea)', or "
                f"'{text} (blend 0)' to switch at once; or wait until chunk {running.chunk + running.blend}")


INPUT_NAMES = {k: k for k in ("recache", "kv_window", "frames_per_block", "sink", "preset")}   # messages' defaults


def official_problem(frames_per_block: int, sink: int = 0, preset=None, names: dict | None = None) -> str | None:
    """Why the official code of the model a setting names would behave differently from the pack (a message naming
    the official behaviour and the setting that avoids it), or None. One setting the official code accepts is not
    reproduced:

    * LongLive (``preset`` 'longlive') with a sink larger than one chunk: its attention always takes the first
      ``sink`` frames of the cache as the sink, written or not (the first chunk attends unwritten, all-zero sink
      slots), and a recompute never writes inside the sink slots, so frames ``frames_per_block .. sink - 1`` keep
      the keys and values of their first denoising step. With ``sink <= frames_per_block`` the first chunk writes
      every sink slot and the pack matches.

    (Krea Realtime with a context of K frames that is not a whole number of blocks is reproduced: the last, partial
    block attends the zero padding keys of Krea's padded block mask, ``padding_keys``.)
    """
    n = {**INPUT_NAMES, **(names or {})}
    fpb, sink = int(frames_per_block), int(sink or 0)
    preset = preset if isinstance(preset, str) else getattr(preset, "name", None)     # a name or a Schedule
    if preset == "longlive" and sink > fpb:
        return (f"{n['sink']} {sink} with {n['preset']} longlive: LongLive's official attention always takes the "
                f"first {sink} frames of its cache as the sink, written or not (its first {fpb}-frame chunk attends "
                f"{sink - fpb} unwritten, all-zero sink frames), and its recompute never writes inside the sink "
                f"slots, so frames {fpb}..{sink - 1} keep the keys and values of their first denoising step; the "
                f"pack does not reproduce that. Use {n['sink']} at most {fpb} ({n['frames_per_block']}) to match "
                f"LongLive, or leave out {n['preset']} longlive ({n['preset']} self_forcing has the same steps and "
                f"shift) for sink {sink} with every sink frame written before it is attended")
    return None


KREA_MIN_CONTEXT = 2                # recache krea: K = kv_window - frames_per_block latent frames, at least 2


def krea_window_problem(fpb: int, window: int, sink: int, n: dict) -> str | None:
    """Why a window / sink does not fit 'krea' (the cache is rebuilt before every chunk from a context of
    K = kv_window - frames_per_block frames, K >= 2, -1: Krea's K = 3; no sink frames), or None. Its advice passes
    this same check. ``n`` names the inputs ('kv_window', 'frames_per_block', 'sink', 'recache')."""
    name = lambda k: n.get(k, k)  # noqa: E731
    if sink:
        return (f"{name('sink')} {sink} does not apply to {name('recache')} krea: the cache is rebuilt before every "
                f"chunk from the first frame and the newest ones, with no sink frames; use {name('sink')} 0 (or "
                f"{name('recache')} switch to keep sink frames in a rolling window)")
    if window != -1 and window - fpb < KREA_MIN_CONTEXT:
        return (f"{name('kv_window')} {window}: {name('recache')} krea rebuilds a context of K = {name('kv_window')} "
                f"- {name('frames_per_block')} latent frames before every chunk, and K must be at least "
                f"{KREA_MIN_CONTEXT}; use {name('kv_window')} at least {fpb + KREA_MIN_CONTEXT}, or -1 for Krea's "
                f"K = {KREA_CONTEXT_FRAMES}")
    return None


def cache_setup(mode: str, frames_per_block: int, kv_window: int = -1, reencode: Callable | None = None,
                names: dict | None = None, *, sink: int = 0, preset=None) -> CacheSetup:
    """The one mapping of a cache mode to the run's settings. 'switch' / 'none': LongLive's re-cache at a prompt
    switch or none, the window as given. 'krea': ``KreaRecompute`` with ``K = kv_window - frames_per_block``
    (kv_window -1: Krea's K = 3, window K + frames_per_block), ``recache='none'``; ``reencode`` the VAE round trip
    of the stand-in first frame (None: the frame itself, said in ``note``). ``names`` maps 'recache', 'kv_window',
    'frames_per_block', 'sink', 'preset' to the input names of messages (ValueError naming the input and the fix).

    It also refuses, before any work, the settings in which the official code behaves in a way the pack does not
    reproduce (``official_problem``): ``preset`` (a schedule preset name or a Schedule; other values are ignored)
    'longlive' with a sink larger than one chunk. ``sink``: the run's sink frames, refused with 'krea' (it
    keeps none): ``validate.check_window``."""
    n = {**INPUT_NAMES, **(names or {})}
    if mode not in CACHE_MODES:
        raise ValueError(f"{n['recache']} must be one of {', '.join(CACHE_MODES)}, got {mode!r}")
    if isinstance(kv_window, bool) or int(kv_window) != kv_window or isinstance(frames_per_block, bool) \
            or int(frames_per_block) != frames_per_block or frames_per_block < 1:
        raise ValueError(f"{n['kv_window']} and {n['frames_per_block']} must be whole numbers of latent frames, got "
                         f"{kv_window!r} and {frames_per_block!r}")
    fpb, window = int(frames_per_block), int(kv_window)
    problem = official_problem(fpb, sink, preset, n)
    if problem:
        raise ValueError(problem)
    if mode != "krea":
        return CacheSetup(mode, mode, None, window)
    problem = krea_window_problem(fpb, window, sink, n)   # the same check as validate.check_window's for krea
    if problem:
        raise ValueError(problem)
    k = KREA_CONTEXT_FRAMES if window < 0 else window - fpb
    policy = KreaRecompute(k, fpb, reencode=reencode)
    return CacheSetup(mode, "none", policy, policy.window_frames,
                      None if reencode is not None else IDENTITY_REENCODE_NOTE)


class StreamReencode:
    """Krea's first-frame re-encode through the stream decoder's state, a ``reencode`` of ``KreaRecompute``.

    Krea's server decodes every block as it is made with one streaming VAE decoder (its temporal cache goes on from
    block to block) and keeps the last ``1 + (K - 1) * 4`` pixel frames; the stand-in first frame is the oldest of
    them, the last pixel frame of latent frame ``f0 - K`` as decoded in the stream, encoded again on its own.
    Decoding that latent frame alone (``vae_reencode``) gives another frame with a real VAE: alone, it is decoded
    like a first frame, without the frames before it.

    push(latents [B, n, C, H, W] model space) -> pixels [B, T, ...] (time second) or None: a streaming decoder whose
    outputs, concatenated, are the whole causal decode, ``1 + time_ratio * (t - 1)`` pixel frames for t latent
    frames (it may hold frames back and return them with a later push); encode(pixels [B, 1, ...]) -> latents
    [B, 1, C, H, W] model space. The policy pushes every clean latent frame once, in order, before the block that
    needs it (``KreaRecompute._feed_stream``); the stream keeps the last pixel frame (pixel ``time_ratio * i``) of
    the latent frames it may still be asked for."""

    def __init__(self, push: Callable, encode: Callable, time_ratio: int = 4):
        if not callable(push) or not callable(encode):
            raise ValueError("StreamReencode needs push(latents) -> pixels and encode(pixels) -> latents callables")
        self.push, self.encode, self.r = push, encode, int(time_ratio)
        self.frames_in = 0              # latent frames pushed
        self.pixels_out = 0             # pixel frames the decoder returned
        self.kept: dict = {}            # latent frame -> its last pixel frame [B, 1, ...] as the stream decoded it
        self.oldest = 0                 # latent frames before this one are no longer kept

    def push_frames(self, start: int, latents: torch.Tensor) -> None:
        if start != self.frames_in:
            raise ValueError(f"the stream decoder has decoded {self.frames_in} latent frames; frames from {start} "
                             "cannot follow them")
        out = self.push(latents)
        self.frames_in += latents.shape[1]
        if out is None:
            return
        for j in range(out.shape[1]):
            p = self.pixels_out + j
            if p % self.r == 0 and p // self.r >= self.oldest:
                self.kept[p // self.r] = out[:, j:j + 1].detach().clone()
        self.pixels_out += out.shape[1]
        if self.pixels_out > 1 + self.r * (self.frames_in - 1):
            raise ValueError(f"the stream decoder returned {self.pixels_out} pixel frames for {self.frames_in} "
                             f"latent frames; a causal Wan decode gives at most {1 + self.r * (self.frames_in - 1)}")

    def forget_before(self, frame: int) -> None:
        self.oldest = max(self.oldest, int(frame))
        for i in [i for i in self.kept if i < self.oldest]:
            del self.kept[i]

    def reencode(self, frame: int) -> torch.Tensor:
        """Latent frame ``frame`` re-encoded from its last pixel frame as the stream decoded it."""
        if frame not in self.kept:
            raise ValueError(f"the stream decoder has not given the last pixel frame of latent frame {frame} (it "
                             f"decoded {self.frames_in} latent frames into {self.pixels_out} pixel frames)")
        return self.encode(self.kept[frame])

    def __call__(self, frames: torch.Tensor) -> torch.Tensor:
        raise TypeError("a StreamReencode re-encodes a frame by its index (KreaRecompute calls reencode(frame))")


def vae_reencode(decode: Callable, encode: Callable) -> Callable:
    """Krea's first-frame re-encode from a VAE: ``decode(latents [B, 1, C, H, W]) -> pixels [B, T, ...]`` (model
    space in, any pixel layout with time second), the last pixel frame kept, ``encode(pixels [B, 1, ...]) ->
    latents [B, 1, C, H, W]`` (model space) as the new first frame."""
    def reencode(frames: torch.Tensor) -> torch.Tensor:
        return encode(decode(frames)[:, -1:])
    return reencode


__all__ = ["CACHE_MODES", "CacheSetup", "KREA_CONTEXT_FRAMES", "KREA_INTERP_STEPS", "cache_setup", "official_problem", "krea_schedule_line", "padding_keys", "StreamReencode", "vae_reencode", "KreaRecompute", "context_frames", "krea_schedule", "krea_schedule_entry"]
