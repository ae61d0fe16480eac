"""Self-attention over a layer's KV cache: the chunk's keys and values written, then every cached key attended.

Two ways to do it, one result:

* ``separate`` (everywhere): ``kv_cache.write_kv`` copies the chunk's keys/values into their slots, then
  ``attention`` runs its kernel over the cache's first ``read_len`` slots.
* ``fused`` (FlashAttention 3's ``flash_attn_with_kvcache``, upstream's build or PyPI's ``fa3-fwd``): one kernel
  appends the new keys/values into the cache at ``cache_seqlens`` and attends ``[0, cache_seqlens + rows)``, which
  saves the copy kernel and one read of the new rows per layer call. ``cache_seqlens`` is the step's device tensor
  (``CacheStep.seqlens``, made once per write pattern with the step's slot index), so a CUDA graph captured on a
  step replays the very append it was captured with. No rotary option is used (FA3 rotates every query of a
  non-causal call by one position; RoPE is applied before the call) and no causal mask (a chunk attends all of its
  own tokens).

The fused way is used only where every condition holds (``fused_problem``): the call's exact kernel is FA3 (the
store's choice for 'auto', FA3's key splits included: the fused call gets the same ``num_splits``; or an explicit
``fa3`` request), the installed build has ``flash_attn_with_kvcache``, the chunk's slots are one contiguous range
that ends the attended range (a global cache, a rolling one until it wraps; not a wrapped ring, not Krea's padding
keys), the chunk, the cache and the queries share one dtype, no fp8 copy of the cache is written beside it, no
torch.compile trace is running; and where it was measured faster (``fused_speed``: the two ways timed through the
operator store at the call's shapes, one verdict per GPU and (query, key) length bucket, the fused output first
checked against the separate one within the store's tolerance for attention: a wrong layout or append fails and is
never used). A run makes every verdict it needs before its first chunk (``warm``, from the runner's warm-up);
measuring never happens inside a CUDA-graph capture, where an unknown shape takes the separate way.
"""
from __future__ import annotations

import logging
import sys

import torch

from ..kernels import _common
from ..kernels import candidates as op_candidates, registry
from . import attention as att
from .kv_cache import count_written, write_kv, writes_fp8

log = logging.getLogger("wan_accel")

SPEED_KERNEL = "speed.attention.fa3_kvcache"     # the operator store's kernel of the fused-or-separate verdict
SPLITS = {"fa3": 1, **{f"fa3.split{n}": n for n in att.FA3_SPLITS}}   # FA3 kernels -> the num_splits they pass
_FN: dict = {}            # "fa3" -> flash_attn_with_kvcache of the module FA3 was found in, or None
_VERDICT: dict = {}       # (device, dtype, heads, head size, batch, length buckets, splits) -> fused is faster


def kvcache_fn():
    """``flash_attn_with_kvcache`` of the installed FlashAttention 3 (the module its ``flash_attn_func`` came
    from), or None."""
    if "fa3" not in _FN:
        module = sys.modules.get(att._FROM.get("fa3", "")) if att._load("fa3") is not None else None
        _FN["fa3"] = getattr(module, "flash_attn_with_kvcache", None)
    return _FN["fa3"]


FAMILY = "attention.kv_append"
registry.register(FAMILY, "self-attention's KV-cache append (per call: fused_problem, then the speed verdict)", [
    registry.Candidate(FAMILY, "fa3", "flash", summary="appended inside FA3's flash_attn_with_kvcache",
                       devices=("cuda",), needs=("attention", "fa3"), problem=lambda d, dt, hd: None
                       if kvcache_fn() is not None else f"{att._FROM.get('fa3', 'FA3')} has no flash_attn_with_kvcache"),
    registry.Candidate(FAMILY, "separate", "torch", summary="kv_cache.write_kv, then attention")])


def fused_problem(kernel: str | None, q, k, k_cache, span, read_len: int, seqlens) -> str | None:
    """Why this call cannot append its keys/values inside FA3's kernel, or None when it can."""
    if kernel not in SPLITS:
        return f"the call's attention kernel is {kernel or 'not FlashAttention 3'}"
    if registry.override(FAMILY) == "separate":
        return f"the override {FAMILY}=separate"
    if _common.is_compiling():
        return "inside a torch.compile trace"
    if kvcache_fn() is None:
        return f"{att._FROM.get('fa3', 'FlashAttention 3')} has no flash_attn_with_kvcache"
    if span is None or seqlens is None or span.stop != read_len:
        return "the chunk's slots are not one range ending the attended slots (a wrapped ring, padding keys)"
    if k.shape[1] != q.shape[1]:
        return "the call's queries and new keys differ in length"
    if not q.dtype == k.dtype == k_cache.dtype:
        return "the queries, the chunk's keys and the cache differ in dtype"
    if k_cache.stride(-1) != 1 or seqlens.shape[0] != q.shape[0]:
        return "the cache is not laid out [batch, slots, heads, head size] for this batch"
    if writes_fp8(k_cache):
        return "the cache's fp8 copy is written beside it"
    return None


def fused_attention(q, k, v, k_cache, v_cache, seqlens, splits: int = 1):
    """FA3's append-and-attend: k, v [B, rows, H, D] written into the caches at slot ``seqlens[b]`` onward, then
    softmax attention of q over slots [0, seqlens[b] + rows), scale 1/sqrt(D), non-causal, no rotary; no autograd."""
    fn = kvcache_fn()
    with torch.no_grad():
        out = fn(q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens, num_splits=splits)
    count_written(k_cache, k, v)
    return out[0] if isinstance(out, (tuple, list)) else out


def _separate(q, k, v, k_cache, v_cache, index, span, read_len, backend, kernel: str | None = None):
    """Write then attend; ``kernel``: the exact candidate the call was found to run (``kernel_of``), called directly
    instead of choosing it again."""
    write_kv(k_cache, v_cache, index, k, v, span)
    kc, vc = k_cache[:, :read_len], v_cache[:, :read_len]
    if kernel in att.AUTO_CANDIDATES:
        return att.AUTO_CANDIDATES[kernel].fn(q, kc, vc)
    return att.attention(q, kc, vc, None, backend=backend)


def fused_speed(batch: int, lq: int, lk: int, heads: int, head_dim: int, dtype, device, backend, splits: int,
                tuner=None) -> bool | None:
    """Whether the fused append-and-attend of ``lq`` new rows into a cache attended up to ``lk`` slots is faster
    than writing then attending, timed through the operator store on seeded inputs of those shapes (the fused
    output checked against the separate one first); one verdict per GPU and (query, key) length bucket, like the
    attention kernel's choice. None where nothing can be measured (not a GPU, a capture or a compile running)."""
    device = torch.device(device)
    key = (device, dtype, heads, head_dim, batch, att.length_bucket(lq), att.length_bucket(lk), splits)
    if key in _VERDICT:
        return _VERDICT[key]
    start = lk - lq
    span = slice(start, lk)

    def inputs():
        gen = torch.Generator().manual_seed(0)
        new = [torch.randn(batch, lq, heads, head_dim, generator=gen).to(device, dtype) for _ in range(3)]
        caches = [torch.randn(batch, lk + lq, heads, head_dim, generator=gen).to(device, dtype)   # room after
                  for _ in range(2)]                                                              # the range
        lens = torch.full((batch,), start, dtype=torch.int32, device=device)
        return (*new, *caches, lens, torch.arange(start, lk, device=device))

    checked: list = []

    def run_fused(q, k, v, kc, vc, lens, index):
        out = fused_attention(q, k, v, kc, vc, lens, splits)
        if not checked:           # the first call: the same inputs the separate way, within attention's tolerance
            want = _separate(q, k, v, kc.clone(), vc.clone(), index, span, lk, backend)
            tol = op_candidates.tolerance(q.dtype, float(want.float().abs().max()), att.STORE_ULPS)
            err = float((out.float() - want.float()).abs().max())
            if not err <= tol:
                raise op_candidates.CandidateMismatch(
                    f"FA3's append-and-attend differs from writing then attending by {err:.3g} (tolerance {tol:.3g})")
            checked.append(err)
        return out

    def run_separate(q, k, v, kc, vc, lens, index):
        return _separate(q, k, v, kc, vc, index, span, lk, backend)

    store_key = (f"{device.type}|h{heads}|d{head_dim}|{str(dtype).replace('torch.', '')}|b{batch}"
                 f"|q{att.length_bucket(lq)}|k{att.length_bucket(lk)}|s{splits}")
    slower, shown = registry.speed(SPEED_KERNEL, store_key, "fused", run_fused, run_separate, inputs, device, tuner)
    if slower is None:
        return None
    _VERDICT[key] = not slower
    log.info("wan_accel: self-attention at %s queries x %s keys %s (%s)", lq, lk,
             "appends to the cache inside FA3's kernel" if not slower else "writes the cache separately", shown)
    return not slower


def warm(shapes, batch: int, heads: int, head_dim: int, dtype, device, backend) -> dict:
    """The fused-or-separate verdict for every self-attention (query, key) length of a run whose kernel is FA3,
    made now so no chunk pays for measuring; {"q<lq>/k<lk>": fused or not}."""
    out = {}
    for lq, lk in shapes:
        if lk < lq:
            continue
        q = torch.empty((batch, lq, heads, head_dim), device=device, dtype=dtype)
        k = torch.empty((batch, lk, heads, head_dim), device=device, dtype=dtype)
        kernel = att.kernel_of(q, k, k, backend)
        del q, k
        if kernel in SPLITS and kvcache_fn() is not None:
            verdict = fused_speed(batch, lq, lk, heads, head_dim, dtype, device, backend, SPLITS[kernel])
            if verdict is not None:
                out[f"q{lq}/k{lk}"] = verdict
    return out


def cached_attention(q, k, v, k_cache, v_cache, index, span, read_len: int, seqlens, backend="auto"):
    """Attention of q [B, Lq, H, D] over the cache after writing this call's k, v [B, rows, H, D] into it (slots
    ``index`` / ``span``; attended slots [0, read_len)): FA3's append-and-attend where it runs and was measured
    faster (see the module's docstring), else the write then ``attention`` with ``backend``."""
    kernel = None
    if seqlens is not None:
        kernel = att.kernel_of(q, k_cache[:, :read_len], v_cache[:, :read_len], backend)
        if kernel in SPLITS and fused_problem(kernel, q, k, k_cache, span, read_len, seqlens) is None:
            b, lq, heads, hd = q.shape
            if fused_speed(b, lq, read_len, heads, hd, q.dtype, q.device, backend, SPLITS[kernel]):
                return fused_attention(q, k, v, k_cache, v_cache, seqlens, SPLITS[kernel])
    return _separate(q, k, v, k_cache, v_cache, index, span, read_len, backend, kernel)
