"""Krea Realtime settings beyond the first fixture, against tensors the official session code made
(tests/fixtures/krea_realtime, ``produce.py`` cases ``partial_block`` and ``interrupted``; README there):

* ``partial_block``: kv_cache_num_frames K = 5 with 3-frame blocks. From block 2 on the context is 5 frames, so its
  last block is partial; the official recompute pads the context to 128 tokens and its block mask (run here as the
  official flex_attention BlockMask, eagerly) lets that block attend 6 zero padding keys.
* ``interrupted``: new prompts while an interpolation is still running (at block 2, when the change of block 1 has
  only repeated the old prompt; at block 4, half way through the change of block 2), then one that runs to its end.

The pack runs both on both sampler paths, chunk by chunk, and in a live play session with the same prompts typed at
the same blocks (a change over Krea's default 4 blocks typed as the plain prompt, as a client of Krea's server sends
it without a step count); every comparison is within 1e-4 (float32).
"""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from krea_variants import UnpaddedRecompute
from tolerances import step as dtype_step, within
from wan_accel.app.play.t2v import PromptPlaySession
from wan_accel.app.prepare import Run
from wan_accel.model.config import WanConfig
from wan_accel.model.loader import load_wan_checkpoint
from wan_accel.sampling.krea import (KREA_INTERP_STEPS, KreaRecompute, krea_schedule, krea_schedule_entry,
                                     krea_schedule_line, padding_keys)
from wan_accel.sampling.prompts import PromptSchedule
from run_helpers import run_causal

FIX = Path(__file__).parent / "fixtures" / "krea_realtime"
TOL = 1e-4
CASES = ("partial_block", "interrupted")


def _fixture(case: str):
    cfg = json.loads((FIX / f"krea_{case}_config.json").read_text())
    return cfg, load_file(str(FIX / cfg["io_file"]))


FIXTURES = {case: _fixture(case) for case in CASES}


@pytest.fixture(scope="module")
def model():
    cfg = FIXTURES["partial_block"][0]
    return load_wan_checkpoint(FIX / cfg["weights_file"], device="cpu", dtype=torch.float32, precision="float32",
                               config=WanConfig.from_dict(cfg["config"]), attention="sdpa")


def _reencode(cfg, seen=None):
    a, b = cfg["reencode"]["a"], cfg["reencode"]["b"]

    def reencode(x):
        if seen is not None:
            seen.append(x.detach().clone())
        return a * x.half().float() + b         # the stand-in encoder gets the frame as the session hands it (fp16)
    return reencode


def _schedule_text(cfg) -> str:
    return "\n".join(["0: p0"] + [krea_schedule_line(ch["block"], f"p{ch['prompt']}", ch["interp_steps"])
                                  for ch in cfg["prompt_changes"]])


def _provider(io, first_chunk: int = 0):
    """The official draws as a noise provider; ``first_chunk``: the video's chunk of the run's chunk 0 (a play
    session's step continues the video: its one chunk is chunk 0 of its run)."""
    def provide(ci, step, shape, dtype, dev):
        ci += first_chunk
        if step < 0:                            # a chunk's initial noise (a play session draws it per chunk)
            fpb = shape[1]
            return io["initial_noise"][:, ci * fpb:(ci + 1) * fpb].reshape(shape).to(dev, dtype)
        return io[f"extra_noise.block{ci}.step{step}"].reshape(shape).to(dev, dtype)
    return provide


def _run(model, case, path, policy=None, schedule_text=None):
    cfg, io = FIXTURES[case]
    s = cfg["session"]
    k, fpb = s["kv_cache_num_frames"], s["num_frame_per_block"]
    seen = []
    policy = policy or KreaRecompute(k, fpb, reencode=_reencode(cfg, seen))
    calls = []
    out = run_causal(model, None, io["initial_noise"], krea_schedule(s["num_denoising_steps"], s["strength"],
                                                                        s["timestep_shift"]),
                        fpb, noise_provider=_provider(io), kv_window=k + fpb, path=path,
                        prompt_schedule=schedule_text or _schedule_text(cfg),
                        prompt_embeddings={f"p{i}": io[f"prompt{i}"] for i in range(3)},
                        recache="none", cache_policy=policy, tracer=calls.append,
                        fast_options={"cuda_graphs": "off"} if path == "optimized" else None)
    return out, calls, policy, seen


@pytest.mark.parametrize("path", ["reference", "optimized"])
@pytest.mark.parametrize("case", CASES)
def test_matches_the_official_session_chunk_by_chunk(model, case, path):
    cfg, io = FIXTURES[case]
    s = cfg["session"]
    out, calls, policy, seen = _run(model, case, path)
    denoise = [c for c in calls if c["kind"] == "denoise"]
    official = [c for c in cfg["calls"] if not c["context"]]
    assert len(denoise) == len(official) == s["num_blocks"] * s["num_denoising_steps"]
    # every denoising call: the same position and timestep, the same x0
    for c, o in zip(denoise, official):
        assert (c["chunk"], c["current_start"]) == (o["block"], o["current_start"])
        assert c["t"] == pytest.approx(o["timestep"], abs=1e-3)
        ref = io[f"block{c['chunk']}.step{c['step']}.x0"]
        assert (c["x0"] - ref).abs().max() <= TOL, (c["chunk"], c["step"])
    assert (out - io["output"]).abs().max() <= TOL
    # the contexts were as long as the official recomputes, and the re-encoded frame is the official one
    contexts = [c["frames"] for c in cfg["calls"] if c["context"]]
    assert [n for _f0, n in policy.positions[1:]] == contexts
    official_inputs = [io[f"reencode_input.{i}"] for i in range(len([k for k in io if k.startswith("reencode_")]))]
    assert len(seen) == len(official_inputs) > 0
    for got, want in zip(seen, official_inputs):
        assert within(got[0, 0].half(), want, TOL + dtype_step(torch.float16, want))   # the official's float16 copy


def test_the_partial_block_fixture_attends_padding_keys_and_tells_them_apart(model):
    """The official mask let the 5-frame context's last block attend 6 zero padding keys (the policy's
    ``padding_keys``); a recompute without them does not match the official session."""
    cfg, io = FIXTURES["partial_block"]
    s = cfg["session"]
    assert cfg["context_mask"]["5"]["padding_keys_attended_by_last_query"] == \
        padding_keys(5, s["frame_seq_length"], s["num_frame_per_block"]) == 6
    assert cfg["context_mask"]["3"]["padding_keys_attended_by_last_query"] == 0
    unpadded = UnpaddedRecompute(s["kv_cache_num_frames"], s["num_frame_per_block"], reencode=_reencode(cfg))
    out, *_ = _run(model, "partial_block", "reference", policy=unpadded)
    # block 0 and 1 (contexts of 0 and 3 frames) are unaffected; from block 2 on it differs
    assert (out[:, :6] - io["output"][:, :6]).abs().max() <= TOL
    assert (out[:, 6:9] - io["output"][:, 6:9]).abs().max() > 10 * TOL


def test_the_interrupted_fixture_follows_krea_entries_not_the_linear_mapping(model):
    cfg, io = FIXTURES["interrupted"]
    blocks = cfg["session"]["num_blocks"]
    prompts = {f"p{i}": io[f"prompt{i}"] for i in range(3)}
    sched = PromptSchedule.parse(_schedule_text(cfg))
    for b, ctx in enumerate(sched.contexts(prompts, blocks)):
        assert (ctx - io[f"block{b}.prompt_embeds"]).abs().max() <= TOL, b
    # the interrupting changes' first blocks repeat the embedding in effect
    assert torch.equal(io["block2.prompt_embeds"], io["prompt0"])
    assert torch.equal(io["block4.prompt_embeds"], io["block3.prompt_embeds"])
    # the (blend N - 1) mapping of an uninterrupted change lets the interrupted blends go on: other embeddings,
    # other frames
    linear = "\n".join(["0: p0"] + [f"{ch['block'] + 1}: p{ch['prompt']} (blend {ch['interp_steps'] - 1})"
                                    for ch in cfg["prompt_changes"]])
    # krea_schedule_entry is krea_schedule_line's one implementation: never the linear mapping
    for ch in cfg["prompt_changes"]:
        chunk, blend = krea_schedule_entry(ch["block"], ch["interp_steps"])
        assert f"{chunk}: p{ch['prompt']} (blend {blend})" == krea_schedule_line(ch["block"], f"p{ch['prompt']}",
                                                                               ch["interp_steps"])
    lin_ctx = PromptSchedule.parse(linear).contexts(prompts, blocks)
    assert max((lin_ctx[b] - io[f"block{b}.prompt_embeds"]).abs().max() for b in range(blocks)) > 100 * TOL
    out, *_ = _run(model, "interrupted", "reference", schedule_text=linear)
    assert (out - io["output"]).abs().max() > 100 * TOL


@pytest.mark.parametrize("case", CASES)
def test_live_play_types_the_official_prompts_and_makes_the_official_frames(model, case, monkeypatch):
    """A play session under recache krea, the official prompt changes typed at their blocks, the official noise given
    to its chunks: the official latents chunk by chunk. A change over Krea's default 4 blocks is typed as the plain
    prompt (its server interpolates a prompt sent without a step count over ``KREA_INTERP_STEPS`` blocks: here the
    change at block 2 of ``interrupted``, which interrupts one and is interrupted itself), the others with their
    ``(blend N, krea)``; between changes the panel sends the prompt in its box again, which changes nothing (Krea's
    server ignores a prompt equal to the one in effect). The schedule file it saves makes the official latents on
    both sampler paths, chunk by chunk."""
    cfg, io = FIXTURES[case]
    s = cfg["session"]
    k, fpb, (h, w) = s["kv_cache_num_frames"], s["num_frame_per_block"], s["latent_hw"]
    real = Run._build

    def with_official_noise(run, inputs):           # the session's run and each chunk it is extended by
        first = 0 if inputs.state is None else inputs.state.frames // fpb
        return real(run, inputs.replace(noise_provider=_provider(io, first)))
    monkeypatch.setattr(Run, "_build", with_official_noise)
    seen = []
    play = PromptPlaySession(model, lambda text: io[f"prompt{int(text[1:])}"], h, w, schedule="krea",
                             frames_per_block=fpb, kv_window=k + fpb, recache="krea", prompt="p0",
                             reencode=_reencode(cfg, seen))
    changes = {ch["block"]: ch for ch in cfg["prompt_changes"]}
    typed, plain = "p0", 0
    for b in range(s["num_blocks"]):
        ch = changes.get(b)
        if ch is not None:
            default = ch["interp_steps"] == KREA_INTERP_STEPS
            typed = f"p{ch['prompt']}" + ("" if default else f" (blend {ch['interp_steps']}, krea)")
            plain += default
        play.step(typed)
        assert (play.latents[-1].transpose(1, 2) - io["output"][:, b * fpb:(b + 1) * fpb]).abs().max() <= TOL, b
    assert plain == (1 if case == "interrupted" else 0)
    assert len(play.schedule_text.splitlines()) == 1 + len(cfg["prompt_changes"])
    video = play.latent_video().transpose(1, 2)
    assert (video - io["output"]).abs().max() <= TOL
    saved = play.script_file()
    assert PromptSchedule.parse(saved) == PromptSchedule.parse(_schedule_text(cfg))
    assert len(seen) == len([key for key in io if key.startswith("reencode_input.")])
    for path in ("reference", "optimized"):
        out, *_ = _run(model, case, path, schedule_text=saved)
        for b in range(s["num_blocks"]):
            assert (out[:, b * fpb:(b + 1) * fpb] - io["output"][:, b * fpb:(b + 1) * fpb]).abs().max() <= TOL, \
                (path, b)
