"""FlashAttention 3 from prebuilt packages (kernels/fa3_packages.py) as candidates of exact attention under 'auto':
the kernel hub (opt-in by WAN_ACCEL_HUB_KERNELS=1) and xformers' FA3 operator, here as fake modules computing
attention in torch. The hub is never loaded without the opt-in; a failed load is a problem, never an exception;
on a CPU each says it needs a CUDA GPU; a failed doctor verdict switches each off alone; the store picks one where
it is verified and fastest and fails a wrong one by verification."""
import sys
import types

import pytest
import torch
import torch.nn.functional as F

import attention_cases as cases
from wan_accel.cache import LimitCache
from wan_accel.cache.autotune import get_autotuner, reset_autotuners
from wan_accel.kernels import candidates as C, registry
from wan_accel.kernels import fa3_packages as fa3
from wan_accel.model import attention as att

KERNEL = C.store_kernel(att.STORE_OP)
CUDA = "cuda:0"


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    fa3._LOADED.clear()
    fa3._PROBED.clear()
    cases.forget_choices()
    reset_autotuners()
    monkeypatch.delenv(fa3.HUB_ENV, raising=False)
    monkeypatch.setattr(registry, "capability", lambda device: (9, 0))   # 'cuda:0' is a Hopper GPU for the checks
    yield
    fa3._LOADED.clear()
    fa3._PROBED.clear()
    cases.forget_choices()
    reset_autotuners()


def _math(q, k, v):
    """softmax(q k^T / sqrt(D)) v in float32 for [B, L, H, D] inputs, and the log-sum-exp [B, H, Lq]."""
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    s = qf @ kf.transpose(-1, -2) / q.shape[-1] ** 0.5
    return (torch.softmax(s, dim=-1) @ vf).transpose(1, 2), torch.logsumexp(s, dim=-1)


def _transposed(q, k, v):
    """The layout mistake: [B, L, H, D] taken as [B, H, L, D] (heads attend to heads): right shape, wrong numbers."""
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float())


def _qkv(dtype=torch.bfloat16, heads=4, hd=16, lq=24, lk=40, seed=3):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, n, heads, hd, generator=g).to(dtype) for n in (lq, lk, lk))


def _fake_hub(monkeypatch, returns="tuple", fail=None, math=None):
    """A fake ``kernels`` package: get_kernel(repo) records its calls and gives a module whose flash_attn_func
    returns (output, lse) or the output alone, in float32 (the adapter must give q's dtype)."""
    calls = []

    def flash_attn_func(q, k, v, causal=True):
        assert causal is False
        out, lse = _math(q, k, v) if math is None else (math(q, k, v), None)
        return (out, lse) if returns == "tuple" else out

    def get_kernel(repo):
        calls.append(repo)
        if fail:
            raise fail
        return types.SimpleNamespace(flash_attn_func=flash_attn_func)
    monkeypatch.setitem(sys.modules, "kernels", types.SimpleNamespace(__name__="kernels", get_kernel=get_kernel))
    return calls


def _fake_xformers(monkeypatch, available=True, math=None):
    """Fake ``xformers.ops.fmha`` and its ``flash3.FwOp``; the forward records the operator it was asked for."""
    ops = []

    class FwOp:
        @classmethod
        def is_available(cls):
            return available

    def memory_efficient_attention_forward(q, k, v, op=None):
        ops.append(op)
        return (_math(q, k, v)[0] if math is None else math(q, k, v)).to(q.dtype)
    flash3 = types.SimpleNamespace(__name__="xformers.ops.fmha.flash3", FwOp=FwOp)
    fmha = types.SimpleNamespace(__name__="xformers.ops.fmha", flash3=flash3,
                                 memory_efficient_attention_forward=memory_efficient_attention_forward)
    for name, mod in (("xformers", types.SimpleNamespace(__name__="xformers")),
                      ("xformers.ops", types.SimpleNamespace(__name__="xformers.ops", fmha=fmha)),
                      ("xformers.ops.fmha", fmha), ("xformers.ops.fmha.flash3", flash3)):
        monkeypatch.setitem(sys.modules, name, mod)
    return ops, FwOp


def test_without_the_opt_in_the_hub_is_never_loaded_and_its_problem_says_how(monkeypatch):
    calls = _fake_hub(monkeypatch)
    why = fa3.problem("fa3_hub", CUDA, torch.bfloat16, 128)
    assert "not opted in" in why and f"{fa3.HUB_ENV}=1" in why
    assert att.AUTO_CANDIDATES["fa3_hub"].problem(torch.device(CUDA), torch.bfloat16, 128) == why
    monkeypatch.setenv(fa3.HUB_ENV, "yes")                  # only "1" opts in
    assert "not opted in" in fa3.problem("fa3_hub", CUDA, torch.bfloat16, 128)
    assert calls == []


@pytest.mark.parametrize("returns", ["tuple", "tensor"])
def test_with_the_opt_in_the_hub_adapter_gives_the_reference(monkeypatch, returns):
    calls = _fake_hub(monkeypatch, returns=returns)
    monkeypatch.setenv(fa3.HUB_ENV, "1")
    monkeypatch.setattr(fa3, "_probe", lambda *a: None)     # no CUDA here for the tiny probe call
    assert fa3.problem("fa3_hub", CUDA, torch.bfloat16, 128) is None
    assert fa3.problem("fa3_hub", CUDA, torch.float16, 64) is None
    assert calls == [fa3.HUB_REPO]                          # loaded once per process
    q, k, v = _qkv()
    out = att.AUTO_CANDIDATES["fa3_hub"].fn(q, k, v)
    assert out.dtype == q.dtype and out.shape == q.shape
    C.verify(att.AUTO_CANDIDATES["fa3_hub"], (q, k, v), reference=att.attention_reference, ulps=att.STORE_ULPS)


def test_the_xformers_adapter_asks_for_fa3_and_gives_the_reference(monkeypatch):
    ops, fwop = _fake_xformers(monkeypatch)
    monkeypatch.setattr(fa3, "_probe", lambda *a: None)
    assert fa3.problem("fa3_xformers", CUDA, torch.float16, 128) is None
    q, k, v = _qkv(torch.float16)
    out = att.AUTO_CANDIDATES["fa3_xformers"].fn(q, k, v)
    assert ops == [fwop] and out.dtype == torch.float16
    C.verify(att.AUTO_CANDIDATES["fa3_xformers"], (q, k, v), reference=att.attention_reference,
             ulps=att.STORE_ULPS)


def test_a_failing_load_becomes_the_problem_never_an_exception(monkeypatch):
    calls = _fake_hub(monkeypatch, fail=OSError("the hub could not be reached"))
    monkeypatch.setenv(fa3.HUB_ENV, "1")
    for _ in range(2):
        why = fa3.problem("fa3_hub", CUDA, torch.bfloat16, 128)
        assert why.startswith("did not load (OSError: the hub could not be reached)"), why
    assert calls == [fa3.HUB_REPO]                          # attempted once per process
    _fake_xformers(monkeypatch, available=False)
    assert "built without its FlashAttention 3 operator" in fa3.problem("fa3_xformers", CUDA, torch.bfloat16, 128)
    with pytest.raises(RuntimeError, match="fa3_hub is not available: OSError"):
        fa3.attention("fa3_hub", *_qkv())


def test_a_probe_call_that_fails_is_the_problem(monkeypatch):
    def unsupported(q, k, v):
        raise ValueError("Operator not supported")
    _fake_xformers(monkeypatch, math=unsupported)
    monkeypatch.setattr(fa3, "_probe_input", lambda device, dtype: torch.zeros(1, 1, 1, 64, dtype=dtype))
    why = fa3.problem("fa3_xformers", CUDA, torch.bfloat16, 128)
    assert why == "the installed build does not run on SM 9.0 (ValueError: Operator not supported)"


def test_call_rules_and_the_gpu_generation(monkeypatch):
    for name in fa3.NAMES:
        assert fa3.problem(name, "cpu", torch.bfloat16, 128) == "needs a CUDA GPU"
        assert fa3.problem(name, CUDA, torch.float32, 128) == "needs fp16/bf16 (got float32)"
        for hd in (260, 100, 0):
            assert fa3.problem(name, CUDA, torch.bfloat16, hd).startswith(f"head size {hd} not supported")
    monkeypatch.setattr(registry, "capability", lambda device: (8, 9))
    assert "SM 9.x" in fa3.problem("fa3_xformers", CUDA, torch.bfloat16, 128)
    assert "SM 8.9" in fa3.problem("fa3_xformers", CUDA, torch.bfloat16, 128)


def test_on_a_cpu_the_listing_says_they_need_a_gpu_and_loads_nothing(monkeypatch):
    calls = _fake_hub(monkeypatch)
    ops, _ = _fake_xformers(monkeypatch)
    monkeypatch.setenv(fa3.HUB_ENV, "1")
    rows = {c.name: why for c, why in att.auto_listing("cpu", torch.bfloat16, 128)}
    assert rows["fa3_hub"] == rows["fa3_xformers"] == "needs a CUDA GPU"
    assert calls == [] and ops == [] and fa3._LOADED == {}
    names = list(att.AUTO_CANDIDATES)                      # FA3 too: after fa3/fa2, before every SDPA candidate
    assert names[:4] == ["fa3", "fa2", "fa3_hub", "fa3_xformers"] and names.index("sdpa.cudnn") == 4


@pytest.mark.parametrize("name", fa3.NAMES)
def test_a_failed_doctor_verdict_switches_each_off_alone(monkeypatch, name):
    from wan_accel.app.doctor import gate
    from wan_accel.app.doctor.core import FEATURES
    from wan_accel.model.tiny import tiny_causal_model
    from wan_accel.nodes.doctor_nodes import FEATURE_CHOICES
    from wan_accel.sampling.runner import FastOptions
    from wan_accel.kernels import _common
    feature = f"attention.{name}"
    assert feature in FEATURES and feature in FEATURE_CHOICES and feature in att.SWITCHABLE
    # a CPU without Triton's interpreter, whatever this process's TRITON_INTERPRET says (tests/test_interpret_pass.py
    # runs this file under it): no fused kernel and no candidate of them to judge
    monkeypatch.setattr(_common, "interpreter_usable", lambda: False)

    class Verdicts:
        def why_off(self, n):
            return "failed: wrong numbers" if n == feature else None

    model = tiny_causal_model()
    options, _ = gate.gate_options(model, FastOptions(), doctor=Verdicts())
    assert feature not in options.switched_off              # a CPU: not a candidate, nothing to judge
    for other in fa3.NAMES:
        monkeypatch.setitem(fa3.PROBLEMS, other, lambda *a: None)
    options, lines = gate.gate_options(model, FastOptions(), doctor=Verdicts())
    assert feature in options.switched_off and any(feature in line for line in lines)
    assert not any(f"attention.{o}" in options.switched_off for o in fa3.NAMES if o != name)
    off = att.auto_request(options.switched_off)
    assert off == ("auto", name)
    rows = {c.name: why for c, why in att.auto_listing("cpu", torch.bfloat16, 128, off[1:])}
    assert rows[name] == att.SWITCHED_OFF
    assert [rows[o] for o in fa3.NAMES if o != name] == [None]


@pytest.mark.parametrize("wrong", [False, True])
def test_the_doctor_checks_the_package_against_softmax_math(monkeypatch, tmp_path, wrong):
    from wan_accel.app.doctor.core import doctor_for
    _fake_xformers(monkeypatch, math=_transposed if wrong else None)
    doc = doctor_for("cpu", torch.bfloat16, 16, cache=LimitCache(tmp_path / "limits.json"), heads=4, tokens=24)
    assert doc.unavailable("attention.fa3_xformers")[0] == "needs a CUDA GPU"
    assert doc.unavailable("attention.fa3_hub")[0] == "needs a CUDA GPU"
    monkeypatch.setitem(fa3.PROBLEMS, "fa3_xformers", lambda *a: None)
    value = doc.check("attention.fa3_xformers")
    assert value["status"] == ("failed" if wrong else "passed"), value


def _store_setup(monkeypatch, times, hub_math=None, xformers_math=None):
    """Both fakes loaded and their problems forced to None; every usable candidate notes its name when it runs and
    the fake timer answers that candidate's time."""
    _fake_hub(monkeypatch, returns="tuple", math=hub_math)
    _fake_xformers(monkeypatch, math=xformers_math)
    monkeypatch.setenv(fa3.HUB_ENV, "1")
    for name in fa3.NAMES:
        monkeypatch.setitem(fa3.PROBLEMS, name, lambda *a: None)
    ran = []
    for name in ("fa3_hub", "fa3_xformers", "sdpa", "torch"):
        c = att.AUTO_CANDIDATES[name]
        monkeypatch.setitem(att.AUTO_CANDIDATES, name, C.Candidate(
            c.family, c.name, c.group, lambda q, k, v, f=c.fn, n=name: (ran.append(n), f(q, k, v))[1], c.problem,
            c.summary))
    get_autotuner().timer = lambda fn: (fn(), times[ran[-1]])[1]
    return ran


def test_the_store_picks_a_package_where_it_is_verified_and_fastest(monkeypatch):
    ran = _store_setup(monkeypatch, {"fa3_hub": 2.0, "fa3_xformers": 1.0, "sdpa": 3.0, "torch": 5.0})
    q, k, v = _qkv()
    out = att.attention(q, k, v)
    entry = get_autotuner().entry(KERNEL, att.store_key(q, k))
    assert entry["best"]["config"] == {"impl": "fa3_xformers"} and not entry["failed"]
    assert sorted(entry["timings"]) == ["impl=fa3_hub", "impl=fa3_xformers", "impl=sdpa", "impl=torch"]
    assert ran[-1] == "fa3_xformers"                        # the call itself ran the fastest verified one
    torch.testing.assert_close(out, fa3.attention("fa3_xformers", q, k, v), rtol=0, atol=0)


def test_a_package_with_the_wrong_layout_is_failed_by_verification(monkeypatch):
    ran = _store_setup(monkeypatch, {"fa3_hub": 2.0, "fa3_xformers": 1.0, "sdpa": 3.0, "torch": 5.0},
                       xformers_math=_transposed)
    q, k, v = _qkv(lq=24, lk=24)                            # self-attention: the mistake runs, its numbers differ
    att.attention(q, k, v)
    entry = get_autotuner().entry(KERNEL, att.store_key(q, k))
    assert list(entry["failed"]) == ["impl=fa3_xformers"]
    assert "wrong numbers" in entry["failed"]["impl=fa3_xformers"]["error"]["message"]
    assert entry["best"]["config"] == {"impl": "fa3_hub"} and ran[-1] == "fa3_hub"


def test_no_probe_call_runs_inside_a_cuda_graph_capture(monkeypatch):
    """A first listing inside a graph capture must not call the kernel (it would break the capture): the candidate
    is no candidate for that call, nothing is remembered, and the first listing outside a capture probes it. The
    FlashAttention module probe (``build_supports``) follows the same rule."""
    calls = []

    def counted(q, k, v):
        calls.append(q.shape)
        return _math(q, k, v)[0].to(q.dtype)
    _fake_xformers(monkeypatch, math=counted)
    monkeypatch.setattr(fa3, "_probe_input", lambda device, dtype: torch.zeros(1, 1, 1, 64, dtype=dtype))
    monkeypatch.setattr(fa3, "capturing", lambda: True)
    assert "capture" in fa3.problem("fa3_xformers", CUDA, torch.bfloat16, 128) and calls == []
    monkeypatch.setitem(att._FUNCS, "fa3", counted)
    assert "capture" in att.build_supports("fa3", CUDA) and calls == []
    monkeypatch.setattr(fa3, "capturing", lambda: False)
    assert fa3.problem("fa3_xformers", CUDA, torch.bfloat16, 128) is None and len(calls) == 1
    monkeypatch.setattr(fa3, "capturing", lambda: True)      # probed once: a capture now reuses that verdict
    assert fa3.problem("fa3_xformers", CUDA, torch.bfloat16, 128) is None and len(calls) == 1
