"""Node "Wan Latent Preview": a Wan latent as preview images, without a VAE (the linear latent->RGB projection)."""
from __future__ import annotations

from .comfy import Node


class WanAccelLatentPreview(Node):
    DESCRIPTION = ("Turns a Wan 2.1 LATENT into preview IMAGE frames with the standard linear latent-to-RGB "
                   "projection: no VAE and no model files needed. Colours are approximate; use a VAE Decode "
                   "for the real video.")
    CATEGORY = "wan_accel/model"
    FUNCTION = "preview"
    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("images",)

    INPUTS = {"required": {
        "samples": ("LATENT", {"tooltip": "A Wan 2.1 latent [B, 16, T, H/8, W/8], e.g. from CausalWan Sampler."}),
        "upscale": ("INT", {"default": 8, "min": 1, "max": 16, "step": 1,
                            "tooltip": "Nearest-neighbour enlargement of each latent pixel (8 = video size)."}),
    }}

    def preview(self, samples, upscale=8):
        import torch

        from ..app.jobs.preview import latents_to_rgb
        from ..vae.latents import from_vae_latents

        from ..app.validate import check_latent

        latent = check_latent("samples", samples, dims=(5,), channels=16)
        frames = latents_to_rgb(from_vae_latents(latent))  # [B, T, h, w, 3] uint8
        images = frames.flatten(0, 1).float() / 255.0
        if upscale > 1:
            images = images.repeat_interleave(upscale, dim=1).repeat_interleave(upscale, dim=2)
        return (images.to(torch.float32).contiguous(),)


NODE_CLASS_MAPPINGS = {"WanAccelLatentPreview": WanAccelLatentPreview}
NODE_DISPLAY_NAME_MAPPINGS = {"WanAccelLatentPreview": "Wan Latent Preview"}
