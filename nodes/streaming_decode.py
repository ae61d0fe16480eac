"""Streaming decode of Wan 2.1 latents, chunk by chunk, with ComfyUI's own VAE: the one adapter around its internals.

ComfyUI's ``WanVAE.decode`` (comfy/ldm/wan/vae.py) is causal: after a 1x1x1 ``conv2`` it walks the latent frames,
the first alone, then pairs, through ``decoder(x, feat_cache, feat_idx)`` with one feature cache (the last frames of
every causal convolution). ``WanStreamDecoder`` continues that walk as chunks arrive: it keeps the feature cache
between chunks and holds back a frame whose pair is still to come, so its frames are those of one whole
``VAE.decode`` (tests/e2e/test_streaming_decode.py checks it against ``VAE.decode``) while its working memory is
one pair of frames however long the video is.

Everything here that touches ComfyUI internals (``first_stage_model``, ``conv2``, ``decoder``,
``count_cache_layers``, the VAE's device/dtype/patcher/``process_output``) is in this file: a ComfyUI change shows
up as one failing parity test. This module imports only torch at import time (the test loads it on its own).
"""
from __future__ import annotations

import torch


class WanStreamDecoder:
    """Decode Wan 2.1 latents [B, 16, n, H, W] (VAE space, a LATENT's ``samples``) chunk after chunk.

    ``push(chunk)`` returns the images that chunk completes, [B, frames, 8H, 8W, 3] in 0..1 (the first chunk gives
    1 + 4 * (its frames - 1) video frames when it has an odd count, later ones 4 per latent frame, a held-back frame
    coming with the next chunk), or None; ``finish()`` returns the frames of a frame still held back (or None).
    Concatenated, they are ``VAE.decode`` of the whole latent video."""

    def __init__(self, vae):
        from comfy.ldm.wan import vae as wan_vae
        model = getattr(vae, "first_stage_model", None)
        if not isinstance(model, wan_vae.WanVAE):
            raise ValueError(f"streaming decode needs a Wan 2.1 VAE (wan_2.1_vae.safetensors in models/vae); this VAE "
                             f"is a {type(model).__name__}. Decode with the VAE Decode node instead.")
        self.vae, self.model = vae, model
        self.feat_map = [None] * wan_vae.count_cache_layers(model.decoder)
        self.held = None                 # conv2 output of a latent frame waiting for its pair
        self.frames_in = 0               # latent frames received
        self.frames_out = 0              # video frames returned
        self.loaded = False              # the VAE loaded for this decoder's first push

    def load(self, shape) -> None:
        """Have ComfyUI load the VAE for latents of ``shape`` (done by the first push; again after other prompts ran)."""
        self.loaded = True
        from comfy import model_management
        vae = self.vae
        need = vae.memory_used_decode((shape[0], shape[1], 2) + tuple(shape[3:]), vae.vae_dtype)
        model_management.load_models_gpu([vae.patcher], memory_required=need,
                                         force_full_load=getattr(vae, "disable_offload", False))

    def _step(self, x) -> torch.Tensor:
        return torch.cat(self.model.decoder(x, feat_cache=self.feat_map, feat_idx=[0]), 2)

    def _images(self, parts: list):
        if not parts:
            return None
        vae = self.vae
        out = torch.cat(parts, 2).to(device=vae.output_device, dtype=vae.vae_output_dtype())
        vae.process_output(out)
        images = out.movedim(1, -1)
        self.frames_out += images.shape[1]
        return images

    @torch.no_grad()
    def push(self, latent: torch.Tensor):
        if latent.dim() != 5 or latent.shape[1] != self.model.z_dim:
            raise ValueError(f"expected Wan 2.1 latents [B, {self.model.z_dim}, frames, H, W], got "
                             f"{tuple(latent.shape)}")
        if latent.shape[2] == 0:
            return None
        if not self.loaded:                         # load once: nothing else is loaded between chunks
            self.load(latent.shape)
        x = self.model.conv2(latent.to(device=self.vae.device, dtype=self.vae.vae_dtype))
        first = self.frames_in == 0
        self.frames_in += latent.shape[2]
        if self.held is not None:
            x, self.held = torch.cat([self.held, x], 2), None
        parts = []
        if first:                                   # the walk's first step: frame 0 alone
            parts.append(self._step(x[:, :, :1]))
            x = x[:, :, 1:]
        while x.shape[2] >= 2:                      # then pairs
            parts.append(self._step(x[:, :, :2]))
            x = x[:, :, 2:]
        if x.shape[2]:
            self.held = x                           # its pair may be in the next chunk
        return self._images(parts)

    @torch.no_grad()
    def finish(self):
        """The frames of a last latent frame without a pair (an even frame count), as the whole decode ends."""
        if self.held is None:
            return None
        x, self.held = self.held, None
        return self._images([self._step(x)])

    def snapshot(self) -> dict:
        """The walk so far (the feature cache, a frame held back, the counts), copied to the CPU: a decoder that
        ``restore``s it goes on as this one would have (a later prompt continuing the video decodes without a seam)."""
        def cpu(t):
            return t.detach().to("cpu", copy=True) if isinstance(t, torch.Tensor) else t
        return {"vae": self._signature(), "feat_map": [cpu(t) for t in self.feat_map], "held": cpu(self.held),
                "frames_in": self.frames_in, "frames_out": self.frames_out}

    def restore(self, snap: dict) -> None:
        """Continue the walk of ``snapshot()`` (made with the same VAE; another VAE raises ValueError)."""
        if snap.get("vae") != self._signature() or len(snap.get("feat_map", ())) != len(self.feat_map):
            raise ValueError("the state's decode was made with another VAE: connect the VAE of the first run, or "
                             "decode this run on its own with VAE Decode")
        dev, dtype = self.vae.device, self.vae.vae_dtype
        move = lambda t: t.to(device=dev, dtype=dtype) if isinstance(t, torch.Tensor) else t
        self.feat_map = [move(t) for t in snap["feat_map"]]
        self.held = move(snap["held"])
        self.frames_in, self.frames_out = int(snap["frames_in"]), int(snap["frames_out"])

    def _signature(self) -> tuple:
        """What identifies this VAE's weights for a continued walk: its class, sizes and a few weight values."""
        first = next(self.model.decoder.parameters())
        return (type(self.model).__name__, int(self.model.z_dim), tuple(first.shape),
                float(first.detach().flatten()[:8].double().sum()))

    def release(self) -> None:
        self.feat_map = [None] * len(self.feat_map)
        self.held = None
