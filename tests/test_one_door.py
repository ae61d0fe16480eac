"""One door for every run (app/prepare.py): every face reaches the sampling loop with the doctor's verdicts applied,
the Wan Accel AR Sampler on ComfyUI's own MODEL included, and one spec gives the same video through every face that
can express it. ComfyUI is stood in for as in test_native_sampler.py (guider and BaseModel) and test_play_mode.py
(the play registry, events and decoder); the gate's CUDA-only condition (on CUDA 'auto' means the optimized path,
which the doctor judges) is stood in for by resolving 'auto' as on CUDA, and the doctor by a verdict that switches
fused q/k/v off."""
from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest
import torch

from wan_accel.app import prepare
from wan_accel.app.doctor import gate
from wan_accel.model.tiny import TINY_CONFIG
from wan_accel.sampling import loop, sampler

from .test_native_sampler import _native

WHY = "wrong numbers: the test's stand-in verdict"
EPS32 = torch.finfo(torch.float32).eps


class _Verdicts:
    """The doctor, stood in: fused q/k/v failed its check on this machine; everything else passed."""

    def why_off(self, name):
        return WHY if name == "fused_qkv" else None

    def unavailable(self, name):
        return None, ""


@pytest.fixture
def reached(monkeypatch):
    """The requests that reached the chunk loop, with 'auto' resolved as on CUDA and the stand-in verdicts."""
    real_resolve, real_loop = sampler.resolve_path, sampler.run_chunks

    def as_on_cuda(path, device, tracer=None, model=None):
        chosen = real_resolve(path, device, tracer, model)
        if path == "auto" and tracer is None and "forward_chunk" not in getattr(model, "__dict__", {}):
            chosen = "optimized"
        return chosen

    seen = []

    def loop(model, executor, req, inputs, hooks):
        seen.append(req)
        return real_loop(model, executor, req, inputs, hooks)
    monkeypatch.setattr(sampler, "resolve_path", as_on_cuda)
    monkeypatch.setattr(prepare, "resolve_path", as_on_cuda)
    monkeypatch.setattr(gate, "model_doctor", lambda model, doctor=None: _Verdicts())
    monkeypatch.setattr(sampler, "run_chunks", loop)
    return seen


@pytest.fixture
def run_door(monkeypatch):
    """The way to the chunk loop, in order: 'prepare' for every run prepared (``Run``, made by ``prepare`` or, for a
    model the doctor's probes prepared themselves, by ``prepare``'s second half ``app.run.Run``),
    'loop' for every time the loop runs inside a prepared run's ``latents()``, 'loop outside a run' for a face that
    reaches ``sampler.sample_causal`` or ``loop.run_chunks`` by itself."""
    events, inside = [], []
    real_init, real_latents = prepare.Run.__init__, prepare.Run.latents

    def init(self, *a, **k):
        events.append("prepare")
        real_init(self, *a, **k)

    def latents(self):
        inside.append(self)
        try:
            return real_latents(self)
        finally:
            inside.pop()

    def spy(real):
        def reach(*a, **k):
            events.append("loop" if inside else "loop outside a run")
            return real(*a, **k)
        return reach
    monkeypatch.setattr(prepare.Run, "__init__", init)
    monkeypatch.setattr(prepare.Run, "latents", latents)
    monkeypatch.setattr(sampler, "sample_causal", spy(sampler.sample_causal))
    monkeypatch.setattr(loop, "run_chunks", spy(loop.run_chunks))
    monkeypatch.setattr(sampler, "run_chunks", spy(sampler.run_chunks))
    return events


def _tiny_handle():
    from wan_accel.app.jobs.handle import load_model_handle
    return load_model_handle(None, "fp32", "float32", "sdpa", device="cpu")


def _context(seed=4):
    return torch.randn(1, 5, TINY_CONFIG.text_dim, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------------- the faces
def native_sampler(_tmp):
    from wan_accel.model.tiny import tiny_causal_model
    from wan_accel.nodes.comfy.native_engine import sample_wan_accel
    from wan_accel.sampling.scheduler import resolve_schedule
    model_k, _ = _native(tiny_causal_model(seed=2), _context())
    x = torch.randn(1, 16, 3, 4, 4, generator=torch.Generator().manual_seed(5))
    report: dict = {}
    sample_wan_accel(model_k, x, torch.tensor(resolve_schedule("self_forcing").sigmas()), extra_args={"seed": 1},
                     report=report)
    assert report["switched_off"] == {"fused_qkv": WHY}           # the sampler's report names the verdicts


def sampler_node(_tmp):
    from wan_accel.nodes.model_nodes import CausalWanSampler
    out = CausalWanSampler().sample(_tiny_handle(), 32, 32, 9, 1, "self_forcing", 3, -1, 0)
    assert "fused_qkv is switched off" in out["ui"]["text"][0]


def sampler_node_continued(_tmp):
    from wan_accel.nodes.model_nodes import CausalWanSampler
    node, handle = CausalWanSampler(), _tiny_handle()
    _, state = node.sample(handle, 32, 32, 9, 1, "self_forcing", 3, -1, 0, keep_state=True)["result"]
    assert state is not None and state.frames == 3
    latent, _ = node.sample(handle, 32, 32, 21, 1, "self_forcing", 3, -1, 0, continue_from=state)["result"]
    assert latent["samples"].shape[2] == 3                 # the frames after the state's


def generate_library(_tmp):
    prepare.sample_video(_tiny_handle().model, prepare.RunSpec(seed=1), prepare.RunInputs(context=_context()), 32,
                         32, 9)


def generate_job(tmp):
    from wan_accel.app.jobs.generate import GenerateOptions, run_generate
    report = run_generate(GenerateOptions(out_dir=str(tmp), frames=9, height=32, width=32, preview=False),
                          log=lambda *_a: None)
    assert report["features"]["switched_off"] == {"fused_qkv": WHY}


def mg2_node(_tmp):
    from wan_accel.app.jobs.mg2 import load_mg2_handle
    from wan_accel.nodes.mg2_nodes import GameActions, MatrixGame2Sampler
    handle = load_mg2_handle(None, dtype="fp32", device="cpu", seed=3)
    actions = GameActions().build("W*8, idle*4", "universal")["result"][0]
    clip = SimpleNamespace(penultimate_hidden_states=torch.randn(1, 9, 32, generator=torch.Generator().manual_seed(1)))
    MatrixGame2Sampler().sample(handle, {"samples": torch.randn(1, 16, 1, 8, 8)}, clip, actions, seed=1)


def mg2_job(tmp):
    from wan_accel.app.jobs.mg2 import MG2Options, run_mg2_generate
    run_mg2_generate(MG2Options(out_dir=str(tmp), frames=3, device="cpu", preview=False), log=lambda *_a: None)


def _play_env(monkeypatch):
    from wan_accel.app.play import registry as play_registry
    from wan_accel.app.play.registry import PlayRegistry
    from wan_accel.nodes import play_nodes
    from wan_accel.nodes.comfy import streaming_decode
    registry = PlayRegistry(reaper=False)
    monkeypatch.setattr(play_registry, "REGISTRY", registry)
    monkeypatch.setattr(streaming_decode, "WanStreamDecoder", lambda vae: None)     # ComfyUI's decoder: not here
    monkeypatch.setattr(play_nodes, "send_play_event", lambda *a, **k: None)
    return registry


def mg2_play(_tmp, monkeypatch):
    from wan_accel.nodes import play_nodes
    from wan_accel.nodes.model_nodes import TINY_MG2_NAME, CausalWanModelLoader
    registry = _play_env(monkeypatch)
    (handle,) = CausalWanModelLoader().load(TINY_MG2_NAME, "fp32", "float32", "sdpa")
    start = {"samples": torch.randn(1, 16, 1, 4, 4, generator=torch.Generator().manual_seed(4))}
    sid = play_nodes.MatrixGame2PlaySession().start(handle, object(), start, seed=11)["result"][0]
    try:
        out = play_nodes.MatrixGame2PlayStep().step(sid, "w")
        assert any("fused_qkv is switched off" in line for line in out["ui"]["text"])
    finally:
        registry.clear()


def prompt_play(_tmp, monkeypatch):
    from wan_accel.nodes.prompt_nodes import CausalWanPromptPlaySession, CausalWanPromptPlayStep
    registry = _play_env(monkeypatch)
    sid = CausalWanPromptPlaySession().start(_tiny_handle(), object(), "a cat", width=32, height=32, seed=5,
                                             frames_per_block=3, kv_window=-1, sink=0)["result"][0]
    try:
        out = CausalWanPromptPlayStep().step(sid, "")
        assert any("fused_qkv is switched off" in line for line in out["ui"]["text"])
    finally:
        registry.clear()


def bench_sampler(_tmp, capsys):
    from wan_accel.bench import sampler as bench
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--variants", "optimized", "--no-parity", "--repeat", "1", "--frames", "9",
                              "--height", "32", "--width", "32", "--device", "cpu", "--json"])
    assert bench.run(args) == 0
    json.loads(capsys.readouterr().out)


def profile(_tmp):
    from wan_accel.app.jobs import profile_targets as targets
    target = targets.ProfileTarget(device="cpu").resolved()
    model = targets.load_model(target)
    targets.sampler_call(model, target, targets.make_inputs(model, target))()


def rank_pool(_tmp, monkeypatch):
    """Rank 0 of a sequence-parallel run (the workers stood in: each runs ``sample_video`` as rank 0 does)."""
    from wan_accel.app.ranks.pool import RankPool
    from wan_accel.nodes.model_nodes import CausalWanSampler
    handle = _tiny_handle()
    pool = RankPool(2, {}, ["cpu", "cpu"])
    monkeypatch.setattr(pool, "start", lambda model: None)
    monkeypatch.setattr(pool, "collect", lambda *a, **k: None)
    handle.extra["rank_pool"] = pool
    CausalWanSampler().sample(handle, 32, 32, 9, 1, "self_forcing", 3, -1, 0)


FACES = {f.__name__: f for f in (native_sampler, sampler_node, generate_library, generate_job, mg2_node, mg2_job,
                                 mg2_play, prompt_play, bench_sampler, profile)}


# the replay tools and benches that keep the model as it is (no doctor): they reach the loop through prepare too
def bench_native(tmp):
    from wan_accel.bench import native
    from wan_accel.model.checkpoint import core_causal_metadata, expected_shapes
    from wan_accel.model.random_checkpoint import write_file
    from wan_accel.model.tiny import draw_weights
    config = native.shape_config("tiny")
    write_file(tmp / "m.safetensors", dict(draw_weights(expected_shapes(config), 0, "cpu", torch.float32)),
               core_causal_metadata(config))
    args = argparse.Namespace(path="auto", repeat=1, lora_strength=1.0)
    inputs = native._inputs(config, "tiny", 0, torch.device("cpu"))
    native.own_rows(tmp / "m.safetensors", None, args, torch.float32, torch.device("cpu"), inputs, False)


def bench_compile(_tmp):
    from wan_accel.bench.compile import wan_workload
    model, run = wan_workload("cpu")
    assert run(model).shape == (1, 6, 16, 8, 8)


def selftest_parity(tmp):
    from wan_accel.checks.selftest import fp8_stage
    assert fp8_stage("cpu", tmp)["layers"] > 0


def doctor_probe(_tmp):
    from wan_accel.app.doctor.probes import _chunk, _probe_model
    from wan_accel.app.doctor.vocabulary import ProbeContext
    ctx = ProbeContext(torch.device("cpu"), torch.float32, head_dim=16)
    assert _chunk(_probe_model(ctx), ctx).shape == (1, 3, 16, 16, 16)


DOOR_FACES = dict(FACES, sampler_node_continued=sampler_node_continued, rank_pool=rank_pool,
                  bench_native=bench_native, bench_compile=bench_compile, selftest_parity=selftest_parity,
                  doctor_probe=doctor_probe)


@pytest.mark.parametrize("face", list(DOOR_FACES))
def test_every_face_reaches_the_loop_inside_a_prepared_run(face, reached, run_door, tmp_path, monkeypatch, capsys):
    fn = DOOR_FACES[face]
    extra = {"monkeypatch": monkeypatch} if face in ("mg2_play", "prompt_play", "rank_pool") else {}
    fn(tmp_path, **({"capsys": capsys} if face == "bench_sampler" else extra))
    assert "loop" in run_door, f"{face} never reached the loop: {run_door}"
    assert "loop outside a run" not in run_door, f"{face} ran the loop outside a prepared run: {run_door}"
    assert run_door[0] == "prepare", run_door


@pytest.mark.parametrize("face", list(FACES))
def test_every_face_reaches_the_loop_with_the_doctors_verdicts(face, reached, tmp_path, monkeypatch, capsys):
    fn = FACES[face]
    extra = {"monkeypatch": monkeypatch} if face in ("mg2_play", "prompt_play") else {}
    if face == "bench_sampler":
        extra = {"capsys": capsys}
    fn(tmp_path, **extra)
    assert reached, f"{face} never reached the loop"
    for req in reached:
        assert req.path == "optimized", (face, req.path)
        assert "fused_qkv" in req.options.switched_off, (face, req.options)


# ------------------------------------------------------------------------------------ no face around the door
@pytest.fixture
def door(monkeypatch):
    """What was reached, in order: 'prepare', 'prepare_model' and 'loop' (the chunk loop, by either of its names)."""
    from wan_accel.sampling import loop
    calls: list = []

    def spy(name, owner, attr):
        real = getattr(owner, attr)
        monkeypatch.setattr(owner, attr, lambda *a, **k: calls.append(name) or real(*a, **k))
    spy("prepare", prepare, "prepare")
    spy("prepare_model", prepare, "prepare_model")
    spy("loop", sampler, "run_chunks")
    spy("loop", loop, "run_chunks")
    return calls


def through_the_door(calls: list, chunks: int = 1, runs: int = 1) -> None:
    """``runs`` runs (or play sessions), each prepared once (the model, then the run) before the loop of every one
    of its ``chunks`` chunks: a face around the door, or a session preparing again, fails this."""
    assert calls == (["prepare_model", "prepare"] + ["loop"] * chunks) * runs, calls


def _mg2_play_session(seed=11):
    from wan_accel.app.play.registry import PlaySession
    from wan_accel.model.mg2_model import tiny_mg2_model
    model = tiny_mg2_model(seed=1)
    g = torch.Generator().manual_seed(seed)
    return PlaySession(model, torch.randn(1, 16, 1, 4, 4, generator=g),
                       torch.randn(1, model.config.clip_tokens, model.config.clip_dim, generator=g), seed=seed)


def test_the_mg2_job_and_node_go_through_prepare(door, tmp_path):
    mg2_job(tmp_path)
    through_the_door(door)
    door.clear()
    mg2_node(tmp_path)
    through_the_door(door)


def test_a_t2v_play_session_is_one_run_prepared_once(door):
    from wan_accel.app.play.t2v import PromptPlaySession
    from wan_accel.model.tiny import tiny_causal_model, tiny_text_embedding
    model = tiny_causal_model(seed=3)
    encode = lambda text: tiny_text_embedding(text, model.config.text_len, model.config.text_dim)  # noqa: E731
    play = PromptPlaySession(model, encode, 4, 4, prompt="a cat", frames_per_block=3, kv_window=6, sink=3)
    for prompt in ("", "a dog", ""):
        play.step(prompt)
    through_the_door(door, chunks=3)


def test_a_mg2_play_session_is_one_run_prepared_once(door):
    play = _mg2_play_session()
    for keys in (["w"], [], ["a"]):
        play.step(keys)
    through_the_door(door, chunks=3)


def test_the_prompt_play_node_goes_through_the_sessions_one_run(door, monkeypatch):
    from wan_accel.nodes.play_nodes import MatrixGame2PlayStep
    from wan_accel.nodes.prompt_nodes import CausalWanPromptPlaySession, CausalWanPromptPlayStep
    registry = _play_env(monkeypatch)
    sid = CausalWanPromptPlaySession().start(_tiny_handle(), object(), "a cat", width=32, height=32, seed=5,
                                             frames_per_block=3, kv_window=-1, sink=0)["result"][0]
    try:
        with pytest.raises(ValueError, match="a prompt play session: use CausalWan Prompt Play Step"):
            MatrixGame2PlayStep().step(sid, "w")        # the other kind's Step node refuses it, making nothing
        for prompt in ("", "a dog"):
            CausalWanPromptPlayStep().step(sid, prompt)
    finally:
        registry.clear()
    through_the_door(door, chunks=2)


def test_bench_play_times_the_sessions_step_through_prepare(door, capsys):
    from wan_accel.cli import main
    assert main(["bench", "play", "--chunks", "1", "--warmup", "1", "--json"]) == 0
    through_the_door(door, chunks=3, runs=2)       # two modes' sessions: 1 warm-up, 1 timed and 1 counted chunk


# ------------------------------------------------------------------------------------------- one spec, one video
SEED, FRAMES, SIZE = 7, 21, 32          # 21 video frames: 6 latent frames, two 3-frame chunks of 4x4 latents


def _draws(steps: int):
    """The draws of a seeded run in the loop's order (each chunk's initial noise, then its re-noising), split as
    the native sampler takes them: the noised latent and the recorded re-noising draws."""
    g = torch.Generator().manual_seed(SEED)
    shape, inits, rec = (1, 3, 16, SIZE // 8, SIZE // 8), [], {}
    for ci in range(2):
        inits.append(torch.randn(shape, generator=g))
        for k in range(steps - 1):
            rec[f"extra_noise.block{ci}.step{k}"] = torch.randn(shape, generator=g)
    return torch.cat(inits, 1), rec


@pytest.mark.parametrize("path", ["reference", "optimized"])
def test_one_spec_gives_the_same_video_through_every_face(path, tmp_path):
    from safetensors.torch import load_file, save_file

    from wan_accel.app.jobs.generate import GenerateOptions, run_generate
    from wan_accel.nodes.model_nodes import CausalWanSampler
    from wan_accel.nodes.comfy.native_engine import RECORDED_NOISE_KEY, sample_wan_accel
    from wan_accel.sampling.scheduler import resolve_schedule
    from wan_accel.vae.latents import to_vae_latents
    handle, ctx = _tiny_handle(), _context()
    spec = prepare.RunSpec(path=path, seed=SEED)
    library = prepare.sample_video(handle.model, spec, prepare.RunInputs(context=ctx), SIZE, SIZE, FRAMES)

    node = CausalWanSampler().sample(handle, SIZE, SIZE, FRAMES, SEED, "self_forcing", 3, -1, 0, positive=[[ctx, {}]],
                                     sampler=path)[0]["samples"]
    assert torch.equal(node, to_vae_latents(library))

    save_file({"context": ctx}, str(tmp_path / "text.safetensors"))
    run_generate(GenerateOptions(out_dir=str(tmp_path), text_embeds=str(tmp_path / "text.safetensors"),
                                 frames=FRAMES, height=SIZE, width=SIZE, seed=SEED, sampler=path, preview=False),
                 log=lambda *_a: None)
    assert torch.equal(load_file(str(tmp_path / "latents.safetensors"))["latents"], library)

    sched = resolve_schedule("self_forcing")
    noise, rec = _draws(len(sched.timesteps))
    model_k, _ = _native(handle.model, ctx)
    native = sample_wan_accel(model_k, noise.movedim(1, 2), torch.tensor(sched.sigmas()),
                              extra_args={"seed": SEED, "model_options": {"transformer_options": {
                                  RECORDED_NOISE_KEY: rec}}}, frames_per_block=3, path=path).movedim(1, 2)
    assert native.shape == library.shape
    torch.testing.assert_close(native, library, rtol=0, atol=64 * EPS32 * float(library.abs().max()))
