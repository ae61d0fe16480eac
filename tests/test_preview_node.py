"""Wan Latent Preview: VAE-space latents become IMAGE frames through the model-space projection."""
import torch

from wan_accel.nodes.preview_nodes import WanAccelLatentPreview
from wan_accel.app.jobs.preview import latents_to_rgb
from wan_accel.vae.latents import from_vae_latents, to_vae_latents


def test_vae_latent_round_trip():
    x = torch.randn(2, 5, 16, 3, 4)
    assert torch.allclose(from_vae_latents(to_vae_latents(x)), x, atol=1e-5)


def test_preview_node_shapes_and_values():
    x = torch.randn(1, 3, 16, 4, 6)  # model space [B, F, C, h, w]
    (images,) = WanAccelLatentPreview().preview({"samples": to_vae_latents(x)}, upscale=2)
    assert images.shape == (3, 8, 12, 3) and images.dtype == torch.float32
    assert 0.0 <= images.min() and images.max() <= 1.0
    expected = latents_to_rgb(x)[0].float() / 255.0
    assert torch.allclose(images[:, ::2, ::2], expected, atol=1e-6)
