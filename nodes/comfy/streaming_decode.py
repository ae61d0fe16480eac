"""Streaming decode of Wan 2.1 latents, chunk by chunk, with a graph's VAE: the adapters of ComfyUI's VAEs to the
pack's one streaming decoder interface (``vae.frames.FrameStream``: raw latents in, ComfyUI IMAGE frames
[B, frames, H, W, 3] in 0..1 out), and ``stream_decoder``, which picks the adapter for a VAE.

ComfyUI's ``WanVAE.decode`` (comfy/ldm/wan/vae.py) is causal: after a 1x1x1 ``conv2`` it walks the latent frames,
the first alone, then pairs, through ``decoder(x, feat_cache, feat_idx)`` with one feature cache (the last frames of
every causal convolution). ``WanStreamDecoder`` continues that walk as chunks arrive: it keeps the feature cache
between chunks and holds back a frame whose pair is still to come, so its frames are those of one whole
``VAE.decode`` (tests/e2e/test_streaming_decode.py checks it against ``VAE.decode``) while its working memory is
one pair of frames however long the video is.

ComfyUI's tiny video decoders (``comfy.taesd.taehv.TAEHV`` in a ``comfy.sd.VAE``: the ``taew2_1`` and
``lighttaew2_1`` files ComfyUI's VAE loader reads) decode a whole video at once. ``ComfyTinyStream`` streams them
with the pack's TAEHV-class decoder (``vae/taehv.py``) built from the VAE's own weights by key name, the VAE's latent
scaling (``process_in``) applied first: the frames of ``VAE.decode`` (tests/e2e/test_vae_decoders_comfy.py checks
the pack's decoder against ComfyUI's TAEHV on the same weights; tests/e2e/test_streaming_decode.py the stream
against ``VAE.decode``), clamped to 0..1 as an IMAGE is.

``KreaStreamDecoder`` walks the same decoder as Krea Realtime's session decoder does, for Krea's first-frame
re-encode (``sampling.krea.StreamReencode``): one latent frame at a time, and in a temporal upsampling fed one frame
at a time the cache Krea's decoder keeps, which from latent frame 3 on gives other pixels than Wan 2.1's decode
(tests/e2e/test_krea_reencode_vae.py checks it against the official decoder's stream). It needs the full Wan 2.1
VAE (its encoder re-encodes the frame): a tiny decoder is refused there (``refuse_tiny_for_reencode``).

Everything here that touches ComfyUI internals (``first_stage_model``, ``conv2``, ``decoder`` and its layers,
``count_cache_layers``, ``process_in``, the VAE's device/dtype/patcher/``process_output``) is in this file: a
ComfyUI change shows up as one failing parity test. ComfyUI is imported only inside the Wan adapters (a tiny
decoder streams without it).
"""
from __future__ import annotations

import torch

from ...vae.frames import DecoderFrames, FrameStream, check_latents
from .comfy_core import core, optional

TINY_MARK = "decoder.22.bias"           # ComfyUI's VAE loader reads a state dict with it as a TAEHV-class decoder
WAN21_CHANNELS = 16
ACCEPTED = ("the Wan 2.1 VAE (wan_2.1_vae.safetensors) or a Wan 2.1 tiny decoder (taew2_1 / lighttaew2_1) from "
            "Load VAE")


def _tiny_model(vae):
    """The TAEHV-class module of a ComfyUI tiny video decoder (None for any other VAE), told as ComfyUI's own loader
    tells it: by its state dict (``decoder.22.bias``, the last convolution), whatever the module's class."""
    model = getattr(vae, "first_stage_model", None)
    if isinstance(model, torch.nn.Module) and isinstance(getattr(model, "decoder", None), torch.nn.Sequential) \
            and TINY_MARK in model.state_dict():
        return model
    return None


def refuse_tiny_for_reencode(vae) -> None:
    """ValueError when ``vae`` is a tiny video decoder, ComfyUI's (taew2_1, lighttaew2_1, ...) or the pack's own:
    Krea's first-frame re-encode needs the full VAE's encoder."""
    from ...vae.taehv import TinyVideoDecoder
    if _tiny_model(vae) is not None or isinstance(vae, TinyVideoDecoder):
        raise ValueError("recache krea re-encodes a decoded frame with the VAE's encoder, and this VAE is a tiny decoder "
                         "(taew2_1 / lighttaew2_1), whose frames differ from the Wan 2.1 VAE's: connect the Wan 2.1 "
                         "VAE (wan_2.1_vae.safetensors) here, or use recache switch / none")


def stream_decoder(vae) -> FrameStream:
    """The streaming decoder of a graph's VAE: ComfyUI's tiny video decoder -> ``ComfyTinyStream``; a pack decoder
    (``vae.stream.StreamingDecoder``) -> ``DecoderFrames``; anything else -> ``WanStreamDecoder`` (ComfyUI's Wan 2.1
    VAE; another VAE is refused there with a message naming what streams)."""
    from ...vae.stream import StreamingDecoder
    if isinstance(vae, StreamingDecoder):
        return DecoderFrames(vae)
    if _tiny_model(vae) is not None:
        return ComfyTinyStream(vae)
    return WanStreamDecoder(vae)


class ComfyTinyStream(DecoderFrames):
    """A ComfyUI tiny video decoder (``comfy.sd.VAE`` holding a ``TAEHV`` of Wan 2.1 latents) streamed chunk after
    chunk by the pack's tiny decoder, built once from the VAE's decoder weights (by key name; a few MB) on the VAE's
    device in its dtype; the VAE's ``process_in`` is applied to each chunk first, as its ``decode`` does. Every push
    gives all the frames of its latent frames (nothing is held back); the images go to the VAE's output device."""

    def __init__(self, vae):
        from ...vae.taehv import TinyVideoDecoder
        from ...vae.weights import DecoderWeightsError
        model = _tiny_model(vae)
        if model is None:
            raise ValueError(f"not a tiny video decoder; streaming decode takes {ACCEPTED}")
        state = {k: v for k, v in model.state_dict().items() if k.startswith("decoder.")}
        channels, rgb = state["decoder.1.weight"].shape[1], state[TINY_MARK].shape[0]
        if channels != WAN21_CHANNELS or rgb != 3:
            raise ValueError(f"this tiny decoder decodes {channels}-channel latents"
                             f"{' in 2x2 patches' if rgb != 3 else ''} (Wan 2.2's taew2_2, HunyuanVideo 1.5's ...); "
                             f"the causal Wan models make Wan 2.1 latents ({WAN21_CHANNELS} channels): load taew2_1 "
                             f"or lighttaew2_1 with Load VAE")
        try:
            decoder = TinyVideoDecoder.from_state(state, f"the tiny VAE ({type(model).__name__})")
        except DecoderWeightsError as exc:
            raise ValueError(f"{exc}; streaming decode takes {ACCEPTED}") from None
        device = torch.device(getattr(vae, "device", None) or "cpu")
        dtype = getattr(vae, "vae_dtype", None) or torch.float32
        super().__init__(decoder.prepare(device, dtype), output_device=getattr(vae, "output_device", None),
                         latent_in=getattr(model, "process_in", None))
        self.kind = "comfy-tiny"


class WanStreamDecoder(FrameStream):
    """Decode Wan 2.1 latents [B, 16, n, H, W] (VAE space, a LATENT's ``samples``) chunk after chunk with ComfyUI's
    Wan 2.1 VAE.

    ``push(chunk)`` returns the images that chunk completes, [B, frames, 8H, 8W, 3] in 0..1 (the first chunk gives
    1 + 4 * (its frames - 1) video frames when it has an odd count, later ones 4 per latent frame, a held-back frame
    coming with the next chunk), or None; ``finish()`` returns the frames of a frame still held back (or None).
    Concatenated, they are ``VAE.decode`` of the whole latent video."""

    kind = "comfy-wan"

    def __init__(self, vae):
        super().__init__()
        model = getattr(vae, "first_stage_model", None)
        wan_vae = optional("comfy.ldm.wan.vae")
        if wan_vae is None or not isinstance(model, wan_vae.WanVAE):
            raise ValueError(f"streaming decode takes {ACCEPTED}; this VAE is a {type(model).__name__}. Decode "
                             f"with the VAE Decode node instead.")
        self.vae, self.model = vae, model
        self.feat_map = [None] * wan_vae.count_cache_layers(model.decoder)
        self.held = None                 # conv2 output of a latent frame waiting for its pair
        self.loaded = False              # the VAE loaded for this decoder's first push

    def load(self, shape) -> None:
        """Have ComfyUI load the VAE for latents of ``shape`` (done by the first push; again after other prompts ran)."""
        self.loaded = True
        model_management = core("comfy.model_management")
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
        check_latents(latent, self.model.z_dim)
        if latent.shape[2] == 0:
            return None
        if not self.loaded:                         # load once: nothing else is loaded between chunks
            self.load(latent.shape)
        x = self.model.conv2(latent.to(device=self.vae.device, dtype=self.vae.vae_dtype))
        first = self.frames_in == 0
        self.frames_in += latent.shape[2]
        return self._images(self._walk(x, first))

    def _walk(self, x: torch.Tensor, first: bool) -> list:
        """The decoder outputs of a chunk's ``conv2`` output ``x`` (``first``: the video's first chunk)."""
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
        return parts

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


class KreaStreamDecoder(WanStreamDecoder):
    """Decode Wan 2.1 latents [B, 16, n, H, W] (VAE space) as Krea Realtime's session decoder does, chunk after
    chunk: ``push`` returns every pixel frame of the chunk (1 for the video's first latent frame, 4 for each other
    one; nothing is held back), in ComfyUI's image layout, clamped as ``VAE.decode``'s images are.

    Krea's server decodes each block as it is made, one latent frame per step of the decoder, its feature cache
    carried from block to block. Every causal convolution keeps the last two frames it has seen, as in Wan 2.1's
    walk. A temporal upsampling (``Resample`` 'upsample3d') differs: its first step keeps a zero cache and leaves the
    frame as it is; after that, given one frame, it keeps that frame twice (zero where the frame it kept last is
    exactly zero) where Wan 2.1 keeps the frame before it and that frame. Only the first temporal upsampling of the
    decoder is fed one frame a step, so from latent frame 3 on its pixels are not those of ``VAE.decode``: a defect
    of Krea's decoder, followed here only for the frame Krea re-encodes (the nodes show ``WanStreamDecoder``'s
    frames). ``snapshot``/``restore`` are not offered: a Krea re-encode stream starts with its run."""

    NOT_CONTINUED = "a Krea re-encode stream is not continued across runs; it decodes its run from its first frame"

    def __init__(self, vae):
        super().__init__(vae)
        self.layers = core("comfy.ldm.wan.vae")
        self.cached: dict = {}            # layer -> the frames it keeps for the next step

    def _conv(self, conv, x):
        """A causal convolution that keeps its last two input frames (the one it kept last and a single new one)."""
        old = self.cached.get(conv)
        keep = x[:, :, -2:]
        if keep.shape[2] < 2 and old is not None:
            keep = torch.cat([old[:, :, -1:], keep], 2)
        out = conv(x, old)
        self.cached[conv] = keep
        return out

    def _time_upsample(self, layer, x):
        """The temporal doubling of an 'upsample3d' layer with Krea's cache (see the class doc)."""
        old = self.cached.get(layer)
        if old is None:
            self.cached[layer] = x.new_zeros(x.shape[0], x.shape[1], 2, *x.shape[3:])
            return x
        keep = x[:, :, -2:]
        if keep.shape[2] < 2:
            keep = torch.cat([torch.where(old[:, :, -1:] == 0, 0, keep), keep], 2)
        y = layer.time_conv(x, old)
        self.cached[layer] = keep
        b, c, t, h, w = x.shape
        y = y.reshape(b, 2, c, t, h, w)
        return torch.stack((y[:, 0], y[:, 1]), 3).reshape(b, c, 2 * t, h, w)

    def _layers(self, layers, x):
        wan = self.layers
        for layer in layers:
            if isinstance(layer, wan.CausalConv3d):
                x = self._conv(layer, x)
            elif isinstance(layer, wan.ResidualBlock):
                x = self._layers(layer.residual, x) + layer.shortcut(x)
            elif isinstance(layer, wan.Resample):
                if layer.mode == "upsample3d":
                    x = self._time_upsample(layer, x)
                b, c, t, h, w = x.shape
                y = layer.resample(x.transpose(1, 2).reshape(b * t, c, h, w))
                x = y.reshape(b, t, *y.shape[1:]).transpose(1, 2)
            else:                                   # norms, activations, attention within a frame
                x = layer(x)
        return x

    def _walk(self, x: torch.Tensor, first: bool) -> list:
        d = self.model.decoder
        return [self._layers([d.conv1, *d.middle, *d.upsamples, *d.head], x[:, :, i:i + 1])
                for i in range(x.shape[2])]

    snapshot, restore = FrameStream.snapshot, FrameStream.restore       # refused, with NOT_CONTINUED above

    def release(self) -> None:
        super().release()
        self.cached = {}
