"""The operator-limit store: fake timer, simulated resource limit, persistence across processes."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from wan_accel.cache import LimitCache
from wan_accel.cache.autotune import Autotuner, config_id, install_inductor_feedback, _record_inductor_feedback

errors = pytest.importorskip("triton.runtime.errors")

PKG_PARENT = Path(__file__).resolve().parent.parent.parent
KERNEL, KEY = "toy@1", "D=64|rows=128|float32"
CONFIGS = [{"BLOCK": b, "num_warps": w} for b in (16, 32, 64, 128) for w in (2, 4)]
LIMIT = 64  # simulated: BLOCK above this raises OutOfResources


class Toy:
    """A 'kernel' whose launch fails above LIMIT and whose fake time is lowest at BLOCK=64, 4 warps."""

    def __init__(self):
        self.launched = []
        self.current = None
        self.timed = 0

    def run(self, cfg):
        self.launched.append(config_id(cfg))
        if cfg["BLOCK"] > LIMIT:
            raise errors.OutOfResources(cfg["BLOCK"] * 1024, LIMIT * 1024, "shared memory")
        self.current = cfg

    def timer(self, fn):
        self.timed += 1
        fn()
        c = self.current
        return 10.0 / c["BLOCK"] + (0.0 if c["num_warps"] == 4 else 0.05)


def _tuner(path, toy, **kw):
    return Autotuner(LimitCache(path), timer=toy.timer, **kw)


def test_failures_recorded_and_best_chosen(tmp_path):
    toy = Toy()
    best = _tuner(tmp_path / "l.json", toy).tune(KERNEL, KEY, CONFIGS, toy.run)
    assert best == {"BLOCK": 64, "num_warps": 4}
    entry = LimitCache(tmp_path / "l.json").get("operator", f"{KERNEL}|{KEY}")
    assert set(entry["failed"]) == {"BLOCK=128,num_warps=2", "BLOCK=128,num_warps=4"}
    err = entry["failed"]["BLOCK=128,num_warps=4"]["error"]
    assert (err["type"], err["name"], err["required"], err["limit"]) == ("OutOfResources", "shared memory",
                                                                         128 * 1024, 64 * 1024)
    assert entry["best"]["id"] == "BLOCK=64,num_warps=4" and entry["best"]["ms"] == pytest.approx(10 / 64)
    assert entry["last_working"] is not None and entry["metric"] == "median_ms"
    assert len(entry["timings"]) == 6 and toy.timed == 6


def test_memo_and_store_avoid_rebenchmarking(tmp_path):
    toy = Toy()
    tuner = _tuner(tmp_path / "l.json", toy)
    tuner.tune(KERNEL, KEY, CONFIGS, toy.run)
    tuner.tune(KERNEL, KEY, CONFIGS, toy.run)
    assert toy.timed == 6 and tuner.stats["memo_hits"] == 1
    toy2 = Toy()
    again = _tuner(tmp_path / "l.json", toy2).tune(KERNEL, KEY, CONFIGS, toy2.run)
    assert again == {"BLOCK": 64, "num_warps": 4}
    assert toy2.launched == [] and toy2.timed == 0  # known failures never launched again


def test_only_new_candidates_are_measured(tmp_path):
    toy = Toy()
    _tuner(tmp_path / "l.json", toy).tune(KERNEL, KEY, CONFIGS[:4], toy.run)
    toy2 = Toy()
    best = _tuner(tmp_path / "l.json", toy2).tune(KERNEL, KEY, CONFIGS, toy2.run)
    assert best == {"BLOCK": 64, "num_warps": 4}
    assert set(toy2.launched) == {config_id(c) for c in CONFIGS[4:]}


def test_shared_memory_estimate_prunes_before_compiling(tmp_path):
    toy = Toy()
    tuner = _tuner(tmp_path / "l.json", toy, shared_memory_limit=40 * 1024)
    best = tuner.tune(KERNEL, KEY, CONFIGS, toy.run, smem=lambda c: c["BLOCK"] * 1024)
    assert best == {"BLOCK": 32, "num_warps": 4}
    assert not any(c.startswith(("BLOCK=64", "BLOCK=128")) for c in toy.launched)
    entry = tuner.entry(KERNEL, KEY)
    pruned = entry["failed"]["BLOCK=64,num_warps=2"]["error"]
    assert pruned["estimated"] is True and pruned["required"] == 64 * 1024 and pruned["limit"] == 40 * 1024
    assert tuner.stats["pruned_shared_memory"] == 4


def test_every_config_failing_returns_none_and_logs(tmp_path, caplog):
    toy = Toy()
    with caplog.at_level(logging.ERROR, logger="wan_accel.autotune"):
        best = _tuner(tmp_path / "l.json", toy).tune(KERNEL, KEY, CONFIGS[-2:], toy.run)
    assert best is None
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert KERNEL in msg and KEY in msg and "OutOfResources" in msg and "torch implementation" in msg


def test_other_errors_are_recorded_transient_ones_not(tmp_path):
    def run(cfg):
        if cfg["BLOCK"] == 16:
            raise errors.PTXASError("ptxas failed")
        if cfg["BLOCK"] == 32:
            raise RuntimeError("CUDA out of memory. Tried to allocate")
    tuner = Autotuner(LimitCache(tmp_path / "l.json"), timer=lambda fn: (fn(), 1.0)[1])
    tuner.tune(KERNEL, KEY, CONFIGS[:4], run)
    failed = tuner.entry(KERNEL, KEY)["failed"]
    assert failed["BLOCK=16,num_warps=2"]["error"]["type"] == "PTXASError"
    assert not any(k.startswith("BLOCK=32") for k in failed)  # out of memory says nothing about the config


def test_a_transient_out_of_memory_is_not_remembered_as_no_config(tmp_path):
    """Tuning that hit only out-of-memory (VRAM tight right now) falls back to torch once, then tunes again."""
    oom = [True]

    def run(cfg):
        if oom[0]:
            raise RuntimeError("CUDA out of memory. Tried to allocate 256.00 MiB")
    tuner = Autotuner(LimitCache(tmp_path / "l.json"), timer=lambda fn: (fn(), 1.0)[1])
    configs = tuple(CONFIGS[:2])
    assert tuner.tune(KERNEL, KEY, configs, run) is None
    oom[0] = False
    assert tuner.tune(KERNEL, KEY, configs, run) == CONFIGS[0]


def test_extreme_policy_only_faster_replaces(tmp_path):
    path = tmp_path / "l.json"
    times = {"v": 1.0}
    tuner = Autotuner(LimitCache(path), timer=lambda fn: (fn(), times["v"])[1])
    cfg = [{"BLOCK": 32, "num_warps": 4}]
    tuner.tune(KERNEL, KEY, cfg, lambda c: None, policy="extreme")
    times["v"] = 2.0  # slower re-measurement must not replace
    tuner.tune(KERNEL, KEY, cfg, lambda c: None, policy="extreme", force=True)
    entry = tuner.entry(KERNEL, KEY)
    assert entry["best"]["ms"] == 1.0 and entry["policy"] == "extreme" and "timestamp" in entry
    times["v"] = 0.5
    tuner.tune(KERNEL, KEY, cfg, lambda c: None, policy="extreme", force=True)
    assert tuner.entry(KERNEL, KEY)["best"]["ms"] == 0.5
    times["v"] = 3.0  # the default policy takes the new measurement
    tuner.tune(KERNEL, KEY, cfg, lambda c: None, policy="default", force=True)
    assert tuner.entry(KERNEL, KEY)["best"]["ms"] == 0.5  # entry stays extreme once marked


def test_locked_entry_is_never_rebenchmarked(tmp_path):
    toy = Toy()
    tuner = _tuner(tmp_path / "l.json", toy)
    tuner.tune(KERNEL, KEY, CONFIGS[:2], toy.run)
    tuner.lock(KERNEL, KEY)
    toy2 = Toy()
    best = _tuner(tmp_path / "l.json", toy2).tune(KERNEL, KEY, CONFIGS, toy2.run, force=True)
    assert toy2.launched == [] and best == {"BLOCK": 16, "num_warps": 4}
    assert _tuner(tmp_path / "l.json", toy2).entry(KERNEL, KEY)["locked"] is True


_CHILD = """
import json, sys
from wan_accel.cache import LimitCache
from wan_accel.cache.autotune import Autotuner
calls = {"timer": 0, "run": 0}
def run(cfg):
    calls["run"] += 1
def timer(fn):
    calls["timer"] += 1
    fn()
    return 1.0
configs = json.loads(sys.argv[2])
tuner = Autotuner(LimitCache(sys.argv[1]), timer=timer)
best = tuner.tune(sys.argv[3], sys.argv[4], configs, run)
print(json.dumps({"best": best, "calls": calls, "stats": tuner.stats}))
"""


def test_second_process_performs_zero_benchmarks(tmp_path):
    toy = Toy()
    path = tmp_path / "l.json"
    first = _tuner(path, toy).tune(KERNEL, KEY, CONFIGS, toy.run)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PKG_PARENT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(path), json.dumps(CONFIGS), KERNEL, KEY],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["best"] == first
    assert out["calls"] == {"timer": 0, "run": 0} and out["stats"]["benchmarks"] == 0
    assert out["stats"]["cache_hits"] == 1


class _Node:
    def __init__(self, size):
        self.size = size

    def get_size(self):
        return self.size

    def get_dtype(self):
        return "torch.bfloat16"


class _Choice:
    def __init__(self, name):
        self.name = name


def test_inductor_feedback_records_winner_and_failures(tmp_path):
    cache = LimitCache(tmp_path / "l.json")
    timings = {_Choice("triton_mm_1"): 0.2, _Choice("aten_mm"): 0.3, _Choice("triton_mm_big"): float("inf")}
    _record_inductor_feedback(cache, timings, "mm", [_Node([64, 32]), _Node([32, 16])])
    rows = cache.entries("operator")
    assert len(rows) == 1 and rows[0]["key"] == "inductor/mm/64x32:bfloat16|32x16:bfloat16"
    value = rows[0]["value"]
    assert value["best"] == {"choice": "triton_mm_1", "ms": 0.2} and value["failed"] == ["triton_mm_big"]


def _inductor_savers():
    """The observers Inductor calls after benchmarking GEMM choices (the list its autotuner iterates)."""
    from torch._inductor import select_algorithm
    return select_algorithm.get_algorithm_selector_cache().feedback_saver_fns


@pytest.fixture
def fresh_feedback(monkeypatch):
    """No saver installed yet, in this process and in Inductor (both restored afterwards)."""
    from torch._inductor import select_algorithm
    from wan_accel.cache import autotune
    monkeypatch.setattr(autotune, "_FEEDBACK_INSTALLED", set())
    monkeypatch.setattr(select_algorithm.get_algorithm_selector_cache(), "feedback_saver_fns", [])
    return select_algorithm


def test_feedback_install_registers_an_observer_inductor_calls(tmp_path, fresh_feedback):
    assert install_inductor_feedback(None) is False and _inductor_savers() == []
    cache = LimitCache(tmp_path / "l.json")
    assert install_inductor_feedback(cache) is True
    assert install_inductor_feedback(cache) is True          # idempotent: still one observer
    (saver,) = _inductor_savers()
    # what Inductor's autotuner does with every saver after benchmarking (select_algorithm.py)
    saver({_Choice("triton_mm_3"): 0.1, _Choice("aten_mm"): 0.4}, "addmm", [_Node([16, 8]), _Node([8, 4])], [],
          lambda: None, {})
    (row,) = cache.entries("operator")
    assert row["key"] == "inductor/addmm/16x8:bfloat16|8x4:bfloat16"
    assert row["value"]["best"] == {"choice": "triton_mm_3", "ms": 0.1}
    saver({_Choice("x"): 0.1}, "mm", [object()], [], lambda: None, {})     # odd nodes: recorded as '?', no raise
    assert len(cache.entries("operator")) == 2


def test_feedback_install_without_the_inductor_hook(tmp_path, fresh_feedback, monkeypatch):
    """A torch without add_feedback_saver: not installed, nothing registered, nothing recorded."""
    monkeypatch.delattr(fresh_feedback, "add_feedback_saver")
    cache = LimitCache(tmp_path / "l.json")
    assert install_inductor_feedback(cache) is False
    assert _inductor_savers() == [] and cache.entries("operator") == []


def test_without_benchmarking_only_known_results_are_used(tmp_path):
    toy = Toy()
    tuner = _tuner(tmp_path / "l.json", toy)
    assert tuner.tune(KERNEL, KEY, CONFIGS, toy.run, benchmark=False) is None  # e.g. during graph capture
    assert toy.launched == []
    best = tuner.tune(KERNEL, KEY, CONFIGS, toy.run)  # the None above was not memoised
    assert best == {"BLOCK": 64, "num_warps": 4}
    toy2 = Toy()
    assert _tuner(tmp_path / "l.json", toy2).tune(KERNEL, KEY, CONFIGS, toy2.run, benchmark=False) == best
    assert toy2.launched == []
