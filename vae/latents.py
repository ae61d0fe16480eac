"""The Wan 2.1 latent space: per-channel statistics and the conversion between the sampler's latents and the VAE's.

The sampler makes model-space latents [B, F, 16, H, W]; the Wan 2.1 VAE (and the tiny decoders trained on it)
read raw VAE latents [B, 16, F, H, W]: model space = (vae_latent - mean) / std, with the published per-channel
mean and std of the Wan 2.1 VAE below.
"""
from __future__ import annotations

import torch

WAN21_LATENT_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                     0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
WAN21_LATENT_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160]
LATENT_CHANNELS = len(WAN21_LATENT_MEAN)


def latent_stats(device) -> tuple:
    """(mean, std) of the Wan 2.1 VAE latent channels, float32 [16] on ``device``."""
    return (torch.tensor(WAN21_LATENT_MEAN, dtype=torch.float32, device=device),
            torch.tensor(WAN21_LATENT_STD, dtype=torch.float32, device=device))


def to_vae_latents(latents: torch.Tensor) -> torch.Tensor:
    """Model-space latents [B, F, 16, H, W] -> raw VAE latents [B, 16, F, H, W] (ComfyUI LATENT layout), float32."""
    mean, std = latent_stats(latents.device)
    x = latents.float() * std[:, None, None] + mean[:, None, None]
    return x.permute(0, 2, 1, 3, 4).contiguous()


def from_vae_latents(latents: torch.Tensor) -> torch.Tensor:
    """Raw VAE latents [B, 16, F, H, W] (ComfyUI LATENT layout) -> model-space latents [B, F, 16, H, W]."""
    if latents.dim() != 5 or latents.shape[1] != LATENT_CHANNELS:
        raise ValueError(f"expected a Wan latent [B, {LATENT_CHANNELS}, F, H, W], got {tuple(latents.shape)}")
    mean, std = latent_stats(latents.device)
    x = (latents.float() - mean[:, None, None, None]) / std[:, None, None, None]
    return x.permute(0, 2, 1, 3, 4).contiguous()
