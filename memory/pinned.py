"""Pinned (page-locked) host memory as the allocator really takes it, and a slab arena that wastes little of it.

PyTorch's CUDA host allocator (the one behind ``pin_memory=True``) rounds every allocation up to a power of two
and caches the blocks: a 141.6 MB tensor takes 256 MB of page-locked RAM, about 1.45x over the 1.3B model's
tensors. ``PinnedArena`` therefore packs the tensors to pin into a few power-of-two slabs (full slabs of
``slab_bytes``, the last one sized to what it holds, rounded) and hands out aligned slices, so the rounding costs at
most part of one slab; ``allocator_bytes`` is what an allocation of n bytes really takes, and every budget check
counts that. The allocation function is injectable (tests count it on a CPU; the default pins).
"""
from __future__ import annotations

from typing import Callable

from ..kernels._common import next_pow2

MiB = 1024 ** 2
ALIGN = 512                 # byte alignment of every slice (enough for any dtype and for DMA)
MIN_SLAB = 64 * MiB


def allocator_bytes(nbytes: int) -> int:
    """Bytes of page-locked memory that ``torch.empty(nbytes, pin_memory=True)`` takes (power-of-two rounding)."""
    return next_pow2(int(nbytes)) if nbytes > 0 else 0


def _aligned(n: int) -> int:
    return -(-int(n) // ALIGN) * ALIGN


def slab_size_for(largest: int, slab_bytes: int | None = None) -> int:
    """The arena's slab size: a power of two, at least MIN_SLAB and at least the largest piece."""
    return next_pow2(max(int(slab_bytes or MIN_SLAB), _aligned(largest), 1))


def default_pinned_alloc(nbytes: int):
    import torch

    return torch.empty(int(nbytes), dtype=torch.uint8, device="cpu", pin_memory=True)


class PinnedArena:
    """First-fit packing of pieces into power-of-two slabs, under a byte budget counted as the allocator counts.

    Reserve pieces first (``reserve(nbytes) -> ticket or None``), then ``allocate()`` the slabs once and take
    each piece with ``view(ticket, dtype, numel)``. ``pinned_bytes`` is what the allocator holds for the arena."""

    def __init__(self, sizes_hint, budget: int | None = None, *, slab_bytes: int | None = None,
                 alloc: Callable[[int], object] | None = None):
        hint = [int(s) for s in sizes_hint] or [1]
        self.slab, self.budget = slab_size_for(max(hint), slab_bytes), budget
        self.used: list[int] = []      # bytes used per slab
        self._alloc = alloc or default_pinned_alloc
        self.slabs: list = []
        self.requested: list[int] = []          # sizes passed to the allocation function

    def footprint(self, used=None) -> int:
        used = self.used if used is None else used
        if not used:
            return 0
        return self.slab * (len(used) - 1) + allocator_bytes(used[-1])

    def reserve(self, nbytes: int):
        """(slab index, offset) for a piece of ``nbytes``, or None when it would break the budget."""
        need = _aligned(nbytes)
        # the first slab with room, else a new one (a slab with room that would break the budget: None)
        i = next((i for i, u in enumerate(self.used) if u + need <= self.slab), len(self.used))
        trial = self.used + [0] if i == len(self.used) else list(self.used)
        offset, trial[i] = trial[i], trial[i] + need
        if self.budget is not None and self.footprint(trial) > self.budget:
            return None
        self.used = trial
        return i, offset

    def allocate(self) -> None:
        for i, u in enumerate(self.used):
            size = self.slab if i < len(self.used) - 1 else allocator_bytes(u)
            self.requested.append(size)
            self.slabs.append(self._alloc(size))

    def view(self, ticket, dtype, numel: int):
        import torch

        slab_index, offset = ticket
        es = torch.empty((), dtype=dtype).element_size()
        return self.slabs[slab_index][offset:offset + numel * es].view(dtype)

    @property
    def pinned_bytes(self) -> int:
        return sum(self.requested)


def plan_pinned(groups, budget: int | None = None, slab_bytes: int | None = None) -> tuple[int, int]:
    """(groups whose every piece is pinned, bytes the allocator takes) for groups of piece sizes (e.g. the tensors
    of each swapped block; one piece a group: the pieces pinned) pinned in order through a PinnedArena with
    ``budget``; pieces that do not fit stay pageable. For plans (no allocation)."""
    groups = [[int(s) for s in g] for g in groups]
    sizes = [s for g in groups for s in g]
    if not sizes:
        return 0, 0
    arena = PinnedArena(sizes, budget, slab_bytes=slab_bytes)
    full = 0
    for g in groups:
        placed = [arena.reserve(s) is not None for s in g]
        full += all(placed)
    return full, arena.footprint()
