"""The fp8 attention mode's KV-cache write in one kernel (``kernels/kv_quant.py``): under Triton's interpreter every
config writes the cache copy the torch ops write (int8 key codes, steps, e4m3 value code bytes, scales), bit for bit;
built for Ada and Hopper without a GPU, its conversions and divisions are the correctly rounded ones.

TRITON_INTERPRET must be set before triton is first imported, so the kernel runs in a child process."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
MARK = "KV_QUANT_RESULT "
# (dtype, batch, rows, heads, head size, capacity, smoothing): rows not a multiple of any BLOCK_R, heads > 1, a head
# size that is not a power of two, slots wrapping around a ring with a sink
CASES = [("bfloat16", 2, 37, 3, 16, 50, "mean"), ("float16", 1, 21, 2, 20, 40, "mean"),
         ("float32", 2, 13, 3, 32, 30, "mean"), ("bfloat16", 1, 12, 2, 16, 24, "zero")]


def _ends():
    """The configs with the fewest and the most rows per program: a row's codes do not depend on its block, the masks
    of a partial block do (the interpreter ignores the warp count); the tuned dispatch below may pick any config."""
    from wan_accel.kernels import kv_quant
    by_rows = sorted(kv_quant.CANDIDATES, key=lambda c: (c["BLOCK_R"], c["num_warps"]))
    return (by_rows[0], by_rows[-1])


ENDS = _ends()


def _ring_index(rows: int, cap: int, sink: int = 2) -> torch.Tensor:
    """Slots of ``rows`` tokens appended to a ring of ``cap - sink`` slots after ``sink`` fixed ones, starting 6
    slots before the ring's end: they wrap (non-contiguous)."""
    ring = cap - sink
    return torch.tensor([sink + (ring - 6 + i) % ring for i in range(rows)], dtype=torch.int64)


def _inputs(dtype: str, b: int, rows: int, h: int, d: int, seed: int):
    """Random keys/values with channel offsets, then special rows: row 0 all zeros (a zero token: with zero means
    the tiny step and scale), row 1 keys whose step is 1 exactly with halves to round to even (0.5, 1.5, 2.5,
    -0.5, -2.5, 126.5), values whose scale is 2^-8 exactly with e4m3 ties in the normal and subnormal ranges and a
    carry into the next binade, row 2 values just under the maximum (codes at +-448)."""
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, rows, h, d, generator=g) * 2 + torch.randn(1, 1, h, d, generator=g)
    v = torch.randn(b, rows, h, d, generator=g) * torch.exp(torch.randn(b, rows, h, 1, generator=g))
    key_ties = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -1.5])
    ties = [272, -272, 304, -304, 124, -124, 2 ** -10, -2 ** -10, 3 * 2 ** -10, -3 * 2 ** -10, -0.0, 2 ** -12]
    value_ties = torch.tensor([1.75] + [t * 2 ** -8 for t in ties])
    near_max = torch.tensor([5.0] + [s * 5.0 * (1 - 2.0 ** -e) for e in range(1, 8) for s in (1, -1)])
    k[:, 0] = 0
    v[:, 0] = 0
    k[:, 1] = key_ties.repeat(d // len(key_ties) + 1)[:d]
    v[:, 1] = value_ties.repeat(d // len(value_ties) + 1)[:d]
    v[:, 2] = near_max.repeat(d // len(near_max) + 1)[:d]
    return k.to(dt), v.to(dt)


def _snapshot(shadow) -> dict:
    return {"k": shadow.k.clone(), "k_scale": shadow.k_scale.view(torch.int32).clone(),
            "v": shadow.v.view(torch.uint8).clone(), "v_scale": shadow.v_scale.view(torch.int32).clone()}


def _differ(a: dict, b: dict) -> dict:
    return {name: int((a[name] != b[name]).sum()) for name in a}


def _child() -> None:
    from wan_accel.cache.autotune import get_autotuner
    from wan_accel.kernels import _common, kv_quant
    from wan_accel.kernels import fp8_attention as fa
    from wan_accel.model.kv_cache import Fp8Shadow
    get_autotuner().timer = lambda run: 1.0          # the interpreter's timings say nothing: no second launch
    out = {"usable": _common.use_triton(torch.zeros(1)), "cases": []}
    for i, (dtype, b, rows, h, d, cap, smooth) in enumerate(CASES):
        k, v = _inputs(dtype, b, rows, h, d, seed=i)
        index = _ring_index(rows, cap)
        cache = torch.zeros(b, cap, h, d, dtype=k.dtype)
        ref = Fp8Shadow(cache, cache)
        if smooth == "mean":
            ref.fix_means(k, v)
        ref.put_torch(index, k, v)
        expect = _snapshot(ref)
        case = {"configs": 0, "differ": {}}
        for cfg in ENDS:
            got = Fp8Shadow(cache, cache)
            got.k_mean.copy_(ref.k_mean)
            got.v_mean.copy_(ref.v_mean)
            ok = kv_quant.write(k, v, got.k_mean, got.v_mean, index, got.k, got.k_scale, got.v, got.v_scale, cfg)
            case["configs"] += int(ok)
            for name, n in _differ(_snapshot(got), expect).items():
                case["differ"][name] = case["differ"].get(name, 0) + n
        # the dispatch (Fp8Shadow.write: tuned through the operator store) with zero padding slots after the rows
        pad = torch.tensor([0, 1], dtype=torch.int64)
        before = get_autotuner().stats["benchmarks"]
        fused = Fp8Shadow(cache, cache)
        fused.pad = pad
        fused.write(index, k, v, fix=smooth == "mean")
        case["dispatch_tuned"] = get_autotuner().stats["benchmarks"] > before
        zeros = torch.zeros((b, 2, h, d), dtype=k.dtype)
        ref.put_torch(pad, zeros, zeros)
        case["dispatch_differ"] = _differ(_snapshot(fused), _snapshot(ref))
        # what the case covers (torch's codes): a tiny step and scale, ties, codes at the e4m3 maximum, wrapped slots
        slot0, slot1, slot2 = (int(index[j]) for j in range(3))
        case["tiny_step"] = bool((ref.k_scale[:, slot0] == fa.INT8_TINY / fa.LEVELS).all()) if smooth == "zero" \
            else None
        case["key_ties"] = ref.k[0, slot1, 0, :8].tolist() if smooth == "zero" else None
        case["value_ties"] = ref.v[0, 0, :13, slot1].float().tolist() if smooth == "zero" else None
        case["at_max"] = float(ref.v[..., slot2].float().abs().max())
        case["wraps"] = bool((index.diff() < 0).any())
        out["cases"].append(case)
    from wan_accel.bench.kernels import fp8_kv_write_rows
    out["bench"] = fp8_kv_write_rows("cpu", "bfloat16")
    print(MARK + json.dumps(out), flush=True)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    sys.path.insert(0, str(HERE.parent))
    from interpret_child import run_interpreted_child
    return run_interpreted_child(HERE, tmp_path_factory.mktemp("kv_quant"), MARK, timeout=600)


def test_the_kv_write_kernel_runs_under_the_interpreter(interpreted):
    assert interpreted["usable"] is True
    from wan_accel.kernels import kv_quant
    assert all(c["configs"] == len(ENDS) for c in interpreted["cases"]), interpreted["cases"]
    assert all(c["dispatch_tuned"] for c in interpreted["cases"])     # Fp8Shadow.write really launched it


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{c[0]}-B{c[1]}-R{c[2]}-H{c[3]}-D{c[4]}-{c[6]}"
                                                          for c in CASES])
def test_the_kv_write_equals_the_torch_ops_bit_for_bit(interpreted, index):
    """Every config writes exactly the cache copy of ``quantize_smoothed`` + the index copies: int8 codes, steps,
    e4m3 code bytes and scales, into wrapping slots, the other slots untouched; so does the dispatch, zero padding
    included."""
    case = interpreted["cases"][index]
    assert all(n == 0 for n in case["differ"].values()), case
    assert all(n == 0 for n in case["dispatch_differ"].values()), case
    assert case["wraps"] and case["at_max"] == 448.0, case


def test_the_cases_hit_tiny_steps_and_ties():
    """The rows above are what they claim, in torch's own codes (the zero-mean case): a zero token's tiny step,
    keys' halves rounded to even, values' e4m3 ties, carry and subnormals."""
    from wan_accel.kernels import fp8_attention as fa
    k, v = _inputs("bfloat16", 1, 4, 1, 16, seed=0)
    zero = torch.zeros(1, 1, 16)
    k8, sk, v8, sv = fa.quantize_smoothed(k, v, zero, zero)
    assert float(sk[0, 0, 0]) == fa.INT8_TINY / fa.LEVELS and float(sk[0, 1, 0]) == 1.0
    assert k8[0, 1, 0, :8].tolist() == [127, 0, 2, 2, 0, -2, 126, -2]
    assert float(sv[0, 1, 0]) == 2 ** -8
    assert v8[0, 1, 0, :13].float().tolist() == [448, 256, -256, 320, -320, 128, -128, 0, -0.0, 2 ** -8, -2 ** -8,
                                                  0, 0]


def test_interpreted_case_values(interpreted):
    zero_case = interpreted["cases"][-1]
    assert zero_case["tiny_step"] is True
    assert zero_case["key_ties"] == [127, 0, 2, 2, 0, -2, 126, -2]
    assert zero_case["value_ties"] == [448, 256, -256, 320, -320, 128, -128, 0, -0.0, 2 ** -8, -2 ** -8, 0, 0]


def test_bench_kernels_fp8_kv_write(interpreted, capsys):
    """``bench kernels``' fp8 KV write row: under the interpreter the kernel at a small shape, bit-equal to the torch
    ops; the GPU table prints the figures it is given."""
    from wan_accel.bench.kernels import CPU_KV_WRITE_SHAPE, _print_fp8
    bench = interpreted["bench"]
    assert [r["shape"] for r in bench] == [CPU_KV_WRITE_SHAPE[0]]
    assert all(r["ok"] and r["bit_equal"] for r in bench), bench
    _print_fp8([dict(bench[0], torch_ms=0.1, triton_ms=0.02, speedup=5.0, triton_gb_s=900.0)])
    out = capsys.readouterr().out
    for text in ("fp8_kv_write", "bit-equal", "torch 0.100 ms", "fused 0.020 ms", "x5.00", "900 GB/s"):
        assert text in out, text


def test_without_triton_the_cache_write_is_the_torch_ops():
    """On a CPU without the interpreter the kernel declines (nothing written) and the copy takes the torch ops."""
    from wan_accel.kernels import _common, kv_quant
    from wan_accel.model.kv_cache import Fp8Shadow
    if _common.use_triton(torch.zeros(1)):
        pytest.skip("the interpreter is on in this process")
    k, v = _inputs("float32", 1, 5, 2, 16, seed=3)
    cache = torch.zeros(1, 8, 2, 16)
    shadow = Fp8Shadow(cache, cache)
    index = torch.arange(5)
    assert kv_quant.problem(k, v) == "no Triton for this device"
    assert not kv_quant.write(k, v, shadow.k_mean, shadow.v_mean, index, shadow.k, shadow.k_scale, shadow.v,
                              shadow.v_scale)
    assert int(shadow.k.abs().sum()) == 0
    shadow.write(index, k, v)
    ref = Fp8Shadow(cache, cache)
    ref.fix_means(k, v)
    ref.put_torch(index, k, v)
    assert _differ(_snapshot(shadow), _snapshot(ref)) == {"k": 0, "k_scale": 0, "v": 0, "v_scale": 0}


@pytest.mark.parametrize("arch", [89, 90])
def test_the_kv_write_compiles_to_correctly_rounded_ptx(tmp_path, monkeypatch, arch):
    """Built for Ada / Hopper without a GPU: correctly rounded divisions (div.rn, no approximate division), the e4m3
    conversion rounding to nearest even in hardware, no flush of subnormals, and the key codes' rounding
    (x + 1.5 * 2^23 - 1.5 * 2^23) kept as two float32 additions."""
    pytest.importorskip("triton")
    from ptx_build import build_ptx
    from wan_accel.kernels import _common, kv_quant
    if _common.interpret_enabled():
        pytest.skip("TRITON_INTERPRET is set: compiled-mode checks need it unset")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    cfg = kv_quant.CANDIDATES[-1] if arch == 90 else kv_quant.CANDIDATES[2]
    strides = ("k_sb", "k_sr", "k_sh", "k_sd", "v_sb", "v_sr", "v_sh", "v_sd", "mk_sb", "mk_sh", "mv_sb", "mv_sh",
               "k8_sb", "k8_ss", "k8_sh", "sk_sb", "sk_ss", "sk_sh", "v8_sb", "v8_sh", "v8_sd", "sv_sb", "sv_ss",
               "sv_sh")
    sig = {"K": "*bf16", "V": "*bf16", "MK": "*fp32", "MV": "*fp32", "IDX": "*i64", "K8": "*i8", "SK": "*fp32",
           "V8": "*fp8e4nv", "SV": "*fp32", "rows": "i32", "H": "i32", "D": "i32", **{s: "i64" for s in strides},
           "k_tiny": "fp32", "v_tiny": "fp32"}
    consts = {"HEAD": 128, "BLOCK_R": cfg["BLOCK_R"], "LEVELS": 127.0, "FP8_MAX": 448.0,
              "ROUND_INT": kv_quant.ROUND_INT, "ROUND_FP8": False, "BF16_BITS": False}
    ptx = build_ptx(kv_quant._kv_quant_kernel, sig, consts, arch, cfg["num_warps"]).asm["ptx"]
    assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and ".ftz" not in ptx
    assert "add.f32" in ptx and ("sub.f32" in ptx or ptx.count("add.f32") >= 2)
    assert "0f4B400000" in ptx                                         # 1.5 * 2^23, not folded away


if __name__ == "__main__" and "--child" in sys.argv:
    _child()


class _DeviceStandIn:
    """A tensor that says it is on CUDA and records what it is divided by."""
    is_cuda = True

    def new_full(self, size, value):
        return ("0-dim tensor", size, value)

    def __truediv__(self, divisor):
        return divisor


def test_scale_divisions_are_correctly_rounded_on_every_device():
    """Steps and scales are max / 127 and max / 448 as the kernels' div_rn computes them: on CUDA the divisor goes in
    as a 0-dim tensor (torch multiplies by a rounded reciprocal for a Python number), elsewhere as the number."""
    from wan_accel.kernels import _common
    assert _common.divide(_DeviceStandIn(), 448.0) == ("0-dim tensor", (), 448.0)
    x = torch.rand(1000, generator=torch.Generator().manual_seed(0)) * 1000
    assert torch.equal(_common.divide(x, 127.0), x / 127.0)


@pytest.mark.cuda
def test_scale_divisions_on_a_gpu_equal_correct_rounding():
    from wan_accel.kernels import _common
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x = 1 + torch.arange(1 << 20, device="cuda", dtype=torch.float32) * 2.0 ** -20       # a binade's mantissas
    for d in (127.0, 448.0):       # float64 division rounded once to float32 is the correctly rounded quotient
        assert torch.equal(_common.divide(x, d), (x.double() / d).float())
