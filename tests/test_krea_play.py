"""recache krea in the live prompt play session: chunk by chunk, with prompts typed along the way, the session makes
the frames of one run of the recorded schedule with Krea's cache policy and the same seed, bit for bit, also once
the window has passed the first frame (the stand-in first frame re-encoded)."""
import logging

import pytest
import torch

from wan_accel.app.play.registry import PlayError
from wan_accel.app.play.t2v import PromptPlaySession
from wan_accel.model.tiny import tiny_causal_model, tiny_text_embedding
from wan_accel.sampling.krea import IDENTITY_REENCODE_NOTE, KreaRecompute, cache_setup
from wan_accel.sampling.prompts import PromptSchedule
from run_helpers import generate_latents

H = W = 4                        # latent size (the tiny model's patch is 2x2)
FPB, WINDOW = 3, 6               # Krea's K = WINDOW - FPB = 3: from chunk 2 on, frame f0 - K stands in for frame 0
# chunk 2: a mix typed plain, Krea's 4-chunk interpolation (chunk 2 repeats the old prompt); chunk 4: a hard switch
# asked for while it runs
PROMPTS = ["a cat walks", "", "a red fox :0.7 | snow falls :0.3", "", "a dog (blend 0)", "", ""]


@pytest.fixture(scope="module")
def model():
    return tiny_causal_model(seed=5)


def encode_with(model):
    cfg = model.config
    return lambda text: tiny_text_embedding(text, cfg.text_len, cfg.text_dim)


class Reencode:
    """A stand-in VAE round trip (not the identity) that counts the frames it re-encodes."""
    def __init__(self):
        self.calls = 0

    def __call__(self, frames):
        self.calls += 1
        return 0.5 * frames + 0.25


def replay(model, schedule_text, chunks, seed, reencode):
    """One run of the recorded schedule from the start with recache krea: [1, C, frames, h, w]."""
    schedule = PromptSchedule.parse(schedule_text)
    enc = encode_with(model)
    setup = cache_setup("krea", FPB, WINDOW, reencode)
    out = generate_latents(model, None, chunks * FPB, H, W, seed=seed, schedule="self_forcing", frames_per_block=FPB,
                           kv_window=setup.kv_window, prompt_schedule=schedule,
                           prompt_embeddings={t: enc(t) for t in schedule.texts()}, path="reference",
                           **setup.sampler_kwargs())
    return out.transpose(1, 2), setup.cache_policy


def test_krea_play_equals_one_run_of_the_recorded_schedule(model):
    reencode = Reencode()
    play = PromptPlaySession(model, encode_with(model), H, W, seed=7, frames_per_block=FPB, kv_window=WINDOW,
                             recache="krea", reencode=reencode)
    for p in PROMPTS:
        play.step(p)
    assert [e["switched"] for e in play.log] == [False, False, False, True, True, False, False]
    assert play.schedule_text.strip() == ("0: a cat walks\n2: a red fox :0.7 | snow falls :0.3 (blend 4, krea)\n"
                                          "4: a dog")
    assert play.describe()["recache"] == "krea" and play.kv_window == WINDOW
    policy = play.cache.cache_policy
    assert isinstance(policy, KreaRecompute) and policy.k == WINDOW - FPB
    # every block after the first is sampled after a rebuilt context of K frames, at the capped position K
    assert policy.positions == [(0, 0), (3, 3)] + [(f, 3) for f in range(6, 3 * len(PROMPTS), 3)]
    assert reencode.calls == len(PROMPTS) - 2          # the window passed frame 0 at chunk 2: re-encoded since
    want, one_run = replay(model, play.script_file(), len(PROMPTS), seed=7, reencode=Reencode())
    video = play.latent_video()
    assert video.shape == want.shape == (1, model.config.out_dim, 3 * len(PROMPTS), H, W)
    assert torch.equal(video, want)
    assert one_run.positions == policy.positions
    # the cache policy matters: the same session with recache none makes other frames after the first block
    plain = PromptPlaySession(model, encode_with(model), H, W, seed=7, frames_per_block=FPB, kv_window=WINDOW,
                              recache="none")
    for p in PROMPTS[:3]:
        plain.step(p)
    assert torch.equal(plain.latent_video()[:, :, :3], video[:, :, :3])
    assert not torch.equal(plain.latent_video()[:, :, 3:], video[:, :, 3:9])


def test_krea_play_without_a_vae_says_so_and_uses_the_frame_as_it_is(model, caplog):
    with caplog.at_level(logging.WARNING, logger="wan_accel"):
        play = PromptPlaySession(model, encode_with(model), H, W, seed=3, prompt="a cat", frames_per_block=FPB,
                                 recache="krea")
    assert IDENTITY_REENCODE_NOTE in caplog.text
    assert play.kv_window == WINDOW                     # kv_window -1: Krea's K = 3
    for p in ("", "", "a dog", ""):
        play.step(p)
    want, _ = replay(model, play.schedule_text, 4, seed=3, reencode=None)
    assert torch.equal(play.latent_video(), want)


def test_an_interrupted_chunk_leaves_the_policy_where_the_last_chunk_left_it(model):
    play = PromptPlaySession(model, encode_with(model), H, W, seed=9, prompt="a cat", frames_per_block=FPB,
                             kv_window=WINDOW, recache="krea", reencode=Reencode())
    play.step("")
    play.step("")

    def stop(*_args, **_kwargs):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        play.step("a dog", callback=stop)           # the policy ran its rebuild under the new prompt, then stopped
    for p in ("a dog", "", ""):
        play.step(p)
    want, _ = replay(model, play.schedule_text, 5, seed=9, reencode=Reencode())
    assert torch.equal(play.latent_video(), want)


def test_bad_krea_window_is_refused_in_one_message(model):
    with pytest.raises(PlayError, match=r"^kv_window 4: recache krea .* use kv_window at least 5"):
        PromptPlaySession(model, encode_with(model), H, W, prompt="a cat", frames_per_block=FPB, kv_window=4,
                          recache="krea")


def test_the_play_session_node_offers_krea_and_re_encodes_through_its_vae(monkeypatch):
    from wan_accel.app.jobs.handle import load_model_handle
    from wan_accel.app.play.registry import REGISTRY
    from wan_accel.nodes.comfy import streaming_decode
    from wan_accel.nodes.prompt_nodes import CausalWanPromptPlaySession
    from tests.test_krea_wire import FakeVAE
    monkeypatch.setattr(streaming_decode, "WanStreamDecoder", lambda vae: None)      # ComfyUI's decoder: not here
    assert "krea" in CausalWanPromptPlaySession.INPUT_TYPES()["required"]["recache"][0]
    handle = load_model_handle(None, "fp32", "float32", "sdpa", device="cpu")
    vae = FakeVAE()
    out = CausalWanPromptPlaySession().start(handle, vae, "a cat", width=32, height=32, seed=1, frames_per_block=3,
                                             kv_window=-1, sink=0, recache="krea")
    sid = out["result"][0]
    try:
        play = REGISTRY.get(sid)
        assert play.recache == "krea" and play.cache.cache_policy.reencode is not None
        for p in ("", "", "a dog"):
            play.step(p)
        assert vae.encoded and play.cache.cache_policy.positions[-1] == (6, 3)    # frame 3 re-encoded at chunk 2
    finally:
        REGISTRY.end(sid)
