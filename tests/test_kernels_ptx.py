"""The kernels compile for real GPUs (PTX for sm_80 / sm_90, no GPU needed), and the shared-memory estimate
the autotuner prunes with is an upper bound of what the compiled kernel uses."""
from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
compiler = pytest.importorskip("triton.compiler")
backends = pytest.importorskip("triton.backends.compiler")

from wan_accel.kernels import _common, norm_modulate, qk_norm_rope, residual, residual_layernorm, rms_norm  # noqa: E402

if _common.interpret_enabled():
    pytest.skip("TRITON_INTERPRET is set: compiled-mode checks need it unset", allow_module_level=True)

CASES = [
    ("layernorm_modulate", norm_modulate, "_lnmod_kernel",
     {"x_ptr": "*bf16", "shift_ptr": "*fp32", "scale_ptr": "*fp32", "out_ptr": "*bf16", "n_rows": "i32",
      "D": "i32", "L": "i32", "tokens_per_frame": "i32", "mod_bstride": "i32", "eps": "fp32"},
     {"YBLOCK": 16, "RBLOCK": 128, "num_warps": 16}, 80),
    ("rmsnorm_rope", qk_norm_rope, "_rmsrope_kernel",
     {"x_ptr": "*bf16", "w_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": "*bf16",
      "n_rows": "i32", "D": "i32", "L": "i32", "half_hd": "i32", "eps": "fp32", "x_row_stride": "i32"},
     {"YBLOCK": 16, "RBLOCK": 128, "num_warps": 16}, 90),
    ("rmsnorm", rms_norm, "_rms_kernel",
     {"x_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*bf16", "n_rows": "i32", "D": "i32", "eps": "fp32",
      "x_row_stride": "i32"},
     {"YBLOCK": 16, "RBLOCK": 128, "num_warps": 16}, 90),
    ("gated_residual", residual, "_gres_kernel",
     {"x_ptr": "*bf16", "y_ptr": "*bf16", "g_ptr": "*fp32", "out_ptr": "*bf16", "n_rows": "i32", "D": "i32",
      "L": "i32", "tokens_per_frame": "i32", "g_bstride": "i32"},
     {"YBLOCK": 16, "XBLOCK": 128, "num_warps": 8}, 90),
]


# one-pass tiles: the widest row class with its most rows and its most warps (the split/join of RMSNorm+RoPE's
# row uses shared memory growing with the warps)
_WIDEST = [c for c in _common.row_candidates(_common.ROW_WIDTH_LIMIT) if c.get("ROW")]
CASES += [(f"{name}-row", module, fn_name, sig, cfg, 90) for name, module, fn_name, sig, _cfg, _arch in CASES[:3]
          for cfg in (max(_WIDEST, key=lambda c: c["YBLOCK"]), max(_WIDEST, key=lambda c: c["num_warps"]))]
# the fused residual + LayerNorm in its two uses (gated + affine; plain + modulation), looped and one-pass
_RESNORM_SIG = {"x_ptr": "*bf16", "y_ptr": "*bf16", "g_ptr": "*fp32", "w_ptr": "*bf16", "b_ptr": "*bf16",
                "sh_ptr": "*fp32", "sc_ptr": "*fp32", "xo_ptr": "*bf16", "ho_ptr": "*bf16", "n_rows": "i32", "D": "i32",
                "L": "i32", "tokens_per_frame": "i32", "mod_bstride": "i32", "eps": "fp32"}
_NORM3 = {"GATE": True, "AFFINE": True, "BIAS": True, "MODULATE": False}
_NORM2 = {"GATE": False, "AFFINE": False, "BIAS": False, "MODULATE": True}
CASES += [(f"residual_norm-{use}", residual_layernorm, "_resnorm_kernel", _RESNORM_SIG, dict(cfg, **flags), 90)
          for use, flags in (("norm3", _NORM3), ("norm2", _NORM2))
          for cfg in ({"YBLOCK": 16, "RBLOCK": 128, "num_warps": 16}, max(_WIDEST, key=lambda c: c["YBLOCK"]),
                      {"ROW": 1, "YBLOCK": 4, "RBLOCK": 2048, "num_warps": 8})]


@pytest.mark.parametrize("name,module,fn_name,sig,cfg,arch", CASES,
                         ids=[f"{c[0]}-Y{c[4]['YBLOCK']}-R{c[4].get('RBLOCK', c[4].get('XBLOCK'))}-w{c[4]['num_warps']}"
                              for c in CASES])
def test_kernel_compiles_to_ptx_within_estimate(tmp_path, monkeypatch, name, module, fn_name, sig, cfg, arch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a real compile, not a cache hit
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    consts = {k: v for k, v in cfg.items() if k != "num_warps"}
    consts["ROUND_BF16"] = False
    if name != "gated_residual":
        consts["ROW"] = bool(cfg.get("ROW"))
    signature = dict(sig, **{k: "constexpr" for k in consts})
    src = compiler.ASTSource(fn=triton.jit(getattr(module, fn_name)), signature=signature, constexprs=consts)
    try:
        kernel = triton.compile(src, target=backends.GPUTarget("cuda", arch, 32),
                                options={"num_warps": cfg["num_warps"]})
    except RuntimeError as exc:  # no ptxas / NVIDIA backend in this triton build
        if "ptxas" in str(exc).lower() or "backend" in str(exc).lower():
            pytest.skip(f"cannot build for CUDA here: {exc}")
        raise
    assert ".entry" in kernel.asm["ptx"]
    assert kernel.metadata.shared <= module._smem(cfg), kernel.metadata.shared
