"""Block math of the optimized causal path (same results as ``WanBlock.forward``, less work per call).

``WanBlock.forward(..., fast=FastArgs(...))`` runs ``block_forward`` below, so regional ``torch.compile`` of the
blocks (``compile.compile_model``, scope 'blocks') covers it. Everything a call needs arrives as tensors or as
values that only change with the chunk's shape, so Dynamo installs no guard on Python bookkeeping:

* the layer's KV buffers and a device index tensor of the cache slots each chunk row goes to (``index_copy_``),
  plus ``read_len`` (slots attended; it changes only when the attended window grows, i.e. with the shape);
* the cross-attention keys/values, computed once per prompt by ``cross_kv`` (no "is the cache filled" check);
* per-timestep modulation inputs ``e0`` [B, 1, 6, dim] (uniform timestep per chunk: one group).

Optional: one q/k/v GEMM over a concatenated weight (``ensure_fused_qkv``), and the fused Triton kernels of
``kernels/`` (LayerNorm+modulate, RMSNorm+RoPE, gated residual; torch fallbacks where Triton does not run).
``kv_only`` is the refresh pass of the last block: only its keys/values are used, so only they are computed.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..kernels import gated_residual, layernorm_modulate, rmsnorm_rope
from . import blocks as _blocks
from .attention import attention
from .layers import RMSNorm, gated_add, modulate
from .rope import apply_rope

QKV_WEIGHT, QKV_BIAS = "qkv_weight", "qkv_bias"


class FastFlags(NamedTuple):
    attention: str          # resolved backend: 'fa3' | 'fa2' | 'sdpa'
    fused_kernels: bool
    fused_qkv: bool


class FastArgs(NamedTuple):
    k_cache: torch.Tensor   # [B, capacity, H, hd] this layer's keys
    v_cache: torch.Tensor
    write_idx: torch.Tensor  # [L] long: cache slot of each chunk row
    read_len: int           # attend slots [0, read_len)
    cross: tuple            # (k, v) or (k, v, k_img, v_img), each [B, Lc, H, hd]
    flags: FastFlags


# ----------------------------------------------------------------------------- fused q/k/v weight
def _aliases(buf: torch.Tensor, parts) -> bool:
    step = parts[0].numel() * buf.element_size()
    return all(p.device == buf.device and p.dtype == buf.dtype and p.data_ptr() == buf.data_ptr() + i * step
               for i, p in enumerate(parts))


def fused_qkv_intact(sa) -> bool:
    """The self-attention's q/k/v parameters are still views into its concatenated weight."""
    w = sa._buffers.get(QKV_WEIGHT)
    if w is None or not _aliases(w, [sa.q.weight, sa.k.weight, sa.v.weight]):
        return False
    b = sa._buffers.get(QKV_BIAS)
    return b is None or _aliases(b, [sa.q.bias, sa.k.bias, sa.v.bias])


def drop_fused_qkv(sa) -> None:
    sa._buffers.pop(QKV_WEIGHT, None)
    sa._buffers.pop(QKV_BIAS, None)


def ensure_fused_qkv(sa) -> bool:
    """Give ``sa`` (WanSelfAttention) one [3*dim, dim] q/k/v weight; the q/k/v parameters become views into it,
    so no memory is duplicated and the state dict (keys and values) is unchanged. The weight is a non-persistent
    buffer. Rebuilt when the views were broken (``model.to``, ``set_precision``). Returns whether it is fused."""
    if fused_qkv_intact(sa):
        return True
    drop_fused_qkv(sa)
    lin = [sa.q, sa.k, sa.v]
    ws = [m.weight for m in lin]
    bs = [m.bias for m in lin]
    if len({(w.device, w.dtype, w.shape) for w in ws}) != 1 or (any(b is None for b in bs) and
                                                               not all(b is None for b in bs)):
        return False
    with torch.no_grad():
        w = torch.cat([t.data for t in ws])
        for m, part in zip(lin, w.chunk(3)):
            m.weight.data = part
        sa.register_buffer(QKV_WEIGHT, w, persistent=False)
        if bs[0] is not None:
            b = torch.cat([t.data for t in bs])
            for m, part in zip(lin, b.chunk(3)):
                m.bias.data = part
            sa.register_buffer(QKV_BIAS, b, persistent=False)
    return True


# ----------------------------------------------------------------------------- pieces
def _modulated(norm, x, m, i: int, fused: bool):
    """modulate(norm(x), shift=m[i], scale=m[i+1]) with m [B, G, 6, dim]; LayerNorm without affine."""
    if fused:
        return layernorm_modulate(x, m[:, :, i], m[:, :, i + 1], eps=norm.eps)
    return modulate(norm(x), m[:, :, i:i + 1], m[:, :, i + 1:i + 2])


def _gated(x, y, m, i: int, fused: bool):
    if fused:
        return gated_residual(x, y, m[:, :, i])
    return gated_add(x, y, m[:, :, i:i + 1])


def _norm_rope(norm, x, rope, heads: int, fused: bool):
    cos, sin = rope
    if fused and isinstance(norm, RMSNorm):
        return rmsnorm_rope(x, norm.weight, cos, sin, heads, norm.eps)
    return apply_rope(norm(x).unflatten(2, (heads, -1)), cos, sin)


def _project(sa, h, fl: FastFlags, parts: int):
    """The last ``parts`` of (q, k, v) for input h: one GEMM over the fused weight when available."""
    d = h.shape[-1]
    w = getattr(sa, QKV_WEIGHT, None) if fl.fused_qkv else None
    if w is not None:
        b = getattr(sa, QKV_BIAS, None)
        start = (3 - parts) * d
        return F.linear(h, w[start:], None if b is None else b[start:]).split(d, dim=-1)
    return tuple(m(h) for m in (sa.q, sa.k, sa.v)[3 - parts:])


def _write(a: FastArgs, k, v) -> None:
    a.k_cache.index_copy_(1, a.write_idx, k.to(a.k_cache.dtype))
    a.v_cache.index_copy_(1, a.write_idx, v.to(a.v_cache.dtype))


def _self_attention(sa, h, rope, a: FastArgs):
    fl = a.flags
    q, k, v = _project(sa, h, fl, 3)
    q = _norm_rope(sa.norm_q, q, rope, sa.num_heads, fl.fused_kernels)
    k = _norm_rope(sa.norm_k, k, rope, sa.num_heads, fl.fused_kernels)
    _write(a, k, v.unflatten(2, (sa.num_heads, -1)))
    out = attention(q, a.k_cache[:, :a.read_len], a.v_cache[:, :a.read_len], backend=fl.attention)
    return sa.o(out.flatten(2))


def _cross_attention(ca, h, cross: tuple, backend: str):
    q = ca.norm_q(ca.q(h)).unflatten(2, (ca.num_heads, -1))
    out = attention(q, cross[0], cross[1], backend=backend)
    if len(cross) == 4:
        out = out + attention(q, cross[2], cross[3], backend=backend)
    return ca.o(out.flatten(2))


# ----------------------------------------------------------------------------- block entry points
def block_forward(block, x, e0, rope, a: FastArgs, actions=None):
    """WanBlock.forward for the optimized path. x [B, L, dim]; e0 [B, G, 6, dim]; rope (cos, sin) [L, hd/2]."""
    fl, cd = a.flags, block.compute_dtype
    fused = fl.fused_kernels
    m = block.modulation.unsqueeze(1) + e0                                   # [B, G, 6, dim]
    y = _self_attention(block.self_attn, _modulated(block.norm1, x, m, 0, fused).to(cd), rope, a)
    x = _gated(x, y, m, 2, fused)
    x = x + _cross_attention(block.cross_attn, block.norm3(x).to(cd), a.cross, fl.attention)
    if actions is not None and getattr(block, "action_model", None) is not None:
        x = block.action_model(x, actions)
    y = block.ffn(_modulated(block.norm2, x, m, 3, fused).to(cd))
    return _gated(x, y, m, 5, fused)


def kv_only(block, x, e0, rope, a: FastArgs) -> None:
    """The block's self-attention keys/values for x, written to its cache; nothing else (refresh, last block)."""
    fl, sa = a.flags, block.self_attn
    m = block.modulation[:, :2].unsqueeze(1) + e0[:, :, :2]
    h = _modulated(block.norm1, x, m, 0, fl.fused_kernels).to(block.compute_dtype)
    k, v = _project(sa, h, fl, 2)
    k = _norm_rope(sa.norm_k, k, rope, sa.num_heads, fl.fused_kernels)
    _write(a, k, v.unflatten(2, (sa.num_heads, -1)))


def cross_kv(block, text, image=None) -> tuple:
    """The block's cross-attention keys/values for an embedded prompt: (k, v) or (k, v, k_img, v_img).

    Works for a block whose weights live elsewhere (block swap): they are copied to the prompt's device for
    this one computation and put back."""
    ca = block.cross_attn
    params = list(ca.parameters())
    saved = [p.data for p in params]
    moved = any(p.device != text.device for p in params)
    try:
        if moved:
            for p in params:
                p.data = p.data.to(text.device, non_blocking=True)
        kv = ca._context_kv(text, image)
    finally:
        if moved:
            for p, d in zip(params, saved):
                p.data = d
    keys = ("k", "v", "k_img", "v_img") if "k_img" in kv else ("k", "v")
    return tuple(kv[k].contiguous() for k in keys)


_blocks.FAST_FORWARD = block_forward      # WanBlock.forward(..., fast=...) dispatches here
