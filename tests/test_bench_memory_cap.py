"""Cards of 8 to 32 GB on one big GPU (issue 41 items 3 and 4), on the CPU: the VRAM plan's decisions for each cap
against its own estimates, the cap's one override point (WAN_ACCEL_VRAM_CAP_GB, read by detect_system), the bench's
14B / Krea / LongLive shapes, fp8-stored random weights, and the option checks made before any work."""
import argparse
import json
import types

import pytest
import torch

from tests.cli_run import refused, run_cli
from wan_accel.bench import sampler as bench
from wan_accel.bench import sampler_setup as setup
from wan_accel.memory import system as msys
from wan_accel.memory.system import GiB, SystemInfo

CAPS = (8, 12, 16, 24, 32)
VIDEO = (81, 480, 832)       # frames, height, width: the 1.3B and 14B shapes


def _plan(shape, weights, cap):
    own, _sink = setup.shape_window(shape)
    system = SystemInfo.simulated_gpu(cap, ram_gb=128, capability=(9, 0), name=f"H200 capped to {cap} GiB")
    return setup.make_run_plan(setup.shape_config("wan", shape), weights, *VIDEO, system,
                               kv_window=own if own > 0 else None)


@pytest.mark.parametrize("shape,weights", [("1.3b", "bf16"), ("longlive", "bf16"), ("14b", "bf16"),
                                           ("14b", "fp8"), ("krea", "bf16"), ("krea", "fp8")])
@pytest.mark.parametrize("cap", CAPS)
def test_every_decision_stays_within_the_cap_by_the_estimate(shape, weights, cap):
    plan = _plan(shape, weights, cap)
    if not plan.fits:           # refused, with the reason in words
        assert plan.blocks_to_swap == plan.blocks_total and "every block swapped" in plan.reasons["fits"]
        return
    assert plan.estimated_peak_bytes == sum(plan.breakdown.values())
    assert plan.estimated_peak_bytes <= plan.budget_bytes < cap * GiB
    assert 0 <= plan.blocks_to_swap <= plan.blocks_total
    assert plan.reasons["blocks_to_swap"] and plan.reasons["kv_window"]
    report = setup.plan_report(plan, cap)
    assert report["estimated_peak_gb"] <= report["budget_gb"] < cap and report["fits"]


def test_the_decisions_the_issue_names():
    small, big = _plan("1.3b", "bf16", 8), _plan("1.3b", "bf16", 32)
    assert small.fits and 0 < small.blocks_to_swap < small.blocks_total and small.kv_window == -1
    assert big.fits and big.blocks_to_swap == 0 and big.kv_window == -1
    assert _plan("1.3b", "bf16", 12).blocks_to_swap == 0        # 12 GB holds the 1.3B with its global cache
    for shape in ("krea", "14b"):
        fp8, bf16 = _plan(shape, "fp8", 24), _plan(shape, "bf16", 24)
        assert fp8.fits and bf16.fits and fp8.blocks_to_swap < bf16.blocks_to_swap
        assert fp8.breakdown["weights_resident"] + fp8.breakdown["swap_buffers"] < 16 * GiB
    assert 0 < _plan("14b", "fp8", 24).blocks_to_swap < 40       # the 14B with its global cache swaps some blocks
    assert _plan("krea", "fp8", 32).blocks_to_swap == 0 and _plan("krea", "fp8", 32).kv_window == 6
    assert _plan("krea", "bf16", 32).blocks_to_swap > 0          # 28 GB of bf16 weights do not stay resident
    for shape in ("krea", "14b"):                                # nothing fits an 8 GB card: refused in words
        plan = _plan(shape, "fp8", 8)
        assert not plan.fits and "lower the resolution" in plan.reasons["fits"]
    swaps = [_plan("krea", "bf16", c).blocks_to_swap for c in CAPS]
    assert swaps == sorted(swaps, reverse=True)                  # a bigger card never swaps more


# ----------------------------------------------------------------------------- the cap's override point
def _fake_cuda(monkeypatch, total=139, free=130, allocated=2, reserved=3):
    props = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, total_memory=int(total * GiB))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _i: props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda _i: (int(free * GiB), int(total * GiB)))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda _i: int(reserved * GiB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda _i: int(allocated * GiB))


def test_detect_system_sees_the_capped_card(monkeypatch):
    _fake_cuda(monkeypatch)
    monkeypatch.delenv(msys.VRAM_CAP_ENV, raising=False)
    monkeypatch.delenv(msys.MEMORY_LIMIT_ENV, raising=False)
    whole = msys.detect_system("cuda:0")
    assert whole.total_vram == 139 * GiB and whole.free_vram == 131 * GiB and whole.vram_cap == 0
    monkeypatch.setenv(msys.VRAM_CAP_ENV, "12")
    capped = msys.detect_system("cuda:0")
    # the card is 12 GiB; of it, what this process holds (2 GiB allocated) is taken
    assert capped.total_vram == 12 * GiB and capped.free_vram == 10 * GiB and capped.vram_cap == 12 * GiB
    assert "capped to 12.00 GiB" in capped.describe()
    monkeypatch.setenv(msys.VRAM_CAP_ENV, "200")            # larger than the card: the card as it is
    assert msys.detect_system("cuda:0").total_vram == 139 * GiB


def test_apply_vram_cap_sets_the_fraction_and_the_plan_variable(monkeypatch):
    _fake_cuda(monkeypatch)
    monkeypatch.delenv(msys.VRAM_CAP_ENV, raising=False)
    got = {}
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i: got.update(f=f, i=i))
    out = msys.apply_vram_cap(24, "cuda:0")
    assert got == {"f": pytest.approx(24 / 139), "i": 0} and out["cap_bytes"] == 24 * GiB
    assert msys.vram_cap() == 24 * GiB
    with pytest.raises(ValueError, match="more than the card"):
        msys.apply_vram_cap(200, "cuda:0")


@pytest.mark.parametrize("raw", ["0", "-3", "x", "inf", "nan"])
def test_a_bad_cap_variable_is_named(monkeypatch, raw):
    monkeypatch.setenv(msys.VRAM_CAP_ENV, raw)
    with pytest.raises(ValueError, match=msys.VRAM_CAP_ENV):
        msys.vram_cap()


def test_apply_vram_cap_without_cuda_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv(msys.VRAM_CAP_ENV, raising=False)
    with pytest.raises(ValueError, match="no CUDA device"):
        msys.apply_vram_cap(8)


# ----------------------------------------------------------------------------- shapes and weights
def test_shape_tables():
    from wan_accel.bench.options import SAMPLER_SHAPES
    from wan_accel.sampling.krea import KreaRecompute
    assert set(setup.SHAPE_PRESETS) == set(SAMPLER_SHAPES["wan"])
    c14 = setup.shape_config("wan", "14b")
    assert (c14.dim, c14.num_layers, c14.num_heads, c14.ffn_dim, c14.text_dim) == (5120, 40, 40, 13824, 4096)
    assert SAMPLER_SHAPES["wan"]["14b"] == SAMPLER_SHAPES["wan"]["krea"] == VIDEO
    krea = setup.shape_config("wan", "krea")
    assert krea.dim == 5120 and krea.local_attn_size == 6
    assert setup.shape_schedule("wan", "14b").timesteps == setup.shape_schedule("wan", "1.3b").timesteps
    kw = setup.sampler_kwargs("krea")()
    assert kw["kv_window"] == 6 and kw["recache"] == "none" and isinstance(kw["cache_policy"], KreaRecompute)
    assert setup.sampler_kwargs("krea")()["cache_policy"] is not kw["cache_policy"]     # a fresh policy per run
    assert setup.sampler_kwargs("longlive")() == {"kv_window": 12, "sink": 3}
    assert setup.sampler_kwargs("1.3b")() == {} and setup.sampler_kwargs("14b", 15)() == {"kv_window": 15, "sink": 0}


def test_random_model_draws_fp8_block_weights_per_tensor():
    from wan_accel.model.quant import FP8Linear
    from wan_accel.model.random_weights import random_model
    from wan_accel.model.tiny import TINY_CONFIG
    a = random_model(TINY_CONFIG, "cpu", torch.bfloat16, seed=3, weights="fp8")
    b = random_model(TINY_CONFIG, "cpu", torch.bfloat16, seed=3, weights="fp8", host_blocks=1)
    fp8 = [m for m in a.blocks.modules() if isinstance(m, FP8Linear)]
    assert len(fp8) == TINY_CONFIG.num_layers * 10     # self q k v o, cross q k v o, ffn 0 and 2
    assert all(m.weight.dtype == torch.float8_e4m3fn and m.scale_weight.shape == () for m in fp8)
    assert not any(isinstance(m, FP8Linear) for m in a.head.modules())
    assert a.patch_embedding.weight.dtype == torch.bfloat16
    for (n, p), (_n, q) in zip(a.state_dict().items(), b.state_dict().items()):    # the same seed: the same values
        assert torch.equal(p.float(), q.float()), n
    w = fp8[0].dequantized()
    assert 0.4 < w.abs().max() * (w.shape[1] ** 0.5) / 4.5 < 2.0                  # the spread of the tiny model's


def test_tiny_bench_runs_with_fp8_stored_weights(capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--weights", "fp8", "--json", "--device", "cpu", "--repeat", "1"])
    assert bench.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["weights"] == "fp8" and out["memory_cap_gb"] is None
    rows = {r["variant"]: r for r in out["rows"]}
    assert set(rows) == {"reference", "optimized"}
    for r in rows.values():
        assert r["model_bytes"]["cpu:float8_e4m3fn"] > 0 and r["video_fps"] > 0 and r["first_chunk_ms"] > 0
    assert rows["optimized"]["parity_max_abs"] < 1e-3         # the same fp8 weights on both paths


# ----------------------------------------------------------------------------- option checks
@pytest.mark.parametrize("argv,words", [
    (["--memory-cap-gb", "8", "--device", "cpu"], ["--memory-cap-gb", "CUDA", "cpu"]),
    (["--memory-cap-gb", "0", "--device", "cpu"], ["--memory-cap-gb", "greater than 0"]),
    (["--shape", "14b", "--device", "cpu"], ["--shape 14b", "CUDA"]),
    (["--shape", "krea", "--weights", "fp8", "--device", "cpu"], ["--shape krea", "CUDA"]),
    (["--model-kind", "matrix-game2", "--weights", "fp8", "--device", "cpu"], ["--weights fp8", "matrix-game2"]),
])
def test_refused_before_any_work(argv, words):
    refused(run_cli("bench", "sampler", *argv), *words)


def test_refused_combinations_on_a_cuda_card(monkeypatch):
    _fake_cuda(monkeypatch)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    dev = torch.device("cuda", 0)
    names = ["reference", "optimized"]
    with pytest.raises(ValueError, match="--variants reference"):
        setup.check_options(parser.parse_args(["--shape", "krea"]), dev, names, bench.VARIANTS)
    with pytest.raises(ValueError, match="--variants reference"):
        setup.check_options(parser.parse_args(["--memory-cap-gb", "12"]), dev, names, bench.VARIANTS)
    with pytest.raises(ValueError, match="more than the card"):
        setup.check_options(parser.parse_args(["--memory-cap-gb", "500"]), dev, ["optimized"], bench.VARIANTS)
    ok = parser.parse_args(["--shape", "krea", "--weights", "fp8", "--memory-cap-gb", "24"])
    setup.check_options(ok, dev, ["optimized"], bench.VARIANTS)
    assert setup.parity_off(ok)
