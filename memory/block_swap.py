"""Block swap: keep the last N blocks of an ``nn.ModuleList`` in (pinned) host memory and stream them in.

Each swapped tensor is copied to the host once. Before block ``i`` runs (forward pre-hook) its device copy is made
current and the copies of the next ``prefetch`` swapped blocks are issued; on CUDA they run on a side stream
(non_blocking, from pinned memory) ordered by an event the compute stream waits on, and ``record_stream`` tells
the allocator the compute stream used them. After block ``i`` (forward hook) ``param.data`` is pointed back at the
host copy: the device copy is dropped, never copied back (inference weights do not change).

On a non-CUDA device the same code path runs with synchronous copies (host store + a fresh per-call tensor), so
CPU tests exercise it and give outputs identical to no swap. Inference only.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch import nn

from ..model.attachments import SWAP_ATTR, block_list, block_swap_of
from .pinned import PinnedArena
from .system import GiB, PlainFields

log = logging.getLogger("wan_accel")
ATTR = SWAP_ATTR                          # model/attachments.py reads it
EMBEDDING_NAMES = ("text_embedding", "img_emb")


@dataclass
class SwapSettings(PlainFields):
    blocks_to_swap: int = 0
    prefetch: int = 1
    offload_embeddings: bool = False
    pin_memory: bool | None = None        # None: pin when CUDA is available


@dataclass
class SwapStats:
    swapped_bytes: int = 0            # bytes held on the host for the swapped units (each storage once)
    pinned_bytes: int = 0             # page-locked bytes as the host allocator takes them (power-of-two slabs)
    copies: int = 0                   # unit materialisations (host -> device)
    bytes_copied: int = 0
    sync_loads: int = 0               # materialisations that were not prefetched


class _Transfer:
    """Host -> device copies. CUDA with streams: side stream + event; otherwise plain synchronous copies. A copy in
    flight is (its device tensors, the event that orders them or None)."""

    def __init__(self, device: torch.device, use_stream: bool):
        self.device = device
        self.stream = torch.cuda.Stream(device) if use_stream else None

    def start(self, host: list) -> tuple:
        if self.stream is None:
            return [torch.empty(h.shape, dtype=h.dtype, device=self.device).copy_(h) for h in host], None
        with torch.cuda.stream(self.stream):
            out = [torch.empty(h.shape, dtype=h.dtype, device=self.device).copy_(h, non_blocking=True) for h in host]
            event = torch.cuda.Event()
            event.record(self.stream)
        return out, event

    def finish(self, pending: tuple) -> list:
        tensors, event = pending
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in tensors:
                t.record_stream(current)
        return tensors

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


class _Slot:
    """One swapped tensor: where it lives in its module and its layout inside its unit's segment."""
    __slots__ = ("module", "name", "is_param", "ref", "host", "orig_device", "seg", "rel", "shape", "stride")

    def __init__(self, module, name, is_param, ref, orig_device, seg, rel, shape, stride):
        self.module, self.name, self.is_param, self.ref = module, name, is_param, ref
        self.orig_device, self.seg, self.rel, self.shape, self.stride = orig_device, seg, rel, shape, stride
        self.host = None

    def view_of(self, segment: torch.Tensor) -> torch.Tensor:
        return segment.as_strided(self.shape, self.stride, segment.storage_offset() + self.rel)

    def owned(self) -> bool:
        """Still the tensor we manage (nobody replaced the parameter/buffer object)."""
        return (self.module._parameters if self.is_param else self.module._buffers).get(self.name) is self.ref

    def point_to(self, t) -> None:
        if self.is_param:
            self.ref.data = t
        else:
            self.module._buffers[self.name] = t
            self.ref = t


class _Segment:
    """One element range of one storage, copied once for every tensor of the unit that views it (the q/k/v
    parameters and the fused q/k/v buffer they are views of move as one tensor)."""
    __slots__ = ("src", "lo", "numel", "dtype", "orig_device", "host", "ticket")

    def __init__(self, src, lo, numel, dtype, orig_device):
        self.src, self.lo, self.numel, self.dtype, self.orig_device = src, lo, numel, dtype, orig_device
        self.host, self.ticket = None, None

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


class _Unit:
    __slots__ = ("name", "slots", "segments", "state", "pending", "nbytes")

    def __init__(self, name, slots, segments):
        self.name, self.slots, self.segments, self.state, self.pending = name, slots, segments, "host", None
        self.nbytes = sum(seg.nbytes for seg in segments)


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) storage element offsets a tensor reads."""
    lo = t.storage_offset()
    if t.numel() == 0:
        return lo, lo
    return lo, lo + 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))


def _storage_key(t: torch.Tensor):
    try:
        return (t.device, t.dtype, t.untyped_storage().data_ptr())
    except Exception:  # noqa: BLE001 - a tensor without a plain storage: on its own
        return (t.device, t.dtype, ("id", id(t)))


def default_pin_limit() -> int:
    """The pinned budget of this machine (memory.system.pinned_budget_for): every swap is capped by it unless the
    caller passes its own limit."""
    from .system import host_memory, pinned_budget_for

    return pinned_budget_for(*host_memory())


class BlockSwap:
    """Swap the last ``blocks_to_swap`` blocks of ``blocks`` (and optionally ``embeddings``) through host memory.

    ``device``: the compute device (default: where the blocks are, else CUDA if available, else CPU).
    ``pin_memory``: None pins when CUDA is available; ``pin_limit_bytes`` caps the pinned total as the allocator
    counts it (power-of-two slabs, ``memory.pinned``; None: this machine's pinned budget); the rest stays pageable.
    ``pinned_alloc(nbytes)``: the pinned allocation function (tests). ``move_resident`` moves the resident blocks
    to ``device``. Each storage is held and copied once per unit (views into one buffer move as one tensor).
    Use ``remove()`` to undo.
    """

    def __init__(self, blocks: nn.ModuleList, *, blocks_to_swap: int, prefetch: int = 1, device=None,
                 embeddings=(), pin_memory: bool | None = None, pin_limit_bytes: int | None = None,
                 use_stream: bool | None = None, move_resident: bool = True, pinned_alloc=None):
        if not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
            raise TypeError(f"block swap needs an nn.ModuleList of blocks, got {type(blocks).__name__}")
        n = len(blocks)
        if not 0 <= int(blocks_to_swap) <= n:
            raise ValueError(f"blocks_to_swap must be between 0 and {n} (the number of blocks), got {blocks_to_swap}")
        if getattr(blocks, ATTR, None) is not None:
            raise RuntimeError("these blocks already have a block swap installed; call remove() on it first "
                               "(or use ensure_block_swap)")
        self.blocks, self.n_blocks = blocks, n
        self.blocks_to_swap, self.prefetch = int(blocks_to_swap), max(0, int(prefetch))
        if device is None:          # where the blocks are, else CUDA if available, else the CPU
            device = next((p.device for p in blocks.parameters() if p.device.type not in ("cpu", "meta")), None)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        can_pin = torch.cuda.is_available() or pinned_alloc is not None
        self.pin = (can_pin and cuda) if pin_memory is None else bool(pin_memory and can_pin)
        self._pinned_alloc = pinned_alloc
        self.transfer = _Transfer(self.device, cuda if use_stream is None else bool(use_stream and cuda))
        self.stats = SwapStats()
        self.settings: SwapSettings | None = None   # set by apply_block_swap
        self.pin_limit = (default_pin_limit() if pin_limit_bytes is None else int(pin_limit_bytes)) if self.pin else 0
        self.arena = None
        self._handles = []
        self.first_swapped = n - self.blocks_to_swap
        self.units: dict[object, _Unit] = {}
        try:
            if move_resident:
                for i in range(self.first_swapped):
                    blocks[i].to(self.device)
            for i in range(self.first_swapped, n):
                self.units[i] = self._make_unit(f"blocks.{i}", blocks[i])
            for k, mod in enumerate(embeddings):
                if mod is not None:
                    self.units[("emb", k)] = self._make_unit(type(mod).__name__, mod)
                    self._hook(mod, ("emb", k))
            self._fill_host()
            for i in range(n):
                self._hook(blocks[i], i)
        except BaseException:
            self.remove(restore=True)
            raise
        setattr(blocks, ATTR, self)

    # ------------------------------------------------------------------ setup
    def _make_unit(self, name: str, module: nn.Module) -> _Unit:
        entries, seen = [], set()
        for sub in module.modules():
            for is_param, table in ((True, sub._parameters), (False, sub._buffers)):
                for tname, t in list(table.items()):
                    if t is None or id(t) in seen:
                        continue
                    seen.add(id(t))
                    entries.append((sub, tname, is_param, t))
        groups: dict = {}
        for entry in entries:
            groups.setdefault(_storage_key(entry[3].data), []).append(entry)
        slots, segments = [], []
        for members in groups.values():
            # tensors whose element ranges overlap share one segment; disjoint tensors of one storage (e.g. a
            # whole checkpoint mapped as one storage) keep their own, so nothing outside the unit is copied
            spans = sorted(((_extent(e[3].data), e) for e in members), key=lambda se: se[0])
            runs: list = []
            for (lo, hi), e in spans:
                if runs and lo < runs[-1][1]:
                    runs[-1][1] = max(runs[-1][1], hi)
                    runs[-1][2].append(e)
                else:
                    runs.append([lo, hi, [e]])
            for lo, hi, run in runs:
                d0 = run[0][3].data
                seg = _Segment(d0.detach(), lo, hi - lo, d0.dtype, d0.device)
                segments.append(seg)
                for sub, tname, is_param, t in run:
                    d = t.data
                    slots.append(_Slot(sub, tname, is_param, t, d.device, seg, d.storage_offset() - lo,
                                       tuple(d.shape), tuple(d.stride())))
        unit = _Unit(name, slots, segments)
        self.stats.swapped_bytes += unit.nbytes
        return unit

    def _fill_host(self) -> None:
        """Host copies of every segment (pinned ones packed into the arena within the pin limit), then every
        swapped tensor pointed at its host view."""
        segments = [seg for unit in self.units.values() for seg in unit.segments]
        copy_pinned = []
        if self.pin:
            wanted = [seg for seg in segments if not (seg.orig_device.type == "cpu" and seg.src.is_pinned())]
            self.arena = PinnedArena([seg.nbytes for seg in wanted], self.pin_limit, alloc=self._pinned_alloc)
            for seg in wanted:
                seg.ticket = self.arena.reserve(seg.nbytes)
                if seg.ticket is not None:
                    copy_pinned.append(seg)
            self.arena.allocate()
            self.stats.pinned_bytes = self.arena.pinned_bytes
        for seg in segments:
            src = seg.src.as_strided((seg.numel,), (1,), seg.lo)
            if seg.ticket is not None:
                seg.host = self.arena.view(seg.ticket, seg.dtype, seg.numel).copy_(src)
            elif seg.orig_device.type == "cpu":
                seg.host = src          # already in host memory: share it, no copy
            else:
                seg.host = torch.empty(seg.numel, dtype=seg.dtype, device="cpu").copy_(src)
            seg.src = None
        for unit in self.units.values():
            for slot in unit.slots:
                slot.host = slot.view_of(slot.seg.host)
                slot.point_to(slot.host)

    def _hook(self, module: nn.Module, key) -> None:
        eager = torch.compiler.disable      # the hooks move tensors between devices: kept out of compiled graphs
        self._handles.append(module.register_forward_pre_hook(eager(lambda m, args: self._before(key))))
        self._handles.append(module.register_forward_hook(eager(lambda m, args, out: self._after(key))))

    # ------------------------------------------------------------------ runtime
    def _issue(self, unit: _Unit) -> None:
        if unit.state == "host":
            unit.pending = self.transfer.start([seg.host for seg in unit.segments])
            unit.state = "pending"

    def _materialize(self, unit: _Unit) -> None:
        if unit.state == "device":
            return
        if unit.state == "host":
            self.stats.sync_loads += 1
            self._issue(unit)
        tensors = dict(zip(map(id, unit.segments), self.transfer.finish(unit.pending)))
        for slot in unit.slots:
            if slot.owned():
                slot.point_to(slot.view_of(tensors[id(slot.seg)]))
        unit.pending, unit.state = None, "device"
        self.stats.copies += 1
        self.stats.bytes_copied += unit.nbytes

    def _drop(self, unit: _Unit, back: dict | None = None) -> None:
        """Point the unit's tensors at their host copies, or at their segment's copy in ``back`` {id(segment): t}."""
        for slot in unit.slots:
            if slot.owned():
                seg = None if back is None else back.get(id(slot.seg))
                slot.point_to(slot.host if seg is None else slot.view_of(seg))
        unit.pending, unit.state = None, "host"

    def _before(self, key) -> None:
        unit = self.units.get(key)
        if unit is not None:
            self._materialize(unit)
        if isinstance(key, int) and self.blocks_to_swap:
            for step in range(1, self.prefetch + 1):
                nxt = self.units.get((key + step) % self.n_blocks)
                if nxt is not None and nxt is not unit:
                    self._issue(nxt)

    def _after(self, key) -> None:
        unit = self.units.get(key)
        if unit is not None:
            self._drop(unit)

    # ------------------------------------------------------------------ control
    def release(self) -> None:
        """Drop every device copy and in-flight prefetch (e.g. after an out-of-memory error)."""
        self.transfer.synchronize()
        for unit in self.units.values():
            self._drop(unit)

    def remove(self, restore: bool = True) -> None:
        """Remove the hooks. ``restore``: put each swapped tensor back on its original device (one copy);
        otherwise leave it on the host (e.g. when the model is being offloaded anyway)."""
        try:
            self.transfer.synchronize()
        except Exception as exc:  # noqa: BLE001 - removal must go on
            log.warning("wan_accel: block swap could not synchronize its copy stream: %s", exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for unit in self.units.values():
            self._drop(unit, {id(seg): seg.host.to(seg.orig_device) for seg in unit.segments
                              if restore and seg.orig_device.type != "cpu"})   # one copy per segment: views stay views
        self.units.clear()
        if getattr(self.blocks, ATTR, None) is self:
            delattr(self.blocks, ATTR)

    def is_intact(self) -> bool:
        """Every swapped tensor is still the object this swap manages (nobody replaced a parameter)."""
        return all(slot.owned() for unit in self.units.values() for slot in unit.slots)

    def describe(self) -> str:
        return (f"block swap: {self.blocks_to_swap}/{self.n_blocks} blocks on the host "
                f"({self.stats.swapped_bytes / GiB:.2f} GiB, {self.stats.pinned_bytes / GiB:.2f} GiB pinned), "
                f"prefetch {self.prefetch}, device {self.device}")


# ---------------------------------------------------------------------- helpers
def find_blocks(model) -> nn.ModuleList:
    """``model.blocks`` (our WanModel, ComfyUI's ``diffusion_model``), or the ModuleList itself."""
    blocks = block_list(model)
    if blocks is None:
        raise TypeError(f"{type(model).__name__} has no 'blocks' ModuleList to swap")
    return blocks


def apply_block_swap(model, settings: SwapSettings | None = None, *, device=None, pin_limit_bytes=None,
                     move_resident: bool = True, pinned_alloc=None, **kw) -> BlockSwap:
    """Install a BlockSwap on ``model.blocks`` (or a ModuleList); ``settings`` or keyword fields of SwapSettings.

    With ``move_resident`` everything that is not swapped (resident blocks, and for a model its other layers)
    is moved to ``device``: a model loaded on the CPU becomes ready to run while only its resident part ever
    occupies VRAM."""
    s = settings or SwapSettings(**kw)
    emb = []
    if s.offload_embeddings and not isinstance(model, nn.ModuleList):
        emb = [m for m in (getattr(model, n, None) for n in EMBEDDING_NAMES) if isinstance(m, nn.Module)]
    blocks = find_blocks(model)
    swap = BlockSwap(blocks, blocks_to_swap=s.blocks_to_swap, prefetch=s.prefetch, device=device,
                     embeddings=emb, pin_memory=s.pin_memory, pin_limit_bytes=pin_limit_bytes,
                     move_resident=move_resident, pinned_alloc=pinned_alloc)
    if move_resident and model is not blocks:
        try:
            for child in model.children():
                if child is not blocks and not any(child is e for e in emb):
                    child.to(swap.device)
            for p in model._parameters.values():
                if p is not None:
                    p.data = p.data.to(swap.device)
            for name, b in list(model._buffers.items()):
                if b is not None:
                    model._buffers[name] = b.to(swap.device)
        except BaseException:
            swap.remove(restore=True)
            raise
    swap.settings = dataclasses.replace(s)
    return swap


active_swap = block_swap_of             # the model's active BlockSwap, or None (model/attachments.py)


def ensure_block_swap(model, settings: SwapSettings | None, *, device=None, restore: bool = True,
                      **kw) -> BlockSwap | None:
    """Make the model's swap match ``settings`` (None, or nothing to swap: no swap). Idempotent: call it
    before each run; a swap with other settings is removed first (``restore`` as in BlockSwap.remove)."""
    current = active_swap(model)
    want = settings if settings is not None and (settings.blocks_to_swap > 0 or settings.offload_embeddings) else None
    if current is not None and want is not None and current.settings == want:
        return current
    if current is not None:
        current.remove(restore=restore)
    if want is None:
        return None
    return apply_block_swap(model, want, device=device, **kw)


HANDLE_KEY = "block_swap"


def attach_swap_settings(handle, settings: SwapSettings):
    """A copy of a model handle carrying ``settings`` (``handle.extra['block_swap']`` for our ModelHandle, a key for
    dicts); the model object itself is shared."""
    d = settings.to_dict()
    if isinstance(handle, dict):
        return dict(handle, **{HANDLE_KEY: d})
    extra = getattr(handle, "extra", None)
    if isinstance(extra, dict) and dataclasses.is_dataclass(handle):
        return dataclasses.replace(handle, extra=dict(extra, **{HANDLE_KEY: d}))
    return handle


def handle_swap_settings(handle) -> SwapSettings | None:
    """The block-swap settings a handle carries (None: no swap requested)."""
    d = handle.get(HANDLE_KEY) if isinstance(handle, dict) else (getattr(handle, "extra", None) or {}).get(HANDLE_KEY)
    return SwapSettings.from_dict(d) if isinstance(d, dict) else None


def run_with_swap_fallback(model, run, *, key: str | None, settings: SwapSettings | None = None, cache=None,
                           step: int | None = None, device=None, on_oom=None):
    """Run ``run()`` (e.g. one sampling chunk); on out-of-memory swap ``step`` more blocks (default an eighth of
    them) and run it again, down to every block swapped. The resident block count that worked is learned under
    ``key`` (see limits.dit_limit_key) and is where the next call starts. ``on_oom(resident)`` lets the caller
    drop partial state (KV cache writes of the failed chunk, ...). Raises oom.NoFitError when nothing fits."""
    from .oom import oom_retry

    n = len(find_blocks(model))
    base = settings or SwapSettings(0, 1)
    step = max(1, step or n // 8)

    def attempt(resident: int):
        want = dataclasses.replace(base, blocks_to_swap=n - resident)
        current = active_swap(model)
        # swapping more: weights already on the host stay there (no copy back to a GPU that just ran out)
        more = current is not None and want.blocks_to_swap > current.blocks_to_swap
        ensure_block_swap(model, want, device=device, restore=not more)
        return run()

    def cleanup(resident: int) -> None:
        swap = active_swap(model)
        if swap is not None:
            swap.release()
        if on_oom is not None:
            on_oom(resident)

    return oom_retry(attempt, key=key, start=n - base.blocks_to_swap, cache=cache, minimum=0, unit="resident blocks",
                     shrink=lambda r: max(0, r - step) if r > 0 else None, on_oom=cleanup, what="DiT forward",
                     hint="Lower the resolution or frame count, use a rolling KV window, or free VRAM used by "
                          "other programs.")
