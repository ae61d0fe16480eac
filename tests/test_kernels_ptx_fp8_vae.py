"""The fp8 attention kernel and the VAE's norm+SiLU kernel compile for the GPUs they are meant for (PTX for sm_89 /
sm_90, no GPU needed): a Triton front-end or layout error shows here, before any GPU run."""
from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
compiler = pytest.importorskip("triton.compiler")
backends = pytest.importorskip("triton.backends.compiler")

from ptx_build import build_ptx  # noqa: E402
from wan_accel.kernels import _common, fp8_attention, vae_norm  # noqa: E402

if _common.interpret_enabled():
    pytest.skip("TRITON_INTERPRET is set: compiled-mode checks need it unset", allow_module_level=True)

STRIDES = ("q_sb", "q_sm", "q_sh", "k_sb", "k_sn", "k_sh", "sk_sb", "sk_sn", "sk_sh",
           "v_sb", "v_sn", "v_sh", "v_sd", "sv_sb", "sv_sn", "sv_sh", "mv_sb", "mv_sh", "o_sb", "o_sm", "o_sh")


# the most shared memory one block may use: Ada (sm_89) 99 KiB, Hopper (sm_90) 227 KiB
SHARED_LIMIT = {89: 101376, 90: 232448}


def _compile(fn, signature: dict, consts: dict, arch: int, num_warps: int, num_stages: int = 3):
    return build_ptx(fn, signature, consts, arch, num_warps, num_stages)


def _smem_order(c: dict) -> tuple:
    return (c["BLOCK_M"] * c["num_stages"], c["num_stages"], c["num_warps"])


# The configs differ only in tile sizes: the instruction checks hold for any of them, and shared memory grows with
# BLOCK_M and the stages, so the config needing the most must fit each GPU (then every smaller one does)
LARGEST = max(fp8_attention.CANDIDATES, key=_smem_order)
PTX_CASES = [(89, LARGEST), (90, LARGEST)]


@pytest.mark.parametrize("arch, cfg", PTX_CASES,
                         ids=["{}-m{BLOCK_M}w{num_warps}s{num_stages}".format(a, **c) for a, c in PTX_CASES])
def test_fp8_attention_kernel_compiles(tmp_path, monkeypatch, arch, cfg):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    sig = {"Q": "*bf16", "K8": "*i8", "SK": "*fp32", "V8": "*fp8e4nv", "SV": "*fp32", "MV": "*fp32", "O": "*bf16", "Lq": "i32", "Lk": "i32", "H": "i32", "qk_scale": "fp32", **{s: "i64" for s in STRIDES}}
    consts = {"HEAD": 128, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": fp8_attention.TILE, "EMULATE_RTNE": False,
              "ROUND_BF16": False}
    kernel = _compile(fp8_attention._fp8_attn_kernel, sig, consts, arch, cfg["num_warps"], cfg["num_stages"])
    ptx = kernel.asm["ptx"]
    assert ".entry" in ptx
    # both products on the 8-bit tensor cores (Hopper: wgmma; Ada: mma.sync), Q . K over int8 into int32 and
    # P . V over e4m3, not widened to 16 bits
    mma = "wgmma.mma_async" if arch == 90 else "mma.sync.aligned"
    products = [line for line in ptx.splitlines() if mma in line]
    assert any(".s32.s8.s8" in line for line in products), "Q . K is not an int8 tensor-core product"
    assert any(".e4m3.e4m3" in line for line in products), "P . V is not an e4m3 tensor-core product"
    assert "div.rn.f32" in ptx                          # Q's steps and codes by IEEE divisions, as int8_tokens
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx          # P to e4m3: round to nearest even, as the torch version
    assert kernel.metadata.shared <= SHARED_LIMIT[arch]   # so every candidate can launch on that GPU


@pytest.mark.parametrize("whole", [True, False])
def test_vae_norm_silu_kernel_compiles(tmp_path, monkeypatch, whole):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    sig = {"x_ptr": "*bf16", "g_ptr": "*bf16", "out_ptr": "*bf16", "C": "i32", "S": "i32", "x_bstride": "i64",
           "x_cstride": "i64", "x_tstride": "i64", "out_bstride": "i64", "out_cstride": "i64", "out_tstride": "i64",
           "scale": "fp32", "eps": "fp32"}
    consts = {"PBLOCK": 64, "CBLOCK": 128 if whole else 32, "WHOLE": whole, "SILU": True, "ROUND_BF16": False}
    kernel = _compile(vae_norm._norm_silu_kernel, sig, consts, 90, 4)
    assert ".entry" in kernel.asm["ptx"]
