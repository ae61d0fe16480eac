"""Count what a piece of torch code dispatches: aten ops (a kernel-launch proxy), host syncs, KV bytes written.

``DispatchCounts`` is a context manager (a ``TorchDispatchMode`` plus a ``TorchFunctionMode``) that counts, while
it is active:

* ``ops``: every aten op that reaches the dispatcher below autograd (composite ops counted as what they decompose
  into), by name;
* ``syncs``: every point where the host waits for a device value, by name:
  - ops whose output size or value must be read on the host: ``aten._local_scalar_dense`` (``item()``),
    ``nonzero``, ``equal``, ``is_nonzero``, ``allclose``, ``masked_select``, the ``unique`` family,
    ``repeat_interleave`` without ``output_size``, ``bincount``, boolean-mask ``index`` / ``index_put_``;
  - copies from a non-CPU device to the host (``_to_copy`` / ``copy_`` into a CPU tensor);
  - tensor -> Python conversions (``tolist``, ``numpy``, ``__array__``, ``item``, ``bool()``, ``int()``,
    ``float()``, ``__index__``, formatting and printing a tensor), each counted once, under its own name, even when
    it dispatches ops that are syncs themselves.
  A sync is counted whatever the device: on a CPU the same call is a sync on a GPU, so the count is what the
  code would cost on CUDA.
* ``kv_write_bytes``: bytes the one KV writer (``model/kv_cache.write_kv``) writes, whether it copies into one
  contiguous slice or runs ``index_copy_`` over wrapped slots: k and v elements x the cache's element size.
* ``alloc_bytes``: bytes of every new tensor an op returns (not views, not in-place results), and
  ``largest_alloc_bytes`` the largest one: what a piece of code allocates, whatever the allocator reuses.

``snapshot()`` gives the running totals (a ``Counts``; ``b - a`` is what happened between two snapshots), and
``step_callback()`` gives a sampler ``callback`` that snapshots after every denoising step, so ``steady_step()`` is
the cost of one steady-state chunk step: the last chunk's last step (re-noise, one forward, flow -> x0).

Counting makes every op go through Python: time nothing while it is active.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..model.kv_cache import WRITE_COUNTERS

# aten op packets (name without the overload) whose result the host must wait for
SYNC_OPS = frozenset({
    "_local_scalar_dense", "nonzero", "nonzero_numpy", "equal", "is_nonzero", "allclose", "masked_select",
    "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive", "bincount",
})
# Tensor methods that hand a value to Python
CONVERSIONS = frozenset({
    "tolist", "numpy", "__array__", "item", "__bool__", "__int__", "__float__", "__complex__", "__index__",
    "__format__", "__repr__", "__str__",
})


@dataclass(frozen=True)
class Counts:
    """Totals at a point (or the difference of two snapshots)."""
    ops: int = 0
    syncs: int = 0
    kv_write_bytes: int = 0
    sync_names: tuple = ()         # ((name, count), ...) sorted by name
    op_names: tuple = ()
    alloc_bytes: int = 0

    def __sub__(self, other: "Counts") -> "Counts":
        return Counts(self.ops - other.ops, self.syncs - other.syncs, self.kv_write_bytes - other.kv_write_bytes,
                      _diff(self.sync_names, other.sync_names), _diff(self.op_names, other.op_names),
                      self.alloc_bytes - other.alloc_bytes)


def _diff(a: tuple, b: tuple) -> tuple:
    c = Counter(dict(a))
    c.subtract(dict(b))
    return tuple(sorted((k, v) for k, v in c.items() if v))


def _is_sync(packet: str, args, kwargs) -> bool:
    if packet in SYNC_OPS:
        return True
    if packet == "repeat_interleave":
        return isinstance(args[0] if args else None, torch.Tensor) and kwargs.get("output_size") is None
    if packet in ("index", "index_put", "index_put_", "_index_put_impl_"):
        return len(args) > 1 and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                     for i in args[1] or ())
    if packet == "_to_copy":
        src, dev = args[0] if args else None, kwargs.get("device")
        return isinstance(src, torch.Tensor) and src.device.type != "cpu" and dev is not None and \
            torch.device(dev).type == "cpu"
    if packet == "copy_" and len(args) > 1:
        dst, src = args[0], args[1]
        non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
        return isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst.device.type == "cpu" \
            and not non_blocking
    return False


class _Dispatch(TorchDispatchMode):       # both modes count into their ``owner``, set by DispatchCounts
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        o = self.owner
        packet = getattr(func, "__name__", str(func)).split(".")[0]         # "nonzero.default" -> "nonzero"
        o.op_names[packet] += 1
        if o._converting == 0 and _is_sync(packet, args, kwargs):
            o.sync_names[packet] += 1
        out = func(*args, **kwargs)
        if all(r.alias_info is None for r in func._schema.returns):       # new tensors (not views, not in place)
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    n = t.numel() * t.element_size()
                    o.alloc_bytes += n
                    o.largest_alloc_bytes = max(o.largest_alloc_bytes, n)
        return out


class _Function(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name not in CONVERSIONS:
            return func(*args, **kwargs)
        o = self.owner
        if o._converting == 0:
            o.sync_names[name] += 1
        o._converting += 1          # the ops the conversion dispatches are part of this one sync
        try:
            return func(*args, **kwargs)
        finally:
            o._converting -= 1


@dataclass
class DispatchCounts:
    """Counts ops, host syncs, KV bytes written and allocated bytes while active (``with DispatchCounts() as c:``)."""
    op_names: Counter = field(default_factory=Counter)
    sync_names: Counter = field(default_factory=Counter)
    kv_write_bytes: int = 0
    alloc_bytes: int = 0
    largest_alloc_bytes: int = 0
    steps: dict = field(default_factory=dict)       # (chunk, step) -> Counts of that step (see step_callback)
    _converting: int = 0

    def __post_init__(self):
        self._modes = None
        self._last_mark = None

    # ------------------------------------------------------------------ the modes
    def __enter__(self) -> "DispatchCounts":
        if self._modes is not None:
            raise RuntimeError("DispatchCounts is already active")
        self._modes = (_Function(), _Dispatch())
        for m in self._modes:
            m.owner = self
            m.__enter__()
        WRITE_COUNTERS.append(self._kv_written)
        return self

    def __exit__(self, *exc) -> None:
        modes, self._modes = self._modes, None
        WRITE_COUNTERS.remove(self._kv_written)
        for m in reversed(modes):
            m.__exit__(*exc)

    def _kv_written(self, nbytes: int) -> None:
        self.kv_write_bytes += nbytes

    # ------------------------------------------------------------------ totals
    @property
    def ops(self) -> int:
        return sum(self.op_names.values())

    @property
    def syncs(self) -> int:
        return sum(self.sync_names.values())

    def snapshot(self) -> Counts:
        return Counts(self.ops, self.syncs, self.kv_write_bytes, tuple(sorted(self.sync_names.items())),
                      tuple(sorted(self.op_names.items())), self.alloc_bytes)

    # ------------------------------------------------------------------ per sampler step
    def step_callback(self, then=None):
        """A sampler ``callback(chunk, step, chunks, steps, x0)``: records the Counts since the previous call under
        (chunk, step) in ``self.steps`` (the first call: since this method was called), then calls ``then``."""
        self._last_mark = self.snapshot()

        def callback(ci, k, num_chunks, num_steps, x0):
            now = self.snapshot()
            self.steps[(ci, k)] = now - self._last_mark
            self._last_mark = now
            if then is not None:
                then(ci, k, num_chunks, num_steps, x0)
        return callback

    def steady_step(self) -> Counts:
        """The Counts of one steady-state chunk step: the last recorded chunk's last step (after its first step,
        so no chunk start and no refresh pass are in it)."""
        if not self.steps:
            raise ValueError("no step was recorded: pass step_callback() as the sampler's callback")
        last_chunk = max(c for c, _k in self.steps)
        ks = sorted(k for c, k in self.steps if c == last_chunk)
        if ks[-1] < 1:
            raise ValueError("the last chunk has a single step: no steady-state step to isolate")
        return self.steps[(last_chunk, ks[-1])]
