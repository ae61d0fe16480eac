"""Hard edges, round three (issue 32), the classes about values: no silent NaN video (weights checked where they are
made, conditioning where it enters, the latents before they are written or shown), arithmetic on user numbers that
cannot overflow (prompt mixes normalised by their largest weight), a live prompt session that survives one bad
prompt, and work from user text bounded before anything is encoded. Each case drives the command line, the nodes
and the live session."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from cli_run import refused, run_cli
from wan_accel.app.play import registry as play_registry
from wan_accel.app.play.registry import PlayError, PlayRegistry
from wan_accel.app.play.t2v import PromptPlaySession
from wan_accel.model.checkpoint import METADATA_KEY, keeps_fp8
from wan_accel.model.finite import NonFiniteError
from checkpoint_files import save_wan_checkpoint
from wan_accel.model.tiny import TINY_CONFIG, tiny_causal_model, tiny_text_embedding
from wan_accel.sampling import prompts as P
from wan_accel.sampling.prompts import PromptSchedule

SMALL = ["--device", "cpu", "--frames", "9", "--height", "32", "--width", "32", "--no-preview"]
NODE_RUN = dict(width=32, height=32, num_frames=9, seed=1, preset="self_forcing", frames_per_block=3, kv_window=-1,
                sink=0, sampler="reference")
H = W = 4                        # latent size of the live sessions


def _refused(result, *words) -> str:
    return refused(result, *words, longest=1200)          # a long input is never echoed whole


@pytest.fixture(scope="module")
def handle():
    from wan_accel.app.jobs.handle import load_model_handle
    return load_model_handle(None, "fp32", "float32", "sdpa", device="cpu")


class Clip:
    """ComfyUI's CLIP interface; ``answer(text)`` gives the embedding (default: the tiny stand-in, 8 wide)."""

    def __init__(self, width=TINY_CONFIG.text_dim, answer=None):
        self.width, self.answer, self.encoded = width, answer, []

    def tokenize(self, text):
        return {"text": text}

    def encode_from_tokens(self, tokens):
        self.encoded.append(tokens["text"])
        if self.answer is not None:
            return self.answer(tokens["text"])
        return tiny_text_embedding(tokens["text"], 6, self.width)


# ================================================================================ 1. no silent NaN video
def _state():
    return {n: t.detach().clone().contiguous() for n, t in tiny_causal_model(seed=3).state_dict().items()}


def _write(path, tensors):
    save_file(tensors, str(path), metadata={METADATA_KEY: json.dumps(TINY_CONFIG.to_dict())})
    return path


def _fp8(state, dtype=torch.float8_e4m3fn):
    """Every block linear weight in fp8 with a per-tensor scale (amax / the format's largest value)."""
    out = {}
    for name, t in state.items():
        if not keeps_fp8(name, "F8_E4M3", t.shape):
            out[name] = t
            continue
        scale = t.abs().max() / torch.finfo(dtype).max
        out[name] = (t / scale).to(dtype)
        out[f"{name[:-len('.weight')]}.scale_weight"] = scale.reshape(())
    out["scaled_fp8"] = torch.empty(0, dtype=dtype)
    return out


LAYER = "blocks.1.ffn.2"


def _nan_float(state):
    state[f"{LAYER}.weight"].view(-1)[7] = float("nan")
    return state


def _inf_float(state):
    state["head.head.weight"].view(-1)[0] = float("inf")
    return state


def _huge_scale(state):
    t = _fp8(state)
    t[f"{LAYER}.scale_weight"] = torch.tensor(3e38)       # finite and positive: the product overflows
    return t


def _nan_bytes(state):
    t = _fp8(state)
    t[f"{LAYER}.weight"].view(torch.uint8).view(-1)[3] = 0x7F         # e4m3fn: 0x7F is NaN
    return t


def _inf_bytes_e5m2(state):
    t = _fp8(state, torch.float8_e5m2)
    t[f"{LAYER}.weight"].view(torch.uint8).view(-1)[5] = 0x7C         # e5m2: 0x7C is +inf
    return t


def _scale_of_a_dequantized_layer(state):
    """An fp8 tensor the loader dequantizes at load (not a block linear), its scale finite but far too large."""
    t = _fp8(state)
    w = state["head.head.weight"]
    t["head.head.weight"] = (w / w.abs().max() * 448).to(torch.float8_e4m3fn)
    t["head.head.scale_weight"] = torch.tensor(3e38)
    return t


BAD_CHECKPOINTS = {
    "nan weight": (_nan_float, [f"{LAYER}.weight", "NaN"]),
    "inf weight": (_inf_float, ["head.head.weight", "infinite"]),
    "fp8 scale 3e38": (_huge_scale, [f"{LAYER}.weight", "scale"]),
    "fp8 bytes NaN": (_nan_bytes, [f"{LAYER}.weight", "bytes encode NaN"]),
    "e5m2 bytes inf": (_inf_bytes_e5m2, [f"{LAYER}.weight", "bytes encode NaN or inf"]),
    "scale dequantized at load": (_scale_of_a_dequantized_layer, ["head.head.weight", "head.head.scale_weight"]),
}


@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_a_checkpoint_that_would_give_a_nan_video_is_refused_by_name(case, tmp_path):
    from wan_accel.nodes.model_nodes import CausalWanModelLoader
    make, words = BAD_CHECKPOINTS[case]
    path = _write(tmp_path / "bad.safetensors", make(_state()))
    out = tmp_path / "run"
    _refused(run_cli("generate", "--checkpoint", str(path), "--out", str(out), *SMALL), "bad.safetensors", *words)
    assert not (out / "latents.safetensors").exists()
    with pytest.raises(ValueError) as err:
        CausalWanModelLoader().load(str(path), "fp32", "float32", "sdpa")
    assert isinstance(err.value, NonFiniteError) and all(w in str(err.value) for w in words), str(err.value)


def test_weights_finite_but_far_too_large_are_named_when_the_run_overflows(tmp_path):
    """A scale that keeps the weights finite but huge: the weights pass, the run overflows, and the message names
    the weight; nothing is written."""
    t = _fp8(_state())
    t[f"{LAYER}.scale_weight"] = torch.tensor(1e30)
    path = _write(tmp_path / "big.safetensors", t)
    out = tmp_path / "run"
    _refused(run_cli("generate", "--checkpoint", str(path), "--out", str(out), *SMALL),
             "sampled latents", f"{LAYER}.weight", "fp8 scale")
    assert not (out / "latents.safetensors").exists()


def test_a_good_fp8_checkpoint_still_loads_and_runs(tmp_path):
    path = _write(tmp_path / "good.safetensors", _fp8(_state()))
    code, out, err = run_cli("generate", "--checkpoint", str(path), "--out", str(tmp_path / "run"), "--json", *SMALL)
    assert code == 0, err
    latents = load_file(json.loads(out)["files"]["latents"])["latents"]
    assert bool(torch.isfinite(latents).all())


def _lora(path, layer, up, down, alpha=None):
    t = {f"diffusion_model.{layer}.lora_A.weight": down.contiguous(),
         f"diffusion_model.{layer}.lora_B.weight": up.contiguous()}
    if alpha is not None:
        t[f"diffusion_model.{layer}.alpha"] = torch.tensor(float(alpha))
    save_file(t, str(path))
    return path


@pytest.mark.parametrize("values, strength", [(1e20, "1"),        # B @ A = 1e40: past float32
                                              (2e18, "100"),      # 4e36 * (rank 2) * 100: past float32
                                              (3e19, "1")])       # 9e38 per entry: the sum overflows
def test_a_lora_of_finite_values_whose_merge_overflows_is_refused(values, strength, tmp_path):
    from wan_accel.nodes.model_nodes import CausalWanModelLoader
    ckpt = save_wan_checkpoint(tiny_causal_model(seed=3), tmp_path / "base.safetensors")
    w = tiny_causal_model(seed=3).get_submodule(LAYER).weight
    lora = _lora(tmp_path / "boom.safetensors", LAYER, torch.full((w.shape[0], 2), values),
                 torch.full((2, w.shape[1]), values))
    assert all(bool(torch.isfinite(t).all()) for t in load_file(str(lora)).values())
    line = _refused(run_cli("generate", "--checkpoint", str(ckpt), "--lora", str(lora), "--lora-strength", strength,
                         "--out", str(tmp_path / "run"), *SMALL), "boom.safetensors", f"{LAYER}.weight", "strength")
    assert "NaN or infinite" in line
    with pytest.raises(ValueError, match=rf"boom\.safetensors.*{LAYER}\.weight.*lower the LoRA strength"):
        CausalWanModelLoader().load(str(ckpt), "fp32", "float32", "sdpa", lora=str(lora),
                                    lora_strength=float(strength))


def test_a_lora_that_stays_finite_still_merges(tmp_path):
    from wan_accel.model.loader import load_wan_checkpoint
    ckpt = save_wan_checkpoint(tiny_causal_model(seed=3), tmp_path / "base.safetensors")
    w = tiny_causal_model(seed=3).get_submodule(LAYER).weight
    lora = _lora(tmp_path / "fine.safetensors", LAYER, torch.full((w.shape[0], 1), 1e3),
                 torch.full((1, w.shape[1]), 1e3))                    # large, but finite after the merge
    model = load_wan_checkpoint(ckpt, lora=str(lora))
    assert bool(torch.isfinite(model.get_submodule(LAYER).weight).all())


def _nan_clip(bad="a dog"):
    def answer(text):
        emb = tiny_text_embedding(text, 6, TINY_CONFIG.text_dim)
        if text == bad:
            emb[0, 2, 5] = float("nan")
        return emb
    return Clip(answer=answer)


def test_a_text_encoder_that_answers_nan_is_named_with_the_prompt(handle):
    from wan_accel.nodes.model_nodes import CausalWanSampler
    from wan_accel.nodes.prompt_nodes import WanAccelPromptSchedule
    with pytest.raises(NonFiniteError, match=r"'a dog'.*NaN"):
        WanAccelPromptSchedule().encode(_nan_clip(), "0: a cat\n2: a dog")
    with pytest.raises(NonFiniteError, match=r"'a dog'.*NaN"):     # the first prompt too, inside a mix
        WanAccelPromptSchedule().encode(_nan_clip(), "0: a cat :0.5 | a dog :0.5")
    # the sampler's positive input and its own text encoder (a model that is not the tiny one takes the CLIP)
    nan_cond = [[torch.full((1, 4, TINY_CONFIG.text_dim), float("nan")), {}]]
    with pytest.raises(ValueError, match=r"positive .*NaN"):
        CausalWanSampler().sample(handle, positive=nan_cond, **NODE_RUN)


def test_the_sampler_checks_every_chunk_context_where_it_enters():
    from run_helpers import generate_latents
    model = tiny_causal_model(seed=3)
    good = tiny_text_embedding("a cat", 6, TINY_CONFIG.text_dim)
    bad = good.clone()
    bad[0, 0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match="infinite"):
        generate_latents(model, bad, 3, H, W)
    with pytest.raises(NonFiniteError, match="infinite"):
        generate_latents(model, good, 6, H, W, prompt_schedule=PromptSchedule.parse("0: a\n1: b"),
                         prompt_embeddings={"a": good, "b": bad})


def test_latents_that_overflow_while_sampling_are_not_written(tmp_path):
    """Finite inputs can still overflow: conditioning of huge values gives NaN latents; the run says so, names the
    conditioning, and writes nothing."""
    embeds = tmp_path / "huge.safetensors"
    save_file({"context": torch.full((6, TINY_CONFIG.text_dim), 1e37)}, str(embeds))
    out = tmp_path / "run"
    _refused(run_cli("generate", "--text-embeds", str(embeds), "--out", str(out), *SMALL),
             "sampled latents", "text conditioning", "Nothing was kept")
    assert not (out / "latents.safetensors").exists() and not (out / "report.json").exists()
    from run_helpers import generate_latents
    with pytest.raises(NonFiniteError, match="latent frame 0"):
        generate_latents(tiny_causal_model(seed=3), torch.full((1, 6, TINY_CONFIG.text_dim), 1e37), 3, H, W)


def test_the_first_non_finite_frame_is_named_whatever_batch_item_holds_it():
    from wan_accel.model.finite import output_problem
    latents = torch.zeros(2, 5, 4, 3, 3)
    latents[1, 3, 2] = float("nan")
    latents[1, 4, 0, 0, 0] = float("inf")
    assert output_problem(latents) == "non-finite values (9 NaN, 1 infinite of 360), from latent frame 3 on"
    assert output_problem(torch.zeros(2, 5, 4)) is None


# ================================================================================ 2. overflow of user numbers
HUGE_MIXES = ["0: a :1e308 | b :1e308", "0: a :1.7976931348623157e308 | b :1.7e308 | c :1e308",
              "0: a\n1: b :1e308 | c :1e308 (blend 1)", "0: a :1e308 | b"]


@pytest.mark.parametrize("text", HUGE_MIXES)
def test_huge_mix_weights_are_normalised_not_overflowed(text):
    from wan_accel.nodes.prompt_nodes import WanAccelPromptSchedule
    schedule = PromptSchedule.parse(text)
    for e in schedule.entries:
        w = e.weights()
        assert all(0 <= x <= 1 for x in w) and abs(sum(w) - 1) < 1e-12
    (cond,) = WanAccelPromptSchedule().encode(Clip(), text)
    assert bool(torch.isfinite(cond[0][0]).all())


def test_a_run_with_huge_mix_weights_samples_finite_latents(tmp_path, handle):
    """The weights above are what every consumer mixes with; one run through the command and the node (a schedule
    that switches at the second chunk, each entry with weights near the float limit) samples finite latents."""
    from wan_accel.nodes.model_nodes import CausalWanSampler
    text = HUGE_MIXES[2]
    code, out, err = run_cli("generate", "--prompt-schedule", text, "--out", str(tmp_path / "run"), "--json", *SMALL,
                          "--frames", "21")         # two chunks
    assert code == 0, err
    assert bool(torch.isfinite(load_file(json.loads(out)["files"]["latents"])["latents"]).all())
    (latent, _) = CausalWanSampler().sample(handle, prompt_schedule=text, **dict(NODE_RUN, num_frames=21))
    assert bool(torch.isfinite(latent["samples"]).all())


def test_equal_huge_weights_mix_as_equal_small_ones():
    a = PromptSchedule.parse("0: x :1e308 | y :1e308").entries[0].weights()
    assert a == PromptSchedule.parse("0: x :1 | y :1").entries[0].weights() == [0.5, 0.5]
    assert PromptSchedule.parse("0: x :3e307 | y :1e307").entries[0].weights() == pytest.approx([0.75, 0.25])


@pytest.mark.parametrize("text, words", [
    ("0: a :1e-308 | b :1e308", ["1e-308", "rounds to 0"]),             # a share that no float holds
    ("0: a :5e-324 | b :1e10", ["5e-324", "rounds to 0"]),
    ("0: a :1e309 | b :1", ["inf", "finite"]),                            # a weight that no float holds
    ("0: a :" + "9" * 400 + " | b", ["finite"]),
])
def test_only_what_cannot_be_represented_is_refused(text, words, tmp_path, handle):
    from wan_accel.nodes.model_nodes import CausalWanSampler
    from wan_accel.nodes.prompt_nodes import WanAccelPromptSchedule
    _refused(run_cli("generate", "--prompt-schedule", text, "--out", str(tmp_path / "run"), *SMALL),
             "--prompt-schedule", *words)
    for call in (lambda: WanAccelPromptSchedule().encode(Clip(), text),
                 lambda: CausalWanSampler().sample(handle, prompt_schedule=text, **NODE_RUN)):
        with pytest.raises(ValueError) as err:
            call()
        assert "prompt_schedule" in str(err.value) and all(w in str(err.value) for w in words), str(err.value)


# ================================================================================ 3. a live session survives
@pytest.fixture()
def env(monkeypatch):
    from wan_accel.nodes.comfy import streaming_decode
    registry = PlayRegistry(reaper=False)
    monkeypatch.setattr(play_registry, "REGISTRY", registry)
    monkeypatch.setattr(streaming_decode, "WanStreamDecoder", lambda vae: None)      # ComfyUI's decoder: not here
    yield registry
    registry.clear()


BAD_LIVE_PROMPTS = {
    "lone surrogate": "a cat \ud800 runs",
    "lone low surrogate": "\udfff",
    "control character": "a cat\x00 runs",
    "share that rounds to 0": "a :1e-308 | b :1e308",
    "weight past float": "a :1e999 | b",
    "2 MB prompt": "a cat " * 350_000,
    "too many mixed prompts": " | ".join(f"p{i}" for i in range(40)),
    "bad blend": "a dog (blend x)",
}


def _start(handle, prompt="a cat"):
    from wan_accel.nodes.prompt_nodes import CausalWanPromptPlaySession
    out = CausalWanPromptPlaySession().start(handle, object(), prompt, width=32, height=32, seed=5,
                                             frames_per_block=3, kv_window=-1, sink=0)
    return out["result"][0]


def test_a_live_session_survives_every_bad_prompt(handle, env):
    from wan_accel.nodes.prompt_nodes import CausalWanPromptPlayStep
    sid = _start(handle)
    step = CausalWanPromptPlayStep()
    step.step(sid, "")
    step.step(sid, "a :1e308 | b :1e308")          # the overflowing mix of the issue: now a mix like any other
    play = env.get(sid)
    for name, bad in BAD_LIVE_PROMPTS.items():
        before = (play.chunks, play.schedule_text, len(play.log), play.prompt)
        with pytest.raises(PlayError) as err:
            step.step(sid, bad)
        msg = str(err.value)
        assert len(msg) < 1000 and "\ud800" not in msg and "\udfff" not in msg, (name, msg[:200])
        assert not play.ended and (play.chunks, play.schedule_text, len(play.log), play.prompt) == before, name
    step.step(sid, "")                              # goes on from where it was, with the prompt in effect
    step.step(sid, "a dog")
    assert play.chunks == 4 and not play.ended
    assert play.schedule_text.strip() == "0: a cat\n1: a :1e+308 | b :1e+308\n3: a dog"
    assert all(bool(torch.isfinite(t).all()) for t in play.latents)


def test_a_live_session_survives_an_encoder_that_fails_or_answers_nan(handle, env):
    model = handle.model

    def encode(text):
        if text == "boom":
            raise RuntimeError("the text encoder ran out of memory")
        emb = tiny_text_embedding(text, model.config.text_len, model.config.text_dim)
        if text == "nan please":
            emb[0, 0, 0] = float("nan")
        if text == "huge":
            emb = emb * 1e37                       # finite, but the chunk it makes overflows
        return emb

    play = PromptPlaySession(model, encode, H, W, seed=2, prompt="a cat")
    play.step("")
    for bad, says in (("boom", "RuntimeError: the text encoder ran out of memory"), ("nan please", "NaN"),
                      ("huge", "NaN")):
        with pytest.raises(PlayError, match=says):
            play.step(bad)
        assert play.chunks == 1 and not play.ended and play.schedule_text.strip() == "0: a cat"
    play.step("")
    again = PromptPlaySession(model, encode, H, W, seed=2, prompt="a cat")
    again.step("")
    again.step("")
    assert torch.equal(play.latent_video(), again.latent_video())     # as if the bad prompts never came


@pytest.mark.parametrize("name", ["lone surrogate", "2 MB prompt", "share that rounds to 0"])
def test_a_bad_first_prompt_is_refused_at_the_start(name, handle, env):
    with pytest.raises(ValueError) as err:
        _start(handle, BAD_LIVE_PROMPTS[name])
    assert str(err.value).startswith("prompt") and len(str(err.value)) < 1000
    assert len(env) == 0                           # nothing registered, nothing kept


# ================================================================================ 5. bounded work from user text
def test_the_bounds_fit_the_longest_video_and_the_text_encoder():
    from wan_accel.app.validate import MAX_VIDEO_FRAMES
    assert P.MAX_CHUNKS == (MAX_VIDEO_FRAMES - 1) // 4 + 1          # one latent frame per chunk at the most
    assert P.TEXT_TOKENS == 512 and P.MAX_PROMPT_CHARS >= 4 * P.TEXT_TOKENS


@pytest.mark.parametrize("entries", [1025, 5000, 20000])
def test_a_schedule_longer_than_any_video_is_refused_before_encoding(entries, tmp_path, handle):
    from wan_accel.nodes.model_nodes import CausalWanSampler
    from wan_accel.nodes.prompt_nodes import WanAccelPromptSchedule
    text = "\n".join(f"{i}: prompt number {i}" for i in range(entries))
    clip = Clip()
    with pytest.raises(ValueError, match="prompt_schedule: .*1024"):
        WanAccelPromptSchedule().encode(clip, text)
    assert clip.encoded == []                      # nothing was encoded
    with pytest.raises(ValueError, match="prompt_schedule: .*1024"):
        CausalWanSampler().sample(handle, prompt_schedule=text, clip=clip, **NODE_RUN)
    path = tmp_path / "long.txt"
    path.write_text(text)
    _refused(run_cli("generate", "--prompt-schedule", str(path), "--out", str(tmp_path / "run"), *SMALL),
             "--prompt-schedule", "1024")


@pytest.mark.parametrize("text", ["0: a\n1024: b", "0: a\n5000: b", "0: a\n" + "9" * 30 + ": b"])
def test_a_chunk_past_the_longest_video_is_refused_before_encoding(text):
    from wan_accel.nodes.prompt_nodes import WanAccelPromptSchedule
    clip = Clip()
    with pytest.raises(ValueError, match="1024") as err:
        WanAccelPromptSchedule().encode(clip, text)
    assert clip.encoded == [] and len(str(err.value)) < 400


@pytest.mark.parametrize("size", [16 * 512 + 1, 100_000, 10 * 2 ** 20])     # just past MAX_PROMPT_CHARS ...
def test_a_prompt_longer_than_the_encoder_reads_is_refused(size, tmp_path, handle, env):
    from wan_accel.nodes.prompt_nodes import WanAccelPromptSchedule
    long = ("a cat walks " * (size // 12 + 1))[:size].strip() + "x"
    clip = Clip()
    with pytest.raises(ValueError, match="characters") as err:
        WanAccelPromptSchedule().encode(clip, f"0: {long}")
    assert clip.encoded == [] and len(str(err.value)) < 600
    with pytest.raises(ValueError, match="characters"):
        _start(handle, long)
    if size < 2 ** 20:                              # the command line reads schedules of up to 1 MiB
        _refused(run_cli("generate", "--prompt-schedule", f"0: {long}", "--out", str(tmp_path / "run"), *SMALL),
                 "--prompt-schedule", "characters")


def test_a_prompt_the_encoder_reads_whole_is_accepted():
    text = "a" * P.MAX_PROMPT_CHARS
    assert PromptSchedule.parse(f"0: {text}").texts() == [text]
    assert PromptSchedule.parse("0: " + " | ".join(f"p{i}" for i in range(P.MAX_MIX_PARTS))).entries[0].parts


def test_constructed_schedules_are_bounded_too():
    with pytest.raises(ValueError, match="1024"):
        PromptSchedule((P.Entry(0, (("a", 1.0),)), P.Entry(5000, (("b", 1.0),))))
    with pytest.raises(ValueError, match="characters"):
        PromptSchedule((P.Entry(0, (("a" * (P.MAX_PROMPT_CHARS + 1), 1.0),)),))
    with pytest.raises(ValueError, match="surrogate"):
        PromptSchedule((P.Entry(0, (("\ud800", 1.0),)),))
    with pytest.raises(ValueError, match="rounds to 0"):
        PromptSchedule((P.Entry(0, (("a", 1e-308), ("b", 1e308))),))
