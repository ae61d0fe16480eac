"""FlashAttention 3 from PyPI's ``fa3-fwd`` (module ``fa3_fwd_interface``) as the ``fa3`` candidate, and its key
splits (``num_splits``) as candidates of their own, against a stand-in module with the wheel's exact signatures
whose numbers come from torch: found under either module name, bf16 only (its build has no fp16 kernels), every
split verified against plain softmax math (a wrong layout, scale or split fails), switched off with ``fa3``, called
without autograd."""
import inspect
import sys
import types

import pytest
import torch

import attention_cases as cases
from wan_accel.cache.autotune import reset_autotuners
from wan_accel.kernels import candidates as C
from wan_accel.kernels import fa3_fp8, registry
from wan_accel.model import attention as att

CUDA = "cuda:0"
SPLITS = ["fa3"] + [f"fa3.split{n}" for n in att.FA3_SPLITS]


def _math_lse(q, k, v, scale):
    """Output and log-sum-exp [B, H, Lq] of softmax(q k^T * scale) v over these keys, float32."""
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    s = (qf @ kf.transpose(-1, -2)) * scale
    return (torch.softmax(s, dim=-1) @ vf), torch.logsumexp(s, dim=-1)


def _stand_in(calls: list, combine_right: bool = True):
    """A module with fa3_fwd_interface's flash_attn_func signature (0.0.3). num_splits > 1 computes each part of
    the keys on its own and combines the parts by their log-sum-exp, as the kernel does; ``combine_right=False``
    is a broken combine (plain mean of the parts)."""
    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                        v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                        pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
        assert not causal and window_size == (-1, -1) and qv is None and softcap == 0.0
        calls.append({"num_splits": num_splits, "grad": torch.is_grad_enabled(), "scale": softmax_scale,
                      "dtype": q.dtype})
        if q.dtype == torch.float8_e4m3fn:                   # fp8: codes times float32 descales [B, H_k]
            assert k.dtype == v.dtype == q.dtype
            for t, d in ((q, q_descale), (k, k_descale), (v, v_descale)):
                assert d is not None and d.dtype == torch.float32 and tuple(d.shape) == (t.shape[0], t.shape[2])
            q, k, v = (t.float() * d[:, None, :, None] for t, d in ((q, q_descale), (k, k_descale),
                                                                     (v, v_descale)))
            q = q.to(torch.bfloat16)                         # its output is bf16
        assert q.dtype == torch.bfloat16, "the wheel has no fp16 kernels"
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        parts = [_math_lse(q, kp, vp, scale) for kp, vp in zip(k.chunk(max(1, num_splits), dim=1),
                                                                 v.chunk(max(1, num_splits), dim=1))]
        if combine_right:
            lse = torch.logsumexp(torch.stack([p[1] for p in parts]), dim=0)
            out = sum(torch.exp(p[1] - lse)[..., None] * p[0] for p in parts)
        else:
            out = sum(p[0] for p in parts) / len(parts)
        out = out.transpose(1, 2).to(q.dtype)
        return (out, None) if return_attn_probs else out

    mod = types.ModuleType("fa3_fwd_interface")
    mod.flash_attn_func = flash_attn_func
    config = types.ModuleType("fa3_fwd_config")
    config.CONFIG = {"build_flags": {"FLASHATTENTION_DISABLE_FP16": True, "FLASHATTENTION_DISABLE_SPLIT": False}}
    return mod, config


def _forget():
    att._FUNCS.clear()
    att._FROM.clear()
    att._NO_FP16.clear()
    att._BUILD.clear()
    att.resolve_backend.cache_clear()
    cases.forget_choices()
    reset_autotuners()


@pytest.fixture
def wheel(monkeypatch):
    """Only fa3-fwd installed (upstream's flash_attn_interface absent), on a Hopper 'cuda:0'."""
    _forget()
    calls: list = []
    mod, config = _stand_in(calls)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)       # import of it fails
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", mod)
    monkeypatch.setitem(sys.modules, "fa3_fwd_config", config)
    monkeypatch.setattr(registry, "capability", lambda device: (9, 0))
    monkeypatch.setattr(att, "build_supports", lambda name, device, dtype=None: None)   # no CUDA for the probe
    yield calls
    _forget()


def _qkv(dtype=torch.bfloat16, lq=24, lk=45, heads=3, hd=16, seed=5):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, n, heads, hd, generator=g).to(dtype) for n in (lq, lk, lk))


def test_the_stand_in_has_the_wheels_signature():
    params = list(inspect.signature(_stand_in([])[0].flash_attn_func).parameters)
    assert params[:6] == ["q", "k", "v", "softmax_scale", "causal", "qv"]
    assert "num_splits" in params and params.index("num_splits") == 12


def test_found_under_the_wheels_module_name(wheel):
    assert att.fa_available("fa3") and att.loaded_from("fa3") == "fa3_fwd_interface"
    assert att.flash_problem("fa3", CUDA, torch.bfloat16, 128) is None
    name, why = att.explain_backend("fa3", CUDA, torch.bfloat16, 128)
    assert name == "fa3" and "fa3_fwd_interface" in why


def test_upstreams_module_wins_where_both_import(wheel, monkeypatch):
    upstream = types.ModuleType("flash_attn_interface")
    upstream.flash_attn_func = lambda q, k, v, **kw: ("upstream", kw)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", upstream)
    _forget()
    assert att.loaded_from("fa3") == "flash_attn_interface"
    assert att.fa_dtype_problem("fa3", torch.float16) is None              # that build has fp16 kernels


def test_no_fp16_call_is_offered_to_the_wheel(wheel):
    for name in SPLITS:
        why = att.AUTO_CANDIDATES[name].problem(torch.device(CUDA), torch.float16, 128)
        assert why == "fa3_fwd_interface is built without fp16 kernels (bf16 only)", (name, why)
        assert att.AUTO_CANDIDATES[name].problem(torch.device(CUDA), torch.bfloat16, 128) is None
    assert att.explain_backend("fa3", CUDA, torch.float16, 128)[0] == "sdpa"
    assert att.flash_problem("fa3", "cpu", torch.bfloat16, 128) == "needs a CUDA device"
    assert wheel == []                                                     # nothing was called for it


@pytest.mark.parametrize("name", SPLITS)
def test_every_split_is_verified_against_softmax_math(wheel, name):
    q, k, v = _qkv()
    C.verify(att.AUTO_CANDIDATES[name], (q, k, v), reference=att.attention_reference, ulps=att.STORE_ULPS)
    splits = 1 if name == "fa3" else int(name.rsplit("split", 1)[1])
    assert {c["num_splits"] for c in wheel} == {splits}
    assert all(c["scale"] is None for c in wheel)                          # the wheel's own 1/sqrt(D)


def test_a_wrong_combine_of_the_splits_fails_verification(monkeypatch):
    _forget()
    calls: list = []
    mod, config = _stand_in(calls, combine_right=False)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", mod)
    monkeypatch.setitem(sys.modules, "fa3_fwd_config", config)
    q, k, v = _qkv()
    C.verify(att.AUTO_CANDIDATES["fa3"], (q, k, v), reference=att.attention_reference, ulps=att.STORE_ULPS)
    with pytest.raises(C.CandidateMismatch):
        C.verify(att.AUTO_CANDIDATES["fa3.split2"], (q, k, v), reference=att.attention_reference,
                 ulps=att.STORE_ULPS)
    _forget()


def test_it_runs_without_autograd(wheel):
    q, k, v = (t.requires_grad_() for t in _qkv())
    for name in SPLITS:
        out = att.AUTO_CANDIDATES[name].fn(q, k, v)
        assert out.grad_fn is None and out.shape == q.shape
    assert [c["grad"] for c in wheel] == [False] * len(SPLITS)


def test_the_splits_are_switched_off_with_fa3(wheel):
    rows = {c.name: why for c, why in att.auto_listing("cpu", torch.bfloat16, 128, off=("fa3",))}
    assert all(rows[n] == att.SWITCHED_OFF for n in SPLITS)
    assert rows["fa2"] != att.SWITCHED_OFF and rows["fa3_hub"] != att.SWITCHED_OFF
    assert all(att.feature_of(n) == "fa3" for n in SPLITS) and att.feature_of("fa3_hub") == "fa3_hub"
    assert att.auto_request(["attention.fa3"]) == ("auto", "fa3")


def test_the_doctor_refuses_fp16_with_the_wheel_and_says_how(wheel, monkeypatch):
    from wan_accel.app.doctor import probes
    from wan_accel.app.doctor.vocabulary import NotAvailable

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    ctx = types.SimpleNamespace(device=torch.device(CUDA), dtype=torch.float16, head_dim=128)
    with pytest.raises(NotAvailable, match="without fp16 kernels"):
        probes._fa_checker("fa3")(ctx)
    assert "fa3-fwd" in probes.FA_HINTS["fa3"]


def test_quantized_heads_round_within_e4m3s_step():
    x = _qkv(torch.float32)[1] * torch.tensor([1.0, 30.0, 1e-3])[None, None, :, None]   # heads of unlike scales
    codes, descale = fa3_fp8.quantize_heads(x)
    assert codes.dtype == torch.float8_e4m3fn and descale.shape == (x.shape[0], x.shape[2])
    back = codes.float() * descale[:, None, :, None]
    step = x.abs().amax(dim=(1, 3), keepdim=True) / 448          # one code's worth of the head's scale
    # round to nearest: half e4m3's relative step (2^-3) of the value, or half the subnormal step (2^-9) near 0
    assert torch.all((back - x).abs() <= 2.0 ** -4 * x.abs() + step * 2.0 ** -10 + 1e-30)
    assert float((back - x).abs().max()) > 0                                # it does round


def test_fp8_through_fa3_gets_codes_and_descales_and_stays_within_its_bound(wheel):
    q, k, v = _qkv()
    kv = fa3_fp8.quantize_kv(k, v)
    out = fa3_fp8.attention(att.flash_function("fa3"), q, kv)
    assert out.dtype == torch.bfloat16 and wheel[-1]["dtype"] == torch.float8_e4m3fn
    ref = att.attention_reference(q.double(), k.double(), v.double())
    err = (out.double() - ref).abs()
    bound = fa3_fp8.error_bound(q, k, v, kernel="fa3", kv=kv)
    assert float(err.max()) > 0 and bool((err <= bound).all()), float((err / bound).max())
    fn = att.flash_function("fa3")
    wrong = fa3_fp8.attention(fn, q, kv._replace(k_descale=kv.k_descale * 2))   # keys' descale off by 2
    assert not bool(((wrong.double() - ref).abs() <= bound).all())
    no_mean = fa3_fp8.attention(fn, q, kv._replace(v_mean=kv.v_mean * 0))      # the values' vector not added back
    assert not bool(((no_mean.double() - ref).abs() <= bound).all())
    cand = registry.candidate("attention.fp8", "fa3")              # the fp8 mode's FA3 candidate
    assert cand.rejected(CUDA, torch.float16, 128) == "takes bfloat16, not float16"
    assert cand.rejected(CUDA, torch.bfloat16, 128) is None
