"""Building blocks of the Wan DiT: norms, timestep sinusoid, modulation helpers, head, image projection."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    """y = x * rsqrt(mean(x^2) + eps) * weight over the last dim; statistics in float32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)).to(x.dtype)
        return (normed * self.weight).to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """LayerNorm whose affine parameters follow the input dtype (no float32 upcast of the output)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.to(x.dtype) if self.weight is not None else None
        b = self.bias.to(x.dtype) if self.bias is not None else None
        return F.layer_norm(x, self.normalized_shape, w, b, self.eps)


def sinusoidal_embedding(freq_dim: int, t: torch.Tensor) -> torch.Tensor:
    """[N] timesteps -> [N, freq_dim] float64: all cosines, then all sines; w_j = 10000^(-j/half)."""
    half = freq_dim // 2
    pos = t.to(torch.float64).flatten()
    freqs = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64, device=pos.device).div(half))
    angles = torch.outer(pos, freqs)
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=1)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [B, L, D] with per-group shift/scale [B, G, 1, D] (tokens split into G equal groups)."""
    g = shift.shape[1]
    xg = x.unflatten(1, (g, x.shape[1] // g))
    return (xg * (1 + scale) + shift).flatten(1, 2)


def gated_add(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x + y * gate with per-group gate [B, G, 1, D]."""
    g = gate.shape[1]
    return x + (y.unflatten(1, (g, y.shape[1] // g)) * gate).flatten(1, 2)


class Head(nn.Module):
    """Output head: modulated LayerNorm then Linear(dim, prod(patch) * out_dim)."""

    def __init__(self, dim: int, out_dim: int, patch_size, eps: float):
        super().__init__()
        pt, ph, pw = patch_size
        self.norm = LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.head = nn.Linear(dim, pt * ph * pw * out_dim)
        self.modulation = nn.Parameter(torch.zeros(1, 2, dim))
        self.compute_dtype = torch.float32

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """x [B, L, dim]; e [B, G, dim] (time embedding per token group) -> [B, L, prod(patch)*out_dim]."""
        m = self.modulation.unsqueeze(1) + e.unsqueeze(2)          # [B, G, 2, dim]
        h = modulate(self.norm(x), m[:, :, 0:1], m[:, :, 1:2])
        return self.head(h.to(self.compute_dtype))


class ImageProjection(nn.Module):
    """i2v CLIP image-token projection; keys img_emb.proj.{0,1,3,4}."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.proj = nn.Sequential(nn.LayerNorm(in_dim), nn.Linear(in_dim, in_dim), nn.GELU(),
                                  nn.Linear(in_dim, out_dim), nn.LayerNorm(out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.proj:
            w = getattr(layer, "weight", None)
            x = layer(x.to(w.dtype) if w is not None else x)
        return x
