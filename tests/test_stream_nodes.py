"""CausalWan Sampler + Decode without ComfyUI: each chunk's final latents reach the decoder once, in order, while
sampling (the LATENT output is exactly what was decoded), the walk ends with the last chunk, and the IMAGE output is
the decoder's frames in order. The decode adapter itself is checked against ComfyUI's VAE.decode in tests/e2e."""
import pytest
import torch

from wan_accel.nodes import streaming_decode
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
    assert images.shape == (9, 2, 2, 3) and torch.equal(images[:, 0, 0, 0], means)
    assert state is None and len(node.last_report["chunk_s"]) == 3 and node.last_report["first_frames_s"] > 0


def test_a_chunk_redone_after_an_out_of_memory_retry_is_decoded_once():
    dec = FakeDecoder(None)
    run = _DecodeInLockstep(dec, live=False)
    x0 = torch.randn(1, 2, 16, 2, 2)
    for ci in (0, 0, 1):                    # chunk 0's last step seen twice (the chunk was redone)
        run(ci, 3, 2, 4, x0)
    assert len(dec.pushed) == 2 and dec.finished == 1
    assert sum(p.shape[0] for p in run.parts) == 4
