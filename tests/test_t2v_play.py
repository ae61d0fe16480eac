"""Live prompt play (text-to-video): the prompt typed for a chunk conditions that chunk and the ones after it, the
session records the rows the model was given and the schedule that reproduces it bit for bit with the same seed,
and bad prompts are refused with one clear message before anything is made."""
import pytest
import torch

from wan_accel.app.play.registry import PlayError, PlayRegistry
from wan_accel.app.play.t2v import PromptPlaySession, context_digest
from wan_accel.model.tiny import tiny_causal_model, tiny_text_embedding
from wan_accel.sampling.prompts import PromptSchedule
from run_helpers import generate_latents

H = W = 4                        # latent size (the tiny model's patch is 2x2)
SETTINGS = dict(frames_per_block=3, kv_window=6, sink=3)       # the window rolls within 4 chunks


@pytest.fixture(scope="module")
def model():
    return tiny_causal_model(seed=3)


def encoder(model, calls=None):
    cfg = model.config

    def encode(text):
        if calls is not None:
            calls.append(text)
        return tiny_text_embedding(text, cfg.text_len, cfg.text_dim)
    return encode


def replay(model, schedule_text, chunks, seed, recache="switch"):
    """One run of the recorded schedule from the start: [1, C, frames, h, w] as the session stores it."""
    schedule = PromptSchedule.parse(schedule_text)
    enc = encoder(model)
    out = generate_latents(model, enc(schedule.texts()[0]), chunks * 3, H, W, seed=seed, schedule="self_forcing",
                           prompt_schedule=schedule, prompt_embeddings={t: enc(t) for t in schedule.texts()},
                           recache=recache, **SETTINGS)
    return out.transpose(1, 2)


@pytest.mark.parametrize("recache", ["switch", "none"])
def test_typed_prompts_drive_their_chunks_and_the_schedule_reproduces_the_session(model, recache):
    calls: list = []
    play = PromptPlaySession(model, encoder(model, calls), H, W, seed=11, prompt="a cat walks", recache=recache,
                             **SETTINGS)
    play.step("")                               # the first prompt given at the start
    play.step("")                               # empty: the prompt in effect goes on
    play.step("a red fox :0.7 | snow falls :0.3")
    play.step("a red fox :0.7 | snow falls :0.3")      # the same prompt again: no new entry
    assert [e["prompt"] for e in play.log] == ["a cat walks"] * 2 + ["a red fox :0.7 | snow falls :0.3"] * 2
    assert [e["switched"] for e in play.log] == [False, False, True, False]
    assert play.schedule_text.strip() == "0: a cat walks\n2: a red fox :0.7 | snow falls :0.3"
    assert sorted(calls) == sorted(set(calls)) == ["a cat walks", "a red fox", "snow falls"]   # each text once
    cat = tiny_text_embedding("a cat walks", model.config.text_len, model.config.text_dim)
    fox = tiny_text_embedding("a red fox", model.config.text_len, model.config.text_dim)
    snow = tiny_text_embedding("snow falls", model.config.text_len, model.config.text_dim)
    mix = 0.7 * fox + 0.3 * snow
    assert [e["context_sha256"] for e in play.log[:2]] == [context_digest(cat)] * 2
    tol = 4 * torch.finfo(torch.float32).eps * float(mix.abs().max())
    assert torch.allclose(torch.tensor(play.log[2]["context_head"]), mix[0, 0, :8], atol=tol, rtol=0)
    video = play.latent_video()
    assert video.shape == (1, model.config.out_dim, 12, H, W)
    assert torch.equal(video, replay(model, play.script_file(), 4, seed=11, recache=recache))   # header: comments
    assert torch.equal(video[:, :, :6], replay(model, "0: a cat walks", 2, seed=11))   # before the switch: same


def test_a_switch_changes_the_frames_from_its_chunk_on(model):
    a = PromptPlaySession(model, encoder(model), H, W, seed=2, prompt="a cat", **SETTINGS)
    b = PromptPlaySession(model, encoder(model), H, W, seed=2, prompt="a cat", **SETTINGS)
    for p in ("", "", ""):
        a.step(p)
    for p in ("", "a dog", ""):
        b.step(p)
    va, vb = a.latent_video(), b.latent_video()
    assert torch.equal(va[:, :, :3], vb[:, :, :3])
    assert not torch.equal(va[:, :, 3:6], vb[:, :, 3:6]) and not torch.equal(va[:, :, 6:], vb[:, :, 6:])


def test_bad_prompts_are_refused_before_anything_is_made(model):
    with pytest.raises(PlayError, match="prompt 'a :nan | b'"):
        PromptPlaySession(model, encoder(model), H, W, prompt="a :nan | b", **SETTINGS)
    play = PromptPlaySession(model, encoder(model), H, W, **SETTINGS)
    with pytest.raises(PlayError, match="type a prompt for the first chunk"):
        play.step("   ")
    play.step("a cat")
    for bad, says in (("a dog\nand a cow", "one line"), ("a dog :0 | a cow", "a dog :0"),
                      ("a dog (blend x)", "blend")):
        with pytest.raises(PlayError, match=says):
            play.step(bad)
    assert play.chunks == 1 and len(play.log) == 1 and play.schedule_text.strip() == "0: a cat"
    play.step("a dog")
    assert play.schedule_text.strip() == "0: a cat\n1: a dog"


def test_encoder_output_is_checked(model):
    wide = PromptPlaySession(model, lambda t: torch.zeros(1, 4, model.config.text_dim + 1), H, W, **SETTINGS)
    with pytest.raises(PlayError, match="wide"):
        wide.step("a cat")
    nan = PromptPlaySession(model, lambda t: torch.full((1, 4, model.config.text_dim), float("nan")), H, W,
                            **SETTINGS)
    with pytest.raises(PlayError, match="non-finite"):
        nan.step("a cat")
    assert wide.chunks == nan.chunks == 0


def test_sessions_live_in_the_play_registry_and_routes_show_the_rows(model):
    from wan_accel.server_routes import play_touch
    reg = PlayRegistry(reaper=False)
    play = PromptPlaySession(model, encoder(model), H, W, prompt="a cat", **SETTINGS)
    sid = reg.open(play, owner="tab")
    play.step("")
    play.step("a dog")
    info = play_touch({"session": sid}, registry=reg)
    assert info["type"] == "t2v" and info["chunks"] == 2 and info["prompt"] == "a dog"
    assert not {"kind", "session"} & set(play.describe())      # the play events' own fields (send_play_event)
    assert [r["prompt"] for r in info["chunk_actions"]] == ["a cat", "a dog"]
    assert info["script"].strip() == "0: a cat\n1: a dog"
    reg.end(sid)
    with pytest.raises(PlayError, match="ended"):
        play.step("")
    assert play.latent_video().shape[2] == 6 and play.model is None          # what saving needs is kept


# ------------------------------------------------------------------------------------------------ the nodes
class FakeClip:
    """ComfyUI's CLIP interface as the nodes use it: tokenize, then encode_from_tokens -> [1, L, width]."""

    def __init__(self, width):
        self.width, self.encoded = width, []

    def tokenize(self, text):
        return {"text": text}

    def encode_from_tokens(self, tokens):
        self.encoded.append(tokens["text"])
        return tiny_text_embedding(tokens["text"], 6, self.width)


@pytest.fixture(scope="module")
def handle():
    from wan_accel.app.jobs.handle import load_model_handle
    return load_model_handle(None, "fp32", "float32", "sdpa", device="cpu")


def test_sampler_node_prompt_schedule_equals_the_engine_run(handle):
    from wan_accel.vae.latents import to_vae_latents
    from wan_accel.nodes.model_nodes import CausalWanSampler
    text = "0: a cat\n1: a dog (blend 1)"
    node = CausalWanSampler()
    args = dict(width=32, height=32, num_frames=4 * 5 + 1, seed=4, preset="self_forcing", frames_per_block=3,
                kv_window=6, sink=0, sampler="reference")
    (latent, _), (plain, _) = (node.sample(handle, prompt_schedule=t, **args) for t in (text, "0: a cat"))
    sched = PromptSchedule.parse(text)
    enc = encoder(handle.model)
    want = generate_latents(handle.model, enc("a cat"), 6, 4, 4, seed=4, kv_window=6, prompt_schedule=sched,
                            prompt_embeddings={t: enc(t) for t in sched.texts()})
    assert torch.equal(latent["samples"], to_vae_latents(want))
    assert torch.equal(latent["samples"][:, :, :3], plain["samples"][:, :, :3])
    assert not torch.equal(latent["samples"][:, :, 3:], plain["samples"][:, :, 3:])
    for bad, says in (("0: a cat\n5: a dog", "prompt_schedule: .*5"), ("1: a cat", "prompt_schedule: .*0"),
                      ("0: a :inf | b", "prompt_schedule: ")):
        with pytest.raises(ValueError, match=says):
            node.sample(handle, prompt_schedule=bad, **args)
    with pytest.raises(ValueError, match="recache"):
        node.sample(handle, prompt_schedule=text, recache="sometimes", **args)


def test_text_encoder_uses_the_clip_and_checks_its_width(handle):
    from wan_accel.nodes.prompt_nodes import text_encoder
    cfg = handle.model.config
    clip = FakeClip(cfg.text_dim)
    assert torch.equal(text_encoder(clip, handle.model)("a cat"), tiny_text_embedding("a cat", 6, cfg.text_dim))
    assert clip.encoded == ["a cat"]
    with pytest.raises(ValueError, match="4096 wide"):
        text_encoder(FakeClip(4096), handle.model)("a cat")
    with pytest.raises(ValueError, match="connect the CLIP"):
        text_encoder(None, handle.model)                   # a model that is not the built-in tiny one
    stand_in = tiny_text_embedding("a cat", cfg.text_len, cfg.text_dim)
    for c in (None, FakeClip(4096)):                       # the tiny model: its stand-in, a CLIP connected or not
        assert torch.equal(text_encoder(c, handle)("a cat"), stand_in)


def test_native_schedule_node_reaches_the_sampler_arguments():
    from wan_accel.nodes.comfy.native_engine import positive_schedule
    from wan_accel.nodes.prompt_nodes import SCHEDULE_KEY, WanAccelPromptSchedule
    clip = FakeClip(8)
    (cond,) = WanAccelPromptSchedule().encode(clip, "0: a cat\n2: a dog", recache="none")
    first, extra = cond[0]
    assert torch.equal(first, tiny_text_embedding("a cat", 6, 8)) and sorted(clip.encoded) == ["a cat", "a dog"]
    guider = type("Guider", (), {"conds": {"positive": [dict(extra, model_conds={})]}})()
    kwargs = positive_schedule(guider)
    assert kwargs["recache"] == "none" and kwargs["prompt_schedule"].to_text().strip() == "0: a cat\n2: a dog"
    assert set(kwargs["prompt_embeddings"]) == {"a cat", "a dog"} and SCHEDULE_KEY in extra
    assert positive_schedule(type("Guider", (), {"conds": {"positive": [{"model_conds": {}}]}})()) == {}
    with pytest.raises(ValueError, match="prompt_schedule: .*line 2"):
        WanAccelPromptSchedule().encode(clip, "0: a cat\n0: a dog")
