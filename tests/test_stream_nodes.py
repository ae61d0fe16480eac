"""CausalWan Sampler + Decode without ComfyUI: each chunk's final latents reach the decoder once, in order, while
sampling (the LATENT output is exactly what was decoded), the walk ends with the last chunk, and the IMAGE output is
the decoder's frames in order. The decode adapter itself is checked against ComfyUI's VAE.decode in tests/e2e."""
import pytest
import torch

from wan_accel.nodes.comfy import streaming_decode
from wan_accel.nodes.model_nodes import CausalWanModelLoader
from wan_accel.nodes.stream_nodes import CausalWanSamplerDecode, _DecodeInLockstep
from fake_decoder import FakeDecoder


@pytest.fixture()
def fake(monkeypatch):
    made = []
    monkeypatch.setattr(streaming_decode, "WanStreamDecoder", lambda vae: made.append(FakeDecoder(vae)) or made[-1])
    return made


def test_each_chunk_is_decoded_once_in_lockstep(fake):
    (handle,) = CausalWanModelLoader().load("(built-in tiny model)", "fp32", "float32", "sdpa")
    node = CausalWanSamplerDecode()
    images, latent, state = node.sample(object(), handle, 32, 32, 33, 3, "self_forcing", 3, -1, 0)
    dec = fake[0]
    assert [p.shape[2] for p in dec.pushed] == [3, 3, 3] and dec.finished == 1 and dec.released >= 1
    assert torch.equal(torch.cat(dec.pushed, 2), latent["samples"])     # what was decoded is the LATENT output
    means = latent["samples"].mean(dim=(1, 3, 4))[0]
    per_frame = torch.tensor([1] + [4] * 8)                             # a walk: first frame 1 image, then 4 each
    assert images.shape == (33, 2, 2, 3) and torch.equal(images[:, 0, 0, 0], means.repeat_interleave(per_frame))
    assert state is None and len(node.last_report["chunk_s"]) == 3 and node.last_report["first_frames_s"] > 0


def test_each_chunk_is_decoded_before_its_refresh_pass(fake, monkeypatch):
    """The node decodes from the sampler's ``on_chunk_latents``: a chunk's frames are made before the model call
    that refreshes its cache (first frames sooner), not after it."""
    from wan_accel.sampling.loop import EagerExecutor
    events = []
    real = EagerExecutor.forward

    def forward(self, kind, *a, **k):
        events.append(kind)
        return real(self, kind, *a, **k)
    monkeypatch.setattr(EagerExecutor, "forward", forward)
    monkeypatch.setattr(FakeDecoder, "push", lambda self, x, _push=FakeDecoder.push: events.append("decode")
                        or _push(self, x))
    (handle,) = CausalWanModelLoader().load("(built-in tiny model)", "fp32", "float32", "sdpa")
    CausalWanSamplerDecode().sample(object(), handle, 32, 32, 21, 3, "self_forcing", 3, -1, 0, sampler="reference")
    assert events == (["denoise"] * 4 + ["decode", "refresh"]) * 2


def test_the_decode_is_not_the_progress_callback():
    """A step callback (progress, preview) decodes nothing; each chunk's latents are decoded once when handed over."""
    dec = FakeDecoder(None)
    run = _DecodeInLockstep(dec, live=False)
    x0 = torch.randn(1, 2, 16, 2, 2)
    for k in range(4):
        run(0, k, 2, 4, x0)
    assert dec.pushed == []
    run.chunk_latents(0, 2, x0)
    run.chunk_latents(1, 2, x0)
    assert len(dec.pushed) == 2 and dec.finished == 1
    assert sum(p.shape[0] for p in run.parts) == 1 + 4 * 3


def _frames(node, *args, **kw):
    images, latent, state = node.sample(object(), *args, **kw)
    return images, latent, state


@pytest.mark.parametrize("first_frames", [21, 33])      # 6 latent frames (one held back at the end) and 9 (none)
def test_a_continued_video_decodes_without_a_seam(fake, first_frames):
    (handle,) = CausalWanModelLoader().load("(built-in tiny model)", "fp32", "float32", "sdpa")
    args = (handle, 32, 32)
    rest = (1, "self_forcing", 3, -1, 0)
    whole, whole_latent, _ = _frames(CausalWanSamplerDecode(), *args, 45, *rest)
    first, _, state = _frames(CausalWanSamplerDecode(), *args, first_frames, *rest, keep_state=True)
    walk = state.extra["decoder"]
    assert (walk["held"] is not None) == (first_frames == 21)
    more, _, _ = _frames(CausalWanSamplerDecode(), *args, 45, *rest, continue_from=state)
    assert fake[2].restored is walk
    # the first run's frames, then the continuation's: one decode of the whole video (a frame the first run had to
    # decode alone at its end is shown once, the continuation's decode of it in its pair is not shown again)
    assert torch.equal(torch.cat([first, more])[:, 0, 0, 0], whole[:, 0, 0, 0]) and len(whole) == 45
    fresh, _, _ = _frames(CausalWanSamplerDecode(), *args, first_frames, *rest)
    assert torch.equal(fresh, first) and not hasattr(fake[-1], "restored")
