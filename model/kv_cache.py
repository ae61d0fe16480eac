"""Self-attention KV cache (global or rolling window with sink frames) and the cross-attention cache.

Bookkeeping is host-side Python ints: every forward call gets a ``CacheStep`` (which slots to write, how
many slots to attend) computed once and shared by all layers. A chunk whose rows fill one contiguous range of
slots (a global cache; a rolling one until it wraps) is written with one plain copy into that slice; one whose slots
wrap around the ring (or straddle the sink) with one ``index_copy_`` over the step's device index tensor (built
once per write pattern and kept). Neither needs a host sync, and the optimized path's CUDA graphs replay either: a
graph is keyed by the step's writes, so it replays the very slice (or index) it was captured with. The rolling window is a ring buffer: the
first ``sink`` tokens keep their slots; later tokens go to slot ``sink + (g - sink) % ring``. Attention is
order-independent over keys (RoPE is already applied to cached keys), so no data is ever shifted.

Under the opt-in fp8 attention mode (``kernels/fp8_attention.py``) a cache also keeps an fp8 copy of every layer
(``use_fp8``): the smoothed keys' int8 codes and the smoothed values' e4m3 codes with float32 steps / scales per
(token, head), written by ``write_kv`` in the same call as the exact keys/values, so keys and values are
quantized once, when they enter the cache, not on every attention call. Smoothing subtracts one key vector and
one value vector per (batch, head) from every token; attention is exact only if every key it reads was smoothed
by the same vector, so a layer's pair is fixed at its first write after the cache was emptied (the mean of those
first keys and values) and every later write (appends, a rolling window's wrap, a re-cache's rewrite, zero
padding, a write retried after running out of memory) uses it. One fused kernel (``kernels/kv_quant.py``, where
Triton runs for the tensors) quantizes a write straight into its slots, else the same torch ops. The choice is
made on the device (a flag beside the vectors), so a CUDA graph that captured a first write makes the same choice
when replayed. Where the mode runs FlashAttention 3's e4m3 kernels the copy takes their form instead (``Fa3Shadow``:
e4m3 codes of the smoothed keys and values with one scale per (batch, head) each, fixed with the vectors at the
first write, ``kernels/fa3_fp8.py``; written in torch ops). Attention finds
the copy of the cache view it is given (``fp8_copy``). The copy is made once per cache and kept while the cache
lives (CUDA graphs captured under the mode read its memory); outside the mode it is not written, and switching
the mode on again quantizes the cache's contents anew.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from ..kernels import fa3_fp8, kv_quant
from ..kernels.fp8_attention import FP8, INT8_TINY, LEVELS, TINY_SCALE, Fp8KV, quantize_smoothed, token_mean
from .attachments import seq_parallel_of

_FP8_ATTR = "_wan_accel_fp8"      # a cache tensor's fp8 copy (Fp8Shadow), set by KVCache.use_fp8
_FP8 = {"made": 0}                 # fp8 copies alive in this process: 0 = write_kv never looks for one (a compiled
#                                    block then writes without the eager fp8 step: no graph break)
_eager = getattr(getattr(torch, "compiler", None), "disable", lambda fn: fn)   # runs eagerly under compile


def _one_fewer() -> None:
    _FP8["made"] -= 1


@dataclass(frozen=True)
class CacheStep:
    writes: tuple          # ((dst_start, dst_end, src_start, src_end), ...) slot ranges <- chunk rows
    read_len: int          # attend to slots [0, read_len)
    index: torch.Tensor | None = field(default=None, compare=False, hash=False, repr=False)
    # [rows] long on the cache's device: the slot of each chunk row (same information as ``writes``)
    seqlens: torch.Tensor | None = field(default=None, compare=False, hash=False, repr=False)
    # [batch] int32 on the cache's device: the first slot of the rows when they fill one contiguous range (the
    # cached length an in-kernel append starts at, ``model/cached_attention.py``), else None

    @property
    def span(self) -> slice | None:
        """``slice(d0, d1)`` when the rows fill one contiguous range of slots (``write_kv`` then copies into that
        slice), else None (the slots wrap or straddle the sink: ``index`` places every row)."""
        first, end, rows = self.writes[0][0], self.writes[0][0], 0
        for d0, d1, s0, s1 in self.writes:      # in row order; a range split at the sink joins up again
            if d0 != end or s0 != rows:
                return None
            end, rows = d1, s1
        return slice(first, end)


WRITE_COUNTERS: list = []   # callables(bytes) told of every KV write outside compiled code (profiling.dispatch_counts)
WIDE = torch.int64          # the element a same-dtype strided copy moves (8 bytes, bit for bit)


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; where both have src's dtype, their last dimension is contiguous and every size and stride
    allows it, as a copy of 8-byte words (the same bits): a strided source (the values of the fused q/k/v output,
    rows 3 x width apart) is then copied in a quarter of the elements of a 2-byte dtype, not element by element."""
    size = src.element_size()
    ratio = WIDE.itemsize // size if size < WIDE.itemsize else 0
    if (ratio and dst.dtype == src.dtype and dst.shape == src.shape and src.dim() and dst.stride(-1) == 1
            and src.stride(-1) == 1 and src.shape[-1] % ratio == 0
            and all(st % ratio == 0 for t in (dst, src) for st in t.stride()[:-1])
            and dst.data_ptr() % WIDE.itemsize == 0 and src.data_ptr() % WIDE.itemsize == 0):
        dst.view(WIDE).copy_(src.view(WIDE))
    else:
        dst.copy_(src)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, span: slice | None = None) -> None:
    """The one KV writer: row i of k/v [B, rows, H, hd] goes to slot index[i] of the caches [B, capacity, H, hd].
    ``span`` (the step's one contiguous range, when it has one): a plain copy into that slice, casting as it
    copies, instead of ``index_copy_``. Compiled code takes the index (a tensor input: a slice's ints would be
    guarded on, one recompile per chunk position)."""
    if not torch.compiler.is_compiling() and span is not None:     # (compiled: span never read, never guarded)
        copy_rows(k_cache[:, span], k)
        copy_rows(v_cache[:, span], v)
    else:
        k_cache.index_copy_(1, index, k.to(k_cache.dtype))
        v_cache.index_copy_(1, index, v.to(v_cache.dtype))
    if _FP8["made"]:
        _write_fp8(k_cache, v_cache, index, k, v)
    count_written(k_cache, k, v)


def count_written(k_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Tell ``WRITE_COUNTERS`` the bytes of a KV write of k, v into ``k_cache``'s dtype (outside compiled code)."""
    if WRITE_COUNTERS and not torch.compiler.is_compiling():
        written = (k.numel() + v.numel()) * k_cache.element_size()
        for count in WRITE_COUNTERS:
            count(written)


class Fp8Shadow:
    """The fp8 attention mode's copy of one layer's cache [B, capacity, H, D]: int8 key codes [B, capacity, H, D],
    e4m3 value codes keys-fastest [B, H, D, capacity] (the kernel's operand layout), float32 steps / scales
    [B, capacity, H], and the layer's smoothing vectors [B, H, D] with the device flag saying they are fixed."""

    __slots__ = ("k", "k_scale", "v", "v_scale", "k_mean", "v_mean", "fixed", "pad", "v_ptr", "enabled",
                 "__weakref__")
    scheme = "smoothed"

    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls)
        _FP8["made"] += 1                               # counted while it lives (freed with its cache, or dropped)
        weakref.finalize(self, _one_fewer)
        return self

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor):
        b, cap, h, d = k_cache.shape
        dev = k_cache.device
        self.k, self.k_scale, self.v, self.v_scale = self._codes(b, cap, h, d, dev)
        self.k_mean = torch.zeros((b, h, d), device=dev)
        self.v_mean = torch.zeros((b, h, d), device=dev)
        self.fixed = torch.zeros((), dtype=torch.bool, device=dev)
        self.pad = None           # slots of zero padding keys the current step attends (KVCache.pad_next)
        self.v_ptr, self.enabled = v_cache.data_ptr(), True

    @staticmethod
    def _codes(b, cap, h, d, dev) -> tuple:
        """(key codes, their steps, value codes, their scales) of an empty copy, in this scheme's layout."""
        return (torch.zeros((b, cap, h, d), dtype=torch.int8, device=dev),
                torch.full((b, cap, h), INT8_TINY / LEVELS, device=dev),
                torch.zeros((b, h, d, cap), dtype=FP8, device=dev),
                torch.full((b, cap, h), TINY_SCALE, device=dev))

    def fix_means(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Where not fixed yet, the means of k, v [B, rows, H, D] become the smoothing vectors (device ops only)."""
        self.k_mean.copy_(torch.where(self.fixed, self.k_mean, token_mean(k)))
        self.v_mean.copy_(torch.where(self.fixed, self.v_mean, token_mean(v)))
        self.fixed.fill_(True)

    def write(self, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fix: bool = True) -> None:
        """Quantize k, v [B, rows, H, D] (as cached) into the slots ``index``, smoothed by the layer's vectors
        (fixed from these rows where the cache was just emptied, unless ``fix`` is False); the current step's zero
        padding slots too (their codes depend on the vectors)."""
        if fix:
            self.fix_means(k, v)
        self._put(index, k, v)
        if self.pad is not None:
            zeros = k.new_zeros(()).expand((k.shape[0], self.pad.numel()) + tuple(k.shape[2:]))
            self._put(self.pad, zeros, zeros)

    def _put(self, index, k, v) -> None:
        if not kv_quant.write(k, v, self.k_mean, self.v_mean, index, self.k, self.k_scale, self.v, self.v_scale):
            self.put_torch(index, k, v)             # else one fused kernel wrote it (CUDA SM 8.9+, the interpreter)

    def put_torch(self, index, k, v) -> None:
        """``_put`` in torch ops (the definition the fused kernel matches bit for bit; any device)."""
        k8, sk, v8, sv = quantize_smoothed(k, v, self.k_mean, self.v_mean)
        self.k.index_copy_(1, index, k8)
        self.v.view(torch.uint8).index_copy_(3, index, v8.view(torch.uint8).permute(0, 2, 3, 1))  # no fp8
        self.k_scale.index_copy_(1, index, sk)                                 # index_copy_ on a CPU
        self.v_scale.index_copy_(1, index, sv)

    def view(self, n: int) -> Fp8KV:
        """The first ``n`` slots, as the attention kernel takes them."""
        return Fp8KV(self.k[:, :n], self.k_scale[:, :n], self.v[..., :n].permute(0, 3, 1, 2), self.v_scale[:, :n],
                     self.k_mean, self.v_mean)


class Fa3Shadow(Fp8Shadow):
    """The fp8 copy of one layer's cache in FlashAttention 3's form (``kernels/fa3_fp8.py``): the smoothed keys' and
    values' e4m3 codes [B, capacity, H, D], one float32 scale per (batch, head) for each and the smoothing vectors
    [B, H, D], the scales and vectors fixed together at the layer's first write (the scales with ``HEADROOM``)."""

    __slots__ = ()
    scheme = "fa3"

    @staticmethod
    def _codes(b, cap, h, d, dev) -> tuple:
        return (torch.zeros((b, cap, h, d), dtype=FP8, device=dev), torch.ones((b, h), device=dev),
                torch.zeros((b, cap, h, d), dtype=FP8, device=dev), torch.ones((b, h), device=dev))

    def fix_means(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Where not fixed yet, the means of k, v [B, rows, H, D] become the smoothing vectors and the largest
        smoothed magnitudes, with ``HEADROOM``, the scales (device ops only)."""
        for x, mean, scale in ((k, self.k_mean, self.k_scale), (v, self.v_mean, self.v_scale)):
            m = token_mean(x)
            mean.copy_(torch.where(self.fixed, mean, m))
            scale.copy_(torch.where(self.fixed, scale, fa3_fp8.head_scales(x.float() - m[:, None], fa3_fp8.HEADROOM)))
        self.fixed.fill_(True)

    def _put(self, index, k, v) -> None:
        self.put_torch(index, k, v)

    def put_torch(self, index, k, v) -> None:
        kv = fa3_fp8.quantize_kv(k, v, self.k_mean, self.v_mean, self.k_scale, self.v_scale)
        self.k.view(torch.uint8).index_copy_(1, index, kv.k.view(torch.uint8))     # no fp8 index_copy_ on a CPU
        self.v.view(torch.uint8).index_copy_(1, index, kv.v.view(torch.uint8))

    def view(self, n: int) -> fa3_fp8.Fa3KV:
        return fa3_fp8.Fa3KV(self.k[:, :n], self.v[:, :n], self.k_scale, self.v_scale, self.k_mean, self.v_mean)


SHADOWS = {"smoothed": Fp8Shadow, "fa3": Fa3Shadow}    # the fp8 copy of each fp8 attention scheme


@_eager
def _write_fp8(k_cache, v_cache, index, k, v) -> None:
    shadow = getattr(k_cache, _FP8_ATTR, None)
    if shadow is not None and shadow.enabled:
        shadow.write(index, k.to(k_cache.dtype), v.to(v_cache.dtype))


def writes_fp8(k_cache: torch.Tensor) -> bool:
    """Whether writes into this cache layer also write its fp8 copy (the fp8 attention mode)."""
    shadow = getattr(k_cache, _FP8_ATTR, None) if _FP8["made"] else None
    return shadow is not None and shadow.enabled


def fp8_copy(k: torch.Tensor, v: torch.Tensor) -> Fp8KV | fa3_fp8.Fa3KV | None:
    """The fp8 copy of k, v when they are the leading slots of a cache layer that keeps one (``use_fp8``), else
    None (attention then quantizes them itself: the same codes, per token)."""
    if not _FP8["made"]:
        return None
    base = k._base if k._base is not None else k
    shadow = getattr(base, _FP8_ATTR, None)
    if (shadow is None or not shadow.enabled or k.data_ptr() != base.data_ptr() or k.stride() != base.stride()
            or k.shape[0] != base.shape[0] or k.shape[2:] != base.shape[2:] or v.data_ptr() != shadow.v_ptr
            or v.stride() != k.stride()):
        return None
    return shadow.view(k.shape[1])


class LayerKV:
    """One layer's key/value buffers [B, capacity, heads, head_dim]."""

    __slots__ = ("k", "v")

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v

    def update(self, k: torch.Tensor, v: torch.Tensor, step: CacheStep):
        """Write this call's keys/values, return the views to attend to."""
        write_kv(self.k, self.v, step.index, k, v, step.span)
        return self.k[:, :step.read_len], self.v[:, :step.read_len]


class KVCache:
    """Per-layer KV buffers of ``capacity`` tokens plus shared host-side indices.

    rolling=False: absolute slots, a call for tokens [s, e) writes slots [s, e) and attends [0, e).
    rolling=True : ring buffer with ``sink_tokens`` fixed slots; attends every valid slot.
    """

    def __init__(self, num_layers: int, batch: int, capacity: int, heads: int, head_dim: int, *,
                 device=None, dtype=torch.float32, rolling: bool = False, sink_tokens: int = 0):
        if rolling and not 0 <= sink_tokens < capacity:
            raise ValueError(f"sink ({sink_tokens} tokens) must be smaller than the cache ({capacity} tokens)")
        self.capacity, self.rolling, self.sink_tokens = capacity, rolling, sink_tokens if rolling else 0
        shape = (batch, capacity, heads, head_dim)
        self.layers = [LayerKV(torch.zeros(shape, device=device, dtype=dtype),
                               torch.zeros(shape, device=device, dtype=dtype)) for _ in range(num_layers)]
        self.end = 0        # global token index one past the newest token written
        self.device = self.layers[0].k.device if self.layers else torch.device(device or "cpu")
        self._index: dict = {}   # writes -> device index tensor (kept: graphs captured on it read its memory;
        # bounded: a global cache has one pattern per chunk position, a rolling one repeats them)
        self._pad = 0       # zero keys/values the next plan attends past its last token (pad_next)

    @classmethod
    def for_model(cls, model, batch: int, frame_tokens: int, num_frames: int, kv_window: int = -1,
                  sink: int = 0, device=None) -> "KVCache":
        """Global cache for ``num_frames`` latent frames (kv_window <= 0 or >= num_frames), else a rolling
        window of ``kv_window`` frames whose first ``sink`` frames are kept. Under sequence parallelism
        (``model/seq_parallel.py``) a rank's cache holds its share of the heads only."""
        c = model.config
        sp = seq_parallel_of(model)
        heads = c.num_heads if sp is None else sp.local_heads(c.num_heads)
        rolling = 0 < kv_window < num_frames
        frames = kv_window if rolling else num_frames
        return cls(c.num_layers, batch, frames * frame_tokens, heads, c.head_dim,
                   device=device if device is not None else model.device,
                   dtype=model.compute_dtype,
                   rolling=rolling, sink_tokens=sink * frame_tokens)

    def use_fp8(self, on: bool, scheme: str = "smoothed") -> None:
        """Keep (and write) an fp8 copy of every layer beside the exact one (the fp8 attention mode), in the form of
        ``scheme`` ('smoothed': the pack's kernels; 'fa3': FlashAttention 3's), or stop writing it. Switched on, the
        copy is made where missing (or kept in the other form) and the cache's contents are quantized anew (a cache
        filled another way, e.g. copied from an earlier run, is covered)."""
        for layer in self.layers:
            shadow = getattr(layer.k, _FP8_ATTR, None)
            if not on:
                if shadow is not None:
                    shadow.enabled = False
                continue
            if shadow is None or shadow.scheme != scheme:
                shadow = SHADOWS[scheme](layer.k, layer.v)
                setattr(layer.k, _FP8_ATTR, shadow)
            shadow.enabled = True
            valid = min(self.end, self.capacity)
            if valid:              # the tokens it holds fix the smoothing vectors where nothing written has yet
                shadow.fix_means(layer.k[:, :valid], layer.v[:, :valid])
                shadow.write(self._step(((0, self.capacity, 0, self.capacity),), 0).index, layer.k, layer.v,
                             fix=False)

    @property
    def ring(self) -> int:
        return self.capacity - self.sink_tokens

    def reset(self) -> None:
        """Empty the cache (its next write starts at token 0; under the fp8 mode it fixes new smoothing vectors)."""
        self.end = 0
        for shadow in self._shadows():
            shadow.fixed.fill_(False)       # the next write fixes the smoothing vectors anew (on the device)

    def _shadows(self) -> list:
        """The layers' fp8 copies being written (the fp8 attention mode)."""
        found = (getattr(layer.k, _FP8_ATTR, None) for layer in self.layers)
        return [s for s in found if s is not None and s.enabled]

    def pad_next(self, tokens: int) -> None:
        """Make the next ``plan`` also attend ``tokens`` all-zero keys and values right after the slots it attends
        (the zeroed slots are free ones, written by a later call): Krea Realtime's context recompute, whose block
        mask lets a partial last block attend the zero padding keys of its 128-token padding."""
        self._pad = int(tokens)

    def plan(self, start: int, num_tokens: int) -> CacheStep:
        """Slots for a call covering global tokens [start, start+num_tokens); advances the host indices."""
        step = self._plan(start, num_tokens)
        pad, self._pad = getattr(self, "_pad", 0), 0
        shadows = self._shadows() if _FP8["made"] else []
        for shadow in shadows:
            shadow.pad = None
        if pad <= 0:
            return step
        read = step.read_len
        if read != self.end or read + pad > self.capacity:
            raise ValueError(f"no {pad} free slots after token {read} to attend as zero padding keys "
                             f"(the cache holds {self.capacity} tokens, {self.end} written)")
        for layer in self.layers:
            layer.k[:, read:read + pad].zero_()
            layer.v[:, read:read + pad].zero_()
        for shadow in shadows:         # every write of this step quantizes the padding with the layer's vectors
            shadow.pad = self._step(((read, read + pad, 0, pad),), 0).index
        return CacheStep(step.writes, read + pad, step.index, step.seqlens)

    def _plan(self, start: int, num_tokens: int) -> CacheStep:
        end = start + num_tokens
        if start > self.end:
            raise ValueError(f"KV cache gap: call starts at token {start} but only {self.end} tokens are cached")
        if not self.rolling and end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} tokens but the call reaches token {end}; "
                             f"use a rolling window (kv_window) for longer videos")
        if self.rolling and num_tokens > self.ring:
            raise ValueError(f"a chunk of {num_tokens} tokens does not fit the rolling window of "
                             f"{self.ring} non-sink tokens; raise kv_window or lower sink")
        if self.rolling and start != self.end and end != self.end:
            raise ValueError("a rolling KV cache only appends the next chunk or recomputes the newest one "
                             f"(cached up to token {self.end}, call covers [{start}, {end}))")
        self.end = max(self.end, end) if self.rolling else end
        return self._step(self._segments(start, end), min(self.end, self.capacity))

    def rewrite(self, start: int, num_tokens: int) -> CacheStep:
        """Slots for recomputing cached tokens [start, start+num_tokens) that end at the newest one (a re-cache
        after a prompt switch); every one must still be held: a sink token or one of the newest ring tokens. The
        host indices do not move."""
        end = start + num_tokens
        if start < 0 or num_tokens <= 0 or end != self.end:
            raise ValueError(f"a rewrite covers cached tokens up to the newest one (cached up to token {self.end}, "
                             f"call covers [{start}, {end}))")
        if end > self.capacity and start < end - self.ring:     # (never in a global cache: it holds every token)
            raise ValueError(f"tokens [{start}, {end - self.ring}) left the rolling window; rewrite at most the "
                             f"newest {self.ring} non-sink tokens")
        return self._step(self._segments(start, end), min(self.end, self.capacity))

    def _step(self, writes: tuple, read_len: int) -> CacheStep:
        made = self._index.get(writes)
        if made is None:
            parts = [torch.arange(d0, d1, device=self.device) for d0, d1, _s0, _s1 in sorted(writes, key=lambda w: w[2])]
            span = CacheStep(writes, read_len).span
            batch = self.layers[0].k.shape[0] if self.layers else 1
            made = (torch.cat(parts) if len(parts) > 1 else parts[0],
                    None if span is None else torch.full((batch,), span.start, dtype=torch.int32, device=self.device))
            self._index[writes] = made
        return CacheStep(writes, read_len, *made)

    def _segments(self, g0: int, g1: int) -> tuple:
        """The writes of global tokens [g0, g1): one range in a global cache, the ring's ranges in a rolling one."""
        if not self.rolling:
            return ((g0, g1, 0, g1 - g0),)
        segs, g, s, r = [], g0, self.sink_tokens, self.ring
        while g < g1:
            if g < s:
                dst, stop = g, min(g1, s)
            else:
                off = (g - s) % r
                dst, stop = s + off, min(g1, g + r - off)
            segs.append((dst, dst + stop - g, g - g0, stop - g0))
            g = stop
        return tuple(segs)

    def ordered(self, layer: int):
        """(k, v) of a layer in chronological order: sink tokens, then oldest..newest (valid slots only)."""
        kv = self.layers[layer]
        valid = min(self.end, self.capacity)
        if not self.rolling or self.end <= self.capacity:
            return kv.k[:, :valid], kv.v[:, :valid]
        s, p = self.sink_tokens, (self.end - self.sink_tokens) % self.ring
        order = lambda t: torch.cat([t[:, :s], t[:, s + p:], t[:, s:s + p]], dim=1)
        return order(kv.k), order(kv.v)


class CrossKV:
    """One layer's cross-attention keys/values (computed once per prompt)."""

    __slots__ = ("tensors",)

    def __init__(self):
        self.tensors = None     # (k, v) or (k, v, k_img, v_img) of the prompt; None: not computed yet


class CrossAttnCache:
    def __init__(self, num_layers: int):
        self.layers = [CrossKV() for _ in range(num_layers)]

    def reset(self) -> None:
        for layer in self.layers:
            layer.tensors = None
