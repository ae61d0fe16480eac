"""A tiny video decoder of the TAEHV class, ``taew2_1`` layout, streaming: raw Wan 2.1 latents [B, 16, n, h, w] ->
pixel frames [B, 3, frames, 8h, 8w] in about 0..1.

Architecture (the ``decoder.N`` sequence of a ``taew2_1`` file): a soft clamp of the latent (3 tanh(x / 3)), a
3x3 convolution to 256 channels and ReLU, then three stages of [3 memory blocks, nearest 2x up-sampling in space,
a time-growth step, a 3x3 convolution without bias to the next width] with widths 256 -> 128 -> 64 -> 64, then ReLU
and a 3x3 convolution to RGB. Everything is per frame but two kinds of layers:

* a memory block sees its input frame and the frame before it at the same layer (zeros before the video's
  first frame): ReLU(conv3x3(ReLU(conv3x3(ReLU(conv3x3([x, previous])))) + x);
* a time-growth step (stride 1 in the first stage, 2 in the last two) makes ``stride`` frames of each frame with a
  1x1 convolution to stride x channels, channel group j becoming frame j.

A stream's state keeps each memory block's last input frame, so chunks of any size give the frames of one whole
decode. Each latent frame makes 4 frames; the first 3 frames of a video are dropped (the up-sampling's frames
before frame 0), so T latent frames give 4 T - 3 = 1 + 4 (T - 1) pixel frames, as the Wan 2.1 VAE.

Key names are those of ``taew2_1.safetensors`` (``decoder.1.weight`` ... ``decoder.22.bias``); its ``encoder.*``
half is not used. The widths are read from the file.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .stream import StreamingDecoder
from .weights import DecoderWeightsError, header_of, load_file, load_state


@dataclass(frozen=True)
class TinyDecoderConfig:
    latent_channels: int = 16
    widths: tuple = (256, 128, 64, 64)
    time_upscale: tuple = (False, True, True)
    space_upscale: tuple = (True, True, True)
    image_channels: int = 3


TAEW2_1 = TinyDecoderConfig()
REDUCED = TinyDecoderConfig(widths=(32, 16, 8, 8))      # the same architecture, narrow: CPU tests, tiny bench shape
FILE_HINT = "use taew2_1.safetensors (github.com/madebyollin/taehv), the file ComfyUI's VAE loader reads as taew2_1"
UNUSED = ("encoder.",)
WHAT = "TAEHV-class tiny decoder (taew2_1)"
# where each stage's first memory block and the last convolution sit in the decoder sequence (their shapes give
# the widths of a file)
STAGE_BLOCKS, LAST_CONV = (3, 9, 15), 20
MAX_WIDTH = 2048


def _conv(cin: int, cout: int, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, padding=1, bias=bias)


class SoftClamp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / 3) * 3


class MemoryBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv = nn.Sequential(_conv(2 * cin, cout), nn.ReLU(inplace=True), _conv(cout, cout),
                                  nn.ReLU(inplace=True), _conv(cout, cout))
        self.skip = nn.Conv2d(cin, cout, 1, bias=False) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(torch.cat([x, previous], 1)) + self.skip(x))


class TimeGrowth(nn.Module):
    def __init__(self, channels: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(channels, channels * stride, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N frames, C, H, W] -> [N * stride frames, C, H, W] (frame i -> frames i * stride + j)."""
        y = self.conv(x)
        return y.reshape(y.shape[0] * self.stride, y.shape[1] // self.stride, *y.shape[2:])


class TinyVideoDecoder(StreamingDecoder):
    """The TAEHV-class decoder of Wan 2.1 latents (``taew2_1`` layout), streaming (see the module doc)."""

    kind = "tiny"

    def __init__(self, cfg: TinyDecoderConfig = TAEW2_1):
        super().__init__(cfg)
        w = cfg.widths
        layers: list = [SoftClamp(), _conv(cfg.latent_channels, w[0]), nn.ReLU(inplace=True)]
        for i in range(3):
            layers += [MemoryBlock(w[i], w[i]) for _ in range(3)]
            layers += [nn.Upsample(scale_factor=2 if cfg.space_upscale[i] else 1),
                       TimeGrowth(w[i], 2 if cfg.time_upscale[i] else 1), _conv(w[i], w[i + 1], bias=False)]
        layers += [nn.ReLU(inplace=True), _conv(w[3], cfg.image_channels)]
        self.decoder = nn.Sequential(*layers)
        self.trim = 2 ** sum(bool(t) for t in cfg.time_upscale) - 1    # frames made before the video's first

    def decode_raw(self, z: torch.Tensor, state: dict) -> torch.Tensor:
        b, c, t, h, w = z.shape
        x = z.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
        for layer in self.decoder:
            if isinstance(layer, MemoryBlock):
                frames = x.reshape(b, t, *x.shape[1:])
                before = state.get(layer)
                if before is None:
                    before = torch.zeros_like(frames[:, :1])
                previous = torch.cat([before, frames[:, :-1]], 1).reshape(x.shape)
                state[layer] = frames[:, -1:].clone()
                x = layer(x, previous)
            else:
                x = layer(x)
                if isinstance(layer, TimeGrowth):
                    t *= layer.stride
        made = state.get("frames_made", 0)
        state["frames_made"] = made + t
        cut = min(t, max(0, self.trim - made))
        return x.reshape(b, t, *x.shape[1:])[:, cut:].permute(0, 2, 1, 3, 4)

    def to_images(self, raw: torch.Tensor) -> torch.Tensor:
        return raw.float().clamp(0.0, 1.0)

    @classmethod
    def from_file(cls, path, header: dict) -> "TinyVideoDecoder":
        cfg = cls.config_of(header, path)
        return load_file(lambda: cls(cfg), path, WHAT, UNUSED, FILE_HINT, header)

    @classmethod
    def from_state(cls, state: dict, source: str) -> "TinyVideoDecoder":
        """The decoder with the weights of another implementation's state dict of the same layout (ComfyUI's
        ``TAEHV`` of a ``taew2_1`` / ``lighttaew2_1`` file), checked by key name as a file is."""
        return load_state(cls(cls.config_of(header_of(state), source)), state, source, WHAT, UNUSED, FILE_HINT)

    @staticmethod
    def config_of(header: dict, path) -> TinyDecoderConfig:
        """The widths of a ``taew2_1``-layout header (the released ones where the file does not give them: the key
        check then says what is wrong); DecoderWeightsError for another latent space or out-of-range widths."""
        first = header.get("decoder.1.weight", ((),))[0]
        if len(first) == 4 and first[1] != TAEW2_1.latent_channels:
            raise DecoderWeightsError(f"{path}: a tiny decoder of {first[1]}-channel latents; Wan 2.1 latents "
                                      f"have {TAEW2_1.latent_channels}: {FILE_HINT}")
        shapes = [header.get(f"decoder.{i}.conv.0.weight", ((),))[0] for i in STAGE_BLOCKS]
        last = header.get(f"decoder.{LAST_CONV}.weight", ((),))[0]
        if all(len(s) == 4 for s in shapes) and len(last) == 4:
            widths = tuple(s[0] for s in shapes) + (last[0],)
            if not all(1 <= v <= MAX_WIDTH for v in widths):
                raise DecoderWeightsError(f"{path}: widths {widths} out of range; taew2_1 has {TAEW2_1.widths}: "
                                          f"{FILE_HINT}")
            return TinyDecoderConfig(widths=widths)
        return TAEW2_1
