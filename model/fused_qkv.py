"""One q/k/v GEMM: the self-attention's q, k and v weights as views into one concatenated buffer.

``ensure_fused_qkv(sa)`` gives a ``WanSelfAttention`` a [3*dim, dim] weight (and [3*dim] bias) whose thirds are the
q/k/v parameters themselves (views: no memory is duplicated, the state dict is unchanged). The block forward uses it
when its parts ask for ``fused_qkv`` (``blocks.BlockParts``).
"""
from __future__ import annotations

import torch

from .quant import is_quantized

QKV_WEIGHT, QKV_BIAS = "qkv_weight", "qkv_bias"


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


def _adjacent(parts):
    """One tensor [3*n, ...] over parts that already lie back to back in one storage (a view: nothing copied),
    or None. Rebuilds the concatenated weight of q/k/v that were fused before (e.g. after the buffer was dropped
    so it would not hold memory on its own)."""
    p0 = parts[0]
    if not all(p.is_contiguous() and p.shape == p0.shape and p.dtype == p0.dtype and p.device == p0.device
               for p in parts) or p0.device.type == "meta":
        return None
    if not all(p.untyped_storage().data_ptr() == p0.untyped_storage().data_ptr() for p in parts[1:]):
        return None
    whole = torch.empty(0, dtype=p0.dtype, device=p0.device)
    whole.set_(p0.untyped_storage(), p0.storage_offset(), (len(parts) * p0.shape[0],) + tuple(p0.shape[1:]))
    return whole if _aliases(whole, parts) else None


def drop_fused_qkv(sa) -> None:
    sa._buffers.pop(QKV_WEIGHT, None)
    sa._buffers.pop(QKV_BIAS, None)


def ensure_fused_qkv(sa) -> bool:
    """Give ``sa`` (WanSelfAttention) one [3*dim, dim] q/k/v weight; the q/k/v parameters become views into it,
    so no memory is duplicated and the state dict (keys and values) is unchanged. The weight is a non-persistent
    buffer. Rebuilt when the views were broken (``model.to``, ``set_precision``): as a view when q/k/v still lie back
    to back in one storage, else by one copy. Returns whether it is fused."""
    if fused_qkv_intact(sa):
        return True
    drop_fused_qkv(sa)
    lin = [sa.q, sa.k, sa.v]
    if any(is_quantized(m) for m in lin):      # each dequantizes its own weight with its own scale
        return False
    ws = [m.weight for m in lin]
    bs = [m.bias for m in lin]
    if len({(w.device, w.dtype, w.shape) for w in ws}) != 1 or (any(b is None for b in bs) and
                                                               not all(b is None for b in bs)):
        return False
    with torch.no_grad():
        w = _adjacent([t.data for t in ws])
        b = None if bs[0] is None else _adjacent([t.data for t in bs])
        if w is not None and (bs[0] is None or b is not None):        # already one buffer: a view, no copy
            sa.register_buffer(QKV_WEIGHT, w, persistent=False)
            if b is not None:
                sa.register_buffer(QKV_BIAS, b, persistent=False)
            return True
        for name, params in ((QKV_WEIGHT, ws), (QKV_BIAS, bs)):        # one copy of the weights (and biases)
            if params[0] is not None:
                whole = torch.cat([t.data for t in params])
                for p, part in zip(params, whole.chunk(3)):
                    p.data = part
                sa.register_buffer(name, whole, persistent=False)
    return True
