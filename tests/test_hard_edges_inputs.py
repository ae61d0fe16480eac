"""Inputs at the hard edges: runs that cannot fit are refused before anything is allocated, every input that sizes
work is bounded, and values that would give a NaN video are refused at every entry point."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from cli_run import refused, run_cli_in


# ----------------------------------------------------------------------------------------------- memory
def test_generate_too_large_is_refused_with_the_estimate_and_what_fits(tmp_path):
    import re

    from wan_accel.memory.estimate import sampling_need
    from wan_accel.model.tiny import TINY_CONFIG

    limit_gb = 2                     # WAN_ACCEL_MEMORY_LIMIT_GB caps the RAM counted on, whatever the host has
    line = refused(run_cli_in(tmp_path, "generate", "--frames", "4089", "--width", "4096", "--height", "4096",
                              "--device", "cpu", "--out", "out", env={"WAN_ACCEL_MEMORY_LIMIT_GB": str(limit_gb)}),
                   "--frames 4089", "GiB", "RAM available", "would fit")
    assert not (tmp_path / "out").exists()
    # the frame count it suggests fits the same estimate within the limit, one block more does not
    fewer = int(re.search(r"--frames (\d+) or fewer", line).group(1))
    assert sum(sampling_need(TINY_CONFIG.to_dict(), fewer, 4096, 4096).values()) <= limit_gb * 1024 ** 3
    assert sum(sampling_need(TINY_CONFIG.to_dict(), fewer + 12, 4096, 4096).values()) > limit_gb * 1024 ** 3


@pytest.mark.parametrize("value", ["abc", "0", "-3", "nan", "inf"])
def test_memory_limit_variable_is_checked(tmp_path, value):
    refused(run_cli_in(tmp_path, "generate", "--device", "cpu", "--out", "out",
                       env={"WAN_ACCEL_MEMORY_LIMIT_GB": value}), "WAN_ACCEL_MEMORY_LIMIT_GB")


def test_memory_limit_caps_what_every_estimate_counts_on(monkeypatch):
    from wan_accel.app.validate import device_memory
    from wan_accel.memory.system import detect_system, host_memory

    monkeypatch.setenv("WAN_ACCEL_MEMORY_LIMIT_GB", "0.5")
    assert host_memory()[1] <= 2 ** 29 and detect_system("cpu").host_ram_available <= 2 ** 29
    budget, where = device_memory("cpu")
    assert budget <= 2 ** 29
    monkeypatch.delenv("WAN_ACCEL_MEMORY_LIMIT_GB")
    assert "WAN_ACCEL_MEMORY_LIMIT_GB" not in device_memory("cpu")[1]


def test_fit_check_reports_device_memory_and_options():
    from wan_accel.app.validate import UsageError, check_fits
    from wan_accel.memory.estimate import fit_problem, sampling_need
    from wan_accel.model.tiny import TINY_CONFIG

    cfg = TINY_CONFIG.to_dict()
    need = sampling_need(cfg, 81, 512, 512)
    budget = sum(need.values()) - 1
    msg = fit_problem(cfg, 81, 512, 512, budget, "the test device has 1 byte", names={"kv_window": "kv_window"})
    assert msg and "the test device has 1 byte" in msg and "rolling kv_window" in msg and "frames" in msg
    assert fit_problem(cfg, 81, 512, 512, budget + 1, "x") is None
    # the global KV cache grows with frames, a window does not
    assert sampling_need(cfg, 81, 512, 512, kv_window=6)["kv_cache"] < need["kv_cache"]
    check_fits(cfg, 9, 32, 32, device="cpu")                       # a small run passes
    with pytest.raises(UsageError, match="num_frames 4089"):
        check_fits(dict(cfg, dim=4096, ffn_dim=16384, num_layers=64), 4089, 4096, 4096, device="cpu",
                   names={"frames": "num_frames"})


def test_sampler_node_refuses_before_allocating():
    from wan_accel.nodes.model_nodes import CausalWanModelLoader, CausalWanSampler

    (handle,) = CausalWanModelLoader().load("(built-in tiny model)", "fp32", "self_forcing", "sdpa")
    handle.model.config.dim, handle.model.config.num_layers = 1 << 16, 1 << 10   # a huge model, as seen by sizing
    try:
        with pytest.raises(ValueError, match=r"num_frames 4089 at 4096x4096 needs about .* GiB"):
            CausalWanSampler().sample(handle, 4096, 4096, 4089, 0, "self_forcing", 3, -1, 0)
    finally:
        handle.model.config.dim, handle.model.config.num_layers = 64, 2


# ----------------------------------------------------------------------------------------------- actions
@pytest.mark.parametrize("script, words", [
    ("W*4000000000", ["item 1", "4092"]),
    ("W*2000, A*2000, D*200", ["item 3", "4092"]),
    ("W*" + "9" * 5000, ["item 1", "4092"]),
    ("W*²", ["item 1", "count"]),
    ("W*4, mouse(1e308,-1e308)*4", ["item 2", "mouse"]),
    ("W*4, mouse(0,nan)*4", ["item 2"]),
])
def test_action_script_bounds(script, words):
    from wan_accel.sampling.actions_script import ActionScriptError, parse_action_script

    with pytest.raises(ActionScriptError) as info:
        parse_action_script(script)
    for w in words:
        assert w in str(info.value), str(info.value)


def test_action_script_text_length_is_bounded():
    from wan_accel.sampling.actions_script import MAX_SCRIPT_CHARS, ActionScriptError, parse_action_script

    with pytest.raises(ActionScriptError, match="characters"):
        parse_action_script("idle," * (MAX_SCRIPT_CHARS // 5 + 1) + "idle*3")
    assert parse_action_script("W*4088, idle*4").video_frames == 4093


def test_explicit_action_values_are_bounded():
    from wan_accel.sampling.actions_script import ActionScriptError, GameActions, check_action_values

    kb = [[1.0, 0.0, 0.0, 0.0]] * 5
    with pytest.raises(ActionScriptError, match="mouse value"):
        check_action_values(GameActions("universal", kb, [[0.0, 0.0]] * 4 + [[1e308, 0.0]]))
    with pytest.raises(ActionScriptError, match="mouse value"):
        check_action_values(GameActions("universal", kb, [[0.0, math.inf]] * 5))
    assert check_action_values(GameActions("universal", kb, [[0.1, -0.1]] * 5)).video_frames == 5


def test_cli_actions_bound(tmp_path):
    refused(run_cli_in(tmp_path, "generate", "--model-kind", "matrix-game2", "--actions", "W*4000000000",
                       "--out", "out"), "--actions", "item 1")
    refused(run_cli_in(tmp_path, "generate", "--model-kind", "matrix-game2", "--actions", "mouse(1e308,-1e308)*4",
                       "--out", "out"), "mouse")


# ----------------------------------------------------------------------------------------------- world size
@pytest.mark.parametrize("world, words", [("0", ["--world-size"]), ("-2", ["--world-size"]),
                                          ("100000", ["--world-size"]), ("3", ["--world-size 3", "heads"])])
def test_bench_world_size_checked_before_any_rank(tmp_path, world, words):
    refused(run_cli_in(tmp_path, "bench", "sampler", "--world-size", world, "--device", "cpu"), *words)


@pytest.mark.parametrize("env, words", [
    ({"WORLD_SIZE": "0"}, ["WORLD_SIZE"]), ({"WORLD_SIZE": "-1"}, ["WORLD_SIZE"]),
    ({"WORLD_SIZE": "100000"}, ["WORLD_SIZE"]), ({"WORLD_SIZE": "3"}, ["WORLD_SIZE 3", "heads"]),
    ({"WORLD_SIZE": "2"}, ["RANK", "torchrun"]), ({"WORLD_SIZE": "x"}, ["WORLD_SIZE"]),
    ({"WORLD_SIZE": "2", "RANK": "7", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, ["RANK"]),
])
def test_generate_world_env_checked(tmp_path, env, words):
    refused(run_cli_in(tmp_path, "generate", "--device", "cpu", "--out", "out", env=env), *words)
    assert not (tmp_path / "out").exists()


def test_run_ranks_refuses_a_world_before_starting():
    from wan_accel.app.ranks.parallel import MAX_WORLD, check_world, run_ranks
    from wan_accel.app.validate import UsageError

    for world in (0, -1, MAX_WORLD + 1, 100000):
        with pytest.raises(ValueError, match="world must be"):
            run_ranks(print, world)
    with pytest.raises(UsageError, match="divide"):
        check_world(3, 4, device="cpu")
    assert check_world(1, 4, device="cpu") == 1


# ----------------------------------------------------------------------------------------------- schedules
def test_tiny_shift_is_refused_at_every_entry(tmp_path):
    from wan_accel.nodes.native_nodes import causal_sigmas
    from wan_accel.sampling.scheduler import resolve_schedule

    refused(run_cli_in(tmp_path, "generate", "--shift", "1e-8", "--device", "cpu", "--out", "out"), "--shift", "inf")
    with pytest.raises(ValueError, match="inf"):
        resolve_schedule("self_forcing", shift=1e-8)
    with pytest.raises(ValueError, match="finite"):
        causal_sigmas("custom", "1000,750,500,250", float("nan"), True)
    with pytest.raises(ValueError, match="finite"):
        resolve_schedule("custom", steps=[1000, float("nan")])
    sched = resolve_schedule("self_forcing", shift=5.0)
    assert all(math.isfinite(t) and 0 <= t <= 1000 for t in sched.timesteps)


@pytest.mark.parametrize("sigmas", [[1, float("nan"), 0], [float("inf"), 0], [1.0, 0.5, float("nan")],
                                    [1.0, -0.5, 0], [2.0, 0]])
def test_sigma_lists_are_finite_and_in_range(sigmas):
    from wan_accel.sampling.scheduler import ScheduleError, check_sigmas, schedule_from_sigmas

    with pytest.raises(ValueError):
        schedule_from_sigmas(sigmas)
    with pytest.raises(ScheduleError):
        check_sigmas(sigmas, "sigmas")
    assert schedule_from_sigmas([1.0, 0.5, 0.0]).timesteps == [1000.0, 500.0]


# ----------------------------------------------------------------------------------------------- options
@pytest.mark.parametrize("given", [("--kv-window", "6"), ("--sink", "1"), ("--frames-per-block", "3"),
                                   ("--sink", "0"), ("--kv-window", "-1"), ("--no-warp",), ("--compile",)])
def test_wan_options_refused_for_matrix_game2(tmp_path, given):
    """Any Wan option given explicitly, its default value included, is refused for Matrix-Game-2."""
    refused(run_cli_in(tmp_path, "generate", "--model-kind", "matrix-game2", *given, "--out", "out"), given[0],
            "matrix-game2")


def test_largest_seed_runs_matrix_game2(tmp_path):
    code, out, err = run_cli_in(tmp_path, "generate", "--model-kind", "matrix-game2", "--seed", str(2 ** 64 - 1),
                                "--device", "cpu", "--actions", "W*12", "--no-preview", "--out", "out")
    assert code == 0, err
    from safetensors.torch import load_file
    assert torch.isfinite(load_file(str(tmp_path / "out" / "latents.safetensors"))["latents"]).all()


def test_plan_capability_and_doctor_head_dim(tmp_path):
    refused(run_cli_in(tmp_path, "plan", "--model", "1.3b", "--capability", "9", "--vram-gb", "8"), "--capability")
    refused(run_cli_in(tmp_path, "plan", "--model", "1.3b", "--capability", "x.y"), "--capability")
    refused(run_cli_in(tmp_path, "doctor", "--head-dim", "0"), "--head-dim")
    refused(run_cli_in(tmp_path, "doctor", "--head-dim", "127"), "--head-dim", "even")
    refused(run_cli_in(tmp_path, "doctor", "--head-dim", "100000"), "--head-dim")


# ----------------------------------------------------------------------------------------------- continuation
def sample_video_with_state(model, spec, context, width, height, num_frames, state=None):
    """(new latents, state after them): a continuable run through the one prepare call."""
    from wan_accel.app.prepare import prepare_video
    from wan_accel.sampling.request import RunInputs
    run = prepare_video(model, spec, RunInputs(context=context, state=state), width, height, num_frames,
                        keep_state=True)
    return run.latents(), run.state


def test_state_of_other_weights_is_refused():
    from wan_accel.app.prepare import RunSpec
    from wan_accel.model.tiny import tiny_causal_model

    a = tiny_causal_model(0, "cpu", torch.float32, "float32")
    b = tiny_causal_model(1, "cpu", torch.float32, "float32")       # same structure, other weights
    ctx = torch.zeros(1, 0, a.config.text_dim)
    _, state = sample_video_with_state(a, RunSpec(), ctx, 32, 32, 9)
    with pytest.raises(ValueError, match="model weights"):
        sample_video_with_state(b, RunSpec(), ctx, 32, 32, 21, state=state)
    first = next(a.parameters())
    saved = first.detach().clone()
    with torch.no_grad():                                             # patched in place: also other weights
        first.add_(1.0)
    with pytest.raises(ValueError, match="model weights"):
        sample_video_with_state(a, RunSpec(), ctx, 32, 32, 21, state=state)
    with torch.no_grad():
        first.copy_(saved)
    more, _ = sample_video_with_state(a, RunSpec(), ctx, 32, 32, 21, state=state)
    assert more.shape[1] == 3


def test_state_of_weights_loaded_as_inference_tensors():
    """ComfyUI loads weights as inference tensors (no in-place version counter): a continuation on the same
    weights goes on, other weights or a weight patched in place are refused."""
    from wan_accel.app.prepare import RunSpec
    from wan_accel.model.tiny import tiny_causal_model

    with torch.inference_mode():
        a = tiny_causal_model(0, "cpu", torch.float32, "float32")
        b = tiny_causal_model(1, "cpu", torch.float32, "float32")
    assert next(a.parameters()).is_inference()
    ctx = torch.zeros(1, 0, a.config.text_dim)
    with torch.inference_mode():
        _, state = sample_video_with_state(a, RunSpec(), ctx, 32, 32, 9)
        more, _ = sample_video_with_state(a, RunSpec(), ctx, 32, 32, 21, state=state)
        assert more.shape[1] == 3
        with pytest.raises(ValueError, match="model weights"):
            sample_video_with_state(b, RunSpec(), ctx, 32, 32, 21, state=state)
        next(a.parameters()).add_(1.0)                                # in place, no version counter to see it
        with pytest.raises(ValueError, match="model weights"):
            sample_video_with_state(a, RunSpec(), ctx, 32, 32, 21, state=state)


def test_mg2_node_refuses_out_of_range_actions():
    from wan_accel.app.jobs.mg2 import load_mg2_handle
    from wan_accel.nodes.mg2_nodes import GameActions, MatrixGame2Sampler

    handle = load_mg2_handle(None, dtype="fp32", device="cpu", seed=3)
    actions = GameActions().build("W*8, look_left*12, idle*4", "universal")["result"][0]
    actions.mouse[3] = [1e308, -1e308]
    clip = SimpleNamespace(penultimate_hidden_states=torch.randn(1, 9, 32))
    with pytest.raises(ValueError, match="mouse value"):
        MatrixGame2Sampler().sample(handle, {"samples": torch.randn(1, 16, 1, 8, 8)}, clip, actions, seed=1)


# ----------------------------------------------------------------------------------------------- every entry point
def _device_with(monkeypatch, budget):
    """The device memory every fit check reads, set to ``budget`` bytes (the host's RAM plays no part)."""
    import wan_accel.app.validate as validate

    monkeypatch.setattr(validate, "device_memory", lambda device=None: (budget, f"the test device has {budget} B"))


def _need(config: dict, frames, height, width, **kw) -> int:
    from wan_accel.memory.estimate import sampling_need

    return sum(sampling_need(config, frames, height, width, **kw).values())


@pytest.mark.parametrize("keep_state", [False, True])
def test_python_api_refuses_before_allocating(monkeypatch, capsys, keep_state):
    import wan_accel.app.prepare as job
    import wan_accel.app.run as run
    from wan_accel.sampling.request import RunInputs
    from wan_accel.model.tiny import tiny_causal_model

    model = tiny_causal_model(0, "cpu", torch.float32, "float32")
    ctx = torch.zeros(1, 0, model.config.text_dim)
    need = _need(model.config.to_dict(), 9, 32, 32)
    _device_with(monkeypatch, need - 1)

    def no_tensors(*_a, **_k):
        raise AssertionError("sampling started")

    with monkeypatch.context() as m:
        m.setattr(run, "build_request", no_tensors)
        m.setattr(run, "continued", no_tensors)
        with pytest.raises(ValueError, match=r"num_frames 9 at 32x32 needs about .* test device has"):
            job.prepare_video(model, job.RunSpec(), RunInputs(context=ctx), 32, 32, 9, keep_state=keep_state)
    _device_with(monkeypatch, need)                      # exactly the estimate: runs, and the check says nothing
    out = job.prepare_video(model, job.RunSpec(), RunInputs(context=ctx), 32, 32, 9, keep_state=keep_state).latents()
    assert out.shape[1] == 3 and torch.isfinite(out).all()
    assert capsys.readouterr().err == ""


def _native_base(seed=2):
    from wan_accel.model.tiny import tiny_causal_model

    class WAN21_CausalAR:                      # noqa: N801 - named as ComfyUI's class, which the sampler checks
        def __init__(self, dm):
            self.diffusion_model = dm
            self.model_sampling = SimpleNamespace(multiplier=1000.0)

        def get_dtype_inference(self):
            return torch.float32

    dm = tiny_causal_model(seed=seed)
    dm.model_type, dm.num_heads, dm.text_len = "t2v", dm.config.num_heads, dm.config.text_len
    base = WAN21_CausalAR(dm)
    ctx = torch.randn(1, 5, dm.config.text_dim, generator=torch.Generator().manual_seed(4))
    guider = SimpleNamespace(inner_model=base, conds={
        "positive": [{"model_conds": {"c_crossattn": SimpleNamespace(cond=ctx)}}]}, cfg=1.0)
    return SimpleNamespace(inner_model=guider), base


def test_native_ar_sampler_refuses_before_building_the_engine(monkeypatch):
    import wan_accel.nodes.comfy.native_engine as engine
    from wan_accel.model.borrowed import borrowed_config
    from wan_accel.sampling.scheduler import resolve_schedule

    model_k, base = _native_base()
    x = torch.randn(1, 16, 6, 8, 8)                       # [B, C, T, H, W]: 21 video frames at 64x64
    sigmas = torch.tensor(resolve_schedule("self_forcing").sigmas())
    cfg = borrowed_config(base.diffusion_model, num_heads=base.diffusion_model.num_heads).to_dict()
    need = _need(cfg, 21, 64, 64)
    _device_with(monkeypatch, need - 1)
    with monkeypatch.context() as m:
        m.setattr(engine, "engine_for", lambda *a, **k: (_ for _ in ()).throw(AssertionError("engine built")))
        with pytest.raises(ValueError, match=r"length 21 at 64x64 needs about .* test device has"):
            engine.sample_wan_accel(model_k, x, sigmas, extra_args={"seed": 1}, path="reference")
    _device_with(monkeypatch, need)
    out = engine.sample_wan_accel(model_k, x, sigmas, extra_args={"seed": 1}, path="reference")
    assert out.shape == x.shape and torch.isfinite(out).all()


class _FakeVAE:
    """A Wan-like VAE (4x time, 8x space) that counts its decode calls."""
    latent_dim = 3

    def __init__(self):
        self.calls = 0

    def temporal_compression_decode(self):
        return 4

    def spacial_compression_decode(self):
        return 8

    def decode(self, latent):
        self.calls += 1
        b, _, t, h, w = latent.shape
        return torch.zeros(b, 1 + 4 * (t - 1), 8 * h, 8 * w, 3)


def test_chunked_vae_decode_refuses_a_video_that_cannot_be_held(monkeypatch):
    from wan_accel.memory.estimate import decoded_video_bytes
    from wan_accel.nodes.memory_nodes import WanChunkedVAEDecode

    latent = torch.zeros(1, 16, 5, 8, 8)
    need = decoded_video_bytes(5, 8, 8)
    assert need == 17 * 64 * 64 * 3 * 4                   # 17 float32 RGB frames of 64x64
    _device_with(monkeypatch, need - 1)
    vae = _FakeVAE()
    with pytest.raises(ValueError, match=r"samples: 5 latent frames at 64x64 .* at most 4 latent frames"):
        WanChunkedVAEDecode().decode({"samples": latent}, vae, chunk_frames=2)
    assert vae.calls == 0
    _device_with(monkeypatch, need)
    (images,) = WanChunkedVAEDecode().decode({"samples": latent}, vae, chunk_frames=2)
    assert images.shape == (17, 64, 64, 3) and vae.calls >= 1


# ----------------------------------------------------------------------------------------------- other weights
def test_matrix_game2_state_of_other_weights_is_refused():
    from wan_accel.model.mg2_model import tiny_mg2_model
    from run_helpers import sample_mg2_continuable

    a, b = tiny_mg2_model(seed=7), tiny_mg2_model(seed=8)                 # same structure, other weights
    g = torch.Generator().manual_seed(4)
    img, ctx = torch.randn(1, 16, 1, 4, 4, generator=g), torch.randn(1, 9, 32, generator=g)
    mouse, keyboard = 0.1 * torch.randn(1, 21, 2, generator=g), (torch.rand(1, 21, 4, generator=g) < 0.4).float()
    _, state = sample_mg2_continuable(a, img, ctx, mouse[:, :9], keyboard[:, :9], 3, seed=3)
    with pytest.raises(ValueError, match="model weights"):
        sample_mg2_continuable(b, img, ctx, mouse[:, 9:], keyboard[:, 9:], 6, state=state)
    more, _ = sample_mg2_continuable(a, img, ctx, mouse[:, 9:], keyboard[:, 9:], 6, state=state)
    assert more.shape[2] == 3


def test_play_session_refuses_weights_changed_between_chunks():
    from wan_accel.app.play.registry import PlayError, PlaySession
    from wan_accel.model.mg2_model import tiny_mg2_model

    g = torch.Generator().manual_seed(2)
    model = tiny_mg2_model(seed=7)
    play = PlaySession(model, torch.randn(1, 16, 1, 4, 4, generator=g), torch.randn(1, 9, 32, generator=g), seed=5)
    play.step({"w"})
    first = next(model.parameters())
    saved = first.detach().clone()
    with torch.no_grad():                                  # another fine-tune loaded into the same modules
        first.add_(0.5)
    with pytest.raises(PlayError, match="weights changed"):
        play.step({"w"})
    assert play.chunks == 1 and not play.ended            # nothing made, the session goes on
    with torch.no_grad():
        first.copy_(saved)
    play.step({"w"})
    assert play.chunks == 2


# ----------------------------------------------------------------------------------------------- node values
def _tiny_handle():
    from wan_accel.nodes.model_nodes import CausalWanModelLoader

    return CausalWanModelLoader().load("(built-in tiny model)", "fp32", "self_forcing", "sdpa")[0]


def _causal_node(widget, value):
    from wan_accel.nodes.model_nodes import CausalWanSampler

    kw = dict(seed=0, preset="custom", shift=5.0, custom_steps="1000,750,500,250")
    kw[widget] = value
    seed = kw.pop("seed")
    CausalWanSampler().sample(_tiny_handle(), 32, 32, 9, seed, frames_per_block=3, kv_window=-1, sink=0, **kw)


def _mg2_node(widget, value):
    from wan_accel.app.jobs.mg2 import load_mg2_handle
    from wan_accel.nodes.mg2_nodes import GameActions, MatrixGame2Sampler

    handle = load_mg2_handle(None, dtype="fp32", device="cpu", seed=3)
    actions = GameActions().build("W*8, look_left*4", "universal")["result"][0]
    kw = {"seed": 1}
    if widget == "actions":
        actions.mouse[3] = [value, 0.0]
    else:
        kw[widget] = value
    clip = SimpleNamespace(penultimate_hidden_states=torch.randn(1, 9, 32))
    MatrixGame2Sampler().sample(handle, {"samples": torch.randn(1, 16, 1, 8, 8)}, clip, actions, **kw)


def _native_node(widget, value):
    from wan_accel.nodes.comfy.native_engine import sample_wan_accel
    from wan_accel.nodes.native_nodes import causal_sigmas

    model_k, _ = _native_base()
    kw = {"frames_per_block": 3, "kv_window": -1, "sink": 0}
    sigmas, seed = causal_sigmas("self_forcing"), 1
    if widget == "shift":
        sigmas = causal_sigmas("custom", "1000,750,500,250", value, True)
    elif widget == "sigmas":
        sigmas = torch.tensor([1.0, value, 0.0])
    elif widget == "noise_seed":
        seed = value
    else:
        kw[widget] = value
    sample_wan_accel(model_k, torch.randn(1, 16, 3, 8, 8), sigmas, extra_args={"seed": seed}, path="reference",
                     **kw)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("node, widget, value", [
    (_causal_node, "seed", 2 ** 64), (_causal_node, "seed", -1), (_causal_node, "shift", NAN),
    (_causal_node, "shift", INF), (_causal_node, "shift", 1e-8), (_causal_node, "custom_steps", "1000,nan"),
    (_mg2_node, "seed", 2 ** 64), (_mg2_node, "seed", -5), (_mg2_node, "actions", NAN),
    (_mg2_node, "actions", 1e308),
    (_native_node, "noise_seed", 2 ** 64), (_native_node, "noise_seed", -1), (_native_node, "shift", NAN),
    (_native_node, "shift", 1e-8), (_native_node, "sigmas", NAN), (_native_node, "sigmas", INF),
    (_native_node, "frames_per_block", 0), (_native_node, "kv_window", -7), (_native_node, "sink", -1),
])
def test_sampler_nodes_refuse_bad_values_naming_the_widget(node, widget, value):
    with pytest.raises(ValueError) as info:
        node(widget, value)
    text = str(info.value)
    assert ("mouse" if widget == "actions" else widget) in text, text


@pytest.mark.parametrize("node", [_causal_node, _mg2_node, _native_node])
def test_sampler_nodes_take_the_largest_seed(node):
    node("noise_seed" if node is _native_node else "seed", 2 ** 64 - 1)


@pytest.mark.parametrize("content", [b"hello", b"\x80\x02}q\x00(X\x01", b"PK\x03\x04" + b"\x00" * 40])
def test_convert_reports_any_unreadable_pt_file_as_damaged(tmp_path, content):
    """Garbage bytes fail the weights-only unpickler in many ways (KeyError, struct.error, ...): each is one
    'not a readable PyTorch checkpoint' line with exit 2, and nothing is written."""
    (tmp_path / "bad.pt").write_bytes(content)
    line = refused(run_cli_in(tmp_path, "convert", "bad.pt", "out.safetensors"), "bad.pt", "not a readable PyTorch")
    assert "internal error" not in line and not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("fill, words", [
    (lambda: torch.full((5, 64), float("nan")), "NaN or inf"),
    (lambda: torch.full((1, 5, 64), float("inf")), "NaN or inf"),
    (lambda: torch.zeros(5, 64, dtype=torch.int64), "floating-point"),
    (lambda: torch.zeros(2, 5, 64), "[1, L, 64]"),
])
def test_text_embeds_that_would_give_a_nan_video_are_refused(tmp_path, fill, words):
    """The one text-embedding reader refuses non-finite values, whole numbers and a batch of prompts (exit 2,
    naming the file), before sampling; the tiny model's text width is 64."""
    from safetensors.torch import save_file
    save_file({"context": fill()}, str(tmp_path / "emb.safetensors"))
    refused(run_cli_in(tmp_path, "generate", "--out", "o", "--no-preview", "--text-embeds", "emb.safetensors"),
            "emb.safetensors", words)
    assert not (tmp_path / "o" / "latents.safetensors").exists()


def test_mg2_conditioning_with_nan_is_refused(tmp_path):
    from safetensors.torch import save_file
    save_file({"image_latent": torch.full((1, 16, 1, 8, 8), float("nan")), "visual_context": torch.zeros(1, 4, 32)},
              str(tmp_path / "cond.safetensors"))
    refused(run_cli_in(tmp_path, "generate", "--model-kind", "matrix-game2", "--out", "o", "--no-preview",
                       "--conditioning", "cond.safetensors"), "cond.safetensors", "'image_latent'", "NaN or inf")


def test_a_path_too_long_or_looping_is_a_usage_error(tmp_path):
    """ENAMETOOLONG and ELOOP from any reader are the user's to fix: one line, exit 2 (not a run failure)."""
    (tmp_path / "loop1").symlink_to("loop2")
    (tmp_path / "loop2").symlink_to("loop1")
    refused(run_cli_in(tmp_path, "report", "--history", "a" * 300 + ".jsonl"), "aaaa", "shorter path")
    refused(run_cli_in(tmp_path, "report", "--history", "loop1"), "loop1", "link loop")
