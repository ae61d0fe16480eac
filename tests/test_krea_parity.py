"""Krea Realtime's per-block KV recomputation (sampling/krea.py) against the official session code's output."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from wan_accel.model.config import WanConfig
from wan_accel.model.loader import load_wan_checkpoint
from wan_accel.sampling.krea import (KreaRecompute, context_frames, krea_schedule,
                                     krea_schedule_entry)
from wan_accel.sampling.prompts import PromptSchedule
from run_helpers import run_causal

FIX = Path(__file__).parent / "fixtures" / "krea_realtime"
CFG = json.loads((FIX / "krea_config.json").read_text())
IO = load_file(str(FIX / CFG["io_file"]))
S = CFG["session"]
TOL = 1e-4


def _model():
    config = WanConfig.from_dict(CFG["config"])
    return load_wan_checkpoint(FIX / CFG["weights_file"], device="cpu", dtype=torch.float32, precision="float32",
                               config=config, attention="sdpa")


def _reencode(x):
    r = CFG["reencode"]
    return r["a"] * x.half().float() + r["b"]


def _schedule_text() -> str:
    lines = ["0: p0"]
    for ch in CFG["prompt_changes"]:
        chunk, blend = krea_schedule_entry(ch["block"], ch["interp_steps"])
        lines.append(f"{chunk}: p{ch['prompt']} (blend {blend})")
    return "\n".join(lines)


def _run(path, policy=None, recache="none"):
    model = _model()
    fpb, k = S["num_frame_per_block"], S["kv_cache_num_frames"]
    policy = policy or KreaRecompute(k, fpb, reencode=_reencode)
    noise = IO["initial_noise"]

    def provide(ci, step, shape, dtype, dev):
        return IO[f"extra_noise.block{ci}.step{step}"].reshape(shape).to(dev, dtype)

    calls = []
    out = run_causal(model, None, noise, krea_schedule(S["num_denoising_steps"], S["strength"],
                                                          S["timestep_shift"]),
                        fpb, noise_provider=provide, kv_window=k + fpb, path=path,
                        prompt_schedule=_schedule_text(),
                        prompt_embeddings={f"p{i}": IO[f"prompt{i}"] for i in range(3)},
                        recache=recache, cache_policy=policy, tracer=calls.append,
                        fast_options={"cuda_graphs": "off"} if path == "optimized" else None)
    return out, calls, policy


def test_step_list_matches_the_official_one():
    sched = krea_schedule(S["num_denoising_steps"], S["strength"], S["timestep_shift"])
    assert torch.tensor(sched.timesteps) == pytest.approx(IO["denoising_step_list"], abs=1e-3)


def test_schedule_blends_equal_kreas_interpolation():
    sched = PromptSchedule.parse(_schedule_text())
    ctx = sched.contexts({f"p{i}": IO[f"prompt{i}"] for i in range(3)}, S["num_blocks"])
    for b, c in enumerate(ctx):
        assert (c - IO[f"block{b}.prompt_embeds"]).abs().max() <= TOL, b


def test_context_frames_follow_the_window():
    k, fpb = 6, 3
    assert context_frames(0, k, fpb) == []
    assert context_frames(3, k, fpb) == [0, 1, 2]
    assert context_frames(6, k, fpb) == [0, 1, 2, 3, 4, 5]
    assert context_frames(9, k, fpb) == [-1 - 3, 4, 5, 6, 7, 8]         # frame 3 re-encoded, then 4..8
    assert context_frames(9, k, fpb, keep_first_frame=True) == [0, 4, 5, 6, 7, 8]
    with pytest.raises(ValueError, match="kv_cache_num_frames"):
        KreaRecompute(1, 3)


@pytest.mark.parametrize("path", ["reference", "optimized"])
def test_matches_the_official_session(path):
    out, calls, policy = _run(path)
    worst = (out - IO["output"]).abs().max().item()
    assert worst <= TOL, worst
    # the model positions: capped at K once K frames exist, as the official current_start
    ft = S["frame_seq_length"]
    denoise = [c for c in calls if c["kind"] == "denoise"]
    official = [c for c in CFG["calls"] if not c["context"]]
    assert [c["current_start"] for c in denoise] == [c["current_start"] for c in official]
    assert max(c["current_start"] for c in denoise) == S["kv_cache_num_frames"] * ft
    for c in denoise:
        ref = IO[f"block{c['chunk']}.step{c['step']}.x0"]
        assert (c["x0"] - ref).abs().max() <= TOL, (c["chunk"], c["step"])


def test_without_the_policy_it_differs():
    """The fixture tells the policy apart: the same run with a plain global cache does not match it."""
    model = _model()
    fpb = S["num_frame_per_block"]
    noise = IO["initial_noise"]
    out = run_causal(model, None, noise, krea_schedule(S["num_denoising_steps"]), fpb,
                        noise_provider=lambda ci, st, shape, dt, dev: IO[f"extra_noise.block{ci}.step{st}"],
                        path="reference", prompt_schedule=_schedule_text(), recache="none",
                        prompt_embeddings={f"p{i}": IO[f"prompt{i}"] for i in range(3)})
    assert (out - IO["output"]).abs().max() > 100 * TOL
