"""The self-test's ``bench native`` stage and the two native goals read from it.

The outputs judged here are those ``bench native`` prints: its skip line's JSON from its own writer
(``bench.native.skipped``), and a result of the keys ``bench.native.run`` and ``run_variant`` write, the rows from its
own ``summarize``. The stage's command line is parsed by the bench's own options. Where ComfyUI imports (here, or
through COMFYUI_DIR and COMFYUI_VENV, as tests/test_bench_native.py finds it) the stage runs end to end at the tiny
shape on the CPU; without ComfyUI the stage runs and is listed as skipped."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from wan_accel.bench import native
from wan_accel.checks import goals, selftest

from .test_bench_native import REPO, _comfy

GOAL_OWN = "native path vs the pack's own path, 1.3B"
GOAL_CORE = "native path vs core's SamplerARVideo, same MODEL"


def _skip_output(capsys, why="ModuleNotFoundError: No module named 'comfy'") -> str:
    """The stdout of ``bench native --json`` where ComfyUI does not import, from the bench's own writer."""
    assert native.skipped(why, SimpleNamespace(json=True)) == 0
    out, err = capsys.readouterr()
    assert err.strip() == native.SKIP_LINE
    return out


def _variant(weights: str, core=3.0, native_s=1.5, own=1.48, parity=(0.0, 5e-6)) -> dict:
    """One weights variant as ``run_variant`` writes it."""
    rows = {k: native.summarize([s], [s / 7], [None]) for k, s in (("core", core), ("native", native_s), ("own", own))}
    return {"weights": weights, "file_mb": 0.29, "rows": rows,
            "parity": {"native_vs_core_max_abs": parity[1], "native_vs_core_own_draws_max_abs": 5.3,
                       "native_vs_own_max_abs": parity[0]},
            "comfy_model": "WAN21_CausalAR", "comfy_diffusion_model": "CausalWanModel",
            "comfy_weight_dtype": "bfloat16", "comfy_manual_cast": "None", "comfy_quantized_layers": 0,
            "lora_patches": 0,
            "ratios": {"native_speedup_vs_core": round(core / native_s, 3),
                       "native_speedup_vs_own": round(own / native_s, 3)},
            "why_slower": None}


def _result(shape="1.3b", device="cuda", variants=None) -> dict:
    """A finished ``bench native --json`` result, with the top-level keys ``bench.native.run`` writes."""
    return {"bench": "native", "skipped": False, "shape": shape,
            "config": {"dim": 1536, "ffn_dim": 8960, "num_heads": 12, "num_layers": 30, "text_len": 512},
            "latent": [1, 16, 21, 60, 104], "pixels": [81, 480, 832], "steps": 4, "frames_per_block": 3, "repeat": 3,
            "path": "auto", "device": device, "device_name": "NVIDIA H200", "threads": 16,
            "date": "2026-11-29T00:00:00", "versions": {"torch": "2.11.0", "comfyui": "0.33.0"},
            "variants": variants if variants is not None else
            [_variant("bf16"), _variant("fp8_scaled"), _variant("bf16+lora")], "wall_s": 200.0}


def _judge(stdout: str) -> list:
    """bench native's judge on that output, read as the self-test reads a stage's stdout."""
    return selftest.judge_bench_native(selftest._json(stdout))


def _printed(result: dict) -> str:
    return json.dumps(result, indent=1)           # as ``bench native --json`` prints it


def _ctx(tmp_path, gpu: bool, quick: bool = False, env=None) -> selftest.Context:
    return selftest.Context(out=tmp_path / "out", work=tmp_path, gpu=gpu, device="cuda" if gpu else "cpu",
                            quick=quick, env=env or {})


def _stage() -> selftest.Stage:
    return next(s for s in selftest.STAGES if s.name == "bench native")


# ----------------------------------------------------------------------------------------------- the judge
def test_judge_skips_where_the_bench_says_comfyui_does_not_import(capsys):
    with pytest.raises(selftest.Skipped, match="ComfyUI does not import here") as info:
        _judge(_skip_output(capsys))
    assert "No module named 'comfy'" in str(info.value) and "COMFYUI_DIR" in str(info.value)
    assert "\n" not in str(info.value)


def test_judge_passes_a_good_output():
    assert _judge(_printed(_result())) == []
    assert _judge(_printed(_result("tiny", "cpu"))) == []


def test_judge_fails_an_errored_row():
    # the ComfyUI side failed (only the own row ran), and the own path failed in another variant
    comfy_failed = _variant("fp8_scaled")
    comfy_failed["rows"] = {"own": comfy_failed["rows"]["own"]}
    comfy_failed["error"] = "ComfyUI side: RuntimeError: no QuantizedTensor"
    comfy_failed["parity"] = {"native_vs_own_max_abs": None}
    own_failed = _variant("bf16+lora")
    own_failed["rows"]["own"] = {"error": "ValueError: a LoRA over fp8 weights"}
    own_failed["parity"]["native_vs_own_max_abs"] = None
    problems = _judge(_printed(_result(variants=[_variant("bf16"), comfy_failed, own_failed])))
    assert problems == ["fp8_scaled: ComfyUI side: RuntimeError: no QuantizedTensor",
                        "bf16+lora own: ValueError: a LoRA over fp8 weights"]
    assert _judge(_printed(_result(variants=[]))) == ["no weights variant ran"]


def test_judge_fails_a_parity_that_is_not_finite_or_missing():
    """bench native states no parity tolerance: a figure fails where it is not a finite number (a video that blew
    up), or where it is missing although the two rows it compares ran; core's own-draws figure differs by design."""
    bad = _variant("bf16", parity=(float("nan"), 5e-6))
    gone = _variant("bf16+lora")
    del gone["parity"]["native_vs_core_max_abs"]
    problems = _judge(_printed(_result(variants=[bad, _variant("fp8_scaled"), gone])))
    assert problems == ["bf16: native_vs_own_max_abs is nan (a video that is not finite)",
                        "bf16+lora: no native_vs_core_max_abs although core and native ran"]
    inf = _variant("bf16", parity=(0.0, float("inf")))
    assert "native_vs_core_max_abs is inf" in _judge(_printed(_result(variants=[inf])))[0]
    far = _variant("bf16")
    far["parity"]["native_vs_core_own_draws_max_abs"] = 17.0        # different re-noising draws: not judged
    assert _judge(_printed(_result(variants=[far]))) == []


# ----------------------------------------------------------------------------------------------- the goals
def _goal(result: dict, name: str) -> dict:
    return next(r for r in goals.judge({"bench native": result}) if r["goal"] == name)


def test_native_goals_read_the_bf16_rows_at_1_3b_on_cuda():
    result = _result(variants=[_variant("fp8_scaled", 9.0, 1.0, 9.0), _variant("bf16", core=3.3, native_s=1.5,
                                                                                 own=1.48)])
    assert goals.native_over_own(result)[0] == round(1.5 / 1.48, 3)
    assert goals.native_vs_core(result)[0] == 2.2
    own, core = _goal(result, GOAL_OWN), _goal(result, GOAL_CORE)
    assert (own["value"], own["status"], own["target"]) == (1.014, goals.MET, "<= 1.03 x")
    assert (core["value"], core["status"], core["target"]) == (2.2, goals.MET, ">= 1.5 x")
    assert own["stage"] == core["stage"] == "bench native" and "bf16" in own["source"]
    slow = _result("1.3b", "cuda:0", [_variant("bf16", core=2.0, native_s=1.6, own=1.5)])
    assert (_goal(slow, GOAL_OWN)["status"], _goal(slow, GOAL_CORE)["status"]) == (goals.SHORT, goals.SHORT)
    assert _goal(slow, GOAL_OWN)["value"] == round(1.6 / 1.5, 3) and _goal(slow, GOAL_CORE)["value"] == 1.25


def test_native_goals_are_unmeasured_off_the_1_3b_shape_on_cuda(capsys):
    for result in (_result("tiny", "cuda"), _result("mid", "cuda"), _result("1.3b", "cpu"),
                   json.loads(_skip_output(capsys)), _result(variants=[_variant("fp8_scaled")])):
        assert goals.native_over_own(result) is None and goals.native_vs_core(result) is None
        assert _goal(result, GOAL_OWN)["status"] == _goal(result, GOAL_CORE)["status"] == goals.UNMEASURED
    no_native = _variant("bf16")
    no_native["rows"] = {"own": no_native["rows"]["own"]}           # the ComfyUI side failed: no native figure
    assert goals.native_over_own(_result(variants=[no_native])) is None
    assert goals.native_vs_core(_result(variants=[no_native])) is None


def test_goals_select_the_native_stage():
    assert "bench native" in goals.STAGES
    assert set(goals.STAGES) <= {s.name for s in selftest.STAGES}


# ----------------------------------------------------------------------------------------------- the stage
def _parsed(argv: list):
    assert argv[:2] == ["bench", "native"]
    p = argparse.ArgumentParser()
    native.add_arguments(p)
    return p.parse_args(argv[2:])


@pytest.mark.parametrize("gpu,quick", [(False, False), (False, True), (True, True)])
def test_stage_runs_the_tiny_shape_on_a_cpu_or_quick(tmp_path, gpu, quick):
    args = _parsed(_stage().argv(_ctx(tmp_path, gpu, quick)))
    assert args.shape == "tiny" and args.json and args.device == ("cuda" if gpu else "cpu")
    assert native.parse_weights(args.weights) == ["bf16", "fp8_scaled", "bf16+lora"]


def test_stage_runs_the_1_3b_shape_with_three_variants_on_a_gpu(tmp_path):
    stage = _stage()
    args = _parsed(stage.argv(_ctx(tmp_path, gpu=True)))
    assert args.shape == "1.3b" and args.json and args.device == "cuda"
    assert native.parse_weights(args.weights) == ["bf16", "fp8_scaled", "bf16+lora"]
    assert not stage.gpu and stage.judge is selftest.judge_bench_native and stage.available is None


def test_stage_is_listed_as_skipped_without_comfyui(tmp_path):
    """The stage run as the self-test runs it, by this Python, with a ComfyUI folder that holds no ComfyUI."""
    if importlib.util.find_spec("comfy") is not None:
        pytest.skip("ComfyUI imports in this Python: the skip cannot show here")
    row = selftest.run_stage(_stage(), _ctx(tmp_path, gpu=False, env={"COMFYUI_DIR": str(tmp_path)}))
    assert row["status"] == "skipped", row
    assert row["detail"].startswith("ComfyUI does not import here") and "comfy" in row["detail"]
    assert row["command"].startswith("python -m wan_accel bench native --shape tiny")


def test_stage_runs_end_to_end_with_comfyui(tmp_path, monkeypatch):
    """With ComfyUI: the stage at the tiny shape on the CPU through run_stage, with ComfyUI's Python; it passes its
    judge, keeps its output for the goal table, and the native goals stay unmeasured (not the 1.3B shape on CUDA)."""
    python, comfy_dir = _comfy()
    if python is None:
        pytest.skip("ComfyUI is not importable here (set COMFYUI_DIR and COMFYUI_VENV to ComfyUI's folder and its "
                    "virtual environment to run the stage end to end)")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "wan_accel").symlink_to(REPO, target_is_directory=True)
    monkeypatch.setattr(sys, "executable", python)
    ctx = _ctx(tmp_path, gpu=False, env={"PYTHONPATH": os.pathsep.join([str(tmp_path / "pkg"), comfy_dir]),
                                             "COMFYUI_DIR": comfy_dir})
    row = selftest.run_stage(_stage(), ctx)
    log = (ctx.out / row["output"]).read_text() if row.get("output") else ""
    assert row["status"] == "passed", (row, log[-3000:])
    assert row["detail"].startswith("shape tiny: bf16 core ") and "bf16+lora" in row["detail"]
    data = row[selftest.OUTPUT]
    assert data["shape"] == "tiny" and data["device"] == "cpu"
    assert {v["weights"] for v in data["variants"]} == {"bf16", "fp8_scaled", "bf16+lora"}
    assert _goal(data, GOAL_OWN)["status"] == _goal(data, GOAL_CORE)["status"] == goals.UNMEASURED
    assert Path(ctx.out / row["output"]).is_file()
