"""The one streaming decoder interface (vae/frames.py) and its four adapters, without ComfyUI: the pack's Wan 2.1
and tiny decoders (``DecoderFrames``), ComfyUI's tiny video decoder and ComfyUI's Wan 2.1 VAE (stand-ins of their
objects: tests/comfy_vaes.py). Each gives ComfyUI IMAGE frames [B, frames, H, W, 3] in 0..1 and, pushed in chunks
of any size, the frames of one decode of the whole latent; every streaming and live node takes a tiny decoder;
Krea's re-encode refuses one. The adapters against ComfyUI's real classes: tests/e2e/test_streaming_decode.py."""
from __future__ import annotations

import pytest
import torch

from comfy_vaes import StandInVAE, StandInTAEHV, tiny_vae, wan_vae
from test_play_mode import env  # noqa: F401 (the play sessions' registry, events and output folder)
from wan_accel.nodes.comfy import streaming_decode
from wan_accel.vae import taehv, wan21
from wan_accel.vae.frames import DecoderFrames, FrameStream
from wan_accel.vae.weights import init_random

F32 = 1e-5


def _latents(frames=5, h=3, w=4, seed=0, batch=1):
    return torch.randn(batch, 16, frames, h, w, generator=torch.Generator().manual_seed(seed))


def _pack(kind):
    cls, cfg = {"wan": (wan21.WanVAEDecoder, wan21.REDUCED), "tiny": (taehv.TinyVideoDecoder, taehv.REDUCED)}[kind]
    return init_random(cls(cfg), 1).eval().requires_grad_(False)


def _check_layout(images, z):
    b, _, t, h, w = z.shape
    assert images.shape == (b, 1 + 4 * (t - 1), 8 * h, 8 * w, 3) and images.dtype == torch.float32
    assert images.min() >= 0 and images.max() <= 1


def _pushed(stream: FrameStream, z, chunk):
    parts = [stream.push(z[:, :, f:f + chunk]) for f in range(0, z.shape[2], chunk)] + [stream.finish()]
    return torch.cat([p for p in parts if p is not None], 1)


# ------------------------------------------------------------------------------------------------ the adapters
@pytest.mark.parametrize("kind", ["wan", "tiny"])
@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_the_pack_decoders_stream_the_whole_decode(kind, chunk):
    decoder = _pack(kind)
    z = _latents(5, batch=2)
    whole = decoder.to_images(decoder.stream().push_raw(z)).permute(0, 2, 3, 4, 1)
    got = _pushed(streaming_decode.stream_decoder(decoder), z, chunk)
    _check_layout(got, z)
    assert (got - whole).abs().max() <= F32


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_comfyuis_tiny_decoder_streams_its_whole_decode(chunk):
    vae = tiny_vae(latent_scale=0.8)               # its latent format's scaling is applied first, as decode does
    stream = streaming_decode.stream_decoder(vae)
    assert isinstance(stream, streaming_decode.ComfyTinyStream) and stream.kind == "comfy-tiny"
    z = _latents(6, seed=1) * 2
    whole = vae.decode(z)                          # [B, T, H, W, 3], not clamped (process_output: identity)
    assert whole.min() < 0 or whole.max() > 1      # random weights: the clamp matters
    got = _pushed(stream, z, chunk)
    _check_layout(got, z)
    assert (got - whole.clamp(0, 1)).abs().max() <= F32


def test_comfyuis_tiny_decoder_streams_in_its_dtype():
    """A bf16 VAE: the stream is the whole decode within bf16 resolution."""
    vae = tiny_vae()
    vae.vae_dtype = torch.bfloat16
    z = _latents(4, seed=2)
    stream = streaming_decode.stream_decoder(vae)
    assert stream.decoder.dtype == torch.bfloat16
    got = _pushed(stream, z, 1)
    want = StandInTAEHV().decode(z).movedim(1, -1).clamp(0, 1)       # float32, the same seeded weights
    _check_layout(got, z)
    assert (got - want).abs().max() <= 0.05 and (got - want).abs().mean() <= 0.01


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_comfyuis_wan_vae_streams_its_whole_decode(monkeypatch, chunk):
    vae = wan_vae(monkeypatch)
    stream = streaming_decode.stream_decoder(vae)
    assert isinstance(stream, streaming_decode.WanStreamDecoder) and stream.kind == "comfy-wan"
    z = _latents(6, seed=3)
    whole = vae.decode(z)
    got = _pushed(stream, z, chunk)
    _check_layout(got, z)
    assert (got - whole).abs().max() <= F32
    assert sys_loaded(monkeypatch) == [0]           # ComfyUI loads the VAE once, for the first push


def sys_loaded(monkeypatch):
    import sys
    return sys.modules["comfy.model_management"].loaded


def test_every_adapter_is_the_one_interface(monkeypatch):
    streams = [streaming_decode.stream_decoder(v) for v in (_pack("wan"), _pack("tiny"), tiny_vae(),
                                                             wan_vae(monkeypatch))]
    assert [type(s).__name__ for s in streams] == ["DecoderFrames", "DecoderFrames", "ComfyTinyStream",
                                                   "WanStreamDecoder"]
    assert all(isinstance(s, FrameStream) for s in streams)
    assert [s.kind for s in streams] == ["wan", "tiny", "comfy-tiny", "comfy-wan"]


def test_a_vae_that_does_not_stream_is_refused_with_what_does():
    other = StandInVAE(torch.nn.Linear(2, 2), lambda image: image)        # an image VAE, say
    with pytest.raises(ValueError, match="taew2_1 / lighttaew2_1.*Linear"):
        streaming_decode.stream_decoder(other)
    wan22_tiny = tiny_vae(latent_channels=48)
    with pytest.raises(ValueError, match="48-channel latents.*load taew2_1"):
        streaming_decode.stream_decoder(wan22_tiny)


@pytest.mark.parametrize("kind", ["wan", "tiny"])
@pytest.mark.parametrize("at", [1, 3])
def test_a_pack_stream_continues_from_its_snapshot(kind, at):
    decoder = _pack(kind)
    z = _latents(6, seed=4)
    whole = DecoderFrames(decoder).push(z)
    first = DecoderFrames(decoder)
    head = first.push(z[:, :, :at])
    walk = first.snapshot()
    assert walk["held"] is None and all(not isinstance(k, torch.nn.Module) for k in walk["state"])
    first.release()
    second = DecoderFrames(decoder)
    second.restore(walk)
    got = torch.cat([head, _pushed(second, z[:, :, at:], 2)], 1)
    assert (got - whole).abs().max() <= F32 and second.frames_out == whole.shape[1]
    other = DecoderFrames(init_random(type(decoder)(decoder.config), 9))
    with pytest.raises(ValueError, match="another VAE"):
        other.restore(walk)


# ------------------------------------------------------------------------------ the nodes take a tiny decoder
@pytest.fixture(scope="module")
def t2v():
    from wan_accel.nodes.model_nodes import CausalWanModelLoader
    (h,) = CausalWanModelLoader().load("(built-in tiny model)", "fp32", "float32", "sdpa")
    return h


def test_sampler_decode_streams_with_a_tiny_decoder(t2v):
    from wan_accel.nodes.stream_nodes import CausalWanSamplerDecode
    vae = tiny_vae()
    images, latent, _ = CausalWanSamplerDecode().sample(vae, t2v, 32, 32, 33, 3, "self_forcing", 3, -1, 0,
                                                        live_preview=False)
    want = vae.decode(latent["samples"]).clamp(0, 1).reshape(-1, 32, 32, 3)
    assert images.shape == (33, 32, 32, 3) and (images - want).abs().max() <= F32


def test_a_continued_video_with_a_tiny_decoder_has_no_seam(t2v):
    from wan_accel.nodes.stream_nodes import CausalWanSamplerDecode
    vae = tiny_vae()
    rest = (1, "self_forcing", 3, -1, 0)
    whole, _, _ = CausalWanSamplerDecode().sample(vae, t2v, 32, 32, 45, *rest, live_preview=False)
    first, _, state = CausalWanSamplerDecode().sample(vae, t2v, 32, 32, 21, *rest, live_preview=False,
                                                      keep_state=True)
    assert state.extra["decoder"]["held"] is None
    more, _, _ = CausalWanSamplerDecode().sample(vae, t2v, 32, 32, 45, *rest, live_preview=False,
                                                 continue_from=state)
    assert (torch.cat([first, more]) - whole).abs().max() <= F32


def test_matrix_game2_play_streams_and_saves_with_a_tiny_decoder(env):
    from PIL import Image

    from wan_accel.nodes import play_nodes
    from wan_accel.nodes.model_nodes import TINY_MG2_NAME, CausalWanModelLoader
    (handle,) = CausalWanModelLoader().load(TINY_MG2_NAME, "fp32", "float32", "sdpa")
    start = {"samples": torch.randn(1, 16, 1, 4, 4, generator=torch.Generator().manual_seed(4))}
    sid = play_nodes.MatrixGame2PlaySession().start(handle, tiny_vae(), start, seed=11)["result"][0]
    step = play_nodes.MatrixGame2PlayStep()
    step.step(sid, "w")
    step.step(sid, "d")
    chunks = [e for e in env.events if e["kind"] == "chunk"]
    assert [len(e["frames"]) for e in chunks] == [9, 12] and [e["first_frame"] for e in chunks] == [0, 9]
    saved = play_nodes.MatrixGame2PlaySave().save(sid, "wan_accel/play", "webp")["ui"]["wan_accel_play_saved"][0]
    with Image.open(env.out / saved["subfolder"] / saved["video"]) as im:
        assert im.n_frames == 21 == env.events[-1]["frames"] and im.size == (32, 32)


def test_prompt_play_streams_with_a_tiny_decoder_and_krea_refuses_it(t2v, env):
    from wan_accel.nodes.model_nodes import krea_cache
    from wan_accel.nodes.prompt_nodes import CausalWanPromptPlaySession, CausalWanPromptPlayStep
    vae = tiny_vae()
    kw = dict(width=32, height=32, seed=5, frames_per_block=3, kv_window=-1, sink=0)
    sid = CausalWanPromptPlaySession().start(t2v, vae, "a cat", **kw)["result"][0]
    step = CausalWanPromptPlayStep()
    step.step(sid, "")
    step.step(sid, "a dog")
    chunks = [e for e in env.events if e["kind"] == "chunk"]
    assert [len(e["frames"]) for e in chunks] == [9, 12]
    with pytest.raises(ValueError, match="recache krea re-encodes .* tiny decoder .*wan_2.1_vae"):
        CausalWanPromptPlaySession().start(t2v, vae, "a cat", **dict(kw, recache="krea"))
    with pytest.raises(ValueError, match="tiny decoder"):
        krea_cache("krea", 3, 6, vae)
