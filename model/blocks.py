"""Transformer block of the Wan DiT (self-attention with RoPE and optional KV cache, cross-attention, FFN).

Per-call state (the layer's KV cache, the cache step plan, the layer's cross-attention cache) is passed
in as arguments, so each block can be wrapped, compiled or moved between devices on its own.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .attention import attention
from .layers import LayerNorm, RMSNorm, gated_add, modulate
from .rope import apply_rope

FAST_FORWARD = None     # set by wan.fast_block when the optimized path is loaded


def _qk_norm(dim: int, eps: float, enabled: bool) -> nn.Module:
    return RMSNorm(dim, eps) if enabled else nn.Identity()


class WanSelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, qk_norm: bool, eps: float):
        super().__init__()
        self.num_heads = num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q = _qk_norm(dim, eps, qk_norm)
        self.norm_k = _qk_norm(dim, eps, qk_norm)
        self.attn_backend = "auto"

    def forward(self, x, rope, kv=None, cache_step=None, key_mask=None):
        heads = (self.num_heads, -1)
        q = self.norm_q(self.q(x)).unflatten(2, heads)
        k = self.norm_k(self.k(x)).unflatten(2, heads)
        v = self.v(x).unflatten(2, heads)
        q = apply_rope(q, *rope)
        k = apply_rope(k, *rope)
        if kv is not None:
            k, v = kv.update(k, v, cache_step)
            key_mask = None
        out = attention(q, k, v, key_mask, backend=self.attn_backend)
        return self.o(out.flatten(2))


class WanCrossAttention(nn.Module):
    """Text cross-attention; with ``image=True`` also the i2v image branch (k_img, v_img, norm_k_img)."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool, eps: float, image: bool = False):
        super().__init__()
        self.num_heads = num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q = _qk_norm(dim, eps, qk_norm)
        self.norm_k = _qk_norm(dim, eps, qk_norm)
        self.has_image = image
        if image:
            self.k_img = nn.Linear(dim, dim)
            self.v_img = nn.Linear(dim, dim)
            self.norm_k_img = _qk_norm(dim, eps, qk_norm)
        self.attn_backend = "auto"

    def _context_kv(self, text, image):
        heads = (self.num_heads, -1)
        kv = {"k": self.norm_k(self.k(text)).unflatten(2, heads), "v": self.v(text).unflatten(2, heads)}
        if self.has_image:
            if image is None:
                raise ValueError("this is an i2v model: pass the CLIP image features (clip_fea)")
            kv["k_img"] = self.norm_k_img(self.k_img(image)).unflatten(2, heads)
            kv["v_img"] = self.v_img(image).unflatten(2, heads)
        return kv

    def forward(self, x, text, image=None, cross_kv=None):
        q = self.norm_q(self.q(x)).unflatten(2, (self.num_heads, -1))
        if cross_kv is not None and cross_kv.ready:
            kv = cross_kv.tensors
        else:
            kv = self._context_kv(text, image)
            if cross_kv is not None:
                cross_kv.store(kv)
        out = attention(q, kv["k"], kv["v"], backend=self.attn_backend)
        if self.has_image:
            out = out + attention(q, kv["k_img"], kv["v_img"], backend=self.attn_backend)
        return self.o(out.flatten(2))


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

    def forward(self, x: torch.Tensor, e0: torch.Tensor, text: torch.Tensor, rope: tuple,
                kv=None, cache_step=None, cross_kv=None, key_mask=None, image=None, actions=None,
                fast=None) -> torch.Tensor:
        """x [B, L, dim] residual stream; e0 [B, G, 6, dim] time projection per token group (G groups of
        L/G tokens: one per latent frame in the causal model, one per video otherwise); text [B, Lt, dim]
        embedded text; rope (cos, sin) tables [L, head_dim/2]; kv/cache_step: this layer's KV cache and the
        call's host-side write plan; cross_kv: this layer's cross-attention cache; key_mask [B, L] bool;
        actions: per-call state for an optional ``action_model`` submodule (Matrix-Game-2), which runs
        between cross-attention and the FFN. fast: a ``wan.fast_block.FastArgs`` selects the optimized path
        (KV buffers, precomputed cross K/V; text, kv, cache_step and cross_kv are then unused)."""
        if fast is not None:
            return FAST_FORWARD(self, x, e0, rope, fast, actions)
        cd = self.compute_dtype
        m = self.modulation.unsqueeze(1) + e0                       # [B, G, 6, dim]
        m = [m[:, :, i:i + 1] for i in range(6)]                    # each [B, G, 1, dim]
        y = self.self_attn(modulate(self.norm1(x), m[0], m[1]).to(cd), rope, kv, cache_step, key_mask)
        x = gated_add(x, y, m[2])
        x = x + self.cross_attn(self.norm3(x).to(cd), text, image, cross_kv)
        if actions is not None and getattr(self, "action_model", None) is not None:
            x = self.action_model(x, actions)
        y = self.ffn(modulate(self.norm2(x), m[3], m[4]).to(cd))
        return gated_add(x, y, m[5])
