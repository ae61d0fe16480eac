"""``bench attention``: every attention implementation at a run's own calls (bench/attention.py)."""
from __future__ import annotations

import json

import pytest
import torch

from wan_accel.bench import attention as bench
from wan_accel.model import attention as attn

from .cli_run import refused, run_cli


def test_calls_are_the_runs_own():
    # the 1.3B video: 7 chunks of 3 frames of 1560 tokens; the largest self-attention call reads all 21 frames
    assert bench.calls("1.3b", "largest") == [(4680, 32760)]
    every = bench.calls("1.3b", "all")
    assert every[0] == (4680, 32760) and (4680, 512) in every          # cross-attention's bucket too
    assert len(every) == len(set(every)) and all(q == 4680 for q, _k in every)


def test_rows_on_this_machine():
    rows = bench.measure(40, 70, 1, 2, 16, torch.float32, torch.device("cpu"), ["int8"])
    by = {r["candidate"]: r for r in rows}
    assert "torch" not in by                                   # the reference is what rows are compared with
    assert by["sdpa"]["status"] == "ran" and by["sdpa"]["within"] and by["sdpa"]["ms"] > 0
    assert by["sdpa"]["max_abs"] <= 1e-5
    for name in ("fa3", "fa2", "sdpa.cudnn"):                  # listed with the reason they do not run on a CPU
        assert by[name]["status"] == "unavailable" and "CUDA" in by[name]["why"]
    int8 = by["int8"]
    assert int8["kind"] == "approximate" and "within" not in int8
    assert 1e-4 < int8["max_abs"] < 0.2                        # int8 codes: visibly approximate, never wild
    assert {r["lq"] for r in rows} == {40} and {r["lk"] for r in rows} == {70}


def test_a_wrong_candidate_is_caught_and_a_raising_one_is_a_row(monkeypatch):
    wrong = attn.op_candidates.Candidate(attn.STORE_OP, "sdpa", "sdpa", lambda q, k, v: attn._sdpa(q, k, v) * 1.01,
                                         None, "off by 1 %")
    monkeypatch.setitem(attn.AUTO_CANDIDATES, "sdpa", wrong)
    boom = attn.op_candidates.Candidate(attn.STORE_OP, "fa2", "flash", lambda q, k, v: 1 / 0, None, "x")
    monkeypatch.setitem(attn.AUTO_CANDIDATES, "fa2", boom)
    by = {r["candidate"]: r for r in bench.measure(16, 24, 1, 2, 16, torch.float32, torch.device("cpu"))}
    assert by["sdpa"]["within"] is False
    assert by["fa2"]["status"] == "failed" and "ZeroDivisionError" in by["fa2"]["why"]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_output_is_a_failed_row_never_a_figure(monkeypatch, bad):
    def poisoned(q, k, v):
        out = attn._sdpa(q, k, v).clone()
        out[0, 0, 0, 0] = bad
        return out
    cand = attn.op_candidates.Candidate(attn.STORE_OP, "sdpa", "sdpa", poisoned, None, "one bad value")
    monkeypatch.setitem(attn.AUTO_CANDIDATES, "sdpa", cand)
    by = {r["candidate"]: r for r in bench.measure(16, 24, 1, 2, 16, torch.float32, torch.device("cpu"))}
    assert by["sdpa"]["status"] == "failed" and "non-finite" in by["sdpa"]["why"]
    assert "ms" not in by["sdpa"] and "tflops" not in by["sdpa"]


def test_cli_table_and_json(tmp_path):
    code, out, err = run_cli("bench", "attention", "--lq", "33", "--lk", "65", "--approximate", "none", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["largest_call"] == [33, 65] and data["fastest_exact"] == "sdpa"
    assert not any(r["kind"] == "approximate" for r in data["rows"])
    code, out, err = run_cli("bench", "attention", "--calls", "all")
    assert code == 0, err
    assert "candidate" in out and "sdpa" in out and "int8" in out


@pytest.mark.parametrize("argv, words", [
    (["--lq", "8"], ["--lq and --lk"]),
    (["--lq", "0", "--lk", "4"], ["--lq", "between 1"]),
    (["--approximate", "fp4"], ["--approximate", "fp4"]),
])
def test_bad_options(argv, words):
    refused(run_cli("bench", "attention", *argv), *words)


def test_on_a_gpu_the_table_times_as_the_operator_store_does():
    """The bench ranks the candidates with the store's own GPU timer (graph replays, call by call only where a
    call cannot be captured), so its fastest is the store's choice; a CPU times wall clock."""
    from wan_accel.bench import attention as bench
    from wan_accel.cache import autotune
    assert bench.bench_timer(torch.device("cuda"), 1) is autotune.default_timer
    assert bench.bench_timer(torch.device("cpu"), 1) is not autotune.default_timer
