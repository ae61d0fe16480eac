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
from wan_accel.cache.autotune import Autotuner, config_id

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


def test_config_errors_are_looked_up_by_name_and_left_out_where_absent(monkeypatch):
    """The error types are found by "module.Type": a module that is absent or fails to import, or a name that is
    not a class, is left out and the others are kept, in order."""
    from triton.compiler.errors import CompileTimeAssertionFailure

    from wan_accel.cache.autotune import optional_types, tuning_errors

    assert tuning_errors() == (errors.OutOfResources, errors.PTXASError, CompileTimeAssertionFailure)
    assert optional_types("wan_accel_no_such_module.Error", "json.JSONDecodeError", "json.no_such_name",
                          "os.sep") == (json.JSONDecodeError,)
    monkeypatch.setitem(sys.modules, "triton.runtime.errors", None)      # its import now fails
    assert tuning_errors() == (CompileTimeAssertionFailure,)


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
    # an entry locked by hand in the file
    LimitCache(tmp_path / "l.json").update("operator", f"{KERNEL}|{KEY}", lambda old: dict(old, locked=True))
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
