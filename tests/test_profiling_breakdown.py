"""The profile's GPU time per kernel class (attention, GEMM, memory-bound, copies, idle), its per-call column and
achieved TFLOP/s, the 1.3B random-weight shape and the sampler path option."""
from __future__ import annotations

import json

import pytest

from wan_accel.profiling.report import ProfileReport
from wan_accel.profiling.trace_stats import breakdown_table, kernel_breakdown, kernel_class


def _kernel(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def _window(name, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur}


@pytest.mark.parametrize("name, cls", [
    ("cudnn_generated_fort_native_sdpa_sm90_knob_7_128x128x128_4x1x1_kernel0_0", "attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", "gemm"),
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", "gemm"),
    ("triton_tem_fused_addmm_0", "gemm"),
    ("_lnmod_kernel", "memory-bound"),
    ("_rmsrope_kernel", "memory-bound"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "memory-bound"),
])
def test_kernel_names_fall_in_their_class(name, cls):
    assert kernel_class(name) == cls


def test_copies_are_their_own_class_whatever_their_name():
    assert kernel_class("Memcpy DtoD (Device -> Device)", "gpu_memcpy") == "memcpy/memset"
    assert kernel_class("Memset (Device)", "gpu_memset") == "memcpy/memset"


def test_breakdown_sums_each_class_inside_the_runs_and_counts_idle_per_run():
    # two profiled runs of 100 us each; a kernel outside the windows (warm-up) is not counted
    events = [_window("r/run0", 0, 100), _window("r/run1", 200, 100),
              _kernel("sm90_xmma_gemm", 0, 30), _kernel("flash_fwd_kernel", 30, 50), _kernel("_lnmod_kernel", 90, 10),
              _kernel("sm90_xmma_gemm", 200, 30), _kernel("flash_fwd_kernel", 230, 50),
              _kernel("Memcpy DtoD", 290, 10, cat="gpu_memcpy"),
              _kernel("sm90_xmma_gemm", 500, 1000)]
    b = kernel_breakdown(events, ["r/run0", "r/run1"], model_calls=4, flops={"gemm": 3e6, "attention": 5e6}, runs=2)
    rows = {r["class"]: r for r in b["rows"]}
    assert rows["gemm"]["ms_per_run"] == pytest.approx(0.030)
    assert rows["attention"]["ms_per_run"] == pytest.approx(0.050)
    assert rows["memory-bound"]["ms_per_run"] == pytest.approx(0.005)
    assert rows["memcpy/memset"]["ms_per_run"] == pytest.approx(0.005)
    assert rows["idle"]["ms_per_run"] == pytest.approx(0.010)      # 10 us idle in run0 (80..90), none in run1
    assert sum(r["share"] for r in b["rows"]) == pytest.approx(1.0)
    assert rows["gemm"]["ms_per_call"] == pytest.approx(0.030 / 4)
    assert rows["gemm"]["tflops"] == pytest.approx(3e6 / 30e-6 / 1e12, rel=0.01)
    assert rows["attention"]["tflops"] == pytest.approx(5e6 / 50e-6 / 1e12, rel=0.01)
    assert b["wall_ms_per_run"] == pytest.approx(0.1)
    table = breakdown_table(b, {"bf16_matmul_tflops": 790.0})
    assert "| attention | 0.05 |" in table and "bf16_matmul_tflops 790.0" in table


def test_no_gpu_activity_gives_no_breakdown():
    assert kernel_breakdown([_window("r/run0", 0, 10)], ["r/run0"]) is None


def test_report_text_shows_the_breakdown():
    events = [_window("r/run0", 0, 100), _kernel("flash_fwd_kernel", 0, 60), _kernel("sm90_xmma_gemm", 60, 40)]
    report = ProfileReport(name="x", device="cuda", runs=1,
                           kernel_classes=kernel_breakdown(events, ["r/run0"], model_calls=2))
    text = report.to_text()
    assert "GPU time by kernel class" in text and "| attention | 0.06 | 60.0 % |" in text


def test_work_per_run_counts_the_model_calls_the_sampler_makes(monkeypatch):
    from wan_accel.app.jobs import profile_targets as targets
    from wan_accel.model import flops as fl

    target = targets.ProfileTarget(device="cpu", sampler="reference").resolved()
    model = targets.load_model(target)
    calls = []
    original = model.forward_chunk
    monkeypatch.setattr(model, "forward_chunk", lambda *a, **k: calls.append(1) or original(*a, **k))
    targets.sampler_call(model, target, targets.make_inputs(model, target))()
    n, work = targets.work_per_run(model, target)
    assert n == len(calls)
    cfg = model.config
    geo = fl.Geometry(1, target.frames, (target.height // cfg.patch_size[1]) * (target.width // cfg.patch_size[2]))
    whole = fl.run_flops(cfg, geo, 4, optimized=False, skip_last_refresh=False)["flops"]
    assert work["gemm"] + work["attention"] == whole and work["attention"] > 0


def test_profile_cli_shape_and_sampler(tmp_path, capsys):
    from wan_accel.cli import main

    (tmp_path / "x.safetensors").write_bytes(b"")
    assert main(["profile", "--checkpoint", str(tmp_path / "x.safetensors"), "--shape", "1.3b"]) == 2
    assert "--shape" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["profile", "--shape", "7b"])
    assert exc.value.code == 2 and "--shape" in capsys.readouterr().err
    assert main(["profile", "--sampler", "optimized", "--warmup", "0", "--out", str(tmp_path / "p"), "--no-history",
                 "--json", "--device", "cpu"]) == 0
    data = json.loads(capsys.readouterr().out)["profile"]
    assert data["device"] == "cpu" and data["kernel_classes"] is None and data["runs"] == 1
