"""The opt-in approximate attention modes (int8, fp8): their error bounds and their speed verdicts.

Which implementation each mode takes is the op registry's walk (families 'attention.int8' and 'attention.fp8',
registered beside their kernels in ``kernels/int8_attention.py`` and ``kernels/fp8_attention.py``); the call itself
is ``model/attention.attention``. A mode is opt-in for speed: ``attention_speed`` times it against exact attention
at a run's own largest call (``kernels/registry.speed``: one verdict per GPU and shape).
"""
from __future__ import annotations

import torch

from ..kernels import fa3_fp8, fp8_attention as fp8, int8_attention as int8, registry
from . import attention as att


def fp8_scheme(kind: str) -> str:
    """'fa3' (e4m3 Q, K and V, one scale per head) or 'smoothed' (the pack's int8 Q . K, e4m3 P . V) of a kind."""
    return "fa3" if kind in fa3_fp8.KINDS else "smoothed"


def fp8_error_bound(q, k, v, key_padding_mask=None, kind: str = "torch", **kw):
    """The error bound of fp8 attention of implementation ``kind`` (its module's ``error_bound``)."""
    module = fa3_fp8 if fp8_scheme(kind) == "fa3" else fp8
    return module.error_bound(q, k, v, key_padding_mask, kernel=kind, **kw)


def attention_speed(mode: str, lq: int, lk: int, batch: int, heads: int, head_dim: int, dtype, device, exact="auto",
                    tuner=None) -> tuple[bool | None, str]:
    """(slower, why): whether the opt-in ``mode`` ('int8' | 'fp8') is slower than exact attention at the run's own
    largest call (``lq`` queries, ``lk`` keys), timed through ``registry.speed`` (one verdict per GPU and shape; fp8's
    keys/values quantized beforehand, as the KV cache keeps them; store kernel ``speed.attention.<kind>``). None
    where no speed can be judged: not a GPU, or fp8 by a torch version (its numerics, not its speed)."""
    kind = mode
    if mode == "fp8":
        kind, why = att.fp8_implementation(device, dtype, head_dim)
        if kind not in ("triton", "fa3") and torch.device(device).type in registry.SPEED_DEVICES:
            return None, f"speed not judged: {why}"
        kind = "fa3_fp8" if kind == "fa3" else "fp8"
    run, extra = {"int8": (lambda q, k: int8.int8_attention(q, k, k), lambda k: ()),
                  "fp8": (lambda q, k, kv8: fp8.fp8_attention(q, k, k, kv8=kv8), lambda k: (fp8.quantize_kv(k, k),)),
                  "fa3_fp8": (lambda q, k, kv: fa3_fp8.attention(att.flash_function("fa3"), q, kv),
                              lambda k: (fa3_fp8.quantize_kv(k, k),))}[kind]

    def inputs():
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(batch, lq, heads, head_dim, generator=gen).to(device, dtype)
        k = torch.randn(batch, lk, heads, head_dim, generator=gen).to(device, dtype)
        return (q, k) + extra(k)

    key = f"{torch.device(device).type}|h{heads}|d{head_dim}|{str(dtype).replace('torch.', '')}|q{lq}|k{lk}"
    slower, shown = registry.speed(f"speed.attention.{kind}", key, kind, run,
                                   lambda q, k, *_: att.attention(q, k, k, backend=exact), inputs, device, tuner)
    if slower is None:
        return None, shown if shown.startswith("speed not judged") else f"not measured ({shown})"
    return slower, f"at {lq} queries x {lk} keys: {shown}"
