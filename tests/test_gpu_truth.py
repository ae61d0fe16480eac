"""Defects found on the first real GPU, reproduced on a CPU: speed verdicts only at the run's own shapes."""
from __future__ import annotations

import pytest
import torch

from wan_accel.app.doctor import core as doc
from wan_accel.app.doctor.core import Doctor, Feature, Probe, default_context
from wan_accel.app.doctor.report import doctor_rows
from wan_accel.cache import LimitCache

FP = {"device": "cuda", "gpu": "GPU A", "capability": "9.0", "total_memory": 80, "driver": "550.1",
      "cuda": "12.4", "torch": "2.13.0", "triton": "3.9.0"}


def _x():
    return torch.linspace(-2, 2, 64).reshape(4, 16)


def _slow_at_the_probe(fn, device, **_):
    return 0.004 if fn.__name__ == "feature" else 0.001


def test_a_probe_shape_never_switches_a_feature_off_for_speed(cache_path, monkeypatch):
    """On a GPU the doctor used to judge speed at its 256-token probe: fused q/k/v was switched off there while
    whole runs at the real shape took the same time. Now the timing is shown with its shape, never judged."""
    monkeypatch.setattr(doc, "_sync", lambda device: None)      # a CUDA context on a CPU machine: nothing to sync
    ctx = default_context("cpu", torch.float32, head_dim=16)
    ctx = type(ctx)(device=torch.device("cuda", 0), dtype=torch.float32, head_dim=16)

    def check(c):
        def feature():
            return _x() * 2
        return Probe(feature, lambda: _x() * 2, torch.float32)
    feats = {"fake.fused": Feature("fake.fused", "fused", check, switches_off="fused")}
    d = Doctor(cache=LimitCache(cache_path, fingerprint=FP), context=ctx, features=feats, timer=_slow_at_the_probe)
    value = d.check("fake.fused")
    assert value["status"] == "passed" and value["speed_judged"] is False
    assert value["feature_ms"] == 4.0 and value["shape"] == "256 tokens, 2 heads x 16, float32"
    assert d.why_off("fake.fused") is None
    row = doctor_rows(d, ["fake.fused"])[0]
    assert "timed at 256 tokens" in row["speed"] and "decided at the run's shapes" in row["speed"]
    # a probe that runs the real call's shapes may still be judged
    feats["fake.real"] = Feature("fake.real", "real", lambda c: Probe(check(c).feature, lambda: _x() * 2,
                                                                     torch.float32, judge_speed=True))
    assert d.check("fake.real")["status"] == "slower"


def test_verdicts_of_the_old_probe_version_are_probed_again(cache_path):
    cache = LimitCache(cache_path, fingerprint=FP)
    ctx = default_context("cpu", torch.float32, head_dim=16)
    feats = {"fake.f": Feature("fake.f", "f", lambda c: Probe(lambda: _x(), lambda: _x(), torch.float32))}
    d = Doctor(cache=cache, context=ctx, features=feats)
    d.check("fake.f")
    assert d.probes == 1
    stored = cache.get("doctor", d.key("fake.f"))
    cache.put("doctor", d.key("fake.f"), dict(stored, probe=1, status="slower", error="slower at 256 tokens"))
    d2 = Doctor(cache=LimitCache(cache_path, fingerprint=FP), context=ctx, features=feats)
    assert d2.check("fake.f")["status"] == "passed" and d2.probes == 1
