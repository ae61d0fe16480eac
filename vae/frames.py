"""One streaming decoder interface for every face that shows or writes frames as the sampler makes them.

A ``FrameStream`` decodes one video of Wan 2.1 latents chunk after chunk, whatever decodes it:

* ``push(z)``: raw VAE latents [B, 16, n, h, w] (a ComfyUI LATENT's layout; the next n latent frames) -> the
  frames they complete as images [B, frames, 8h, 8w, 3], float in 0..1 (ComfyUI's IMAGE layout, a batch axis in
  front; float32 but where a ComfyUI VAE's output dtype says otherwise), or None when they complete none (a decoder may hold a frame back until its pair comes);
* ``finish()``: the frames of anything still held back, as the video ends (or None);
* ``load(shape)``: have the decoder's weights where it runs before a push (a ComfyUI VAE that other prompts may
  have unloaded between chunks); ``release()``: drop the walk's state;
* ``snapshot()`` / ``restore(snap)``: the walk so far, for a later prompt that continues the video (a dict with a
  ``held`` entry: not None when ``finish`` gave frames after the snapshot); a stream that cannot be continued
  raises ValueError.

Concatenated over a video, the frames are those of one decode of the whole latent (up to the rounding of the
decoder's dtype). Adapters: ``DecoderFrames`` here, over the pack's own decoders (``vae/wan21.py``,
``vae/taehv.py``); ComfyUI's Wan 2.1 VAE and ComfyUI's tiny video decoders (``taew2_1``, ``lighttaew2_1``) in
``nodes/comfy/streaming_decode.py``, which picks the adapter for a graph's VAE (``stream_decoder``).
"""
from __future__ import annotations

import torch
from torch import nn

from .latents import LATENT_CHANNELS
from .stream import StreamingDecoder


class FrameStream:
    """The interface (see the module doc); subclasses define ``push`` and what their decoder needs."""

    kind = ""                       # what decodes: 'comfy-wan', 'comfy-tiny', 'wan', 'tiny'
    NOT_CONTINUED = "this decoder's walk is not continued across runs"      # why snapshot/restore are refused

    def __init__(self):
        self.frames_in = 0          # latent frames received
        self.frames_out = 0         # video frames returned

    def load(self, shape) -> None:
        """Nothing to load by default: the decoder's weights stay where it runs."""

    def push(self, latent: torch.Tensor):
        raise NotImplementedError

    def finish(self):
        return None

    def snapshot(self) -> dict:
        raise ValueError(self.NOT_CONTINUED)

    def restore(self, snap: dict) -> None:
        raise ValueError(self.NOT_CONTINUED)

    def release(self) -> None:
        """Forget the walk (its caches); the stream is not used again after this."""


def check_latents(latent: torch.Tensor, channels: int = LATENT_CHANNELS) -> None:
    if not isinstance(latent, torch.Tensor) or latent.dim() != 5 or latent.shape[1] != channels:
        shape = tuple(latent.shape) if isinstance(latent, torch.Tensor) else type(latent).__name__
        raise ValueError(f"expected Wan 2.1 latents [B, {channels}, frames, H, W], got {shape}")


class DecoderFrames(FrameStream):
    """A pack decoder (``vae.stream.StreamingDecoder``: the Wan 2.1 VAE's decoder or the tiny decoder) as a
    ``FrameStream``. Both are causal and carry their state between chunks, so nothing is held back: every push
    returns all the frames its latent frames complete. ``output_device`` is where the images go (None: the
    decoder's device); ``latent_in`` is applied to each chunk's latents first (a ComfyUI tiny decoder's own latent
    scaling)."""

    def __init__(self, decoder: StreamingDecoder, output_device=None, latent_in=None):
        super().__init__()
        self.decoder = decoder
        self.kind = decoder.kind
        self.output_device, self.latent_in = output_device, latent_in
        self.stream = decoder.stream()

    @torch.no_grad()
    def push(self, latent: torch.Tensor):
        check_latents(latent)
        if latent.shape[2] == 0:
            return None
        z = latent if self.latent_in is None else self.latent_in(latent)
        raw = self.stream.push_raw(z)
        self.frames_in += latent.shape[2]
        if raw.shape[2] == 0:
            return None
        images = self.decoder.to_images(raw).permute(0, 2, 3, 4, 1)         # [B, T, H, W, 3]
        images = images.to(device=self.output_device or images.device, dtype=torch.float32).contiguous()
        self.frames_out += images.shape[1]
        return images

    def snapshot(self) -> dict:
        """The decoder's state so far, copied to the CPU (its layers named by their place in the decoder)."""
        names = {m: n for n, m in self.decoder.named_modules()}

        def key(k):
            if isinstance(k, nn.Module):
                return (names[k],)
            if isinstance(k, tuple) and k and isinstance(k[0], nn.Module):
                return (names[k[0]],) + tuple(k[1:])
            return k
        state = {key(k): v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
                 for k, v in self.stream.state.items()}
        return {"vae": self._signature(), "state": state, "held": None, "frames_in": self.frames_in,
                "frames_out": self.frames_out}

    def restore(self, snap: dict) -> None:
        if not isinstance(snap, dict) or snap.get("vae") != self._signature():
            raise ValueError("the state's decode was made with another VAE: connect the VAE of the first run, or "
                             "decode this run on its own with VAE Decode")
        modules = dict(self.decoder.named_modules())
        dev, dtype = self.decoder.device, self.decoder.dtype

        def key(k):
            if isinstance(k, tuple) and k and isinstance(k[0], str):
                return modules[k[0]] if len(k) == 1 else (modules[k[0]],) + tuple(k[1:])
            return k
        self.stream.state = {key(k): v.to(device=dev, dtype=dtype) if isinstance(v, torch.Tensor) else v
                             for k, v in snap["state"].items()}
        self.frames_in, self.frames_out = int(snap["frames_in"]), int(snap["frames_out"])

    def _signature(self) -> tuple:
        first = next(self.decoder.parameters())
        return (type(self.decoder).__name__, repr(getattr(self.decoder, "config", None)), tuple(first.shape),
                float(first.detach().flatten()[:8].double().sum()))

    def release(self) -> None:
        self.stream.state = {}
