"""Ulysses sequence parallelism of the causal chunk forward over ``torch.distributed`` (NCCL on GPUs, gloo on CPUs).

Every rank holds the weights and runs the same chunk loop on the same latents; inside a model call the chunk's
tokens are split across the ranks. The split is per latent frame: each frame's ``S = h*w`` tokens are cut into
``world`` contiguous position ranges and rank r keeps range r of every frame, so a rank's tokens are still ``f``
equal groups of frames (the per-frame time modulation, the head and Matrix-Game-2's per-position temporal action
attention run on a shard unchanged). Only self-attention crosses shards:

* q, k, v (after the q/k RMSNorm and RoPE, which need all heads of a token) go through one all-to-all that turns
  sequence shards into head shards: each rank then holds every token of the chunk for ``heads / world`` heads,
  writes those heads into its KV cache (``heads / world`` heads per layer: cache memory per rank divided by the
  rank count, rolling window and sink included) and attends over them;
* the attention output goes back through the inverse all-to-all.

Cross-attention, the FFN, the norms and the action modules are per token or per position: no communication. The
head runs on the shard and one all-gather of its (small) output gives every rank the whole chunk's flow, so the
sampler state stays identical on every rank. Every collective waits with a timeout: a rank that died or hangs
turns into one ``ParallelError`` on the others, never a hang.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .attachments import RUNNER_ATTR, SEQ_PARALLEL_ATTR

DEFAULT_TIMEOUT_S = 300.0


class ParallelError(RuntimeError):
    """A collective of the sequence-parallel group failed or timed out (a rank died, hangs or raised)."""


def valid_rank_counts(*head_counts: int) -> list:
    """Rank counts that divide every head count (1 included)."""
    heads = [int(h) for h in head_counts if h]
    top = min(heads) if heads else 1
    return [n for n in range(1, top + 1) if all(h % n == 0 for h in heads)]


def check_heads(num_heads: int, world: int) -> None:
    """Clear error when ``world`` ranks cannot share ``num_heads`` attention heads."""
    if world < 1 or num_heads % world:
        raise ValueError(f"sequence parallelism splits the {num_heads} attention heads across the ranks, and "
                         f"{num_heads} is not divisible by {world}: use one of "
                         f"{', '.join(map(str, valid_rank_counts(num_heads)))} ranks (GPUs)")


@dataclass
class SeqParallel:
    """A sequence-parallel group: this rank, the rank count, the process group (None: the default one) and the
    timeout of every collective. ``stats`` counts what this rank sent to the other ranks."""
    rank: int
    world: int
    group: object = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    stats: dict = field(default_factory=lambda: {"bytes_sent": 0, "collectives": 0})

    def __post_init__(self):
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside a group of {self.world} ranks")

    def local_heads(self, num_heads: int) -> int:
        check_heads(num_heads, self.world)
        return num_heads // self.world

    def layout(self, frames: int, frame_tokens: int) -> "SeqShard":
        """The split of a chunk of ``frames`` latent frames of ``frame_tokens`` tokens each."""
        if frame_tokens < self.world:
            raise ValueError(f"a latent frame of {frame_tokens} tokens cannot be split across {self.world} ranks; "
                             f"use a larger resolution or fewer ranks")
        base, extra = divmod(frame_tokens, self.world)
        sizes = tuple(base + (1 if r < extra else 0) for r in range(self.world))
        return SeqShard(self, int(frames), sizes)

    def reset_stats(self) -> None:
        self.stats.update(bytes_sent=0, collectives=0)

    # ------------------------------------------------------------------ collectives (all with a timeout)
    def _run(self, what: str, collective, *args) -> None:
        """Start ``collective(*args)`` on the group (async) and wait for it."""
        try:
            work = collective(*args, group=self.group, async_op=True)
        except Exception as exc:  # noqa: BLE001
            raise ParallelError(f"sequence-parallel rank {self.rank} of {self.world}: {what} could not start: "
                                f"{str(exc)[:200]}") from exc
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except Exception as exc:  # noqa: BLE001 - every transport error means: the group is broken
            raise ParallelError(
                f"sequence-parallel rank {self.rank} of {self.world}: {what} failed or timed out after "
                f"{self.timeout_s:g} s: another rank stopped (see its error) or hangs ({str(exc)[:200]})") from exc
        self.stats["collectives"] += 1

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, what: str) -> None:
        self._run(what, dist.all_to_all_single, out, inp, list(out_splits), list(in_splits))
        own = in_splits[self.rank]
        self.stats["bytes_sent"] += (inp.numel() - own) * inp.element_size()

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, what: str) -> None:
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor   # name before 2.13
        self._run(what, gather, out, inp)
        self.stats["bytes_sent"] += (self.world - 1) * inp.numel() * inp.element_size()

    def barrier(self, what: str = "barrier") -> None:
        one = torch.zeros(1)
        self.all_gather(torch.zeros(self.world), one, what)


def enable(model, sp: SeqParallel | None):
    """Run ``model``'s chunk forwards sequence-parallel over ``sp`` (None: back to one rank). Checks the head
    counts first and drops the optimized sampler's buffers (their KV cache has the old head count)."""
    if sp is not None:
        check_heads(model.config.num_heads, sp.world)
    model.__dict__[SEQ_PARALLEL_ATTR] = sp
    runner = model.__dict__.get(RUNNER_ATTR)
    if runner is not None:
        runner.release()
    return model


class SeqShard:
    """One chunk's split: ``sizes[r]`` tokens of every one of ``frames`` frames go to rank r (contiguous
    positions, rank order)."""

    __slots__ = ("sp", "frames", "sizes", "start")

    def __init__(self, sp: SeqParallel, frames: int, sizes: tuple):
        self.sp, self.frames, self.sizes = sp, frames, sizes
        self.start = sum(sizes[:sp.rank])

    def __eq__(self, other):
        return isinstance(other, SeqShard) and self.sp is other.sp and (self.frames, self.sizes) == (
            other.frames, other.sizes)

    def __hash__(self):
        return hash((id(self.sp), self.frames, self.sizes))

    @property
    def frame_tokens(self) -> int:
        """Tokens of one frame on this rank."""
        return self.sizes[self.sp.rank]

    @property
    def full_frame_tokens(self) -> int:
        return sum(self.sizes)

    # ------------------------------------------------------------------ local, no communication
    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of x (the chunk's tokens, frame-major, along ``dim``)."""
        xf = x.unflatten(dim, (self.frames, self.full_frame_tokens))
        return xf.narrow(dim + 1, self.start, self.frame_tokens).flatten(dim, dim + 1).contiguous()

    def shard_rope(self, rope: tuple) -> tuple:
        """This rank's rows of the (cos, sin) tables [L, d] (or per sample [B, L, d])."""
        return tuple(self.shard(t, dim=t.dim() - 2) for t in rope)

    # ------------------------------------------------------------------ all-to-all / all-gather
    @torch.compiler.disable
    def to_heads(self, *ts: torch.Tensor) -> tuple:
        """Tensors [B, L_rank, H, hd] of this rank's tokens -> [B, L, H/world, hd]: every token of the chunk (chunk
        order), this rank's heads. One all-to-all for all of them."""
        n = self.sp.world
        x = torch.stack(ts)                                           # [T, B, Lr, H, hd]
        t, b, lr, heads, hd = x.shape
        h = heads // n
        send = x.view(t, b, lr, n, h, hd).permute(3, 0, 1, 2, 4, 5).contiguous().view(-1)
        unit = t * b * self.frames * h * hd                           # elements per token of a frame
        out_splits = [unit * s for s in self.sizes]
        recv = send.new_empty(sum(out_splits))
        self.sp.all_to_all(recv, send, out_splits, [send.numel() // n] * n, "the all-to-all before attention")
        pieces = [p.view(t, b, self.frames, s, h, hd) for p, s in zip(recv.split(out_splits), self.sizes)]
        full = torch.cat(pieces, dim=3).flatten(2, 3)               # [T, B, L, h, hd]
        return tuple(full.unbind(0))

    @torch.compiler.disable
    def to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L, H/world, hd] (every token, this rank's heads) -> [B, L_rank, H, hd] (this rank's tokens, all
        heads)."""
        n = self.sp.world
        b, _, h, hd = x.shape
        xf = x.view(b, self.frames, self.full_frame_tokens, h, hd)
        send = torch.cat([p.contiguous().view(-1) for p in xf.split(list(self.sizes), dim=2)])
        in_splits = [b * self.frames * s * h * hd for s in self.sizes]
        mine = in_splits[self.sp.rank]
        recv = send.new_empty(mine * n)
        self.sp.all_to_all(recv, send, [mine] * n, in_splits, "the all-to-all after attention")
        lr = self.frames * self.frame_tokens
        return recv.view(n, b, lr, h, hd).permute(1, 2, 0, 3, 4).reshape(b, lr, n * h, hd)

    @torch.compiler.disable
    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L_rank, C] of every rank -> [B, L, C] (the whole chunk, token order) on every rank."""
        n, big = self.sp.world, max(self.sizes)
        b, _, c = x.shape
        xf = x.view(b, self.frames, self.frame_tokens, c)
        if self.frame_tokens < big:
            xf = torch.cat([xf, xf.new_zeros(b, self.frames, big - self.frame_tokens, c)], dim=2)
        send = xf.contiguous().view(-1)
        recv = send.new_empty(send.numel() * n)
        self.sp.all_gather(recv, send, "the all-gather of the chunk's output")
        parts = recv.view(n, b, self.frames, big, c)
        full = torch.cat([parts[j, :, :, :s] for j, s in enumerate(self.sizes)], dim=2)
        return full.flatten(1, 2)
