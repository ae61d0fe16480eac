"""Stand-ins for ComfyUI's VAE objects, for the streaming decoders' tests without ComfyUI (the real classes are
checked in tests/e2e/test_streaming_decode.py and tests/e2e/test_vae_decoders_comfy.py).

* ``tiny_vae()``: a ``comfy.sd.VAE`` holding ComfyUI's ``comfy.taesd.taehv.TAEHV`` as ComfyUI 0.3x builds it for a
  16-channel ``taew2_1`` / ``lighttaew2_1`` file: the ``decoder.N`` layer sequence (the pack's layer classes, whose
  key names are the file's), ``process_in`` from its latent format, and ``decode`` as ComfyUI's parallel path runs
  it (every frame through a layer at once, each memory block given the frame before it, the first 3 frames
  trimmed); the VAE's ``process_output`` is the identity, so ``VAE.decode`` is not clamped.
* ``wan_vae(monkeypatch)``: a ``comfy.sd.VAE`` holding a Wan 2.1 VAE that walks as ComfyUI's ``WanVAE.decode``
  does (``conv2``, then ``decoder(x, feat_cache, feat_idx)`` over the first frame alone and then pairs, returning
  its frames in a list); ``comfy.ldm.wan.vae`` (``WanVAE``, ``count_cache_layers``) and
  ``comfy.model_management`` are put in ``sys.modules`` for the test.
"""
from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

from wan_accel.vae import taehv, wan21
from wan_accel.vae.weights import init_random


class StandInTAEHV(nn.Module):
    def __init__(self, widths=(16, 8, 8, 4), latent_scale=None, seed: int = 3, latent_channels: int = 16):
        super().__init__()
        cfg = taehv.TinyDecoderConfig(widths=widths, latent_channels=latent_channels)
        self.decoder = init_random(taehv.TinyVideoDecoder(cfg), seed).decoder
        self.encoder = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1))      # ComfyUI's has one; decode never uses it
        self.frames_to_trim = 3
        self.latent_channels = latent_channels
        self.process_in = (lambda x: x) if latent_scale is None else (lambda x: x * latent_scale)

    @torch.no_grad()
    def decode(self, x):
        x = self.process_in(x).movedim(2, 1)                            # [B, T, C, H, W]
        b = x.shape[0]
        x = x.reshape(-1, *x.shape[2:])
        for layer in self.decoder:
            if isinstance(layer, taehv.MemoryBlock):
                frames = x.reshape(b, -1, *x.shape[1:])
                past = F.pad(frames, (0, 0, 0, 0, 0, 0, 1, 0))[:, :frames.shape[1]].reshape(x.shape)
                x = layer(x, past)
            else:
                x = layer(x)
        x = x.reshape(b, -1, *x.shape[1:])
        return x[:, self.frames_to_trim:].movedim(2, 1)                 # [B, 3, T', H, W]


class _Walk(nn.Module):
    """ComfyUI's decoder call: ``decoder(x, feat_cache=..., feat_idx=[0])`` -> a list of frame tensors; the cache
    is one list entry here (``count_cache_layers`` says 1)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, feat_cache=None, feat_idx=None):
        if feat_cache[0] is None:
            feat_cache[0] = {}
        return [self.inner(x, feat_cache[0])]


class StandInWanVAE(nn.Module):
    def __init__(self, seed: int = 2):
        super().__init__()
        ref = init_random(wan21.WanVAEDecoder(wan21.REDUCED), seed)
        self.z_dim = 16
        self.conv2, self.decoder = ref.conv2, _Walk(ref.decoder)

    @torch.no_grad()
    def decode(self, z):
        x, cache = self.conv2(z), [None]
        steps = [x[:, :, :1]] + [x[:, :, i:i + 2] for i in range(1, x.shape[2], 2)]
        return torch.cat([torch.cat(self.decoder(s, feat_cache=cache, feat_idx=[0]), 2) for s in steps], 2)


class StandInVAE:
    """``comfy.sd.VAE``'s face as the adapters read it: ``first_stage_model``, device, dtypes, ``process_output``,
    ``patcher``, ``memory_used_decode``; ``decode`` gives [B, T, H, W, 3] as ComfyUI's does for a video."""

    def __init__(self, model, process_output):
        self.first_stage_model, self.process_output = model, process_output
        self.device = self.output_device = torch.device("cpu")
        self.vae_dtype = torch.float32
        self.latent_channels = 16
        self.patcher, self.disable_offload = None, False
        self.memory_used_decode = lambda shape, dtype: 0

    def vae_output_dtype(self):
        return torch.float32

    @torch.no_grad()
    def decode(self, z):
        return self.process_output(self.first_stage_model.decode(z.to(self.vae_dtype))).movedim(1, -1)


def tiny_vae(**kw) -> StandInVAE:
    return StandInVAE(StandInTAEHV(**kw), lambda image: image)


def _wan_output(image):
    return image.add_(1.0).div_(2.0).clamp_(0.0, 1.0)                  # in place, as ComfyUI's


def wan_vae(monkeypatch, seed: int = 2) -> StandInVAE:
    comfy = types.ModuleType("comfy")
    ldm, wan, vae_mod = (types.ModuleType(n) for n in ("comfy.ldm", "comfy.ldm.wan", "comfy.ldm.wan.vae"))
    mm = types.ModuleType("comfy.model_management")
    vae_mod.WanVAE, vae_mod.count_cache_layers = StandInWanVAE, lambda decoder: 1
    mm.loaded = []
    mm.load_models_gpu = lambda models, memory_required=0, force_full_load=False: mm.loaded.append(memory_required)
    comfy.ldm, ldm.wan, wan.vae, comfy.model_management = ldm, wan, vae_mod, mm
    for name, mod in (("comfy", comfy), ("comfy.ldm", ldm), ("comfy.ldm.wan", wan), ("comfy.ldm.wan.vae", vae_mod),
                      ("comfy.model_management", mm)):
        monkeypatch.setitem(sys.modules, name, mod)
    return StandInVAE(StandInWanVAE(seed), _wan_output)
