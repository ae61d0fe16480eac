"""The pack's Triton flash-attention kernel (kernels/flash_attention.py), an exact candidate of the operator store's
'auto': under the interpreter it matches float32 softmax math within the store's tolerance and within the rounding
it is allowed (P and the output rounded once to bf16/fp16) for head sizes 16/64/128, lengths that are no multiple
of the tiles, batch and heads above one, and the pack's views (fused q/k/v, heads-major); the store verifies it,
picks it where it is fastest and fails it alone where it is wrong; it compiles for Hopper and Ada within their
shared memory; where it cannot run (a CPU) the store lists it with the reason, and a failed doctor verdict
switches it off.

TRITON_INTERPRET must be set before triton is first imported, so the kernel runs in a child process.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
MARK = "FLASH_ATTENTION_INTERPRET_RESULT "
F32_U = 2.0 ** -24
EXP2_U = 2.0 ** -22          # the GPU's exp2 (ex2.approx) is within 2 units of float32's last place

CASES = [  # (dtype, head size, batch, heads, queries, keys, BLOCK_M, BLOCK_N, layout)
    ("bfloat16", 16, 2, 3, 37, 75, 16, 32, "fused"),
    ("float16", 16, 1, 2, 20, 13, 16, 16, "heads"),        # fewer keys than one tile: only the masked tile
    ("bfloat16", 64, 2, 2, 21, 64, 16, 32, "heads"),       # a multiple of the tile: no masked tile
    ("float16", 64, 2, 2, 30, 50, 32, 16, "fused"),
    ("bfloat16", 128, 1, 2, 33, 70, 32, 32, "plain"),
    ("float16", 128, 2, 1, 17, 40, 16, 32, "fused"),
]


def make_qkv(dtype, d, b, h, lq, lk, layout, gen):
    """q [b, lq, h, d], k/v [b, lk, h, d] as the pack holds them: views of a fused projection ([.., 3 or 2, h, d]),
    heads-major tensors seen token-major, or plain contiguous tensors."""
    if layout == "fused":
        qkv = torch.randn(b, lq, 3, h, d, generator=gen).to(dtype)
        kv = (torch.randn(b, lk, 2, h, d, generator=gen) * 1.5).to(dtype)
        return qkv[:, :, 0], kv[:, :, 0], kv[:, :, 1]
    if layout == "heads":
        q, k, v = (torch.randn(b, h, n, d, generator=gen).to(dtype) for n in (lq, lk, lk))
        return q.transpose(1, 2), (k * 1.5).transpose(1, 2), v.transpose(1, 2)
    return tuple(torch.randn(b, n, h, d, generator=gen).to(dtype) for n in (lq, lk, lk))


def rounding_bound(q, k, v, out, ref) -> torch.Tensor:
    """Per element: how far the kernel may be from the float32 reference (both rounded to q's dtype). With u the
    dtype's unit roundoff and w the exact softmax weights: P rounded to the dtype moves the output by at most
    u sum_j w_j |v_j|; the two outputs' own roundings by u |each|; float32's sums over the head size move each
    logit by D 2^-24 sum_d |q_d k_d| / sqrt(D), and the sums over keys, the row sum and exp2 by (Lk + 32) 2^-22
    relative, each times sum_j w_j |v_j| + |o|."""
    u = torch.finfo(q.dtype).eps / 2
    d = q.shape[-1]
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    w = torch.softmax(qd @ kd.transpose(-1, -2) / d ** 0.5, dim=-1)
    pv_abs = (w @ vd.abs()).transpose(1, 2)
    logit_abs = ((qd.abs() @ kd.abs().transpose(-1, -2)).amax(-1, keepdim=True) / d ** 0.5).transpose(1, 2)
    f32 = logit_abs * d * F32_U + (k.shape[1] + 32) * EXP2_U
    size = torch.maximum(out.double().abs(), ref.double().abs())
    return u * pv_abs + 2 * u * (1 + 2 * u) * size + f32 * (pv_abs + size)


# ----------------------------------------------------------------------------- the interpreted child
def _child() -> None:
    from wan_accel.cache.autotune import get_autotuner
    from wan_accel.kernels import _common
    from wan_accel.kernels import candidates as C
    from wan_accel.kernels import flash_attention as fa
    from wan_accel.model import attention as att
    assert _common.interpreter_usable()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for dtype, d, b, h, lq, lk, bm, bn, layout in CASES:
        q, k, v = make_qkv(getattr(torch, dtype), d, b, h, lq, lk, layout, gen)
        out = fa.flash_attention(q, k, v, config={"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": 4, "num_stages": 1})
        ref = att.attention_reference(q, k, v)
        diff = (out.double() - ref.double()).abs()
        rows.append({"dtype": str(out.dtype), "shape": list(out.shape), "finite": bool(torch.isfinite(out).all()),
                     "contiguous_inputs": q.is_contiguous() and k.is_contiguous(),
                     "max_diff": float(diff.max()),
                     "store_tol": C.tolerance(q.dtype, float(ref.float().abs().max()), att.STORE_ULPS),
                     "within_rounding": bool((diff <= rounding_bound(q, k, v, out, ref)).all())})

    # a call that needs gradients gets SDPA's (the kernel has no backward)
    q, k, v = (t.detach().requires_grad_() for t in make_qkv(torch.float16, 16, 1, 1, 5, 7, "plain", gen))
    with torch.enable_grad():
        graded = fa.flash_attention(q, k, v).sum()
    graded.backward()
    autograd = bool(q.grad is not None and torch.isfinite(q.grad).all())

    # the store's choice among the candidates, the kernel's tiles tuned through the store too (config None)
    tuner = get_autotuner()
    times, ran = {"triton": 1.0, "sdpa": 2.0, "torch": 5.0}, []
    for name in times:
        c = att.AUTO_CANDIDATES[name]
        att.AUTO_CANDIDATES[name] = C.Candidate(c.family, c.name, c.group,
                                                lambda q, k, v, f=c.fn, n=name: (ran.append(n), f(q, k, v))[1],
                                                (lambda dev, dt, hd: None) if name == "triton" else c.problem,
                                                c.summary)
    tuner.timer = lambda fn: (fn(), times[ran[-1]])[1]
    q, k, v = make_qkv(torch.bfloat16, 16, 1, 2, 20, 40, "fused", gen)
    chosen = att.attention(q, k, v)
    entry = tuner.entry(C.store_kernel(att.STORE_OP), att.store_key(q, k))
    tiles = tuner.entry(fa._KERNEL_NAME, f"D=16|q={_common.rows_bucket(20)}|k={_common.rows_bucket(40)}|h=2|bfloat16")
    store = {"ran": ran[-1], "best": entry["best"]["config"], "failed": sorted(entry["failed"]),
             "timed": sorted(entry["timings"]),
             "equal_to_kernel": bool(torch.equal(chosen, fa.flash_attention(q, k, v))),
             "tile_config": (tiles or {}).get("best", {}).get("config")}

    # a kernel with the wrong softmax scale is failed alone by the store's check (other length buckets: new key)
    fa.LOG2E = 1.0
    q, k, v = make_qkv(torch.float16, 16, 1, 2, 70, 90, "fused", gen)
    att.attention(q, k, v)
    entry = tuner.entry(C.store_kernel(att.STORE_OP), att.store_key(q, k))
    wrong = {"ran": ran[-1], "best": entry["best"]["config"], "failed": sorted(entry["failed"]),
             "message": entry["failed"].get("impl=triton", {}).get("error", {}).get("message", "")}
    print(MARK + json.dumps({"cases": rows, "store": store, "wrong": wrong, "autograd": autograd}), flush=True)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    sys.path.insert(0, str(HERE.parent))
    from interpret_child import run_interpreted_child
    return run_interpreted_child(HERE, tmp_path_factory.mktemp("flash_attention_interp"), MARK, timeout=600)


def test_the_kernel_matches_float32_softmax_math_under_the_interpreter(interpreted):
    rows = interpreted["cases"]
    assert len(rows) == len(CASES)
    for row, case in zip(rows, CASES):
        dtype, d, b, h, lq = case[:5]
        assert row["dtype"] == f"torch.{dtype}" and row["shape"] == [b, lq, h, d] and row["finite"], row
        assert row["max_diff"] <= row["store_tol"], row          # what the store's check demands
        assert row["within_rounding"], row                        # and within the rounding it is allowed
        assert row["contiguous_inputs"] == (case[-1] == "plain"), row
    assert interpreted["autograd"]                                # a call that needs gradients gets them (SDPA)


def test_the_store_picks_the_kernel_where_it_is_verified_and_fastest(interpreted):
    store = interpreted["store"]
    assert store["best"] == {"impl": "triton"} and store["failed"] == [], store
    assert store["timed"] == ["impl=sdpa", "impl=torch", "impl=triton"] and store["ran"] == "triton", store
    assert store["equal_to_kernel"], store                       # the call itself ran the kernel
    from wan_accel.kernels import flash_attention as fa
    assert store["tile_config"] in [dict(c) for c in fa.CANDIDATES], store   # its tiles chosen by the store too


def test_a_wrong_kernel_is_failed_alone_by_the_store(interpreted):
    wrong = interpreted["wrong"]
    assert wrong["failed"] == ["impl=triton"] and "wrong numbers" in wrong["message"], wrong
    assert wrong["best"] == {"impl": "sdpa"} and wrong["ran"] == "sdpa", wrong


# ----------------------------------------------------------------------------- in this process (no interpreter)
def test_on_a_cpu_the_store_lists_it_with_the_reason():
    from wan_accel.kernels import flash_attention as fa
    from wan_accel.model import attention as att
    rows = {c.name: why for c, why in att.auto_listing("cpu", torch.bfloat16, 128)}
    assert "triton" in rows and rows["triton"] == "the kernel needs a CUDA GPU"
    names = list(att.AUTO_CANDIDATES)
    assert names.index("triton") > names.index("sdpa")          # never the availability order's pick
    assert "float16/bfloat16" in fa.kernel_problem("cuda", torch.float32, 128)
    assert "head sizes" in fa.kernel_problem("cuda", torch.bfloat16, 96)
    assert "key padding mask" in fa.kernel_problem("cuda", torch.bfloat16, 128, masked=True)


def test_where_it_cannot_run_sdpa_answers_exactly():
    from wan_accel.kernels import _common
    from wan_accel.kernels import flash_attention as fa
    from wan_accel.model import attention as att
    if _common.interpreter_usable():
        pytest.skip("TRITON_INTERPRET is set: the kernel itself runs on this CPU")
    q, k, v = make_qkv(torch.bfloat16, 16, 1, 2, 9, 13, "fused", torch.Generator().manual_seed(1))
    torch.testing.assert_close(fa.flash_attention(q, k, v), att._sdpa(q, k, v), rtol=0, atol=0)
    assert fa.flash_attention(q, k[:, :0], v[:, :0]).abs().max() == 0          # no keys: nothing attended
    with pytest.raises(ValueError, match="q \\[B, Lq, H, D\\]"):
        fa.flash_attention(q, k[..., :8], v[..., :8])


def test_a_failed_doctor_verdict_switches_it_off(monkeypatch):
    from wan_accel.app.doctor import gate
    from wan_accel.app.doctor.core import FEATURES
    from wan_accel.model import attention as att
    from wan_accel.model.tiny import tiny_causal_model
    from wan_accel.nodes.doctor_nodes import FEATURE_CHOICES
    from wan_accel.sampling.runner import FastOptions
    from wan_accel.kernels import _common
    from wan_accel.kernels import flash_attention as fa
    assert "attention.triton" in FEATURES and "attention.triton" in FEATURE_CHOICES
    # a CPU without Triton's interpreter, whatever this process's TRITON_INTERPRET says (tests/test_interpret_pass.py
    # runs this file under it): no fused kernel and no candidate of them to judge
    monkeypatch.setattr(_common, "interpreter_usable", lambda: False)

    class Verdicts:
        def why_off(self, name):
            return "failed: wrong numbers" if name == "attention.triton" else None

    model = tiny_causal_model()
    options, _ = gate.gate_options(model, FastOptions(), doctor=Verdicts())
    assert "attention.triton" not in options.switched_off       # a CPU: not a candidate, nothing to judge
    monkeypatch.setattr(fa, "kernel_problem", lambda *a, **kw: None)       # a GPU where the kernel runs
    options, lines = gate.gate_options(model, FastOptions(), doctor=Verdicts())
    assert "attention.triton" in options.switched_off and "attention.triton" in lines[0]
    off = att.auto_request(options.switched_off)
    assert off == ("auto", "triton")
    rows = {c.name: why for c, why in att.auto_listing("cpu", torch.bfloat16, 128, off[1:])}
    assert rows["triton"] == att.SWITCHED_OFF


def test_bench_attention_lists_it_among_the_exact_candidates():
    from wan_accel.bench.attention import measure
    rows = {r["candidate"]: r for r in measure(8, 12, 1, 2, 16, torch.bfloat16, torch.device("cpu"))}
    assert rows["triton"]["kind"] == "exact" and rows["triton"]["status"] == "unavailable", rows["triton"]
    assert rows["triton"]["why"] == "the kernel needs a CUDA GPU"


def test_the_doctor_says_why_it_is_not_available_on_a_cpu(tmp_path):
    from wan_accel.app.doctor.core import doctor_for
    from wan_accel.cache import LimitCache
    doc = doctor_for("cpu", torch.bfloat16, 128, cache=LimitCache(tmp_path / "limits.json"), heads=2, tokens=32)
    assert doc.unavailable("attention.triton")[0] == "the kernel needs a CUDA GPU"


# ----------------------------------------------------------------------------- compiled for the GPUs it is meant for
SHARED_LIMIT = {89: 101376, 90: 232448}     # the most shared memory one block may use: Ada 99 KiB, Hopper 227 KiB
STRIDES = ("q_sb", "q_sm", "q_sh", "k_sb", "k_sn", "k_sh", "v_sb", "v_sn", "v_sh", "o_sb", "o_sm", "o_sh")


@pytest.mark.parametrize("arch", [90, 89])
def test_the_kernel_compiles_for_hopper_and_ada_within_shared_memory(tmp_path, monkeypatch, arch):
    from ptx_build import build_ptx
    from wan_accel.kernels import _common
    from wan_accel.kernels import flash_attention as fa
    if _common.interpret_enabled():
        pytest.skip("TRITON_INTERPRET is set: compiled-mode checks need it unset")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    hopper = arch == 90
    fits = [c for c in fa.CANDIDATES if fa._smem(c, 128, 2, hopper) <= SHARED_LIMIT[arch]]
    assert fits[0] == fa.CANDIDATES[0] if hopper else len(fits) >= 4     # Hopper: the default 128 x 128 fits
    cfg = fits[0]                                                        # the largest that fits this GPU
    sig = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "Lq": "i32", "Lk": "i32", "H": "i32",
           "qk_scale": "fp32", **{s: "i64" for s in STRIDES}}
    consts = {"HEAD": 128, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "EMULATE_BF16": False}
    # as a launch on the pack's tensors: pointers and strides multiples of 16
    kernel = build_ptx(fa._flash_attn_kernel, sig, consts, arch, cfg["num_warps"], cfg["num_stages"],
                       aligned=("Q", "K", "V", "O") + STRIDES)
    ptx = kernel.asm["ptx"]
    assert ".entry" in ptx and "bf16" in ptx
    assert ("wgmma" in ptx) if hopper else ("mma.sync" in ptx)          # the tensor cores of that GPU
    assert "cp.async" in ptx                                             # the K/V loads are pipelined
    assert kernel.metadata.shared <= fa._smem(cfg, 128, 2, hopper) <= SHARED_LIMIT[arch]


if __name__ == "__main__" and "--child" in sys.argv:
    _child()
