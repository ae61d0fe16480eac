"""Latent previews: the Wan 2.1 linear latent->RGB projection and animated webp/gif writing.

The 16x3 factors and the bias are the widely used Wan 2.1 preview approximation (as in ComfyUI's
Wan21 latent format); they apply to the model-space (normalised) latents the sampler produces.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ...cache.owned_files import write_with

WAN21_RGB_FACTORS = [
    [-0.1299, -0.1692, 0.2932], [0.0671, 0.0406, 0.0442], [0.3568, 0.2548, 0.1747],
    [0.0372, 0.2344, 0.1420], [0.0313, 0.0189, -0.0328], [0.0296, -0.0956, -0.0665],
    [-0.3477, -0.4059, -0.2925], [0.0166, 0.1902, 0.1975], [-0.0412, 0.0267, -0.1364],
    [-0.1293, 0.0740, 0.1636], [0.0680, 0.3019, 0.1128], [0.0032, 0.0581, 0.0639],
    [-0.1251, 0.0927, 0.1699], [0.0060, -0.0633, 0.0005], [0.3477, 0.2275, 0.2950],
    [0.1984, 0.0913, 0.1861],
]
WAN21_RGB_BIAS = [-0.1835, -0.0868, -0.3360]


def latents_to_rgb(latents: torch.Tensor) -> torch.Tensor:
    """[B, F, 16, H, W] model-space latents -> uint8 frames [B, F, H, W, 3]."""
    if latents.dim() != 5 or latents.shape[2] != len(WAN21_RGB_FACTORS):
        raise ValueError(f"expected latents [B, F, {len(WAN21_RGB_FACTORS)}, H, W], got {tuple(latents.shape)}")
    w = torch.tensor(WAN21_RGB_FACTORS, dtype=torch.float32, device=latents.device)
    b = torch.tensor(WAN21_RGB_BIAS, dtype=torch.float32, device=latents.device)
    rgb = torch.einsum("bfchw,cr->bfhwr", latents.float(), w) + b
    return (((rgb + 1.0) / 2.0).clamp(0, 1) * 255).round().to(torch.uint8).cpu()


def save_animation(frames: torch.Tensor, path, fps: int = 16, scale: int = 4, *, option: str = "") -> Path:
    """Write uint8 frames [F, H, W, 3] as an animated .webp or .gif (by suffix; webp falls back to gif
    when Pillow lacks webp support). Frames are upscaled by ``scale`` (nearest) for visibility. Written through
    the pack's one writer (cache/owned_files.py: atomic, never through a link; ``option`` names the input)."""
    from PIL import Image, features
    path = Path(path)
    if path.suffix.lower() == ".webp" and not features.check("webp"):
        path = path.with_suffix(".gif")
    images = []
    for frame in frames:
        img = _to_image(frame)
        if scale > 1:
            img = img.resize((img.width * scale, img.height * scale), Image.NEAREST)
        images.append(img)
    duration = max(1, round(1000 / fps))
    kwargs = {"lossless": True} if path.suffix.lower() == ".webp" else {}
    fmt = "WEBP" if path.suffix.lower() == ".webp" else "GIF"
    return write_with(path, lambda tmp: images[0].save(tmp, format=fmt, save_all=True, append_images=images[1:],
                                                       duration=duration, loop=0, **kwargs),
                      option=option, purpose="the animated preview")


def _to_image(frame: torch.Tensor):
    from PIL import Image
    h, w, _ = frame.shape
    frame = frame.contiguous()
    try:
        data = frame.numpy().tobytes()
    except RuntimeError:          # torch built without numpy support
        data = bytes(frame.flatten().tolist())
    return Image.frombytes("RGB", (w, h), data)
