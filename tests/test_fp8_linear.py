"""fp8 linear layers (opt-in): per call within the stated bound (kernels/fp8_linear.error_bound) on random and
adversarial inputs, the bound close to the worst case and broken by a coarser code, the emulation equal to
``torch._scaled_mm``'s semantics, the fused input quantize (kernels/fp8_quant.py) equal to ``quantize_rows`` bit for
bit under Triton's interpreter (a child process) and compiled with correctly rounded divisions, no input quantized
twice, the mode really running every block linear layer (and nothing else) on the optimized path, exact runs
untouched, its copies kept current, refusals, the speed verdict (read before any copy is made), the doctor, the
CLI, the kernel and sampler benches and the Fidelity rows of docs/sampler.md; on a CUDA GPU the scaled matmul and the fused
quantize themselves."""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from wan_accel.kernels import fp8_linear as fp8, registry
from wan_accel.model import blocks
from wan_accel.model.tiny import tiny_causal_model

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
HERE = Path(__file__).resolve()


def _layer(dtype, m=48, k=256, n=96, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    return x.to(dtype), w.to(dtype), None if b is None else b.to(dtype)


def _exact(x, w, b=None):
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


def _ratio(x, w, b=None, path="emulated"):
    y = fp8.fp8_linear(x, *fp8.quantize_weight(w), b)
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], w.shape[0])
    err = (y.double() - _exact(x, w, b)).abs()
    return y, err, err / fp8.error_bound(x, w, b, path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_within_the_bound_on_random_inputs_and_really_fp8(dtype):
    x, w, b = _layer(dtype)
    y, err, ratio = _ratio(x, w, b)
    assert torch.isfinite(y).all() and float(ratio.max()) <= 1.0
    exact_err = (torch.nn.functional.linear(x, w, b).double() - _exact(x, w, b)).abs()
    assert float(err.max()) > 4 * float(exact_err.max())          # e4m3's rounding, not the dtype's


def _adversarial(dtype):
    """Rows: an outlier beside small values, zeros, huge and tiny magnitudes (fp32's subnormal range for fp32
    and bf16), mixed signs; a weight with an outlier row and a zero row."""
    g = torch.Generator().manual_seed(3)
    k = 64
    x = torch.randn(8, k, generator=g)
    x[0, 5] = 3e3                                   # one outlier: the rest of its row falls near e4m3's subnormals
    x[1] = 0                                        # a zero row
    x[3] *= 1e-3 if dtype == torch.float16 else 1e-21   # tiny (float16: above its subnormals' reach of the bound)
    x[4] *= 1e2 if dtype == torch.float16 else 1e15     # huge (float16: its outputs stay under 65504)
    x[5] = torch.where(torch.arange(k) % 2 == 0, 1.0, -1.0) * 1e-3
    w = torch.randn(32, k, generator=g) / 8
    w[2, 7] = 50.0
    w[4] = 0
    w[6] *= 1e-20 if dtype != torch.float16 else 1e-2
    b = torch.randn(32, generator=g)
    return x.to(dtype), w.to(dtype), b.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_within_the_bound_on_adversarial_inputs(dtype):
    x, w, b = _adversarial(dtype)
    for bias in (b, None):
        y, _err, ratio = _ratio(x, w, bias)
        assert torch.isfinite(y).all() and float(ratio.max()) <= 1.0, (dtype, float(ratio.max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_rows_give_the_bias_not_nan(dtype):
    x, w, b = _layer(dtype, m=6)
    x[2] = 0
    w[5] = 0
    q, s = fp8.quantize_weight(w)
    assert float(s[5]) > 0 and not torch.isnan(q.float()).any()
    y = fp8.fp8_linear(x, q, s, b)
    assert torch.equal(y[2], b) and not torch.isnan(y).any()
    assert torch.equal(y[:, 5], b[5].expand(6))
    assert torch.equal(fp8.fp8_linear(x, q, s), fp8.fp8_linear(x, q, s, None))   # no bias: none added
    assert torch.equal(fp8.fp8_linear(x, q, s)[2], torch.zeros(w.shape[0], dtype=dtype))


def _midpoints(value: float, k: int = 64, n: int = 8):
    """Rows whose maximum 1.75 maps to 448 (scale 2^-8 exactly) and whose other entries sit at ``value``."""
    x = torch.full((4, k), value)
    x[:, 0] = 1.75
    w = torch.full((n, k), value)
    w[:, 0] = 1.75
    return x, w


def test_the_bound_is_close_to_the_worst_case():
    """1.0625 * 256 = 272 lies half a step between the e4m3 codes 256 and 288: every product is off by
    (2u + u^2) / (1 + u)^2 of its size in the same direction (rounding to nearest errs by u / (1 + u) at most, the
    bound says u), so the error reaches 85 % of the bound."""
    x, w = _midpoints(1.0625)
    _y, _err, ratio = _ratio(x, w)
    assert 0.84 <= float(ratio.max()) <= 1.0


def test_a_code_one_bit_coarser_fails_the_bound(monkeypatch):
    """1.125 is an e4m3 code (x 256 = 288): exact in fp8; e5m2 (2 mantissa bits) rounds it half a step of its own,
    twice e4m3's unit roundoff, and the bound derived for e4m3 no longer holds."""
    x, w = _midpoints(1.125)
    _y, err, ratio = _ratio(x, w)
    assert float(err.max()) < 1e-4
    monkeypatch.setattr(fp8, "FP8", torch.float8_e5m2)
    _y, _err, ratio = _ratio(x, w)
    assert float(ratio.max()) > 1.0


def _cpu_scaled_mm(x, q, s, bias, out_dtype):
    xq, xs = fp8.quantize_rows(x)
    try:
        out = torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s.reshape(1, -1), bias=bias, out_dtype=out_dtype)
    except (RuntimeError, NotImplementedError, AttributeError) as exc:
        pytest.skip(f"torch._scaled_mm with row-wise scales does not run on a CPU in torch {torch.__version__}: "
                    f"{str(exc).splitlines()[0][:120]}")
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_emulation_is_torch_scaled_mm_with_row_wise_scales(dtype):
    """Against torch._scaled_mm on the CPU (same codes, scale_a [M, 1], scale_b [1, N], weight column-major): the
    two differ only in the order of float32 sums, i.e. within twice the accumulation and scaling rounding, plus one
    unit of the output dtype where the two float32 results round to neighbouring values."""
    x, w, b = _layer(dtype, m=40, k=128, n=48)
    q, s = fp8.quantize_weight(w)
    ours = fp8.emulated(x, q, s, b, dtype)
    theirs = _cpu_scaled_mm(x, q, s, b, dtype)
    xq, xs = fp8.quantize_rows(x)
    big_b = (xq.double().abs() @ q.double().abs().t()) * xs.double() * s.double().reshape(1, -1)
    u32 = fp8.unit_roundoff(torch.float32)
    f32 = 2 * (fp8.accumulation_error(128) * big_b + 3 * u32 * (big_b + b.double().abs()))
    u_o = fp8.unit_roundoff(dtype)
    tol = f32 * (1 + u_o) + 2 * u_o * ours.double().abs().clamp_min(theirs.double().abs()) * (dtype != torch.float32)
    gap = (ours.double() - theirs.double()).abs()
    assert bool((gap <= tol).all()), float((gap / tol).max())
    if dtype == torch.bfloat16:
        assert float((gap > 0).float().mean()) < 0.05            # almost every element is the same bf16 value


# ----------------------------------------------------------------------------------------------- fused quantize
MARK = "FP8_QUANTIZE_RESULT "
# (dtype, M, K): M not a multiple of a program's rows, K not a power of two (the 1.3B model's width and a short row
# in every dtype; the FFN width, whose rows take the two-pass configs, in the model's dtype)
QUANT_CASES = [(dt, m, k) for dt in ("bfloat16", "float16", "float32") for m, k in ((37, 1536), (9, 17))] + \
    [("bfloat16", 5, 8960)]


def _quant_input(dtype, m: int, k: int, seed: int) -> torch.Tensor:
    """Random rows, then rows built to hit every rounding case of e4m3 (each exact in bf16, fp16 and fp32):
    row 0 zeros; row 1 (maximum 1.75: scale 2^-8 exactly) ties between two codes in the normal range (272 -> 256,
    304 -> 320: to even) and at a carry into the exponent (124 -> 128), ties in the subnormal range (2^-10 -> 0,
    3 2^-10 -> 2^-8), -0.0 and a value under half the smallest code; row 2 values just under the maximum (near
    +-448 once scaled); row 3 the dtype's subnormals; row 4 values near the dtype's largest."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g, dtype=torch.float64) * 3
    ties = [272, -272, 304, -304, 124, -124, 2 ** -10, -2 ** -10, 3 * 2 ** -10, -3 * 2 ** -10, -0.0, 2 ** -12]
    row1 = torch.tensor([1.75] + [t * 2 ** -8 for t in ties], dtype=torch.float64)     # x / scale = t
    info = torch.finfo(getattr(torch, dtype))
    near_max = torch.tensor([1 - 2.0 ** -e for e in range(1, 9)], dtype=torch.float64)
    rows = {0: torch.zeros(k, dtype=torch.float64),
            1: row1,
            2: torch.cat([torch.tensor([5.0]), 5.0 * near_max, -5.0 * near_max]),
            3: torch.tensor([info.tiny * info.eps, -3 * info.tiny * info.eps] + [info.tiny * j for j in
                                                                                  (1 / 8, -3 / 8, 7 / 8, 5 / 16)],
                            dtype=torch.float64),
            4: torch.tensor([info.max, -info.max / 3, info.max / 1000, 1.0, -1e-3], dtype=torch.float64)}
    for r, vals in rows.items():
        if r < m:
            x[r] = vals.repeat(k // len(vals) + 1)[:k]
    return x.to(getattr(torch, dtype))


def _quant_child() -> None:
    from wan_accel.cache.autotune import get_autotuner
    from wan_accel.kernels import _common, fp8_quant
    results = {"interpreter_usable": _common.use_triton(torch.zeros(1)), "cases": []}
    # every config is run (and compared) below: the store's tuning is checked to happen, with a timer that launches
    # nothing a second time (the interpreter's timing says nothing about speed)
    get_autotuner().timer = lambda run: 1.0
    for i, (dtype, m, k) in enumerate(QUANT_CASES):
        x = _quant_input(dtype, m, k, seed=i)
        ref_q, ref_s = fp8.quantize_rows(x)
        case = {"configs": 0, "codes_differ": 0, "scales_differ": 0}
        for cfg in fp8_quant.candidates(k):
            q, s = fp8_quant.run_triton(x, fp8.FP8_MAX, fp8.TINY, cfg)
            case["configs"] += 1
            case["codes_differ"] += int((q.view(torch.uint8) != ref_q.view(torch.uint8)).sum())
            case["scales_differ"] += int((s.view(torch.int32) != ref_s.view(torch.int32)).sum())
        before = get_autotuner().stats["benchmarks"]
        q, s = fp8.quantize_input(x)                    # the dispatch: tuned through the operator store
        case["dispatch_tuned"] = get_autotuner().stats["benchmarks"] > before
        case["dispatch_equal"] = torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and \
            torch.equal(s.view(torch.int32), ref_s.view(torch.int32))
        w = torch.randn(24, k, generator=torch.Generator().manual_seed(i)).to(x.dtype)
        wq, ws = fp8.quantize_weight(w)
        case["linear_equal"] = torch.equal(fp8.fp8_linear(x, wq, ws),
                                           fp8.emulated(x, wq, ws, None, x.dtype, (ref_q, ref_s)))
        results["cases"].append(case)
    from wan_accel.bench.kernels import fp8_quant_rows
    results["bench"] = fp8_quant_rows("cpu", "bfloat16")
    print(MARK + json.dumps(results), flush=True)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    from interpret_child import run_interpreted_child
    return run_interpreted_child(HERE, tmp_path_factory.mktemp("fp8q"), MARK, timeout=600)


def test_the_fused_quantize_runs_under_the_interpreter(quantized):
    assert quantized["interpreter_usable"] is True
    assert all(c["dispatch_tuned"] for c in quantized["cases"])     # quantize_input really launched the kernel


@pytest.mark.parametrize("index", range(len(QUANT_CASES)),
                         ids=[f"{dt}-M{m}-K{k}" for dt, m, k in QUANT_CASES])
def test_the_fused_quantize_equals_quantize_rows_bit_for_bit(quantized, index):
    """Every config of the kernel (the row held whole, or two passes over K tiles) writes the codes and scales of
    ``quantize_rows`` exactly, ties and carries, subnormals and extremes included; so does the tuned dispatch, and
    the fp8 linear on top of it gives the same numbers as on torch's codes."""
    case = quantized["cases"][index]
    assert case["configs"] >= 3 and case["codes_differ"] == 0 and case["scales_differ"] == 0, case
    assert case["dispatch_equal"] and case["linear_equal"], case


def test_bench_kernels_fp8_quantize_rows(quantized, capsys):
    """``bench kernels``' fp8 quantize rows: under the interpreter the kernel at small shapes, bit-equal to the
    torch ops; without it (this process, a CPU) a row saying why; the GPU table prints each figure it is given."""
    from wan_accel.bench.kernels import CPU_FP8_QUANT_SHAPES, _print_fp8, fp8_quant_rows
    from wan_accel.kernels import _common
    bench = quantized["bench"]
    assert [(r["shape"], r["dtype"]) for r in bench] == [(s[0], "bfloat16") for s in CPU_FP8_QUANT_SHAPES]
    assert all(r["ok"] and r["bit_equal"] and r["max_err"] == 0 for r in bench), bench
    if not _common.use_triton(torch.zeros(1)):
        here = fp8_quant_rows("cpu", "float32")
        assert here and all(r["skipped"] == "no Triton for this device" for r in here)
    gpu = [dict(bench[0], torch_ms=0.125, triton_ms=0.031, speedup=4.03, triton_gb_s=1234.0),
           {"kernel": "fp8_linear", "shape": "ffn up", "exact_ms": 0.21, "fp8_torch_quant_ms": 0.33,
            "fp8_fused_ms": 0.14, "speedup": 1.5},
           {"kernel": "fp8_linear", "shape": "1.3B block", "skipped": "SM 8.0 has no fp8 tensor cores"}]
    _print_fp8(gpu)
    out = capsys.readouterr().out
    for text in ("bit-equal", "torch 0.125 ms", "fused 0.031 ms", "1234 GB/s", "ffn up", "exact 0.210 ms",
                 "fp8+torch quantize 0.330 ms", "fp8+fused 0.140 ms", "x1.50", "SM 8.0 has no fp8"):
        assert text in out, text


def test_the_quantize_inputs_hit_the_rounding_cases():
    """The rows above are what they claim: ties, carries and subnormal codes in every dtype (torch's codes)."""
    for dtype in ("bfloat16", "float16", "float32"):
        x = _quant_input(dtype, 5, 13, seed=0)
        q, s = fp8.quantize_rows(x)
        assert float(s[1]) == 2 ** -8 and float(s[0]) == torch.finfo(torch.float32).tiny
        assert q[1].float().tolist()[1:] == [256, -256, 320, -320, 128, -128, 0, -0.0, 2 ** -8, -2 ** -8, 0, 0]
        assert float(q[2].float().abs().max()) == fp8.FP8_MAX and int((q[3].view(torch.uint8) & 0x7F).max()) > 0


PTX_CASES = [("bf16", 1536, 2048, 4, 90), ("fp16", 8960, 1024, 8, 89), ("fp32", 8960, 16384, 16, 90)]


@pytest.mark.parametrize("dtype,k,kblock,warps,arch", PTX_CASES, ids=[f"{c[0]}-K{c[2]}-sm{c[4]}" for c in PTX_CASES])
def test_the_fused_quantize_compiles_to_correctly_rounded_ptx(tmp_path, monkeypatch, dtype, k, kblock, warps, arch):
    """Built for Ada/Hopper without a GPU: both divisions correctly rounded (div.rn, not Triton's default
    approximate float32 division), the e4m3 conversion round-to-nearest-even in hardware, no flush of subnormals,
    and the shared memory within the estimate the operator store prunes with."""
    triton = pytest.importorskip("triton")
    compiler = pytest.importorskip("triton.compiler")
    backends = pytest.importorskip("triton.backends.compiler")
    from wan_accel.kernels import _common, fp8_quant
    if _common.interpret_enabled():
        pytest.skip("TRITON_INTERPRET is set: compiled-mode checks need it unset")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    cfg = {"YBLOCK": 1, "KBLOCK": kblock, "num_warps": warps}
    sig = {"x_ptr": f"*{dtype}", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "n_rows": "i32", "K": "i32",
           "x_row_stride": "i32", "tiny": "fp32"}
    consts = {"YBLOCK": 1, "KBLOCK": kblock, "ONE_PASS": kblock >= k, "FP8_MAX": fp8.FP8_MAX, "ROUND_FP8": False,
              "BF16_BITS": False}
    src = compiler.ASTSource(fn=triton.jit(fp8_quant._fp8q_kernel), signature=dict(sig, **{c: "constexpr" for c in consts}),
                             constexprs=consts)
    try:
        kernel = triton.compile(src, target=backends.GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    except RuntimeError as exc:  # no ptxas / NVIDIA backend in this triton build
        if "ptxas" in str(exc).lower() or "backend" in str(exc).lower():
            pytest.skip(f"cannot build for CUDA here: {exc}")
        raise
    ptx = kernel.asm["ptx"]
    assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and ".ftz" not in ptx
    assert kernel.metadata.shared <= fp8_quant._smem(cfg)


def test_quantize_input_is_torch_where_the_kernel_does_not_run():
    """On a CPU without the interpreter (this process) and for a coarser code type, quantize_input is
    quantize_rows itself; the kernel says why it does not take an input."""
    from wan_accel.kernels import _common, fp8_quant
    x = _quant_input("bfloat16", 6, 40, seed=1)
    if not _common.use_triton(x):
        assert fp8_quant.problem(x) == "no Triton for this device"
    q, s = fp8.quantize_input(x)
    rq, rs = fp8.quantize_rows(x)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    if _common.use_triton(x):
        assert "2-D" in fp8_quant.problem(x.reshape(2, 3, 40)) and "2-D" in fp8_quant.problem(x.to(torch.float64))


# ----------------------------------------------------------------------------------------------- on the sampler
def _ctx(model):
    return torch.randn(1, 4, model.config.text_dim, generator=torch.Generator().manual_seed(0))


def _run(model, report=None, **fast):
    from run_helpers import generate_latents
    return generate_latents(model, _ctx(model), 6, 4, 6, seed=1, path="optimized", report=report,
                            fast_options={"cuda_graphs": "off", **fast})


def _counting(monkeypatch):
    calls = []
    real = blocks.fp8_linear

    def counted(x, q, s, bias=None, quantized=None):
        calls.append((tuple(q.shape), int(x.reshape(-1, x.shape[-1]).shape[0])))
        return real(x, q, s, bias, quantized)
    monkeypatch.setattr(blocks, "fp8_linear", counted)
    return calls


def test_the_mode_runs_every_block_linear_layer_and_nothing_else(monkeypatch):
    """2 chunks x 4 denoising calls, one refresh pass (the last one is skipped; its last block computes k/v only),
    and the prompt's cross-attention k/v once: every block linear layer of every call goes through fp8, no other
    layer does (no embedding, time MLP or head shape appears)."""
    model = tiny_causal_model()
    cfg = model.config
    d, f, n = cfg.dim, cfg.ffn_dim, cfg.num_layers
    exact = _run(model)
    calls = _counting(monkeypatch)
    report = {}
    out = _run(model, report, linear="fp8")
    assert report["linear"] == "fp8" and report["linear_path"] == "emulated" and "cpu" in report["linear_reason"]
    assert report["fp8_layers"] == 10 * n and report["fp8_layers_kept_as_stored"] == 0
    assert report["fp8_speed"]["slower"] is None                       # emulated on a CPU: no speed verdict
    full = 8 * n + (n - 1)                                             # block calls doing all their work
    expected = {(3 * d, d): full, (2 * d, d): 1, (d, d): 3 * full + 2 * n, (f, d): full, (d, f): full}
    counted = {}
    for shape, _rows in calls:
        counted[shape] = counted.get(shape, 0) + 1
    assert counted == expected
    assert torch.isfinite(out).all()
    diff = float((out - exact).abs().max())
    assert 0 < diff < 0.3, diff


def _quantizing(monkeypatch) -> list:
    """Every input quantized for an fp8 layer (kept alive, so no two distinct inputs can share an address)."""
    seen = []
    real = fp8.quantize_input

    def recorded(x2d):
        seen.append(x2d)
        return real(x2d)
    monkeypatch.setattr(fp8, "quantize_input", recorded)
    monkeypatch.setattr(blocks, "quantize_input", recorded)
    return seen


@pytest.mark.parametrize("fused_qkv", [True, False])
def test_no_input_is_quantized_twice(monkeypatch, fused_qkv):
    """The prompt is quantized once for every block's cross-attention k and v, and separate q/k/v GEMMs share one
    quantized input: no input is quantized twice, and every GEMM beyond the first on a shared input saves one
    quantization (the counts of test_the_mode_runs_every_block_linear_layer_and_nothing_else: 9n - 1 full block
    calls, one k/v-only call)."""
    model = tiny_causal_model()
    seen = _quantizing(monkeypatch)
    calls = _counting(monkeypatch)
    out = _run(model, linear="fp8", fused_qkv=fused_qkv)
    assert torch.isfinite(out).all()
    where = [(t.data_ptr(), tuple(t.shape), t.stride()) for t in seen]
    assert len(set(where)) == len(where), "an input was quantized twice"
    n = model.config.num_layers
    saved = 2 * n - 1 + (0 if fused_qkv else 2 * (9 * n - 1) + 1)     # prompt 2n -> 1; q/k/v 3 -> 1, k/v 2 -> 1
    assert len(calls) - len(seen) == saved, (len(calls), len(seen))


def test_exact_runs_are_untouched_and_the_copies_leave_no_trace(monkeypatch):
    model, fresh = tiny_causal_model(), tiny_causal_model()
    keys = list(model.state_dict())
    before = _run(model)
    _run(model, linear="fp8")
    assert any("fp8" in n for n, _ in model.named_buffers())          # copies are buffers: model.to moves them
    assert list(model.state_dict()) == keys                            # ... and never saved
    calls = _counting(monkeypatch)
    after = _run(model)
    assert calls == [] and torch.equal(before, after) and torch.equal(after, _run(fresh))
    assert not any("fp8" in n for n, _ in model.named_buffers())      # an exact run frees them


def test_fused_and_separate_qkv_compute_the_same_fp8_products():
    model = tiny_causal_model()
    fused = _run(model, linear="fp8")
    separate = _run(model, linear="fp8", fused_qkv=False)
    assert float((fused - separate).abs().max()) <= 1e-4 * float(fused.abs().max())


def test_a_weight_changed_in_place_is_quantized_again():
    from wan_accel.model.fp8_linear import ensure_fp8
    model = tiny_causal_model()
    _run(model, linear="fp8")
    layer = model.blocks[0].ffn[0]
    old = layer._buffers[blocks.FP8_WEIGHT]
    assert ensure_fp8(model.blocks[0]) and layer._buffers[blocks.FP8_WEIGHT] is old    # current: kept
    with torch.no_grad():
        layer.weight.copy_(layer.weight * 2 + 0.01)                     # as a LoRA merge does, in place
    _run(model, linear="fp8")
    q, s = fp8.quantize_weight(layer.weight)
    assert torch.equal(layer._buffers[blocks.FP8_SCALE], s)
    assert torch.equal(layer._buffers[blocks.FP8_WEIGHT].float(), q.float())


def test_layers_patched_when_called_are_refused_and_fp8_checkpoint_layers_left_alone():
    from wan_accel.model.quant import install_fp8_linears
    model = tiny_causal_model()
    model.blocks[1].cross_attn.o.weight_function = [lambda w: w]       # a per-call patch (ComfyUI's LoRA hook)
    with pytest.raises(ValueError, match=r"blocks\.1\.cross_attn\.o: weight patches .*merge a LoRA"):
        _run(model, linear="fp8")
    assert not any("fp8" in n for n, _ in model.named_buffers())      # refused before any copy was made
    model = tiny_causal_model()
    install_fp8_linears(model, {"blocks.0.ffn.0.weight": torch.float8_e4m3fn,
                                "blocks.0.self_attn.k.weight": torch.float8_e4m3fn})
    for name in ("blocks.0.ffn.0", "blocks.0.self_attn.k"):
        layer = model.get_submodule(name)
        torch.nn.init.normal_(layer.weight.data.float())
        layer.weight.data = (torch.randn(layer.weight.shape) / 8).to(torch.float8_e4m3fn)
    report = {}
    out = _run(model, report, linear="fp8")
    assert torch.isfinite(out).all()
    assert report["fp8_layers_kept_as_stored"] == 2 and report["fp8_layers"] == 10 * 2 - 2
    sa = model.blocks[0].self_attn
    assert blocks.FP8_WEIGHT not in model.blocks[0].ffn[0]._buffers and blocks.FP8_WEIGHT not in sa.k._buffers
    assert blocks.QKV_FP8_WEIGHT not in sa._buffers                    # q and v: a copy each
    assert blocks.FP8_WEIGHT in sa.q._buffers and blocks.FP8_WEIGHT in sa.v._buffers


def test_swapped_blocks_run_exact():
    from wan_accel.memory.block_swap import SwapSettings, apply_block_swap
    model = tiny_causal_model()
    apply_block_swap(model, SwapSettings(blocks_to_swap=1, prefetch=1), device="cpu")
    report = {}
    out = _run(model, report, linear="fp8")
    assert torch.isfinite(out).all() and report["swapped_blocks"] == 1
    assert report["fp8_layers"] == 10 and report["fp8_blocks_exact_swapped"] == 1
    assert not any("fp8" in n for n, _ in model.blocks[1].named_buffers())


def test_the_reference_path_and_the_cli_refuse_fp8_with_the_fix(capsys, tmp_path):
    from wan_accel.cli import main
    from run_helpers import generate_latents
    model = tiny_causal_model()
    with pytest.raises(ValueError, match="optimized sampler path only"):
        generate_latents(model, _ctx(model), 3, 4, 4, path="reference", fast_options={"linear": "fp8"})
    code = main(["generate", "--out", str(tmp_path), "--linear", "fp8", "--sampler", "reference", "--no-preview"])
    err = capsys.readouterr().err
    assert code == 2 and "--linear fp8" in err and "--sampler optimized" in err and "Traceback" not in err
    with pytest.raises(ValueError, match="linear must be one of"):
        generate_latents(model, _ctx(model), 3, 4, 4, path="optimized", fast_options={"linear": "fp4"})


# ----------------------------------------------------------------------------------------------- speed verdict
def _no_interpreter(monkeypatch):
    """A CPU without Triton's interpreter, whatever this process's TRITON_INTERPRET says: a stand-in timer counts
    the fp8 verdict's own timings, and under the interpreter the fused kernels would tune their tiles with the same
    timer first (speed_timer.install does the same)."""
    from wan_accel.kernels import _common
    monkeypatch.setattr(_common, "interpreter_usable", lambda: False)


def _speed_run(monkeypatch, slow: bool, **fast):
    import speed_timer
    monkeypatch.setattr(registry, "SPEED_DEVICES", ("cuda", "cpu"))    # judge speed here, with the store's own timer
    timed = speed_timer.install(monkeypatch, slow)               # fp8 timed first, then exact (no interpreter)
    model = tiny_causal_model()
    report = {}
    out = _run(model, report, linear="fp8", **fast)
    return out, _run(tiny_causal_model()), report, timed


def test_fp8_measured_slower_at_the_runs_shape_runs_exact(monkeypatch):
    out, exact, report, timed = _speed_run(monkeypatch, slow=True)
    assert timed and report["fp8_speed"]["slower"] is True and "tokens" in report["fp8_speed"]["why"]
    assert report["linear"] == "exact (fp8 measured slower)"
    assert any("fp8 linear is slower" in n and "--keep-slower" in n for n in report["notes"])
    assert torch.equal(out, exact)                              # the prompt's cross k/v too were made exact


def test_fp8_kept_where_faster(monkeypatch):
    out, exact, report, _ = _speed_run(monkeypatch, slow=False)
    assert report["fp8_speed"]["slower"] is False and report["linear"] == "fp8" and not torch.equal(out, exact)


def test_fp8_kept_where_the_user_insists(monkeypatch):
    out, exact, report, _ = _speed_run(monkeypatch, slow=True, keep_slower=True)
    assert report["fp8_speed"]["slower"] is True and report["linear"] == "fp8" and not torch.equal(out, exact)
    assert any("kept because keep_slower" in n for n in report["notes"])


def _copies_made(monkeypatch) -> dict:
    """Counts of what an fp8 run makes before its first chunk: ensure_fp8 calls and weight quantizations."""
    from wan_accel.model import fp8_linear as fl
    from wan_accel.sampling import runner
    made = {"ensure_fp8": 0, "quantize_weight": 0}
    real_ensure, real_quant = runner.ensure_fp8, fl.fp8.quantize_weight

    def ensure(*a, **kw):
        made["ensure_fp8"] += 1
        return real_ensure(*a, **kw)

    def quant(*a, **kw):
        made["quantize_weight"] += 1
        return real_quant(*a, **kw)
    monkeypatch.setattr(runner, "ensure_fp8", ensure)
    monkeypatch.setattr(fl.fp8, "quantize_weight", quant)
    return made


def test_a_stored_slower_verdict_costs_nothing(monkeypatch):
    """The verdict is read before any fp8 copy is made: measured slower, the first run makes no copy (its timing
    quantizes only the probe's own weights), and a later run of the same shape reads the stored verdict, times
    nothing and makes nothing: no copy, no quantized weight, no fp8 buffer, the exact numbers."""
    made = _copies_made(monkeypatch)
    out, exact, report, timed = _speed_run(monkeypatch, slow=True)
    assert report["linear"] == "exact (fp8 measured slower)" and torch.equal(out, exact)
    assert made["ensure_fp8"] == 0 and made["quantize_weight"] == 4      # one probe weight per layer group
    n_timed = len(timed)
    model, report = tiny_causal_model(), {}
    made.update(ensure_fp8=0, quantize_weight=0)
    again = _run(model, report, linear="fp8")
    assert len(timed) == n_timed and made == {"ensure_fp8": 0, "quantize_weight": 0}
    assert not any("fp8" in n for n, _ in model.named_buffers())
    assert report["fp8_speed"]["slower"] is True and report["linear"] == "exact (fp8 measured slower)"
    assert report.get("linear_path") is None and any("fp8 linear is slower" in n for n in report["notes"])
    assert torch.equal(again, exact)


def test_a_stored_faster_verdict_makes_the_copies_once(monkeypatch):
    from wan_accel.model import fp8_linear as fl
    made = _copies_made(monkeypatch)
    _out, _exact, report, timed = _speed_run(monkeypatch, slow=False)
    n = tiny_causal_model().config.num_layers
    groups = len(fl.GROUPS)
    assert report["linear"] == "fp8" and made["ensure_fp8"] == n and len(timed) == 2 * groups
    model, report = tiny_causal_model(), {}
    _run(model, report, linear="fp8")
    assert len(timed) == 2 * groups and made["ensure_fp8"] == 2 * n and report["fp8_speed"]["slower"] is False
    assert report["linear"] == "fp8" and any("fp8" in name for name, _ in model.named_buffers())


def test_only_the_layer_groups_measured_faster_run_fp8(monkeypatch):
    """Each layer group is judged on its own (in GROUPS order, fp8 timed before exact): the fused q/k/v and the
    FFN's first layer faster, the square layers (o, cross-attention) and the FFN's second slower. Only the faster
    groups hold fp8 copies; the prompt's cross-attention keys/values are exact; the run is fp8 in those layers.
    Judged before any copy is made (at the run's start)."""
    from wan_accel.model import fp8_linear as fl
    _no_interpreter(monkeypatch)
    monkeypatch.setattr(registry, "SPEED_DEVICES", ("cuda", "cpu"))
    from wan_accel.cache.autotune import get_autotuner
    times = {"qkv": 1.0, "square": 4.0, "ffn_up": 1.0, "ffn_down": 4.0}
    timed = []

    def timer(fn):
        fn()
        timed.append(1)
        group = fl.GROUPS[(len(timed) - 1) // 2]
        return times[group] if len(timed) % 2 else 2.0
    monkeypatch.setattr(get_autotuner(), "timer", timer)
    model, report = tiny_causal_model(), {}
    out = _run(model, report, linear="fp8")
    assert len(timed) == 2 * len(fl.GROUPS)
    assert report["fp8_speed"]["slower"] is False and report["fp8_speed"]["faster_groups"] == ["ffn_up", "qkv"]
    assert report["linear"] == "fp8" and report["fp8_groups"] == ["qkv", "ffn_up"]
    assert "fp8 where faster: qkv, ffn_up" in report["fp8_speed"]["why"]
    held = {n for n, _ in model.named_buffers() if "fp8" in n}
    assert held and all(".self_attn." in n or ".ffn.0." in n for n in held)
    assert not any(".cross_attn." in n or ".ffn.2." in n or "self_attn.o." in n for n in held)
    assert not torch.equal(out, _run(tiny_causal_model()))
    # the same numbers from the stored verdicts: nothing timed again
    monkeypatch.setattr(get_autotuner(), "timer", lambda fn: pytest.fail("a stored verdict timed again"))
    again = _run(tiny_causal_model(), {}, linear="fp8")
    assert torch.equal(out, again)


# ----------------------------------------------------------------------------------------------- doctor
def test_the_doctor_judges_fp8_by_its_bound_and_a_failed_verdict_switches_it_off(monkeypatch, cache_path):
    from wan_accel.app.doctor.core import doctor_for
    from wan_accel.app.doctor.gate import gate_options
    from wan_accel.cache import LimitCache
    from wan_accel.sampling.runner import FastOptions
    doc = doctor_for("cpu", torch.float32, 128, cache=LimitCache(cache_path))
    value = doc.check("linear.fp8", recheck=True)
    assert value["status"] == "passed" and 0.8 < value["difference"] <= 1.0 and value["tolerance"] == 1.0
    real = fp8.fp8_linear
    monkeypatch.setattr(fp8, "fp8_linear", lambda x, q, s, b=None: real(x, q, s, b) * 0.95)   # 5 % low
    value = doc.check("linear.fp8", recheck=True)
    assert value["status"] == "failed" and "wrong numbers" in value["error"]
    model = tiny_causal_model()
    options, lines = gate_options(model, FastOptions(linear="fp8"), doctor=doc)
    assert "linear.fp8" in options.switched_off and any("linear.fp8" in line for line in lines)
    report = {}
    monkeypatch.setattr(fp8, "fp8_linear", real)
    out = _run(model, report, **{"linear": "fp8", "switched_off": options.switched_off})
    assert report["linear"] == "exact" and any("fp8 linear is switched off" in n for n in report["notes"])
    assert torch.equal(out, _run(tiny_causal_model()))


# ----------------------------------------------------------------------------------------------- commands
def test_generate_with_linear_fp8_runs_on_the_cpu(tmp_path, capsys):
    from wan_accel.cli import main
    code = main(["generate", "--out", str(tmp_path), "--frames", "9", "--height", "32", "--width", "32",
                 "--device", "cpu", "--linear", "fp8", "--no-preview", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    s = report["sampler"]
    assert s["path"] == "optimized" and s["linear"] == "fp8" and s["linear_path"] == "emulated" and s["fp8_layers"]
    assert report["settings"]["linear"] == "fp8" and any("linear fp8" in n for n in report["notes"])
    assert "linear.fp8" in report["features"]["ran"]


def test_matrix_game2_and_the_doctors_gate_keep_the_callers_linear_mode(tmp_path, capsys):
    """generate --model-kind matrix-game2 --linear fp8 runs fp8 and says so; the Matrix-Game-2 job's one prepare
    step (the doctor's gate) keeps the caller's linear mode and its reference path."""
    from wan_accel.app.jobs.mg2 import MG2Options, run_mg2_generate
    from wan_accel.app.prepare import RunSpec
    from wan_accel.cli import main
    code = main(["generate", "--model-kind", "matrix-game2", "--linear", "fp8", "--device", "cpu", "--frames", "9",
                 "--out", str(tmp_path), "--no-preview", "--json"])
    assert code == 0
    s = json.loads(capsys.readouterr().out)["sampler"]
    assert (s["path"], s["linear"], s["linear_path"]) == ("optimized", "fp8", "emulated") and s["fp8_layers"] > 0
    for spec, path, linear in ((RunSpec(linear="fp8", cuda_graphs="off"), "optimized", "fp8"),
                               (RunSpec(path="reference"), "reference", None)):
        opts = MG2Options(out_dir=str(tmp_path / path), frames=3, device="cpu", preview=False)
        report = run_mg2_generate(opts, log=lambda *_a: None, spec=spec)["sampler"]
        assert report["path"] == path and report.get("linear") == linear, report


def _bench(capsys, *argv):
    from wan_accel.bench import sampler
    parser = argparse.ArgumentParser()
    sampler.add_arguments(parser)
    assert sampler.run(parser.parse_args(list(argv) + ["--json", "--device", "cpu", "--repeat", "1"])) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_sampler_puts_fp8_rows_beside_their_exact_twins(capsys):
    from wan_accel.bench import sampler
    ns = argparse.Namespace(variants="reference,optimized,optimized-no-graphs", attention=None, linear="fp8")
    assert sampler._variant_names(ns, "fp32") == ["reference", "optimized", "optimized-fp8", "optimized-no-graphs",
                                                  "optimized-no-graphs-fp8"]
    ns = argparse.Namespace(variants="optimized", attention="int8", linear="fp8")
    assert sampler._variant_names(ns, "fp32") == ["optimized", "optimized-fp8", "optimized-int8",
                                                  "optimized-int8-fp8"]
    assert sampler.exact_twin("optimized-int8-fp8") == "optimized-int8" and sampler.exact_twin("optimized") is None
    out = _bench(capsys, "--shape", "tiny", "--linear", "fp8", "--frames", "9", "--height", "32", "--width", "32")
    rows = {r["variant"]: r for r in out["rows"]}
    assert list(rows) == ["reference", "optimized", "optimized-fp8"]
    fp8_row, exact_row = rows["optimized-fp8"], rows["optimized"]
    assert (fp8_row["linear"], fp8_row["linear_ran"], fp8_row["linear_path"]) == ("fp8", "fp8", "emulated")
    assert exact_row["linear_ran"] == "exact" and "vs_exact_max_abs" not in exact_row
    assert 0 < fp8_row["vs_exact_max_abs"] < 0.5 and 0 < fp8_row["vs_exact_mean_abs"] <= fp8_row["vs_exact_max_abs"]
    assert fp8_row["host_syncs"] == exact_row["host_syncs"]            # the scales never reach the host


def test_bench_sampler_refuses_a_reference_fp8_twin():
    from wan_accel.bench import sampler
    from wan_accel.app.validate import UsageError
    parser = argparse.ArgumentParser()
    sampler.add_arguments(parser)
    with pytest.raises(UsageError, match="reference path has no fp8 linear mode"):
        sampler.run(parser.parse_args(["--variants", "reference-fp8", "--device", "cpu"]))


def test_the_selftest_fails_fp8_kept_although_slower():
    from wan_accel.checks import selftest
    rows = [{"variant": "optimized", "steady_s": 2.0}, {"variant": "optimized-fp8", "steady_s": 2.5,
                                                         "linear_ran": "fp8"}]
    assert "fp8 linear stayed on" in selftest.judge_bench_sampler({"rows": rows})[0]
    rows[1]["linear_ran"] = "exact (fp8 measured slower)"
    assert selftest.judge_bench_sampler({"rows": rows}) == []
    assert "optimized-fp8" in selftest._sampler_argv(argparse.Namespace(quick=True))[3].split(",")


# ----------------------------------------------------------------------------------------------- fidelity
def _fp8_fidelity_section() -> str:
    section = (REPO / "docs" / "sampler.md").read_text().split("## Fidelity", 1)[1].split("\n## ", 1)[0]
    return section.split("### fp8 linear layers", 1)[1]


def test_every_fp8_call_of_the_fidelity_runs_is_within_the_bound(monkeypatch):
    """What the fp8 rows of docs/sampler.md's Fidelity section state and every CPU reproduces: on the recorded fixtures every fp8 call of
    ``bench fidelity --linear fp8``'s runs stays within ``error_bound`` of the exact product of its own inputs, and
    fp8 does change the video. The table's digits are one machine's measurement (another CPU sums float32 in
    another order, an e4m3 code rounds the other way), so they are checked for their form and machine."""
    from wan_accel.bench.fidelity import measure, paths_for
    from wan_accel.model import fp8_linear as fl
    worst, calls, made = [0.0], [0], {}
    real, real_copy = blocks.fp8_linear, fl._copy

    def recording(owner, names, layers):          # each fp8 copy's address -> the weights it was made from
        real_copy(owner, names, layers)
        w = owner._buffers[names[0]]
        start, end = w.data_ptr(), w.data_ptr() + w.numel()
        for p in [p for p, (n, _) in made.items() if p < end and start < p + n]:
            del made[p]                           # a freed copy's memory, reused by this one
        made[start] = (w.numel(), torch.cat([m.weight.detach() for m in layers]))

    def weight_of(q):
        base = next(p for p, (numel, _) in made.items() if p <= q.data_ptr() < p + numel)
        row = (q.data_ptr() - base) // q.shape[1]      # one byte per e4m3 element
        return made[base][1][row:row + q.shape[0]]

    def checked(x, q, s, bias=None, quantized=None):
        out = real(x, q, s, bias, quantized)
        w = weight_of(q)
        ratio = (out.double() - _exact(x, w, bias)).abs() / fp8.error_bound(x, w, bias)
        worst[0] = max(worst[0], float(ratio.max()))
        calls[0] += 1
        return out

    monkeypatch.setattr(fl, "_copy", recording)
    monkeypatch.setattr(blocks, "fp8_linear", checked)
    section = _fp8_fidelity_section()
    table = {m[0]: [float(v) for v in m[1:]] for m in re.findall(
        r"^\| (\w+) \| fp8 \| ([\d.e+-]+) \| ([\d.e+-]+) \| ([\d.e+-]+) \|", section, re.M)}
    fixtures = ("wan_reference", "matrix_game2")
    assert set(table) == set(fixtures), section
    assert re.search(r"[Mm]easured on (an? )?[A-Z][\w ]*(CPU|GPU), .*\d{4}-\d\d-\d\d", section), "machine, date"
    assert paths_for("fp8") == ("optimized",)
    for fixture in fixtures:
        calls[0], worst[0] = 0, 0.0
        rows = measure(FIXTURES / fixture, "sdpa", "cpu", "fp8")
        assert calls[0] > 0 and worst[0] <= 1.0, (fixture, calls[0], worst[0])
        assert [(r["path"], r["linear"]) for r in rows] == [("optimized", "fp8")]
        assert rows[0]["final"]["max_abs"] > 0 and all(s["max_abs"] > 0 for s in rows[0]["steps"])


# ----------------------------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scaled_mm_within_its_bound_on_a_gpu(dtype):
    """The 1.3B model's layer shapes through torch._scaled_mm on an fp8 GPU (SM 8.9+), against the bound of the
    scaled matmul's own rounding (bfloat16 output, tensor-core sums)."""
    path, why = fp8.path_for("cuda", 1536, 8960)
    if path != "scaled_mm":
        pytest.skip(f"no scaled fp8 matmul on this GPU: {why}")
    g = torch.Generator().manual_seed(5)
    for n, k in ((3 * 1536, 1536), (8960, 1536), (1536, 8960)):
        x = torch.randn(1560, k, generator=g)
        x[::97, :4] *= 50                                            # outlier tokens
        w, b = torch.randn(n, k, generator=g) / k ** 0.5, torch.randn(n, generator=g) / 10
        x, w, b = (t.to("cuda", dtype) for t in (x, w, b))
        q, s = fp8.quantize_weight(w)
        y = fp8.fp8_linear(x, q, s, b)
        assert fp8.mm_problem(x.device, k, n) is None, "the scaled matmul fell back to the emulation"
        err = (y.double() - _exact(x, w, b)).abs()
        assert float((err / fp8.error_bound(x, w, b, "scaled_mm")).max()) <= 1.0
        emulated = fp8.emulated(x, q, s, b, dtype)                   # same codes; sums and output rounding differ
        assert float((y.double() - emulated.double()).abs().max()) <= float(fp8.error_bound(x, w, b, "scaled_mm")
                                                                            .max())


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_the_fused_quantize_equals_quantize_rows_on_a_gpu(dtype):
    """Compiled for this GPU (SM 8.9+), every config of the kernel and the tuned dispatch write torch's codes and
    scales bit for bit, on the interpreter's cases and at a 1.3B block's widths."""
    from wan_accel.kernels import fp8_quant
    x = _quant_input(dtype, 4, 8, 0).cuda()
    why = fp8_quant.problem(x)
    if why is not None:
        pytest.skip(f"the fused quantize does not run here: {why}")
    for i, (m, k) in enumerate(((37, 1536), (5, 8960), (9, 17), (1000, 1536), (300, 8960))):
        x = _quant_input(dtype, m, k, seed=i).cuda()
        ref_q, ref_s = fp8.quantize_rows(x)
        for cfg in fp8_quant.candidates(k) + (None,):
            q, s = fp8_quant.run_triton(x, fp8.FP8_MAX, fp8.TINY, cfg) if cfg else fp8.quantize_input(x)
            assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)), (m, k, cfg)
            assert torch.equal(s.view(torch.int32), ref_s.view(torch.int32)), (m, k, cfg)


@pytest.mark.cuda
def test_fp8_runs_on_the_gpu_with_cuda_graphs():
    model = tiny_causal_model(0, "cuda", torch.bfloat16)
    ctx = _ctx(model).cuda()
    from run_helpers import generate_latents
    report = {}
    run = lambda **kw: generate_latents(model, ctx, 6, 4, 6, seed=1, path="optimized",  # noqa: E731
                                        fast_options={"linear": "fp8", "keep_slower": True}, **kw)
    first = run(report=report)
    second = run()
    cap = torch.cuda.get_device_capability()
    assert report["linear"] == "fp8"
    assert report["linear_path"] == ("scaled_mm" if cap >= fp8.MM_CAPABILITY else "emulated"), report
    assert report["cuda_graphs"] and torch.equal(first, second)                # graph replay: the same numbers
    exact = generate_latents(model, ctx, 6, 4, 6, seed=1, path="optimized")
    assert 0 < float((first - exact).abs().max()) < 0.5


if __name__ == "__main__" and "--child" in sys.argv:
    _quant_child()
