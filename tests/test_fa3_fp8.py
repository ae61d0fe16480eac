"""fp8 attention through FlashAttention 3's e4m3 kernels (``kernels/fa3_fp8.py``): its math in torch within the
stated bound (and the bound not trivially loose), the KV cache's copy in FA3's form (codes and per-head scales fixed
at the first write, saturation counted by the bound), the fp8 mode taking FA3 where it runs (a stand-in with the
wheel's signature on a stood-in Hopper GPU), a whole run reading the copy, and ``bench fidelity --fp8-numerics``."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from wan_accel.kernels import fa3_fp8 as F
from wan_accel.kernels import registry
from wan_accel.model import attention as attn
from wan_accel.model import attention_approx as approx

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
from test_fa3_fwd import wheel  # noqa: E402,F401 - a fixture: fa3-fwd's stand-in on a stood-in Hopper GPU


def _qkv(lq, lk, dtype, spread=1.0, offset=0.0, heads=3, hd=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, lq, heads, hd, generator=g) * spread
    k = torch.randn(2, lk, heads, hd, generator=g) * spread + offset
    v = torch.randn(2, lk, heads, hd, generator=g) + offset
    return tuple(t.to(dtype) for t in (q, k, v))


def _err(out, q, k, v, mask=None):
    keep = slice(None) if mask is None else mask[0]
    ref = attn.attention_reference(q.double(), k[:, keep].double(), v[:, keep].double())
    return (out.double() - ref).abs()


@pytest.mark.parametrize("dtype,spread,offset", [(torch.float32, 1.0, 0.0), (torch.bfloat16, 1.0, 0.0),
                                                 (torch.float32, 2.5, 3.0), (torch.bfloat16, 1.0, 4.0)])
def test_fa3s_math_is_within_its_bound(dtype, spread, offset):
    """Unit and wide logits, channel offsets (taken out by smoothing), lengths that are no multiple of the tile."""
    q, k, v = _qkv(48, 300, dtype, spread, offset)
    err = _err(F.fa3_fp8_torch(q, k, v), q, k, v)
    bound = F.error_bound(q, k, v)
    assert float(err.max()) > 0 and bool((err <= bound).all()), float((err / bound).max())


def test_padded_keys_and_a_cache_like_copy_are_within_the_bound():
    q, k, v = _qkv(32, 200, torch.bfloat16, seed=2)
    mask = torch.ones(2, 200, dtype=torch.bool)
    mask[:, 150:] = False
    err = _err(F.fa3_fp8_torch(q, k, v, mask), q, k, v, mask)
    assert bool((err <= F.error_bound(q, k, v, mask)).all())
    # a cache's copy: vectors and scales fixed from its first 50 keys, with the headroom; later keys 3x larger
    k[:, 50:] *= 3
    first_k, first_v = k[:, :50].float(), v[:, :50].float()
    mk, mv = first_k.mean(1), first_v.mean(1)
    kv = F.quantize_kv(k, v, mk, mv, F.head_scales(first_k - mk[:, None], F.HEADROOM),
                       F.head_scales(first_v - mv[:, None], F.HEADROOM))
    err = _err(F.fa3_fp8_torch(q, k, v, kv=kv), q, k, v)
    assert bool((err <= F.error_bound(q, k, v, kv=kv)).all())


@pytest.mark.parametrize("which", ["k", "v"])
def test_saturated_keys_or_values_are_counted_by_the_bound(which):
    """Scales fixed too small (as if later keys or values were far larger than a cache's first ones): the codes
    saturate at 448 and the error grows far beyond rounding's; the bound counts the clamped amounts and holds."""
    q, k, v = _qkv(16, 64, torch.float32, seed=4)
    small = torch.full((2, 3), 0.5 / 448)
    scales = (small, F.head_scales(v)) if which == "k" else (F.head_scales(k), small)
    kv = F.quantize_kv(k, v, torch.zeros(2, 3, 64), torch.zeros(2, 3, 64), *scales)
    assert float(getattr(kv, which).float().abs().max()) == 448.0         # saturated
    err = _err(F.fa3_fp8_torch(q, k, v, kv=kv), q, k, v)
    bound = F.error_bound(q, k, v, kv=kv)
    assert float(err.max()) > 0.3 and bool((err <= bound).all())
    unclamped = F.error_bound(q, k, v)                                   # what rounding alone allows
    assert not bool((err <= unclamped).all())


def test_a_coarser_rounding_fails_the_bound(monkeypatch):
    """Every code rounded to 1 mantissa bit instead of e4m3's 3: the bound (for e4m3) no longer holds."""
    def coarse(x, scale=None):
        scale = F.head_scales(x) if scale is None else scale.float()
        y = (x.float() / scale[:, None, :, None]).clamp(-448, 448)
        step = torch.exp2(torch.floor(torch.log2(y.abs().clamp_min(2.0 ** -6))) - 1)
        return (torch.round(y / step) * step).to(torch.float8_e4m3fn), scale

    q, k, v = _qkv(48, 300, torch.float32)
    bound = F.error_bound(q, k, v)
    monkeypatch.setattr(F, "quantize_heads", coarse)
    err = _err(F.fa3_fp8_torch(q, k, v), q, k, v)
    assert not bool((err <= bound).all())


# ----------------------------------------------------------------------------- the KV cache's copy in FA3's form
def test_the_cache_keeps_fa3_codes_with_scales_fixed_at_the_first_write():
    from wan_accel.model.kv_cache import KVCache, fp8_copy, write_kv
    cache = KVCache(1, 1, 96, 2, 16, dtype=torch.bfloat16)
    cache.use_fp8(True, "fa3")
    g = torch.Generator().manual_seed(3)
    lay = cache.layers[0]
    first = None
    for start in range(0, 96, 24):
        k, v = (torch.randn(1, 24, 2, 16, generator=g) * (1 + start / 24) for _ in range(2))
        step = cache.plan(start, 24)
        write_kv(lay.k, lay.v, step.index, k, v)
        kc, vc = lay.k[:, :step.read_len], lay.v[:, :step.read_len]
        copy = fp8_copy(kc, vc)
        assert isinstance(copy, F.Fa3KV)
        if first is None:
            mk, mv = F.token_mean(kc), F.token_mean(vc)
            first = (mk, mv, F.head_scales(kc.float() - mk[:, None], F.HEADROOM),
                     F.head_scales(vc.float() - mv[:, None], F.HEADROOM))
        fresh = F.quantize_kv(kc, vc, *first)
        assert all(torch.equal(getattr(copy, f).float(), getattr(fresh, f).float()) for f in F.Fa3KV._fields)
    q = torch.randn(1, 24, 2, 16, generator=g).to(torch.bfloat16)
    with attn.fp8_numerics("fa3-torch"):
        assert torch.equal(attn.attention(q, kc, vc, backend="fp8"), F.fa3_fp8_torch(q, kc, vc, kv=copy))
    cache.reset()                                               # emptied: the next write fixes anew
    k, v = (torch.randn(1, 24, 2, 16, generator=g) * 7 for _ in range(2))
    step = cache.plan(0, 24)
    write_kv(lay.k, lay.v, step.index, k, v)
    copy = fp8_copy(lay.k[:, :24], lay.v[:, :24])
    assert not torch.equal(copy.k_descale, first[2]) and torch.equal(copy.k_mean, F.token_mean(lay.k[:, :24]))
    cache.use_fp8(True, "smoothed")                             # the other scheme: a copy of its own form
    assert not isinstance(fp8_copy(lay.k[:, :24], lay.v[:, :24]), F.Fa3KV)


# ----------------------------------------------------------------------------- FA3 where it runs
@pytest.fixture
def hopper(wheel, monkeypatch):
    """test_fa3_fwd's stand-in wheel on a stood-in Hopper 'cuda:0', the pack's fp8 kernel seeing SM 9.0 too."""
    monkeypatch.setattr(registry, "capability", lambda index: (9, 0))
    return wheel


def test_the_fp8_mode_takes_fa3_where_it_runs_and_says_so(hopper):
    kind, why = attn.fp8_implementation("cuda:0", torch.bfloat16, 128)
    assert kind == "fa3" and "FlashAttention 3" in why and "fa3_fwd_interface" in why
    assert attn.explain_backend("fp8", "cuda:0", torch.bfloat16, 128)[1] == why
    kind, why = attn.fp8_implementation("cuda:0", torch.float16, 128)       # FA3's fp8 output is bf16
    assert kind in ("triton", "torch") and "takes bfloat16, not float16" in why
    here = attn.fp8.implementation("cpu", torch.bfloat16, 128)[0]     # the pack's (torch; triton interpreted)
    assert attn.fp8_implementation("cpu", torch.bfloat16, 128)[0] == here
    assert approx.fp8_scheme("fa3") == approx.fp8_scheme("fa3-torch") == "fa3"
    assert approx.fp8_scheme("triton") == approx.fp8_scheme("torch") == "smoothed"
    with attn.fp8_numerics("fa3-torch"):
        assert attn.fp8_implementation("cpu", torch.bfloat16, 128)[0] == "fa3-torch"
    with pytest.raises(ValueError, match="has no candidate 'fa4'; its candidates: fa3, triton, torch, fa3-torch"):
        attn.fp8_numerics("fa4")


def test_a_call_in_the_fp8_mode_goes_to_fa3s_fp8_kernels(hopper, monkeypatch):
    """The mode's call on the (stood-in) Hopper GPU: FA3 gets e4m3 codes and descales; its result is within the
    bound stated for FA3's kernels."""
    monkeypatch.setattr(attn, "fp8_implementation", lambda *a: ("fa3", "FA3 stood in"))
    q, k, v = _qkv(24, 90, torch.bfloat16, offset=1.0, hd=16)
    out = attn.attention(q, k, v, backend="fp8")
    assert hopper and hopper[-1]["dtype"] == torch.float8_e4m3fn
    err = _err(out, q, k, v)
    assert bool((err <= approx.fp8_error_bound(q, k, v, kind="fa3")).all())
    mask = torch.ones(2, 90, dtype=torch.bool)
    mask[:, 80:] = False
    n = len(hopper)
    masked = attn.attention(q, k, v, mask, backend="fp8")                  # FA3 takes no mask: its math in torch
    assert len(hopper) == n and torch.equal(masked, F.fa3_fp8_torch(q, k, v, mask))


def test_the_speed_verdict_times_fa3s_fp8_against_exact(hopper, monkeypatch):
    import speed_timer
    from wan_accel.cache.autotune import TIMING, get_autotuner
    monkeypatch.setattr(registry, "SPEED_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(attn, "fp8_implementation", lambda *a: ("fa3", "FA3 stood in"))
    speed_timer.install(monkeypatch, slow=False)
    slower, why = approx.attention_speed("fp8", 40, 80, 1, 2, 16, torch.bfloat16, "cpu", exact="sdpa")
    assert slower is False and "40 queries x 80 keys" in why
    assert get_autotuner().entry(f"speed.attention.fa3_fp8@{TIMING}", "cpu|h2|d16|bfloat16|q40|k80")
    assert any(c["dtype"] == torch.float8_e4m3fn for c in hopper)


# ----------------------------------------------------------------------------- a whole run, and its figure
def test_a_run_reads_the_fa3_copy_and_every_call_is_within_the_bound(monkeypatch):
    from wan_accel.model import kv_cache
    from wan_accel.model.tiny import tiny_causal_model
    from run_helpers import generate_latents
    model = tiny_causal_model()
    ctx = torch.randn(1, 4, model.config.text_dim, generator=torch.Generator().manual_seed(0))
    real, seen = F.fa3_fp8_torch, {"copies": 0, "calls": 0, "worst": 0.0}

    def checked(q, k, v, key_padding_mask=None, kv=None, tile=F.TILE):
        assert kv is None or isinstance(kv, F.Fa3KV), type(kv)      # the cache's copy is in FA3's form
        out = real(q, k, v, key_padding_mask, kv, tile)
        seen["calls"] += 1
        seen["copies"] += kv is not None
        err = _err(out, q, k, v, key_padding_mask)
        bound = F.error_bound(q, k, v, key_padding_mask, kv=kv)
        seen["worst"] = max(seen["worst"], float((err / bound).max()))
        return out

    monkeypatch.setattr(F, "fa3_fp8_torch", checked)
    report: dict = {}
    with attn.fp8_numerics("fa3-torch"):
        out = generate_latents(model, ctx, 6, 4, 6, seed=1, path="optimized", report=report,
                               fast_options={"attention": "fp8", "cuda_graphs": "off"})
    exact = generate_latents(model, ctx, 6, 4, 6, seed=1, path="optimized",
                             fast_options={"attention": "sdpa", "cuda_graphs": "off"})
    assert report["attention"] == "fp8" and report["fp8_attention_kind"] == "fa3-torch"
    assert seen["copies"] and seen["copies"] < seen["calls"]     # self-attention reads the cache's copy; cross
    assert 0 < seen["worst"] <= 1                                  # attention quantizes the prompt per call
    assert not torch.equal(out, exact) and float((out - exact).abs().max()) < 0.2
    assert kv_cache.Fa3Shadow.scheme == approx.fp8_scheme(report["fp8_attention_kind"])   # the copy the run made


def test_bench_fidelity_states_fa3s_whole_video_effect():
    from cli_run import run_cli
    fixture = str(HERE.parent / "fixtures" / "wan_reference")
    results = {}
    for numerics in ("fa3", "pack"):
        code, out, err = run_cli("bench", "fidelity", "--attention", "fp8", "--fp8-numerics", numerics,
                                 "--fixture", fixture, "--json")
        assert code == 0, err
        results[numerics] = json.loads(out)
    from wan_accel.kernels import fp8_attention
    pack = fp8_attention.implementation("cpu", torch.float32, 128)[0]        # torch; triton under the interpreter
    assert results["fa3"]["fp8_numerics"] == "fa3-torch" and results["pack"]["fp8_numerics"] == pack
    for r in results.values():
        assert {row["path"] for row in r["rows"]} == {"reference", "optimized"}
        assert all(0 < row["final"]["max_abs"] < 0.5 for row in r["rows"])
    assert results["fa3"]["rows"][0]["final"] != results["pack"]["rows"][0]["final"]
    code, out, err = run_cli("bench", "fidelity", "--attention", "int8", "--fp8-numerics", "fa3", "--fixture", fixture)
    assert code == 2 and "give --attention fp8 with it" in err
