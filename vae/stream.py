"""What both decoders share: a module that decodes Wan 2.1 latents chunk after chunk with its state carried
between chunks, and the stream that feeds it.

A decoder's ``decode_raw(z, state)`` takes raw VAE latents [B, 16, n, h, w] (the next n latent frames) and a
state dict it keeps between calls (a fresh dict starts a video), and returns the pixel frames those latent frames
complete, [B, 3, frames, 8h, 8w]. Both decoders are causal in time, so a video pushed in chunks of any size gives
the frames of one push of the whole latent (``tests/test_vae_decoders.py``). Frame counts: the first latent
frame gives 1 pixel frame and every later one 4, so T latent frames give 1 + 4 * (T - 1).
"""
from __future__ import annotations

import torch
from torch import nn

from .latents import LATENT_CHANNELS, to_vae_latents


class StreamingDecoder(nn.Module):
    """Base of the decoders: device, dtype and memory format (``prepare``), and their streams."""

    kind = ""                       # the --decode name

    def __init__(self, config=None):
        super().__init__()
        self.config = config

    def decode_raw(self, z: torch.Tensor, state: dict) -> torch.Tensor:
        raise NotImplementedError

    def to_images(self, raw: torch.Tensor) -> torch.Tensor:
        """Raw decoder output [B, 3, T, H, W] -> images in 0..1, same layout."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def prepare(self, device, dtype: torch.dtype) -> "StreamingDecoder":
        """Move to ``device`` in ``dtype``, in the default (contiguous) memory layout: channels-last was measured
        slower for both decoders on an H200 in bf16 (docs/benchmarks.md)."""
        self.to(device=device, dtype=dtype)
        return self.eval().requires_grad_(False)

    def stream(self) -> "DecodeStream":
        return DecodeStream(self)


class DecodeStream:
    """One video decoded chunk by chunk: ``push`` each chunk of model-space latents as the sampler makes it and get
    the pixel frames it completes (raw decoder output; ``decoder.to_images`` gives 0..1)."""

    def __init__(self, decoder: StreamingDecoder):
        self.decoder = decoder
        self.state: dict = {}

    @torch.no_grad()
    def push(self, latents: torch.Tensor) -> torch.Tensor:
        """Model-space latents [B, n, 16, h, w] (the sampler's layout) -> raw frames [B, 3, frames, 8h, 8w]."""
        if latents.dim() != 5 or latents.shape[2] != LATENT_CHANNELS or latents.shape[1] == 0:
            raise ValueError(f"expected the sampler's latents [B, frames >= 1, {LATENT_CHANNELS}, H, W], got "
                             f"{tuple(latents.shape)}")
        return self.push_raw(to_vae_latents(latents))

    @torch.no_grad()
    def push_raw(self, z: torch.Tensor) -> torch.Tensor:
        """Raw VAE latents [B, 16, n >= 1, h, w] (a ComfyUI LATENT's layout, checked by the caller: ``push``,
        ``frames.DecoderFrames``) -> raw frames [B, 3, frames, 8h, 8w]."""
        dec = self.decoder
        return dec.decode_raw(z.to(device=dec.device, dtype=dec.dtype), self.state)
