"""Transformer block of the Wan DiT: self-attention with RoPE and an optional KV cache, cross-attention, FFN.

There is one block forward. What differs between the reference and the optimized sampling paths are the parts
plugged into it (``BlockParts``): the attention backend, the fused Triton kernels (LayerNorm+modulate,
RMSNorm+RoPE, gated residual, and with RMSNorm+RoPE the cross-attention query's RMSNorm; torch fallbacks
elsewhere; with them, on CUDA in bf16/fp16, the FFN's bias + GELU in its first GEMM's epilogue: ``ffn_epilogue``)
and one q/k/v GEMM over a concatenated weight
(``fused_qkv``). Everything a call needs arrives in a ``LayerCall`` of tensors and of values that change only with
the chunk's shape, so a compiled block (``compile.compile_model``, scope 'blocks') installs no guard on Python
bookkeeping:

* the layer's KV buffers and the step's device index of the slots each chunk row goes to (``kv_cache.write_kv``;
  eager code copies into their one contiguous range, ``write_span``, where they form one; FlashAttention 3 may
  append them inside its kernel from ``write_lens``: ``cached_attention``), plus ``read_len`` (slots attended; it
  changes only when the attended window grows);
* the cross-attention keys/values, computed once per prompt (``cross_kv``);
* ``e0`` [B, G, 6, dim]: the time projection per token group (one group per latent frame, or one per chunk when
  the chunk's timestep is uniform).

``kv_only`` is the refresh pass of the last block: only its keys/values are used, so only they are computed.

``BlockParts.linear`` 'fp8' (opt-in, approximate) runs every linear layer that carries an fp8 copy of its weight
(``model/fp8_linear.py`` makes them) through ``kernels.fp8_linear``; a layer without one, and every layer under
'exact', is called as before. An input that feeds several fp8 layers (separate q/k/v, the prompt's k and v) is
quantized once for all of them (``fp8_input``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels import candidates as op_candidates
from ..kernels import gated_residual, layernorm_modulate, residual_norm, rmsnorm_rope
from ..kernels.fp8_linear import fp8_linear, quantize_input
from ..kernels.rms_norm import rmsnorm
from .attention import attention
from .fused_qkv import QKV_BIAS, QKV_WEIGHT
from .cached_attention import cached_attention
from .kv_cache import write_kv
from .layers import LayerNorm, RMSNorm, gated_add, modulate
from .rope import apply_rope


class BlockParts(NamedTuple):
    """The parts plugged into the block forward (all of them keep the results within rounding, except the opt-in
    approximate modes: int8 attention, fp8 linear)."""
    attention: str = "auto"       # backend: 'auto' | 'sdpa' | 'fa3' | 'fa2' | ... (model/attention.py)
    fused_kernels: bool | tuple = False   # the fused Triton kernels (only where Triton runs): all, none, or a
    #                                       tuple of the names in use (KERNEL_NAMES; the others run as torch ops)
    fused_qkv: bool = False       # one q/k/v GEMM over the concatenated weight (model/fused_qkv.py)
    ops: tuple = ()               # (mode, *switched off 'op:candidate') of kernels/candidates.py: LayerNorm+modulate
    #                               and RMSNorm+RoPE run the store's verified choice; () = fused_kernels decides
    linear: str = "exact"         # 'exact' | 'fp8': the layers holding an fp8 weight copy run it (approximate, opt-in)


class LayerCall(NamedTuple):
    """One layer's inputs for one forward call besides x, e0 and rope."""
    cross: tuple                       # (k, v) or (k, v, k_img, v_img), each [B, Lc, H, hd]
    parts: BlockParts = BlockParts()
    k_cache: torch.Tensor | None = None  # [B, capacity, H, hd] this layer's keys (None: attend within the call)
    v_cache: torch.Tensor | None = None
    write_idx: torch.Tensor | None = None  # [L] long: cache slot of each row of the call
    read_len: int = 0                  # attend cache slots [0, read_len)
    key_mask: torch.Tensor | None = None   # [B, L] bool, padded keys (no cache only)
    seq: object = None                 # a seq_parallel.SeqShard: x holds this rank's tokens, the cache its heads
    write_span: slice | None = None    # the slots as one contiguous range, when they are (``CacheStep.span``)
    write_lens: torch.Tensor | None = None   # [B] int32: the range's first slot, on the device (``CacheStep.seqlens``)


KERNEL_NAMES = ("layernorm_modulate", "rmsnorm_rope", "gated_residual", "rms_norm", "ffn_gelu", "residual_norm")


def uses_kernel(fused, kernel: str) -> bool:
    """Whether ``BlockParts.fused_kernels`` (True, False or a tuple of kernel names) includes ``kernel``."""
    return fused is True or (not isinstance(fused, bool) and kernel in fused)


FP8_WEIGHT, FP8_SCALE = "fp8_weight", "fp8_scale"          # an nn.Linear's fp8 copy (non-persistent buffers)
QKV_FP8_WEIGHT, QKV_FP8_SCALE, QKV_FP8_BIAS = "qkv_fp8_weight", "qkv_fp8_scale", "qkv_fp8_bias"   # self-attention


def run_linear(layer: nn.Module, x: torch.Tensor, linear: str = "exact", quantized: tuple | None = None
               ) -> torch.Tensor:
    """``layer(x)``, or its fp8 copy under ``linear`` 'fp8' where the layer holds one (``quantized``: x's codes and
    scales from ``fp8_input``, shared with sibling layers)."""
    if linear == "fp8":
        w = layer._buffers.get(FP8_WEIGHT)
        if w is not None:
            return fp8_linear(x, w, layer._buffers[FP8_SCALE], layer.bias, quantized)
    return layer(x)


def fp8_input(x: torch.Tensor, layers, linear: str, memo: dict | None = None) -> tuple | None:
    """x's fp8 codes and scales, made once for the ``layers`` that run an fp8 copy of x under ``linear``; None
    where fewer than two do (a single layer quantizes its own input). ``memo`` shares them further, between the
    blocks that take the same x (the prompt: every block's cross-attention k and v)."""
    copies = 0 if linear != "fp8" else sum(FP8_WEIGHT in m._buffers for m in layers)
    if copies == 0 or (copies == 1 and memo is None):
        return None
    if memo is None:
        return quantize_input(x.reshape(-1, x.shape[-1]))
    hit = memo.get(id(x))
    if hit is None:             # x is kept with its codes: its id names it while the memo lives
        hit = memo[id(x)] = (x, quantize_input(x.reshape(-1, x.shape[-1])))
    return hit[1]


EPILOGUE_DTYPES = (torch.bfloat16, torch.float16)


def epilogue_gelu_runs_on(device, dtype) -> bool:
    """Whether the FFN's bias + GELU may run in its first GEMM's epilogue (``linear_gelu``) here: on CUDA in
    bf16/fp16, where ``torch._addmm_activation`` computes the tanh GELU (cuBLASLt's epilogue from the float32
    accumulator, or torch's addmm + tanh GELU where the epilogue's conditions do not hold). On a CPU the same call
    computes the erf GELU, another function: never used there."""
    return torch.device(device).type == "cuda" and dtype in EPILOGUE_DTYPES


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """GELU(x @ weight.T + bias) for a 2-D x in one call (the tanh GELU on CUDA only: ``epilogue_gelu_runs_on``)."""
    return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)


def ffn_epilogue(ffn: nn.Module, h: torch.Tensor, fused) -> bool:
    """Whether ``_ffn`` runs the first linear's bias + GELU in the GEMM's epilogue: where ``ffn_gelu`` is in use
    (``BlockParts.fused_kernels``; the doctor's ``kernel.ffn_gelu`` switches it off alone), on CUDA in bf16/fp16,
    for a module that is exactly Sequential(Linear with a bias, GELU(approximate='tanh'), Linear) without hooks,
    its first layer's weights stored in h's dtype on h's device (what calling the layer would multiply). Only
    metadata is read: no host sync, the same answer in a compile trace or a CUDA-graph capture."""
    if not uses_kernel(fused, "ffn_gelu") or not epilogue_gelu_runs_on(h.device, h.dtype):
        return False
    if type(ffn) is not nn.Sequential or len(ffn) != 3:
        return False
    first, act, last = ffn[0], ffn[1], ffn[2]
    if type(first) is not nn.Linear or type(act) is not nn.GELU or type(last) is not nn.Linear:
        return False
    if act.approximate != "tanh" or first.bias is None:
        return False
    if any(m._forward_hooks or m._forward_pre_hooks for m in (ffn, first, act)):
        return False
    return all(t.dtype == h.dtype and t.device == h.device for t in (first.weight, first.bias))


def _ffn(ffn: nn.Sequential, h: torch.Tensor, linear: str, fused=False) -> torch.Tensor:
    if linear == "fp8":
        return run_linear(ffn[2], ffn[1](run_linear(ffn[0], h, linear)), linear)
    if ffn_epilogue(ffn, h, fused):            # [B, L, dim] -> [B * L, dim]: a view where h allows one
        g = linear_gelu(h.reshape(-1, h.shape[-1]), ffn[0].weight, ffn[0].bias)
        return ffn[2](g.unflatten(0, h.shape[:-1]))
    return ffn(h)


def _qk_norm(dim: int, eps: float, enabled: bool) -> nn.Module:
    return RMSNorm(dim, eps) if enabled else nn.Identity()


# ----------------------------------------------------------------------------- pieces (plain or fused)
def _modulated(norm, x, m, i: int, fused: bool, ops: tuple = ()):
    """modulate(norm(x), shift=m[i], scale=m[i+1]) with m [B, G, 6, dim]; LayerNorm without affine."""
    if ops:
        return op_candidates.run("layernorm_modulate", ops[0], ops[1:], x, m[:, :, i], m[:, :, i + 1], norm.eps)
    if uses_kernel(fused, "layernorm_modulate"):
        return layernorm_modulate(x, m[:, :, i], m[:, :, i + 1], eps=norm.eps)
    return modulate(norm(x), m[:, :, i:i + 1], m[:, :, i + 1:i + 2])


def _gated(x, y, m, i: int, fused: bool):
    if uses_kernel(fused, "gated_residual"):
        return gated_residual(x, y, m[:, :, i])
    return gated_add(x, y, m[:, :, i:i + 1])


def pack_kernel_runs(parts: BlockParts, kernel: str) -> bool:
    """Whether the pack's kernel ``kernel`` runs: 'residual_norm', a residual update and the LayerNorm after it as
    one kernel (``kernels/residual_layernorm.py``), or 'rms_norm', the cross-attention's query RMSNorm
    (``kernels/rms_norm.py``). Where the fused kernels run and the doctor trusts it (``kernel.residual_norm``,
    ``kernel.rms_norm``), in an ops mode that lets the pack's kernels run; plain torch elsewhere."""
    if not uses_kernel(parts.fused_kernels, kernel):     # off, or switched off by the doctor (kernel.<name>)
        return False
    return not parts.ops or parts.ops[0] in ("auto", "pack")


def _gated_norm3(block, x, y, m, parts: BlockParts):
    """(x + y * gate, norm3 of that): the self-attention's gated residual and the cross-attention's input."""
    norm = block.norm3
    # only the pack's own LayerNorm, whose forward is known (another implementation's module, a borrowed block's,
    # may cast or patch its weights as it runs): any other norm3 is called as it is
    if pack_kernel_runs(parts, "residual_norm") and type(norm) is LayerNorm:
        w = None if norm.weight is None else norm.weight.to(x.dtype)       # in x's dtype, as LayerNorm.forward
        b = None if norm.bias is None else norm.bias.to(x.dtype)
        return residual_norm(x, y, m[:, :, 2], w, b, eps=norm.eps)
    x = _gated(x, y, m, 2, parts.fused_kernels)
    return x, norm(x)


def _norm_rope(norm, x, rope, heads: int, fused: bool, ops: tuple = ()):
    cos, sin = rope
    if ops and isinstance(norm, RMSNorm) and cos.dim() == 2:
        return op_candidates.run("rmsnorm_rope", ops[0], ops[1:], x, norm.weight, cos, sin, heads, norm.eps)
    if uses_kernel(fused, "rmsnorm_rope") and isinstance(norm, RMSNorm) and cos.dim() == 2:
        return rmsnorm_rope(x, norm.weight, cos, sin, heads, norm.eps)
    return apply_rope(norm(x).unflatten(2, (heads, -1)), cos, sin)


def _project(sa, h, fused_qkv: bool, parts: int, linear: str = "exact"):
    """The last ``parts`` of (q, k, v) for input h: one GEMM over the fused weight when available (under
    ``linear`` 'fp8': over the fp8 copy of the three weights, one GEMM when fused, else one per part)."""
    d = h.shape[-1]
    start = (3 - parts) * d
    if linear == "fp8":
        wq = sa._buffers.get(QKV_FP8_WEIGHT)
        if wq is not None:
            scale, bias = sa._buffers[QKV_FP8_SCALE], sa._buffers.get(QKV_FP8_BIAS)
            spans = [(start, 3 * d)] if fused_qkv else [(i * d, (i + 1) * d) for i in range(3 - parts, 3)]
            hq = quantize_input(h.reshape(-1, d)) if len(spans) > 1 else None       # h quantized once
            out = [fp8_linear(h, wq[a:b], scale[a:b], None if bias is None else bias[a:b], hq) for a, b in spans]
            return out[0].split(d, dim=-1) if fused_qkv else tuple(out)
        layers = (sa.q, sa.k, sa.v)[3 - parts:]
        if any(FP8_WEIGHT in m._buffers for m in layers):     # copies of their own (a sibling is stored in fp8)
            hq = fp8_input(h, layers, linear)
            return tuple(run_linear(m, h, linear, hq) for m in layers)
    w = getattr(sa, QKV_WEIGHT, None) if fused_qkv else None
    if w is not None:
        b = getattr(sa, QKV_BIAS, None)
        return F.linear(h, w[start:], None if b is None else b[start:]).split(d, dim=-1)
    return tuple(m(h) for m in (sa.q, sa.k, sa.v)[3 - parts:])


class _Attention(nn.Module):
    """The layers both attentions have: q, k, v, o and the q/k RMSNorms (identities without ``qk_norm``)."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool, eps: float):
        super().__init__()
        self.num_heads = num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q = _qk_norm(dim, eps, qk_norm)
        self.norm_k = _qk_norm(dim, eps, qk_norm)


class WanSelfAttention(_Attention):
    def keys_values(self, h, rope, call: LayerCall, with_query: bool):
        """(q, k, v) or (k, v) of the modulated input h, RoPE applied, [B, L, H, hd] each."""
        p = call.parts
        proj = _project(self, h, p.fused_qkv, 3 if with_query else 2, p.linear)
        k = _norm_rope(self.norm_k, proj[-2], rope, self.num_heads, p.fused_kernels, p.ops)
        v = proj[-1].unflatten(2, (self.num_heads, -1))
        if not with_query:
            return k, v
        return _norm_rope(self.norm_q, proj[0], rope, self.num_heads, p.fused_kernels, p.ops), k, v

    def forward(self, h, rope, call: LayerCall):
        q, k, v = self.keys_values(h, rope, call, with_query=True)
        if call.seq is not None:                 # sequence shards -> head shards (every token, this rank's heads)
            q, k, v = call.seq.to_heads(q, k, v)
        if call.k_cache is not None:
            out = cached_attention(q, k, v, call.k_cache, call.v_cache, call.write_idx, call.write_span,
                                   call.read_len, call.write_lens, backend=call.parts.attention)
        else:
            out = attention(q, k, v, call.key_mask, backend=call.parts.attention)
        if call.seq is not None:
            out = call.seq.to_tokens(out)
        return run_linear(self.o, out.flatten(2), call.parts.linear)


class WanCrossAttention(_Attention):
    """Text cross-attention; with ``image=True`` also the i2v image branch (k_img, v_img, norm_k_img)."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool, eps: float, image: bool = False):
        super().__init__(dim, num_heads, qk_norm, eps)
        self.has_image = image
        if image:
            self.k_img = nn.Linear(dim, dim)
            self.v_img = nn.Linear(dim, dim)
            self.norm_k_img = _qk_norm(dim, eps, qk_norm)

    def context_kv(self, text, image=None, linear: str = "exact", memo: dict | None = None) -> tuple:
        """Keys/values of the embedded prompt: (k, v) or (k, v, k_img, v_img), each [B, Lc, H, hd], contiguous
        (``memo``: the prompt's fp8 codes shared between blocks, see ``fp8_input``)."""
        heads = (self.num_heads, -1)
        tq = fp8_input(text, (self.k, self.v), linear, memo)
        kv = [self.norm_k(run_linear(self.k, text, linear, tq)).unflatten(2, heads),
              run_linear(self.v, text, linear, tq).unflatten(2, heads)]
        if self.has_image:
            if image is None:
                raise ValueError("this is an i2v model: pass the CLIP image features (clip_fea)")
            iq = fp8_input(image, (self.k_img, self.v_img), linear, memo)
            kv += [self.norm_k_img(run_linear(self.k_img, image, linear, iq)).unflatten(2, heads),
                   run_linear(self.v_img, image, linear, iq).unflatten(2, heads)]
        return tuple(t.contiguous() for t in kv)

    def forward(self, h, cross: tuple, backend: str, linear: str = "exact", fused_norm: bool = False):
        q = run_linear(self.q, h, linear)
        if fused_norm and isinstance(self.norm_q, RMSNorm):        # one kernel for the norm's ~6 torch ops
            q = rmsnorm(q, self.norm_q.weight, self.norm_q.eps)
        else:
            q = self.norm_q(q)
        q = q.unflatten(2, (self.num_heads, -1))
        out = attention(q, cross[0], cross[1], backend=backend)
        if len(cross) == 4:
            out = out + attention(q, cross[2], cross[3], backend=backend)
        return run_linear(self.o, out.flatten(2), linear)


class WanBlock(nn.Module):
    def __init__(self, dim: int, ffn_dim: int, num_heads: int, qk_norm: bool, cross_attn_norm: bool,
                 eps: float, image: bool = False):
        super().__init__()
        self.norm1 = LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.self_attn = WanSelfAttention(dim, num_heads, qk_norm, eps)
        self.norm3 = LayerNorm(dim, eps=eps, elementwise_affine=True) if cross_attn_norm else nn.Identity()
        self.cross_attn = WanCrossAttention(dim, num_heads, qk_norm, eps, image=image)
        self.norm2 = LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(ffn_dim, dim))
        self.modulation = nn.Parameter(torch.zeros(1, 6, dim))
        self.compute_dtype = torch.float32

    def forward(self, x: torch.Tensor, e0: torch.Tensor, rope: tuple, call: LayerCall, actions=None) -> torch.Tensor:
        """x [B, L, dim] residual stream; e0 [B, G, 6, dim] time projection per token group (G groups of L/G
        tokens); rope (cos, sin) tables [L, head_dim/2] (or per sample [B, L, head_dim/2]); call: this layer's
        caches, prompt keys/values and parts; actions: per-call state for an optional ``action_model`` submodule
        (Matrix-Game-2), which runs between cross-attention and the FFN."""
        cd, fused = self.compute_dtype, call.parts.fused_kernels
        m = self.modulation.unsqueeze(1) + e0                                    # [B, G, 6, dim]
        y = self.self_attn(_modulated(self.norm1, x, m, 0, fused, call.parts.ops).to(cd), rope, call)
        x, h = _gated_norm3(self, x, y, m, call.parts)
        y = self.cross_attn(h.to(cd), call.cross, call.parts.attention, call.parts.linear,
                            pack_kernel_runs(call.parts, "rms_norm"))
        acting = actions is not None and getattr(self, "action_model", None) is not None
        if (pack_kernel_runs(call.parts, "residual_norm") and not acting
                and torch.promote_types(x.dtype, y.dtype) == x.dtype):
            x, h = residual_norm(x, y, shift=m[:, :, 3], scale=m[:, :, 4], eps=self.norm2.eps)
        else:
            x = x + y
            if acting:
                x = self.action_model(x, actions)
            h = _modulated(self.norm2, x, m, 3, fused, call.parts.ops)
        y = _ffn(self.ffn, h.to(cd), call.parts.linear, fused)
        return _gated(x, y, m, 5, fused)

    def kv_only(self, x: torch.Tensor, e0: torch.Tensor, rope: tuple, call: LayerCall) -> None:
        """The block's self-attention keys/values for x, written to its cache; nothing else (refresh, last block)."""
        m = self.modulation[:, :2].unsqueeze(1) + e0[:, :, :2]
        h = _modulated(self.norm1, x, m, 0, call.parts.fused_kernels, call.parts.ops).to(self.compute_dtype)
        k, v = self.self_attn.keys_values(h, rope, call, with_query=False)
        if call.seq is not None:
            k, v = call.seq.to_heads(k, v)
        write_kv(call.k_cache, call.v_cache, call.write_idx, k, v, call.write_span)


def cross_kv(block: WanBlock, text, image=None, linear: str = "exact", memo: dict | None = None) -> tuple:
    """The block's cross-attention keys/values for an embedded prompt: (k, v) or (k, v, k_img, v_img); ``memo``
    (one dict per prompt) quantizes the prompt once for every block under ``linear`` 'fp8'.

    Works for a block whose weights live elsewhere (block swap): they are copied to the prompt's device for
    this one computation and put back (a swapped block holds no fp8 copy: its layers run exact)."""
    ca = block.cross_attn
    params = list(ca.parameters())
    saved = [p.data for p in params]
    moved = any(p.device != text.device for p in params)
    try:
        if moved:
            for p in params:
                p.data = p.data.to(text.device, non_blocking=True)
        return ca.context_kv(text, image, linear, memo)
    finally:
        if moved:
            for p, d in zip(params, saved):
                p.data = d
