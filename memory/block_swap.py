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
from dataclasses import dataclass, field

import torch
from torch import nn

log = logging.getLogger("wan_accel")
ATTR = "_wan_accel_block_swap"
EMBEDDING_NAMES = ("text_embedding", "img_emb")


@dataclass
class SwapSettings:
    blocks_to_swap: int = 0
    prefetch: int = 1
    offload_embeddings: bool = False
    pin_memory: bool | None = None        # None: pin when CUDA is available

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SwapSettings":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class SwapStats:
    swapped_blocks: list = field(default_factory=list)
    swapped_bytes: int = 0
    pinned_bytes: int = 0
    copies: int = 0                   # unit materialisations (host -> device)
    bytes_copied: int = 0
    sync_loads: int = 0               # materialisations that were not prefetched


class _Pending:
    __slots__ = ("tensors", "event")

    def __init__(self, tensors, event=None):
        self.tensors, self.event = tensors, event


class _Transfer:
    """Host -> device copies. CUDA with streams: side stream + event; otherwise plain synchronous copies."""

    def __init__(self, device: torch.device, use_stream: bool):
        self.device = device
        self.stream = torch.cuda.Stream(device) if use_stream else None

    def start(self, host: list) -> _Pending:
        if self.stream is None:
            return _Pending([torch.empty(h.shape, dtype=h.dtype, device=self.device).copy_(h) for h in host])
        with torch.cuda.stream(self.stream):
            out = [torch.empty(h.shape, dtype=h.dtype, device=self.device).copy_(h, non_blocking=True) for h in host]
            event = torch.cuda.Event()
            event.record(self.stream)
        return _Pending(out, event)

    def finish(self, pending: _Pending) -> list:
        if pending.event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(pending.event)
            for t in pending.tensors:
                t.record_stream(current)
        return pending.tensors

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


class _Slot:
    """One swapped tensor: where it lives in its module, the host copy, the original device."""
    __slots__ = ("module", "name", "is_param", "ref", "host", "orig_device")

    def __init__(self, module, name, is_param, ref, host, orig_device):
        self.module, self.name, self.is_param, self.ref = module, name, is_param, ref
        self.host, self.orig_device = host, orig_device

    def current(self):
        return (self.module._parameters if self.is_param else self.module._buffers).get(self.name)

    def owned(self) -> bool:
        """Still the tensor we manage (nobody replaced the parameter/buffer object)."""
        cur = self.current()
        return cur is self.ref if self.is_param else cur is not None and cur is self.ref

    def point_to(self, t) -> None:
        if self.is_param:
            self.ref.data = t
        else:
            self.module._buffers[self.name] = t
            self.ref = t


class _Unit:
    __slots__ = ("name", "slots", "state", "pending", "nbytes")

    def __init__(self, name, slots):
        self.name, self.slots, self.state, self.pending = name, slots, "host", None
        self.nbytes = sum(s.host.numel() * s.host.element_size() for s in slots)


def _eager(fn):
    """Hooks move tensors between devices: keep them out of torch.compile graphs (run eagerly)."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(fn) if disable is not None else fn


def _pick_device(blocks, device) -> torch.device:
    if device is not None:
        return torch.device(device)
    for p in blocks.parameters():
        if p.device.type != "cpu" and p.device.type != "meta":
            return p.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class BlockSwap:
    """Swap the last ``blocks_to_swap`` blocks of ``blocks`` (and optionally ``embeddings``) through host memory.

    ``device``: the compute device (default: where the blocks are, else CUDA if available, else CPU).
    ``pin_memory``: None pins when CUDA is available; ``pin_limit_bytes`` caps the pinned total (the rest stays
    pageable). ``move_resident`` moves the resident blocks to ``device``. Use ``remove()`` to undo.
    """

    def __init__(self, blocks: nn.ModuleList, *, blocks_to_swap: int, prefetch: int = 1, device=None,
                 embeddings=(), pin_memory: bool | None = None, pin_limit_bytes: int | None = None,
                 use_stream: bool | None = None, move_resident: bool = True):
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
        self.device = _pick_device(blocks, device)
        cuda = self.device.type == "cuda"
        self.pin = (torch.cuda.is_available() and cuda) if pin_memory is None else bool(pin_memory and torch.cuda.is_available())
        self.transfer = _Transfer(self.device, cuda if use_stream is None else bool(use_stream and cuda))
        self.stats = SwapStats()
        self.settings: SwapSettings | None = None   # set by apply_block_swap
        self._pin_left = pin_limit_bytes
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
            for i in range(n):
                self._hook(blocks[i], i)
        except BaseException:
            self.remove(restore=True)
            raise
        self.stats.swapped_blocks = list(range(self.first_swapped, n))
        setattr(blocks, ATTR, self)

    # ------------------------------------------------------------------ setup
    def _host_copy(self, t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        pin = self.pin and (self._pin_left is None or nbytes <= self._pin_left)
        if t.device.type == "cpu" and (not pin or t.is_pinned()):
            return t.detach()  # already in (pinned) host memory: share it, no copy
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        host.copy_(t.detach())
        if pin:
            self.stats.pinned_bytes += nbytes
            if self._pin_left is not None:
                self._pin_left -= nbytes
        return host

    def _make_unit(self, name: str, module: nn.Module) -> _Unit:
        slots, seen = [], set()
        for sub in module.modules():
            for pname, p in list(sub._parameters.items()):
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))
                slot = _Slot(sub, pname, True, p, self._host_copy(p.data), p.device)
                slot.point_to(slot.host)
                slots.append(slot)
            for bname, b in list(sub._buffers.items()):
                if b is None or id(b) in seen:
                    continue
                seen.add(id(b))
                slot = _Slot(sub, bname, False, b, self._host_copy(b), b.device)
                slot.point_to(slot.host)
                slots.append(slot)
        unit = _Unit(name, slots)
        self.stats.swapped_bytes += unit.nbytes
        return unit

    def _hook(self, module: nn.Module, key) -> None:
        self._handles.append(module.register_forward_pre_hook(_eager(lambda m, args: self._before(key))))
        self._handles.append(module.register_forward_hook(_eager(lambda m, args, out: self._after(key))))

    # ------------------------------------------------------------------ runtime
    def _issue(self, unit: _Unit) -> None:
        if unit.state == "host":
            unit.pending = self.transfer.start([s.host for s in unit.slots])
            unit.state = "pending"

    def _materialize(self, unit: _Unit) -> None:
        if unit.state == "device":
            return
        if unit.state == "host":
            self.stats.sync_loads += 1
            self._issue(unit)
        tensors = self.transfer.finish(unit.pending)
        for slot, t in zip(unit.slots, tensors):
            if slot.owned():
                slot.point_to(t)
        unit.pending, unit.state = None, "device"
        self.stats.copies += 1
        self.stats.bytes_copied += unit.nbytes

    def _drop(self, unit: _Unit) -> None:
        for slot in unit.slots:
            if slot.owned():
                slot.point_to(slot.host)
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
            for slot in unit.slots:
                if not slot.owned():
                    continue
                target = slot.host
                if restore and slot.orig_device.type != "cpu":
                    target = slot.host.to(slot.orig_device)
                slot.point_to(target)
            unit.pending, unit.state = None, "host"
        self.units.clear()
        if getattr(self.blocks, ATTR, None) is self:
            delattr(self.blocks, ATTR)

    def is_intact(self) -> bool:
        """Every swapped tensor is still the object this swap manages (nobody replaced a parameter)."""
        return all(slot.owned() for unit in self.units.values() for slot in unit.slots)

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def describe(self) -> str:
        gib = 1024 ** 3
        return (f"block swap: {self.blocks_to_swap}/{self.n_blocks} blocks on the host "
                f"({self.stats.swapped_bytes / gib:.2f} GiB, {self.stats.pinned_bytes / gib:.2f} GiB pinned), "
                f"prefetch {self.prefetch}, device {self.device}")


# ---------------------------------------------------------------------- helpers
def find_blocks(model) -> nn.ModuleList:
    """``model.blocks`` (our WanModel, ComfyUI's ``diffusion_model``), or the ModuleList itself."""
    if isinstance(model, nn.ModuleList):
        return model
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        return blocks
    raise TypeError(f"{type(model).__name__} has no 'blocks' ModuleList to swap")


def embedding_modules(model) -> list:
    return [m for m in (getattr(model, n, None) for n in EMBEDDING_NAMES) if isinstance(m, nn.Module)]


def apply_block_swap(model, settings: SwapSettings | None = None, *, device=None, pin_limit_bytes=None,
                     move_resident: bool = True, **kw) -> BlockSwap:
    """Install a BlockSwap on ``model.blocks`` (or a ModuleList); ``settings`` or keyword fields of SwapSettings.

    With ``move_resident`` everything that is not swapped (resident blocks, and for a model its other layers)
    is moved to ``device``: a model loaded on the CPU becomes ready to run while only its resident part ever
    occupies VRAM."""
    s = settings or SwapSettings(**kw)
    emb = embedding_modules(model) if s.offload_embeddings and not isinstance(model, nn.ModuleList) else []
    blocks = find_blocks(model)
    swap = BlockSwap(blocks, blocks_to_swap=s.blocks_to_swap, prefetch=s.prefetch, device=device,
                     embeddings=emb, pin_memory=s.pin_memory, pin_limit_bytes=pin_limit_bytes,
                     move_resident=move_resident)
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


def active_swap(model) -> BlockSwap | None:
    try:
        return getattr(find_blocks(model), ATTR, None)
    except TypeError:
        return None


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
