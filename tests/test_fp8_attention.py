"""fp8 attention (opt-in): the torch version against exact attention within the stated bound
(kernels/fp8_attention.error_bound), the bound not trivially loose, smoothing (keys' and values' channel offsets
cost nothing with it, much without), the KV cache's copy and its one pair of smoothing vectors per layer, the
Triton kernel under the interpreter against the torch version (tiny shapes: head sizes 16..128, lengths that are
no multiple of the tile, batch 1-2, 1-2 heads), and the zero-token, padding and bad-input edges.

TRITON_INTERPRET must be set before triton is first imported, so the kernel runs in a child process.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

import attention_cases as cases

HERE = Path(__file__).resolve()
MARK = "FP8_ATTENTION_INTERPRET_RESULT "


@pytest.mark.parametrize("dtype,spread", [(torch.float32, 0.0), (torch.bfloat16, 0.0), (torch.float32, 2.0)])
def test_torch_fp8_is_within_the_stated_bound_on_wan_shapes(dtype, spread):
    from wan_accel.kernels import fp8_attention as fa
    from wan_accel.model import attention as attn
    q, k, v = cases.wan_qkv(dtype, v_spread=spread)
    out = fa.fp8_attention_torch(q, k, v)
    assert out.shape == q.shape and out.dtype == dtype and torch.isfinite(out).all()
    err, ratio = cases.ratio(out, q, k, v, fa.error_bound)
    assert float(ratio.max()) <= 1.0
    assert float(ratio.max()) > 0.25            # the bound is of the error's size (random inputs reach a good part)
    exact_err = (attn.attention(q, k, v, backend="sdpa").float() - cases.exact(q, k, v))[:, cases.ROWS].abs()
    assert float(err.max()) > 4 * float(exact_err.max())           # fp8, not exact attention in this dtype


def _coarser_int8(factor):
    """Q and K's int8 quantization with steps ``factor`` times coarser (rounding errors ``factor`` times int8's)."""
    from wan_accel.kernels import fp8_attention as fa
    real = fa.int8_tokens

    def quantize(x):
        codes, step = real(x)
        return (torch.round(x.float() / (step * factor)[..., None]) * factor).clamp(-127, 127).to(torch.int8), step
    return quantize


def _coarser_e4m3(codes_of, factor):
    """A quantizer whose codes lose log2(factor) more mantissa bits (rounding errors ``factor`` times e4m3's)."""
    def quantize(x):
        codes, scale = codes_of(x)
        f = codes.float()
        ulp = torch.exp2(torch.floor(torch.log2(f.abs().clamp_min(2.0 ** -6))) - 3) * factor
        return (torch.round(f / ulp) * ulp).clamp(-448, 448).to(torch.float8_e4m3fn), scale
    return quantize


@pytest.mark.parametrize("factor", [2, 4])
def test_a_coarser_rounding_fails_the_bound(monkeypatch, factor):
    """Q and K with int8 steps 2 or 4 times coarser, V with one or two mantissa bits fewer, exceed the bound."""
    from wan_accel.kernels import fp8_attention as fa
    q, k, v = cases.wan_qkv(torch.float32)
    with monkeypatch.context() as m:
        m.setattr(fa, "int8_tokens", _coarser_int8(factor))
        m.setattr(fa, "quantize_tokens", _coarser_e4m3(fa.quantize_tokens, factor))
        planted = fa.fp8_attention_torch(q, k, v)
    _, ratio = cases.ratio(planted, q, k, v, fa.error_bound)
    assert float(ratio.max()) > 1.0


def test_a_much_coarser_p_fails_the_bound(monkeypatch):
    """P's own term: the folded P' rounded with a spacing 8 times e4m3's (three mantissa bits fewer) exceeds the
    bound (P' in e4m3 itself costs less than Q and K do: with 4 times the spacing it still stays inside)."""
    from wan_accel.kernels import fp8_attention as fa
    q, k, v = cases.wan_qkv(torch.float32, lq=64, lk=256, heads=2, v_spread=2.0)
    real = fa.round_e4m3

    def coarse(x):
        ulp = torch.exp2(torch.floor(torch.log2(real(x).abs().clamp_min(2.0 ** -6))) - 3) * 8
        return torch.round(x / ulp) * ulp

    with monkeypatch.context() as m:
        m.setattr(fa, "round_e4m3", coarse)
        planted = fa.fp8_attention_torch(q, k, v)
    _, ratio = cases.ratio(planted, q, k, v, fa.error_bound)
    assert float(ratio.max()) > 1.0


def test_quantizing_once_equals_quantizing_every_call():
    """K and V quantized per (token, head), smoothed by one pair of vectors, when they enter a cache give the same
    codes as quantizing the whole key set per call with those vectors (its own means), so the cached copy changes
    nothing but the work."""
    from wan_accel.kernels import fp8_attention as fa
    q, k, v = cases.wan_qkv(torch.bfloat16, lq=40, lk=300, heads=2, head_dim=64)
    whole = fa.quantize_kv(k, v)
    parts = [fa.quantize_kv(k[:, i:i + 100], v[:, i:i + 100], whole.k_mean, whole.v_mean) for i in range(0, 300, 100)]
    joined = fa.Fp8KV(*(torch.cat([getattr(p, f) for p in parts], dim=1) for f in fa.Fp8KV._fields[:4]),
                      whole.k_mean, whole.v_mean)
    assert torch.equal(fa.fp8_attention_torch(q, k, v, kv8=joined), fa.fp8_attention_torch(q, k, v))
    own = fa.quantize_kv(k[:, :100], v[:, :100])            # a part's own means: other codes
    assert not torch.equal(own.k, parts[0].k)


def _offsets(k, v, g, size=12.0):
    """k, v with a channel offset shared by every token (a few channels per head, as Wan's keys have)."""
    b, _, h, d = k.shape
    off = torch.zeros(2, b, 1, h, d)
    off[..., : d // 16] = torch.randn(2, b, 1, h, d // 16, generator=g) * size
    return (k.float() + off[0]).to(k.dtype), (v.float() + off[1]).to(v.dtype)


def test_smoothing_takes_the_channel_offsets_out():
    """Keys and values with channel offsets: smoothed (the default), the offsets change the result by rounding
    only (the keys' offset moves every logit of a query alike, the values' is added back exactly), and the
    error stays within the bound; without smoothing (zero vectors) the error is several times larger."""
    from wan_accel.kernels import fp8_attention as fa
    g = torch.Generator().manual_seed(5)
    q, k, v = cases.wan_qkv(torch.float32, lq=96, lk=384, heads=2, head_dim=128)
    ko, vo = _offsets(k, v, g)
    smoothed = fa.fp8_attention_torch(q, ko, vo)
    plain = fa.fp8_attention_torch(q, k, v)
    zeros = torch.zeros(1, 2, 128)
    unsmoothed = fa.fp8_attention_torch(q, ko, vo, kv8=fa.quantize_kv(ko, vo, zeros, zeros))
    ref, ref_plain = cases.exact(q, ko, vo), cases.exact(q, k, v)
    err_s, err_u = (smoothed - ref).abs(), (unsmoothed - ref).abs()
    err_plain = (plain - ref_plain).abs()
    assert float(err_s.max()) < 1.5 * float(err_plain.max())          # the offsets cost (next to) nothing
    assert float(err_u.max()) > 4 * float(err_s.max())                # they cost much without smoothing
    assert float(err_u.square().mean()) > 4 * float(err_s.square().mean())    # on the whole, not one element
    _, ratio = cases.ratio(smoothed, q, ko, vo, fa.error_bound)
    assert float(ratio.max()) <= 1.0
    _, ratio_u = cases.ratio(unsmoothed, q, ko, vo, lambda *a, **kw: fa.error_bound(*a, k_mean=zeros,
                                                                                     v_mean=zeros, **kw))
    assert float(ratio_u.max()) <= 1.0       # the bound follows the vectors a call used


def test_zero_tokens_and_padded_keys():
    from wan_accel.kernels import fp8_attention as fa
    q, k, v = cases.wan_qkv(torch.float32, lq=40, lk=150, heads=2, head_dim=16)
    q[:, 3] = 0
    k[:, 5] = 0
    v[:, :130] = 0                       # a whole tile of zero values next to a partial one
    out = fa.fp8_attention_torch(q, k, v)
    assert torch.isfinite(out).all()
    err, ratio = cases.ratio(out, q, k, v, fa.error_bound)
    assert float(ratio.max()) <= 1.0
    mask = torch.ones(1, 150, dtype=torch.bool)
    mask[:, 140:] = False
    masked = fa.fp8_attention(q, k, v, mask)
    v2 = v.clone()
    v2[:, 140:] = 1e3
    assert torch.equal(masked, fa.fp8_attention(q, k, v2, mask))
    assert float((masked - cases.exact(q, k[:, :140], v[:, :140])).abs().max()) < 0.2


def test_bad_inputs_say_what_to_fix():
    from wan_accel.kernels import fp8_attention as fa
    q, k, v = cases.wan_qkv(torch.float32, lq=4, lk=8, heads=2, head_dim=16)
    with pytest.raises(ValueError, match="q \\[B, Lq, H, D\\]"):
        fa.fp8_attention_torch(q, k[..., :8], v[..., :8])
    with pytest.raises(ValueError, match="kernel must be"):
        fa.error_bound(q, k, v, kernel="cuda")


def test_on_a_cpu_the_torch_version_runs_and_says_why(monkeypatch):
    from wan_accel.kernels import _common
    from wan_accel.kernels import fp8_attention as fa
    # a CPU without Triton's interpreter, whatever this process's TRITON_INTERPRET says (under it the kernel runs)
    monkeypatch.setattr(_common, "interpreter_usable", lambda: False)
    kind, reason = fa.implementation("cpu", torch.float32, 128)
    assert kind == "torch" and "torch version" in reason
    assert "head sizes" in fa.kernel_problem("cpu", torch.float32, 96)


# ----------------------------------------------------------------------------- the KV cache's fp8 copy
def _filled_cache(rolling=False, dtype=torch.bfloat16):
    from wan_accel.model.kv_cache import KVCache
    cache = KVCache(2, 1, 96, 2, 16, dtype=dtype, rolling=rolling, sink_tokens=16 if rolling else 0)
    cache.use_fp8(True)
    g = torch.Generator().manual_seed(3)
    return cache, g


def _write(cache, step, g, layer=0):
    from wan_accel.model.kv_cache import write_kv
    rows = step.index.numel()
    k, v = (torch.randn(1, rows, 2, 16, generator=g) * 3 for _ in range(2))
    lay = cache.layers[layer]
    write_kv(lay.k, lay.v, step.index, k, v)
    return lay.k[:, :step.read_len], lay.v[:, :step.read_len]


def _same_codes(copy, k, v) -> bool:
    """The copy holds exactly the codes of k, v smoothed by the copy's vectors."""
    from wan_accel.kernels import fp8_attention as fa
    fresh = fa.quantize_kv(k, v, copy.k_mean, copy.v_mean)
    return all(torch.equal(getattr(copy, f).float(), getattr(fresh, f).float()) for f in fa.Fp8KV._fields)


@pytest.mark.parametrize("rolling", [False, True])
def test_the_cache_keeps_the_codes_of_what_it_holds(rolling):
    """Every write (appends, a rolling window's wrap, a rewrite, a retried write, zero padding) puts into the fp8
    copy exactly the codes of the cached keys/values smoothed by the layer's one pair of vectors, fixed at the
    first write (the means of those keys and values) until the cache is emptied: attention on the cache reads
    the copy and gives what the torch version gives on the cache view with those vectors."""
    from wan_accel.kernels import fp8_attention as fa
    from wan_accel.model import attention as attn
    from wan_accel.model.kv_cache import fp8_copy
    cache, g = _filled_cache(rolling)
    q = torch.randn(1, 24, 2, 16, generator=g).to(torch.bfloat16)
    first = None
    for start in range(0, 168 if rolling else 96, 24):
        k, v = _write(cache, cache.plan(start, 24), g)
        copy = fp8_copy(k, v)
        if first is None:
            first = fa.token_mean(k), fa.token_mean(v)
        assert copy is not None and _same_codes(copy, k, v)
        assert torch.equal(copy.k_mean, first[0]) and torch.equal(copy.v_mean, first[1])
        assert torch.equal(attn.attention(q, k, v, backend="fp8"),
                           fa.fp8_attention_torch(q, k, v, kv8=fa.quantize_kv(k, v, *first)))
    k, v = _write(cache, cache.rewrite(cache.end - 24, 24), g)
    k, v = _write(cache, cache.rewrite(cache.end - 24, 24), g)          # the same write again (a retry)
    assert _same_codes(fp8_copy(k, v), k, v) and torch.equal(fp8_copy(k, v).k_mean, first[0])
    cache.reset()                                                       # emptied: the next write fixes anew
    if not rolling:
        cache.pad_next(8)                       # zero padding keys attended by the very first call
    step = cache.plan(0, 24)
    k, v = _write(cache, step, g)
    copy = fp8_copy(k, v)
    assert torch.equal(copy.k_mean, fa.token_mean(k[:, :24])) and _same_codes(copy, k, v)
    if not rolling:
        assert step.read_len == 32 and float(k[:, 24:].abs().max()) == 0
        assert torch.equal(attn.attention(q, k, v, backend="fp8"), fa.fp8_attention_torch(q, k, v, kv8=copy))
        _write(cache, cache.plan(24, 24), g)
        assert _same_codes(fp8_copy(*_view(cache, 48)), *_view(cache, 48))


def _view(cache, n, layer=0):
    return cache.layers[layer].k[:, :n], cache.layers[layer].v[:, :n]


def test_attention_reads_the_copy_instead_of_quantizing(monkeypatch):
    from wan_accel.kernels import fp8_attention as fa
    from wan_accel.model import attention as attn
    cache, g = _filled_cache()
    k, v = _write(cache, cache.plan(0, 48), g)
    q = torch.randn(1, 24, 2, 16, generator=g).to(torch.bfloat16)
    calls = []
    real = fa.quantize_kv
    monkeypatch.setattr(fa, "quantize_kv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    attn.attention(q, k, v, backend="fp8")
    assert calls == []
    attn.attention(q, k.clone(), v.clone(), backend="fp8")        # not a cache view: quantized by the call
    assert calls == [1]


def test_the_copy_is_written_only_under_the_mode_and_caught_up_when_it_returns():
    from wan_accel.model.kv_cache import fp8_copy
    cache, g = _filled_cache()
    _write(cache, cache.plan(0, 24), g)
    cache.use_fp8(False)
    k, v = _write(cache, cache.plan(24, 24), g)
    assert fp8_copy(k, v) is None
    shadow = getattr(cache.layers[0].k, "_wan_accel_fp8")
    assert float(shadow.k[:, 24:48].float().abs().sum()) == 0           # not written while off
    cache.layers[0].k[:, :8].copy_(torch.randn(1, 8, 2, 16, generator=g))  # filled another way (a continuation)
    cache.use_fp8(True)
    assert _same_codes(fp8_copy(k, v), k, v)


def test_switched_on_over_a_filled_cache_the_copy_smooths_by_what_it_holds():
    """A cache filled while the mode was off (no copy yet): switching it on fixes the vectors from the tokens the
    cache holds (not its empty slots), and later writes keep them."""
    from wan_accel.kernels import fp8_attention as fa
    from wan_accel.model.kv_cache import KVCache, fp8_copy
    cache = KVCache(1, 1, 96, 2, 16, dtype=torch.float32)
    g = torch.Generator().manual_seed(4)
    k, v = _write(cache, cache.plan(0, 48), g)
    cache.use_fp8(True)
    copy = fp8_copy(k, v)
    assert torch.equal(copy.k_mean, fa.token_mean(k)) and _same_codes(copy, k, v)
    k, v = _write(cache, cache.plan(48, 24), g)
    assert _same_codes(fp8_copy(k, v), k, v) and torch.equal(fp8_copy(k, v).k_mean, copy.k_mean)


def _fp8_run(monkeypatch, slow: bool, judged: bool = True, **fast):
    """The optimized path with attention fp8 on the tiny model; ``judged``: as on a GPU with the kernel (the
    kernel's stand-in is the torch version, the store's timer a set one)."""
    import speed_timer
    from wan_accel.kernels import fp8_attention as fa, registry
    from wan_accel.model import attention as att
    from wan_accel.model.tiny import tiny_causal_model
    from run_helpers import generate_latents
    sys.path.insert(0, str(HERE.parent))
    if judged:
        monkeypatch.setattr(registry, "SPEED_DEVICES", ("cuda", "cpu"))
        monkeypatch.setitem(fa.KINDS, "triton", dataclasses.replace(fa.KINDS["triton"], problem=None))
        monkeypatch.setattr(fa, "fp8_attention_triton", lambda q, k, v, kv8=None: fa.fp8_attention_torch(
            q, k, v, None, kv8))
        speed_timer.install(monkeypatch, slow)
    model = tiny_causal_model()
    ctx = torch.randn(1, 4, model.config.text_dim, generator=torch.Generator().manual_seed(0))
    report = {"copies": []}
    from wan_accel.model import kv_cache
    caches = report["caches"] = []
    use_fp8 = kv_cache.KVCache.use_fp8
    monkeypatch.setattr(kv_cache.KVCache, "use_fp8", lambda self, on, *a: caches.append(self) or use_fp8(self, on, *a))
    real = att.fp8_copy
    monkeypatch.setattr(att, "fp8_copy", lambda k, v: (lambda c: report["copies"].append(c is not None) or c)(
        real(k, v)))
    out = generate_latents(model, ctx, 6, 4, 6, seed=1, path="optimized", report=report,
                           fast_options={"attention": "fp8", "cuda_graphs": "off", **fast})
    exact = generate_latents(model, ctx, 6, 4, 6, seed=1, path="optimized",
                             fast_options={"attention": "sdpa", "cuda_graphs": "off"})
    return out, exact, report


def test_on_a_cpu_the_fp8_run_is_not_judged_and_keeps_fp8(monkeypatch):
    out, exact, report = _fp8_run(monkeypatch, slow=True, judged=False)
    assert report["attention"] == "fp8" and report["fp8_attention_speed"]["slower"] is None
    assert "not judged" in report["fp8_attention_speed"]["why"]
    assert any(report["copies"]) and not all(report["copies"])   # self-attention reads the cache's fp8 copy,
    #                                                                 cross-attention quantizes the prompt's K/V
    assert not torch.equal(out, exact) and float((out - exact).abs().max()) < 0.2


def test_fp8_measured_slower_keeps_the_exact_path(monkeypatch):
    out, exact, report = _fp8_run(monkeypatch, slow=True)
    assert report["fp8_attention_speed"]["slower"] is True and "queries x" in report["fp8_attention_speed"]["why"]
    assert report["attention"] == "exact (fp8 measured slower)"
    assert any("fp8 attention is slower" in n and "--keep-slower" in n for n in report["notes"])
    assert torch.equal(out, exact)
    # no fp8 copy of the cache is left (the verdict comes before any is made: no memory held for nothing)
    from wan_accel.model.kv_cache import _FP8_ATTR
    assert report["caches"] and all(getattr(layer.k, _FP8_ATTR, None) is None
                                    for kv in report["caches"] for layer in kv.layers)


@pytest.mark.parametrize("keep", [False, True])
def test_fp8_kept_where_faster_or_where_the_user_insists(monkeypatch, keep):
    out, exact, report = _fp8_run(monkeypatch, slow=keep, keep_slower=keep)
    assert report["fp8_attention_speed"]["slower"] is keep and report["attention"] == "fp8"
    assert not torch.equal(out, exact)
    from wan_accel.model.kv_cache import _FP8_ATTR
    assert all(getattr(layer.k, _FP8_ATTR, None) is not None for layer in report["caches"][0].layers)


@pytest.mark.parametrize("slow", [True, False])
def test_the_speed_verdict_is_read_before_any_fp8_copy_of_the_cache_is_made(monkeypatch, slow):
    """A run whose fp8 attention is judged slower never allocates the cache's fp8 copy (not made and freed later);
    one judged faster makes it once per layer, after the verdict."""
    from wan_accel.model import kv_cache
    from wan_accel.sampling import runner
    events = []
    shadow = kv_cache.Fp8Shadow
    monkeypatch.setitem(kv_cache.SHADOWS, "smoothed", lambda *a, **kw: events.append("copy") or shadow(*a, **kw))
    speed = runner.attention_speed
    monkeypatch.setattr(runner, "attention_speed", lambda *a, **kw: events.append("verdict") or speed(*a, **kw))
    out, exact, report = _fp8_run(monkeypatch, slow=slow)
    layers = len(report["caches"][0].layers)
    assert report["fp8_attention_speed"]["slower"] is slow
    if slow:
        assert events == ["verdict"] and report["attention"] == "exact (fp8 measured slower)"
        assert torch.equal(out, exact)
    else:
        assert events == ["verdict"] + ["copy"] * layers and report["attention"] == "fp8"


# ----------------------------------------------------------------------------- where the mode is offered
def test_fp8_is_offered_by_the_cli_the_nodes_and_the_benches_never_by_default():
    import argparse
    from wan_accel.bench import sampler
    from wan_accel.cli import build_parser
    from wan_accel.model import attention as attn
    from wan_accel.nodes.doctor_nodes import FEATURE_CHOICES
    from wan_accel.nodes.model_nodes import CausalWanModelLoader
    from wan_accel.nodes.native_nodes import WanAccelARSampler
    parser = build_parser()
    assert parser.parse_args(["generate", "--attention", "fp8"]).attention == "fp8"
    assert "fp8" in CausalWanModelLoader.INPUT_TYPES()["required"]["attention"][0]
    assert "fp8" in CausalWanModelLoader.INPUT_TYPES()["required"]["attention"][1]["tooltip"]
    assert "fp8" in WanAccelARSampler.INPUT_TYPES()["optional"]["attention"][0]
    assert "attention.fp8" in FEATURE_CHOICES
    ns = argparse.Namespace(variants="reference,optimized", attention="fp8")
    assert sampler._variant_names(ns, "fp32") == ["reference", "reference-fp8att", "optimized", "optimized-fp8att"]
    assert sampler.VARIANTS["optimized-fp8att"]["attention"] == "fp8"
    assert sampler.exact_twin("optimized-fp8att") == "optimized"
    assert sampler.exact_twin("optimized-fp8att-fp8") == "optimized-fp8att"      # fp8 linear on top of it
    for requested in ("auto", "flash_attn", "sdpa"):
        assert attn.explain_backend(requested, "cpu", torch.bfloat16, 128)[0] != "fp8"


@pytest.mark.parametrize("path", ["reference", "optimized"])
def test_both_sampler_paths_run_fp8_from_the_loader(monkeypatch, path):
    """The loader node's handle with attention fp8: every attention call of the run goes through fp8; the latents
    differ from exact attention's, closely."""
    from wan_accel.kernels import fp8_attention as fa
    outs, reports = cases.loader_runs(fa, "fp8_attention_torch", "fp8", path, monkeypatch)
    for mode, report in reports.items():
        if path == "optimized":
            assert report["attention"] == mode
    diff = (outs["fp8"] - outs["sdpa"]).abs().max()
    assert torch.isfinite(outs["fp8"]).all() and 0 < float(diff) < 0.2


def test_the_doctor_judges_fp8_by_its_bound(monkeypatch):
    from wan_accel.app.doctor.core import doctor_for
    from wan_accel.kernels import fp8_attention as fa
    d = doctor_for("cpu", torch.float32, 16, tokens=32, heads=2)
    assert d.check("attention.fp8")["status"] == "passed"
    real = fa.fp8_attention_torch
    monkeypatch.setattr(fa, "fp8_attention_torch", lambda *a, **kw: real(*a, **kw) * 1.25)
    assert doctor_for("cpu", torch.float32, 16, tokens=32, heads=2).check("attention.fp8", recheck=True)[
        "status"] == "failed"


def test_bench_attention_times_fp8_with_its_keys_quantized_beforehand():
    from wan_accel.bench import attention as bench
    sys.path.insert(0, str(HERE.parent))
    from cli_run import run_cli
    by = {r["candidate"]: r for r in bench.measure(40, 70, 1, 2, 16, torch.float32, torch.device("cpu"), ["fp8"])}
    assert by["fp8"]["kind"] == "approximate" and by["fp8"]["status"] == "ran"
    assert 1e-4 < by["fp8"]["max_abs"] < 0.5
    code, out, err = run_cli("bench", "attention", "--lq", "33", "--lk", "65", "--approximate", "fp8", "--json")
    assert code == 0, err
    assert [r["candidate"] for r in json.loads(out)["rows"] if r["kind"] == "approximate"] == ["fp8"]


def test_every_fp8_call_of_a_fidelity_run_is_within_the_bound(monkeypatch):
    """``bench fidelity --attention fp8`` on the recorded wan fixture, both paths: every fp8 attention call stays
    within ``error_bound`` of exact attention (float64) on its own inputs, and fp8 changes the video."""
    from wan_accel.bench.fidelity import FIXTURES, PATHS, measure
    from wan_accel.kernels import fp8_attention as fa
    worst, calls = [0.0], [0]
    real = fa.fp8_attention_torch

    def checked(q, k, v, key_padding_mask=None, kv8=None, tile=fa.TILE):
        out = real(q, k, v, key_padding_mask, kv8, tile)
        keep = slice(None) if key_padding_mask is None else key_padding_mask[0]
        means = {} if kv8 is None else {"k_mean": kv8.k_mean, "v_mean": kv8.v_mean}    # a cache's vectors
        bound = fa.error_bound(q, k, v, key_padding_mask, **means)
        worst[0] = max(worst[0], float(((out.float() - cases.exact(q, k[:, keep], v[:, keep])).abs() / bound).max()))
        calls[0] += 1
        return out

    monkeypatch.setattr(fa, "fp8_attention_torch", checked)
    rows = measure(FIXTURES / "wan_reference", "fp8")
    assert calls[0] > 0 and worst[0] <= 1.0, worst
    assert [r["path"] for r in rows] == list(PATHS) and all(r["final"]["max_abs"] > 0 for r in rows)


# ----------------------------------------------------------------------------- the Triton kernel, interpreted
CASES = [  # (batch, queries, keys, heads, head size, tile, BLOCK_M, dtype, value spread)
    (1, 20, 100, 1, 16, 32, 16, "float32", 1.0),
    (2, 20, 70, 1, 64, 32, 32, "bfloat16", 0.0),
    (1, 40, 150, 2, 128, 128, 64, "float32", 2.0),
    (2, 9, 33, 2, 32, 32, 16, "float16", 0.5),
]


CACHED_CASE, PLAIN_CASE = 1, 3     # the bf16 case also runs on a copy made beforehand; the fp16 one on plain codes


def _child() -> None:
    from wan_accel.kernels import _common
    from wan_accel.kernels import fp8_attention as fa
    assert _common.interpreter_usable()
    rows = []
    g = torch.Generator().manual_seed(0)
    for b, lq, lk, h, d, tile, bm, dtype, spread in CASES:
        dt = getattr(torch, dtype)
        q = (torch.randn(b, lq, h, d, generator=g) * 2).to(dt)
        k = (torch.randn(b, lk, h, d, generator=g) * 1.5 + 0.5).to(dt)
        v = (torch.randn(b, lk, h, d, generator=g) * torch.exp(torch.randn(b, lk, h, 1, generator=g) * spread)).to(dt)
        k[:, 1] = 0                                  # a zero key token: unsmoothed, its step is the tiny one
        v[:, 2] = 0
        q[:, 3] = 0                                  # a zero query: the kernel's own tiny step, codes 0
        config = {"BLOCK_M": bm, "num_warps": 4, "num_stages": 1}
        tri = fa.fp8_attention_triton(q, k, v, config=config, tile=tile)
        ref = fa.fp8_attention_torch(q, k, v, tile=tile)
        # a copy of K/V made beforehand, and one not smoothed: each in one case (each kernel run costs seconds here)
        cached = fa.fp8_attention_triton(q, k, v, fa.quantize_kv(k, v), config=config, tile=tile) \
            if len(rows) == CACHED_CASE else None
        zeros = torch.zeros(b, h, d)
        plain = fa.quantize_kv(k, v, zeros, zeros)   # not smoothed (tiny steps and scales of zero tokens)
        tri_plain = fa.fp8_attention_triton(q, k, v, plain, config=config, tile=tile) \
            if len(rows) == PLAIN_CASE else None
        ref_plain = fa.fp8_attention_torch(q, k, v, kv8=plain, tile=tile)
        w = torch.softmax((q.double().transpose(1, 2) @ k.double().transpose(1, 2).transpose(-1, -2)) * d ** -0.5, -1)
        mv = fa.token_mean(v)[:, None]
        pv_abs = (w @ (v.double() - mv).abs().transpose(1, 2)).transpose(1, 2).float() + mv.abs()
        # the same exact integer logits (the same int8 codes of Q); both sum the same exact P . V products in
        # float32 in another order and round the output to the same dtype
        tol = (d + tile + 32) * fa.F32_U * pv_abs + 2 * fa.unit_roundoff(dt) * ref.float().abs()
        bound = fa.error_bound(q, k, v, tile=tile)
        rows.append({"shape": [b, lq, lk, h, d], "dtype": str(tri.dtype), "finite": bool(torch.isfinite(tri).all()),
                     "within_tol": bool(((tri.float() - ref.float()).abs() <= tol).all()),
                     "max_diff": float((tri.float() - ref.float()).abs().max()),
                     "cached_equal": None if cached is None else bool(torch.equal(cached, tri)),
                     "plain_within_tol": None if tri_plain is None else bool(((tri_plain.float() - ref_plain.float())
                                                                              .abs() <= tol + (
                         (d + tile + 32) * fa.F32_U * (w @ v.double().abs().transpose(1, 2)).transpose(1, 2).float())
                     ).all()),
                     "vs_exact": float(((tri.float() - cases.exact(q, k, v)).abs() / bound).max()),
                     "kind": fa.implementation("cpu", dt, d)[0]})
    print(MARK + json.dumps(rows), flush=True)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    sys.path.insert(0, str(HERE.parent))
    from interpret_child import run_interpreted_child
    return run_interpreted_child(HERE, tmp_path_factory.mktemp("fp8_attention_interp"), MARK, timeout=600)


def test_the_triton_kernel_matches_the_torch_version_under_the_interpreter(interpreted):
    assert len(interpreted) == len(CASES)
    for row, case in zip(interpreted, CASES):
        assert row["kind"] == "triton", row
        assert row["dtype"] == f"torch.{case[7]}" and row["finite"], row
        assert row["within_tol"], row
        assert row["vs_exact"] <= 1.0, row              # and the kernel is within the stated bound of exact
    assert interpreted[CACHED_CASE]["cached_equal"] is True     # a cached copy of K/V gives the same result
    assert interpreted[PLAIN_CASE]["plain_within_tol"] is True  # unsmoothed codes (given as a copy) likewise


if __name__ == "__main__" and "--child" in sys.argv:
    _child()
