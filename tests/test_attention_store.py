"""Exact attention under 'auto' is chosen by the operator store like the other ops: every available candidate
(FlashAttention 3 / 2, SDPA, plain softmax math) verified against plain math on the call's shapes, the fastest
verified one kept per (heads, head size, dtype, length buckets), a wrong one failed alone, reused by a new process."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import attention_cases as cases
from wan_accel.app.doctor import ops as doctor_ops
from wan_accel.app.doctor.core import doctor_for
from wan_accel.cache import LimitCache
from wan_accel.cache.autotune import get_autotuner, reset_autotuners
from wan_accel.kernels import _common
from wan_accel.kernels import candidates as C
from wan_accel.model import attention as att

MARK = "ATTN_CHILD "
KERNEL = C.store_kernel(att.STORE_OP)
# (heads, head_dim, query length, key length): the tiny model's layout and Wan 1.3B's (12 heads of 128)
LAYOUTS = ((4, 16, 24, 48), (12, 128, 30, 90))


@pytest.fixture(autouse=True)
def _fresh_choices():
    cases.forget_choices()
    reset_autotuners()
    yield
    cases.forget_choices()
    reset_autotuners()


def _qkv(heads, hd, lq, lk, dtype=torch.float32, seed=5):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, n, heads, hd, generator=g).to(dtype) for n in (lq, lk, lk))


def _math64(q, k, v):
    """Plain softmax attention in float64, written here independently of the pack."""
    qd, kd, vd = (t.double().permute(0, 2, 1, 3) for t in (q, k, v))
    w = torch.softmax(qd @ kd.transpose(-1, -2) / (q.shape[-1] ** 0.5), dim=-1)
    return (w @ vd).permute(0, 2, 1, 3).to(q.dtype)


class Timed:
    """Fake timer: each candidate's fn notes its name when it runs; the timer answers that candidate's time."""

    def __init__(self, times: dict):
        self.times, self.last, self.calls = times, None, []

    def wrap(self, monkeypatch, name, fn=None, problem=None):
        base = att.AUTO_CANDIDATES.get(name) or att.AUTO_CANDIDATES["sdpa"]
        real = fn or base.fn

        def run(q, k, v):
            self.last = name
            self.calls.append(name)
            return real(q, k, v)
        cand = C.Candidate(att.STORE_OP, name, base.group if name in att.AUTO_CANDIDATES else "flash", run,
                           problem or base.problem, base.summary)
        monkeypatch.setitem(att.AUTO_CANDIDATES, name, cand)

    def __call__(self, fn):
        fn()
        return self.times[self.last]


def _fake_setup(monkeypatch, times, extra_fn=None):
    """sdpa and torch wrapped, plus a fake 'fa2' available on this CPU (the real one needs CUDA)."""
    timer = Timed(times)
    for name in ("sdpa", "torch"):
        timer.wrap(monkeypatch, name)
    timer.wrap(monkeypatch, "fa2", extra_fn or (lambda q, k, v: att._sdpa(q, k, v)), problem=lambda d, dt, hd: None)
    get_autotuner().timer = timer
    return timer


@pytest.mark.parametrize("heads,hd,lq,lk", LAYOUTS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_every_available_candidate_and_the_reference_match_plain_math(heads, hd, lq, lk, dtype):
    q, k, v = _qkv(heads, hd, lq, lk, dtype)
    names = []
    for cand, why in att.auto_listing("cpu", dtype, hd):
        if why is None:
            diff = C.verify(cand, (q, k, v), reference=_math64, ulps=att.STORE_ULPS)
            assert diff <= att.STORE_ULPS * torch.finfo(dtype).eps
            names.append(cand.name)
    assert names == ["sdpa", "torch"]
    assert "int8" not in att.AUTO_CANDIDATES       # approximate: opt-in only, never a candidate of 'auto'


def test_the_faster_verified_candidate_is_chosen_and_recorded(monkeypatch):
    timer = _fake_setup(monkeypatch, {"fa2": 1.0, "sdpa": 2.0, "torch": 5.0})
    q, k, v = _qkv(12, 128, 30, 90)
    out = att.attention(q, k, v)                           # 'auto'
    assert timer.calls[-1] == "fa2"                        # the call itself ran the fastest verified one
    assert torch.allclose(out.double(), _math64(q, k, v).double(), atol=1e-5)
    entry = get_autotuner().entry(KERNEL, att.store_key(q, k))
    assert entry["best"]["config"] == {"impl": "fa2"}
    assert sorted(entry["timings"]) == ["impl=fa2", "impl=sdpa", "impl=torch"] and not entry["failed"]
    assert att.store_key(q, k) == "cpu|h12|d128|float32|q32|k128"
    timer.calls.clear()
    att.attention(q[:, :29], k[:, :100], v[:, :100])          # same buckets: the choice is reused, nothing timed
    assert timer.calls == ["fa2"]


def test_a_wrong_candidate_is_failed_alone_and_never_used(monkeypatch):
    timer = _fake_setup(monkeypatch, {"fa2": 1.0, "sdpa": 2.0, "torch": 5.0},
                        extra_fn=lambda q, k, v: att._sdpa(q * 1.5, k, v))       # wrong softmax scale
    q, k, v = _qkv(4, 16, 24, 48)
    out = att.attention(q, k, v)
    entry = get_autotuner().entry(KERNEL, att.store_key(q, k))
    assert list(entry["failed"]) == ["impl=fa2"] and "wrong numbers" in entry["failed"]["impl=fa2"]["error"]["message"]
    assert entry["best"]["config"] == {"impl": "sdpa"} and "impl=torch" in entry["timings"]
    assert timer.calls[-1] == "sdpa"
    torch.testing.assert_close(out, _math64(q, k, v))
    cases.forget_choices()
    timer.calls.clear()
    att.attention(q, k, v)                                 # a fresh choice from the store: fa2 never runs again
    assert timer.calls == ["sdpa"]


def _child(code: str, env_extra: dict) -> dict:
    import wan_accel
    env = dict(os.environ, **env_extra)
    parent = str(Path(wan_accel.__path__[0]).parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (parent, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=300)
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    pytest.fail(f"child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def test_a_second_process_reuses_the_choice_with_zero_timings(tmp_path):
    code = f"""
        import json, torch
        from wan_accel.cache.autotune import get_autotuner
        from wan_accel.model import attention as att
        tuner = get_autotuner()
        used = []
        tuner.timer = lambda fn: (fn(), 1.0 if used[-1] == "torch" else 3.0)[1]    # plain math "faster"
        for name in ("sdpa", "torch"):
            c = att.AUTO_CANDIDATES[name]
            att.AUTO_CANDIDATES[name] = c.__class__(c.family, c.name, c.group,
                                                    lambda q, k, v, f=c.fn, n=name: (used.append(n), f(q, k, v))[1],
                                                    c.problem, c.summary)
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(1, n, 4, 16, generator=g) for n in (24, 48, 48))
        att.attention(q, k, v)
        print({MARK!r} + json.dumps({{"ran": used[-1], "benchmarks": tuner.stats["benchmarks"]}}))
    """
    env = {"WAN_ACCEL_CACHE": str(tmp_path / "limits.json")}
    first, second = _child(code, env), _child(code, env)
    assert first == {"ran": "torch", "benchmarks": 2}
    assert second == {"ran": "torch", "benchmarks": 0}


def test_explicit_sdpa_is_honoured_whatever_the_store_holds(monkeypatch):
    timer = _fake_setup(monkeypatch, {"fa2": 9.0, "sdpa": 5.0, "torch": 1.0})
    q, k, v = _qkv(4, 16, 24, 48)
    att.attention(q, k, v)
    assert timer.calls[-1] == "torch"                      # the store's choice for 'auto'
    timer.calls.clear()
    out = att.attention(q, k, v, backend="sdpa")
    assert timer.calls == []
    torch.testing.assert_close(out, F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2), rtol=0, atol=0)


def test_cpu_with_sdpa_and_math_only_picks_sdpa_untimed(monkeypatch):
    ran = []
    real = att._sdpa
    monkeypatch.setattr(att, "_sdpa", lambda *a, **kw: (ran.append(1), real(*a, **kw))[1])
    q, k, v = _qkv(4, 16, 24, 48)
    att.attention(q, k, v)
    tuner = get_autotuner()
    assert ran == [1] and tuner.stats["benchmarks"] == 0 and tuner.stats["launch_checks"] == 0
    assert tuner.entry(KERNEL, att.store_key(q, k)) is None


def test_no_measuring_while_compiling_store_or_availability_order(monkeypatch):
    timer = _fake_setup(monkeypatch, {"fa2": 3.0, "sdpa": 2.0, "torch": 1.0})
    q, k, v = _qkv(4, 16, 24, 48)
    monkeypatch.setattr(_common, "is_compiling", lambda: True)
    att.attention(q, k, v)
    assert timer.calls == ["fa2"]                          # nothing known: availability order, nothing measured
    assert get_autotuner().stats["benchmarks"] == 0 and get_autotuner().entry(KERNEL, att.store_key(q, k)) is None
    monkeypatch.setattr(_common, "is_compiling", lambda: False)
    att.attention(q, k, v)                                 # measured now: plain math is the fastest here
    assert timer.calls[-1] == "torch"
    cases.forget_choices()
    monkeypatch.setattr(_common, "is_compiling", lambda: True)
    timer.calls.clear()
    att.attention(q, k, v)                                 # compiling again: the store's choice, nothing timed
    assert timer.calls == ["torch"]


def test_switched_off_flash_generations_leave_the_auto_candidates():
    assert att.auto_request(frozenset({"kernel.rmsnorm_rope"})) == "auto"
    assert att.auto_request(frozenset({"attention.fa3", "attention.sdpa", "op.x"})) == ("auto", "fa3")
    rows = dict((c.name, why) for c, why in att.auto_listing("cpu", torch.float32, 16, ("fa3",)))
    assert rows["fa3"] == att.SWITCHED_OFF and rows["sdpa"] is None


def test_the_doctor_lists_attention(tmp_path):
    doc = doctor_for("cpu", torch.float32, 16, cache=LimitCache(tmp_path / "limits.json"), heads=4, tokens=24)
    rows = {r["op"]: r for r in doctor_ops.implementations(doc, probe=False)}
    row = rows["attention"]
    assert row["uses"] == "sdpa" and set(row["candidates"]) == {"fa3", "fa2", "fa3_hub", "fa3_xformers", "sdpa",
                                                                 "torch", "sdpa.cudnn", "sdpa.flash",
                                                                 "sdpa.efficient", "triton", "fa3.split2",
                                                                 "fa3.split3"}
    assert row["candidates"]["fa3"] == "needs a CUDA device" and row["candidates"]["torch"] == "available"
    assert row["candidates"]["sdpa.cudnn"] == "needs a CUDA device, not cpu"
    assert row["candidates"]["fa3_hub"] == row["candidates"]["fa3_xformers"] == "needs a CUDA GPU"
    assert row["candidates"]["triton"] == "takes float16/bfloat16, not float32"
    assert "attention at 1x24x4x16 / 1x24x4x16: sdpa" in doctor_ops.implementation_text(list(rows.values()))
