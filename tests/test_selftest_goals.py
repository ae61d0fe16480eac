"""The speed goals of a GPU run (checks/goals.py), read from the self-test's bench stages."""
from __future__ import annotations

import json

from wan_accel.checks import goals, selftest

from .cli_run import run_cli_in


def _sampler(**rows) -> dict:
    return {"rows": [dict(r, variant=name) for name, r in rows.items()]}


def _by_goal(rows: list) -> dict:
    return {r["goal"]: r for r in rows}


def test_figures_are_read_and_judged_against_their_targets():
    sampler = _sampler(**{
        "reference-same-dtype": {"steady_s": 2.7, "parity_max_abs": 0.02},
        "optimized": {"steady_s": 1.9, "parity_max_abs": 0.021, "chunk_ms": [180, 200, 240, 260, 280, 300, 300],
                      "denoise_ms": [140, 160, 190, 210, 230, 270, 300],
                      "peak_memory": {"cuda_max_allocated_mb": 9000}},
        "optimized-compiled": {"steady_s": 1.45, "parity_max_abs": 0.03},
        "optimized-fp8": {"steady_s": 1.2, "linear_ran": "fp8"},
    })
    attention = {"fastest_exact_tflops": 512.0, "fastest_exact": "sdpa.cudnn", "largest_call": [4680, 32760]}
    decode = {"rows": [{"variant": "optimized", "video_fps_with_decode": 26.1, "decode": "wan"}]}
    by = _by_goal(goals.judge({"bench sampler": sampler, "bench attention": attention, "bench decode wan": decode}))
    exact = by["exact bf16 video (DiT only)"]
    assert (exact["value"], exact["status"]) == (1.45, "met") and "optimized-compiled" in exact["source"]
    assert (by["6th chunk, 4 denoising steps"]["value"], by["6th chunk, 4 denoising steps"]["status"]) == (270, "met")
    assert (by["first chunk (DiT)"]["value"], by["first chunk (DiT)"]["status"]) == (140, "met")
    assert by["attention at the largest call"]["status"] == "short"
    assert by["attention at the largest call"]["source"] == "sdpa.cudnn at 4680 x 32760"
    assert by["fp8 mode video (DiT only)"]["status"] == "short" and by["fp8 mode video (DiT only)"]["value"] == 1.2
    assert by["video FPS with decode, Wan 2.1 VAE"]["status"] == "met"
    assert by["video FPS with decode, tiny decoder"]["status"] == "unmeasured"   # its stage did not run
    assert by["peak memory, exact bf16"]["value"] == round(9000 / 1024, 2)


def test_a_row_that_is_not_what_the_goal_asks_is_not_its_figure():
    sampler = _sampler(**{
        "reference-same-dtype": {"steady_s": 2.7, "parity_max_abs": 0.02},
        "optimized": {"steady_s": 1.9, "parity_max_abs": 0.02, "chunk_ms": [200]},
        # faster but further from the float32 reference than bf16 rounding: not an exact figure
        "optimized-compiled": {"steady_s": 1.3, "parity_max_abs": 0.5},
        # an fp8 twin that was measured slower and ran exact: not an fp8 figure
        "optimized-fp8": {"steady_s": 1.9, "linear_ran": "exact"},
    })
    by = _by_goal(goals.judge({"bench sampler": sampler}))
    assert by["exact bf16 video (DiT only)"]["value"] == 1.9
    assert by["fp8 mode video (DiT only)"]["status"] == "unmeasured"
    assert by["first chunk (DiT)"]["value"] == 200 and "chunk_ms" in by["first chunk (DiT)"]["source"]
    assert by["6th chunk, 4 denoising steps"]["status"] == "unmeasured"      # no per-chunk denoise times
    # a float32 run: its reference-same-dtype is the float32 reference (distance 0); an optimized row within the
    # exact paths' float32 bound is exact, one beyond it is not
    f32 = _sampler(**{"reference-same-dtype": {"steady_s": 0.14, "parity_max_abs": 0.0},
                      "optimized": {"steady_s": 0.09, "parity_max_abs": 1.2e-6},
                      "optimized-compiled": {"steady_s": 0.05, "parity_max_abs": 3e-3}})
    assert _by_goal(goals.judge({"bench sampler": f32}))["exact bf16 video (DiT only)"]["value"] == 0.09
    # output of another shape is unmeasured, never an error
    assert _by_goal(goals.judge({"bench sampler": {"rows": "x"}}))["exact bf16 video (DiT only)"]["value"] is None


def test_selftest_reads_the_goals_from_a_stage_that_ran(tmp_path, monkeypatch):
    # the attention bench at the tiny shape, as a stage that runs here: its figure reaches the goal table
    stage = selftest.Stage("bench attention", lambda ctx: ["bench", "attention", "--shape", "tiny", "--json",
                                                           "--approximate", "none"], 120)
    monkeypatch.setattr(selftest, "STAGES", [stage, *[s for s in selftest.STAGES if s.name != "bench attention"]])
    result = selftest.run_selftest(tmp_path / "st", only_goals=True, log=lambda *_: None)
    assert sorted(r["stage"] for r in result["stages"]) == sorted(goals.STAGES)
    by = _by_goal(result["goals"])
    rate = by["attention at the largest call"]
    assert rate["value"] is not None and rate["status"] == "short" and rate["source"].startswith("sdpa at 288 x 576")
    assert all(r["status"] == "unmeasured" for g, r in by.items() if r["stage"] != "bench attention")
    text = (tmp_path / "st" / "selftest.md").read_text()
    assert "| attention at the largest call |" in text and "Speed goals" in text
    saved = json.loads((tmp_path / "st" / "selftest.json").read_text())
    assert saved["goals"] == result["goals"] and all("_output" not in r for r in saved["stages"])


def test_cli_goals_without_a_gpu(tmp_path):
    code, out, err = run_cli_in(tmp_path, "selftest", "--goals", "--json", "--out", "st")
    assert code == 0, err
    data = json.loads(out)
    assert {r["stage"] for r in data["stages"]} == set(goals.STAGES)
    assert all(r["status"] == selftest.NEEDS_GPU for r in data["stages"] if r["gpu"])
    # bench native runs on a CPU too (the tiny shape): skipped where ComfyUI does not import, else it ran
    assert all(r["status"] in ("skipped", "passed") for r in data["stages"] if not r["gpu"])
    assert [r["goal"] for r in data["goals"]] == [g.name for g in goals.GOALS]
    assert all(r["status"] == "unmeasured" for r in data["goals"])
