"""The Wan 2.1 VAE decoder, streaming: raw latents [B, 16, n, h, w] -> pixel frames [B, 3, frames, 8h, 8w] in -1..1.

Architecture (the Wan 2.1 3D causal VAE, decoder half): a 1x1x1 ``conv2`` on the latent, then ``decoder``: a
causal 3x3x3 ``conv1`` to 4 x base channels, a middle of residual block / attention over space / residual block,
four up stages of 3 residual blocks each (channels base x 4, 4, 2, 1; every stage after the first starts from half
the channels, which its predecessor's up-sampling convolution made), an up-sampling step after each of the first
three stages (nearest 2x in space then a 3x3 convolution that halves the channels; the first two also double the
frames in time), and a head (RMS norm, SiLU, causal 3x3x3 convolution to RGB). Residual blocks are RMS norm, SiLU,
causal 3x3x3 convolution, twice, with a 1x1x1 shortcut where the width changes. RMS norm: x / ||x|| over channels,
times sqrt(channels) and a learned per-channel gain.

Time is causal everywhere: a 3x3x3 convolution sees the frame and the 2 before it (zeros before the video's first
frame). The state of a stream keeps, per convolution, the last 2 frames it was fed, so chunks of any size give the
frames of one whole decode. The temporal up-sampling is the one exception to plain causality: the video's first
frame passes through untouched (1 frame out), and the time convolution runs over the later frames only (zeros
before frame 1), each giving 2 frames; so T latent frames make 1 + 4 * (T - 1) pixel frames.

Key names are those of a Wan 2.1 VAE file (``wan_2.1_vae.safetensors``): ``conv2.*`` and ``decoder.*``; the
file's encoder half (``encoder.*``, ``conv1.*``) is not used. The base width is read from ``decoder.head.0.gamma``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import vae_norm
from .stream import StreamingDecoder
from .weights import DecoderWeightsError, load_file

CACHE_FRAMES = 2                # frames of history a causal 3x3x3 convolution needs


@dataclass(frozen=True)
class WanVAEConfig:
    dim: int = 96                                   # base width
    z_dim: int = 16
    dim_mult: tuple = (1, 2, 4, 4)
    num_res_blocks: int = 2
    temporal_upsample: tuple = (True, True, False)   # per up-sampling step, from the latent side
    out_channels: int = 3


WAN21_VAE = WanVAEConfig()
REDUCED = WanVAEConfig(dim=4)           # the same architecture, narrow: CPU tests and the tiny bench shape
FILE_HINT = ("use the Wan 2.1 VAE (wan_2.1_vae.safetensors: huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged, "
             "split_files/vae)")
UNUSED = ("encoder.", "conv1.")         # the encoder half of a full VAE file
WAN22_MARK = "decoder.upsamples.0.upsamples.0.residual.2.weight"   # the Wan 2.2 VAE's nested up stages
MAX_DIM = 512                           # base widths a file may give (the released one: 96)


class CausalConv3d(nn.Conv3d):
    """A 3D convolution whose time padding is all in front: the frames before a chunk come from the stream's state
    (the last frames this layer was fed), zeros before the video's first frame."""

    def __init__(self, cin: int, cout: int, kernel, padding=(0, 0, 0)):
        super().__init__(cin, cout, kernel, padding=(0, padding[1], padding[2]))
        self.history = 2 * padding[0]

    def forward(self, x: torch.Tensor, state: dict | None = None) -> torch.Tensor:
        if self.history:
            before = None if state is None else state.get(self)
            if before is None:
                before = x.new_zeros(x.shape[:2] + (self.history,) + x.shape[3:])
            x = torch.cat([before, x], 2)
            if state is not None:
                state[self] = x[:, :, -self.history:].clone()
        return super().forward(x)

    def input_buffer(self, x: torch.Tensor, state: dict | None) -> torch.Tensor:
        """This layer's input [B, C, history + T, H, W] for the T frames of ``x``: the history (the stream's, or
        zeros) already in front, the T frames after it left for the caller to write (``run_buffer`` runs it)."""
        buf = torch.empty(x.shape[:2] + (self.history + x.shape[2],) + x.shape[3:], dtype=x.dtype, device=x.device)
        before = None if state is None else state.get(self)
        if before is None:
            buf[:, :, :self.history].zero_()
        else:
            buf[:, :, :self.history].copy_(before)
        return buf

    def run_buffer(self, buf: torch.Tensor, state: dict | None) -> torch.Tensor:
        """The convolution of a filled ``input_buffer``; its last ``history`` frames are the stream's next history."""
        if self.history and state is not None:
            state[self] = buf[:, :, -self.history:].clone()
        return super().forward(buf)


class RMSNorm(nn.Module):
    """x / ||x|| over channels * sqrt(channels) * gamma. ``fused`` (the default; tests turn it off):
    the decoder runs the norm with the SiLU after it in one pass (``kernels/vae_norm.py``: float32 inside, where
    Triton runs) written straight into the next convolution's input buffer; off: the modules one by one."""

    fused = True

    def __init__(self, dim: int, images: bool = False):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones((dim, 1, 1) if images else (dim, 1, 1, 1)))
        self.scale = dim ** 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=1) * self.scale * self.gamma

    def kernel_runs(self, x: torch.Tensor, out: torch.Tensor | None = None) -> bool:
        """True when the fused kernel computes this norm of ``x`` (written into ``out`` where given)."""
        return (self.fused and vae_norm.usable(x, self.gamma) and vae_norm.frames_contiguous(x)
                and (out is None or vae_norm.frames_contiguous(out)))

    def normed(self, x: torch.Tensor, silu: bool = False) -> torch.Tensor:
        """The norm of ``x`` (then SiLU with ``silu``): the fused kernel where it runs, else the torch ops."""
        if self.kernel_runs(x):
            return vae_norm.norm_silu(x, self.gamma, silu)
        return F.silu(self(x)) if silu else self(x)

    def silu_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """silu(norm(x)) written into ``out`` (a view of x's shape): the fused kernel where it runs, else the
        torch ops of ``forward`` and the SiLU, the last two writing ``out`` in place (no copy after them)."""
        if self.kernel_runs(x, out):
            return vae_norm.norm_silu(x, self.gamma, True, out)
        torch.mul(F.normalize(x, dim=1) * self.scale, self.gamma, out=out)
        return F.silu(out, inplace=True)


def _norm_silu_conv(norm: RMSNorm, conv: CausalConv3d, x: torch.Tensor, state: dict | None) -> torch.Tensor:
    """conv(silu(norm(x))) with the stream's history: fused, the norm and SiLU write the frames after the history
    in the convolution's input buffer (no separate SiLU pass, no ``torch.cat`` copy); else (and where autograd
    tracks the inputs) the layers one by one."""
    if not norm.fused or (torch.is_grad_enabled() and (x.requires_grad or norm.gamma.requires_grad)):
        return conv(F.silu(norm(x)), state)
    buf = conv.input_buffer(x, state)
    norm.silu_into(x, buf[:, :, conv.history:])
    return conv.run_buffer(buf, state)


class ResidualBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        # index 5 is where the VAE keeps its (inactive) dropout: the key names count it
        self.residual = nn.Sequential(RMSNorm(cin), nn.SiLU(), CausalConv3d(cin, cout, 3, (1, 1, 1)),
                                      RMSNorm(cout), nn.SiLU(), nn.Identity(), CausalConv3d(cout, cout, 3, (1, 1, 1)))
        self.shortcut = CausalConv3d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, state: dict) -> torch.Tensor:
        r = self.residual
        h = _norm_silu_conv(r[3], r[6], _norm_silu_conv(r[0], r[2], x, state), state)
        return h + self.shortcut(x)


def _frames_as_images(x: torch.Tensor) -> torch.Tensor:
    b, c, t, h, w = x.shape
    return x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)


def _images_as_frames(y: torch.Tensor, b: int) -> torch.Tensor:
    return y.reshape(b, y.shape[0] // b, *y.shape[1:]).permute(0, 2, 1, 3, 4)


class SpatialAttention(nn.Module):
    """One-head self-attention over the positions of each frame (no mixing between frames)."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = RMSNorm(dim, images=True)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor, state: dict | None = None) -> torch.Tensor:
        b, c, _t, h, w = x.shape
        y = _frames_as_images(x)
        n = y.shape[0]
        q, k, v = self.to_qkv(self.norm.normed(y)).reshape(n, 3, 1, c, h * w).transpose(-1, -2).unbind(1)
        o = F.scaled_dot_product_attention(q, k, v)                 # [n, 1, h*w, c]
        o = self.proj(o.transpose(-1, -2).reshape(n, c, h, w))
        return x + _images_as_frames(o, b)


class Upsample(nn.Module):
    """2x in space (nearest, then a 3x3 convolution to half the channels); with ``temporal`` also 2x in time for
    every frame but the video's first (a causal 3x1x1 convolution to twice the channels, split into 2 frames)."""

    def __init__(self, dim: int, temporal: bool):
        super().__init__()
        self.resample = nn.Sequential(nn.Upsample(scale_factor=(2.0, 2.0), mode="nearest-exact"),
                                      nn.Conv2d(dim, dim // 2, 3, padding=1))
        if temporal:
            self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1), (1, 0, 0))

    def _double_frames(self, x: torch.Tensor, state: dict) -> torch.Tensor:
        first = None
        if not state.get((self, "started")):            # the video's first frame: passed through
            state[(self, "started")] = True
            first, x = x[:, :, :1], x[:, :, 1:]
        if x.shape[2] == 0:
            return first
        b, c, t, h, w = x.shape
        y = self.time_conv(x, state).reshape(b, 2, c, t, h, w)
        y = y.permute(0, 2, 3, 1, 4, 5).reshape(b, c, 2 * t, h, w)    # frame i -> frames 2i (group 0), 2i + 1
        return y if first is None else torch.cat([first, y], 2)

    def forward(self, x: torch.Tensor, state: dict) -> torch.Tensor:
        if hasattr(self, "time_conv"):
            x = self._double_frames(x, state)
        return _images_as_frames(self.resample(_frames_as_images(x)), x.shape[0])


class Decoder3d(nn.Module):
    def __init__(self, cfg: WanVAEConfig):
        super().__init__()
        widths = [cfg.dim * m for m in (cfg.dim_mult[-1],) + tuple(reversed(cfg.dim_mult))]
        self.conv1 = CausalConv3d(cfg.z_dim, widths[0], 3, (1, 1, 1))
        self.middle = nn.Sequential(ResidualBlock(widths[0], widths[0]), SpatialAttention(widths[0]),
                                    ResidualBlock(widths[0], widths[0]))
        layers = []
        for i in range(len(widths) - 1):
            cin, cout = widths[i] if i == 0 else widths[i] // 2, widths[i + 1]
            for _ in range(cfg.num_res_blocks + 1):
                layers.append(ResidualBlock(cin, cout))
                cin = cout
            if i < len(widths) - 2:
                layers.append(Upsample(cout, cfg.temporal_upsample[i]))
        self.upsamples = nn.Sequential(*layers)
        self.head = nn.Sequential(RMSNorm(widths[-1]), nn.SiLU(), CausalConv3d(widths[-1], cfg.out_channels, 3,
                                                                              (1, 1, 1)))

    def forward(self, x: torch.Tensor, state: dict) -> torch.Tensor:
        x = self.conv1(x, state)
        for layer in (*self.middle, *self.upsamples):
            x = layer(x, state)
        return _norm_silu_conv(self.head[0], self.head[2], x, state)


class WanVAEDecoder(StreamingDecoder):
    """The Wan 2.1 VAE's decoder half (``conv2`` + ``decoder``), streaming (see the module doc)."""

    kind = "wan"

    def __init__(self, cfg: WanVAEConfig = WAN21_VAE):
        super().__init__(cfg)
        self.conv2 = CausalConv3d(cfg.z_dim, cfg.z_dim, 1)
        self.decoder = Decoder3d(cfg)

    def decode_raw(self, z: torch.Tensor, state: dict) -> torch.Tensor:
        return self.decoder(self.conv2(z), state)

    def to_images(self, raw: torch.Tensor) -> torch.Tensor:
        return ((raw.float() + 1.0) / 2.0).clamp(0.0, 1.0)

    @classmethod
    def from_file(cls, path, header: dict) -> "WanVAEDecoder":
        if WAN22_MARK in header:
            raise DecoderWeightsError(f"{path}: a Wan 2.2 VAE (48 latent channels); the pack's decoder reads the "
                                      f"Wan 2.1 VAE: {FILE_HINT}")
        shape = header.get("decoder.head.0.gamma", ((),))[0]
        cfg = WAN21_VAE                                 # no width in the file: the key check says what is wrong
        if len(shape) == 4:
            if not 1 <= shape[0] <= MAX_DIM:
                raise DecoderWeightsError(f"{path}: decoder.head.0.gamma gives a base width of {shape[0]}; a Wan "
                                          f"2.1 VAE has 96: {FILE_HINT}")
            cfg = WanVAEConfig(dim=shape[0])
        return load_file(lambda: cls(cfg), path, "Wan 2.1 VAE decoder", UNUSED, FILE_HINT, header)
