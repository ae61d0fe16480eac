"""The fp8 attention mode's KV-cache write in one Triton kernel: the fused form of ``fp8_attention.quantize_smoothed``
followed by the cache copy's slot writes (``model/kv_cache.py``, ``Fp8Shadow``).

For rows of k, v [B, rows, H, D] (bfloat16, float16 or float32, any strides), the layer's smoothing vectors
mk, mv [B, H, D] (float32) and the slot of every row ``index`` [rows] (int64), one program takes BLOCK_R rows of
one (batch, head), reads their keys and values once and writes straight into the cache copy:

    x = k - mk (float32)   step = max(max_d |x|, INT8_TINY) / 127      key codes  round_half_even(x / step), +-127
    y = v - mv (float32)   scale = max(max_d |y|, TINY) / 448          value codes e4m3_rtne(clamp(y / scale, +-448))

the int8 key codes at [b, slot, h, :], the steps and scales at [b, slot, h], the e4m3 value codes keys-fastest at
[b, h, :, slot]. Both divisions of each are ``div_rn`` (compiled Triton's ``/`` on float32 is not correctly
rounded), the widening to float32 and the subtraction are those of the torch ops, the e4m3 conversion rounds to
nearest even (``cvt.rn.satfinite``), and the key codes are rounded half to even by adding and subtracting 1.5 * 2^23
(exact for |x| <= 127): codes, steps and scales equal the torch definition's bit for bit (the fp8 quantize kernel's
numerics for the values, ``int8_tokens`` for the keys). The torch definition takes about ten kernels (casts, mean
subtraction, maxima, divisions, rounding, the e4m3 row quantize, four index copies and the values' permute):
predicted ~0.14 ms per write of a 1.3B chunk (K and V [1, 4680, 12, 128] bf16, about 78 bytes moved per element)
against ~15 us for this one pass (docs/benchmarks.md); not measured. Under Triton's CPU interpreter (tests) its bfloat16 widening and e4m3 cast are replaced by
exact bit arithmetic (``fp8_quant.bf16_bits_to_f32`` / ``e4m3_grid``). Finite inputs.
"""
from __future__ import annotations

import torch

from . import _common, registry
from .fp8_attention import INT8_TINY, LEVELS
from .fp8_linear import FP8_MAX, TINY
from ._tiles import head_rows, tl  # None without triton: only the torch path exists

NAME = "fp8_kv_write"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CAPABILITY = (8, 9)                        # e4m3 conversions in hardware: Ada, Hopper and later
ROUND_INT = 12582912.0                     # 1.5 * 2^23: x + it - it rounds |x| < 2^22 to an integer, ties to even
CANDIDATES = tuple({"BLOCK_R": r, "num_warps": w} for r, w in ((8, 2), (16, 4), (32, 4), (64, 4), (64, 8)))

if tl is not None:
    from .fp8_quant import bf16_bits_to_f32, e4m3_grid

    @_common.triton_module().jit
    def _smoothed_rows(X, M, x_base, m_base, r64, d64, x_sr, x_sd, ok, d_ok, BF16_BITS: tl.constexpr):
        # rows [BLOCK_R, HEAD] of x less their mean vector in float32 (0 outside ``ok``), and each row's max |.|
        x = tl.load(X + x_base + r64[:, None] * x_sr + d64[None, :] * x_sd, mask=ok, other=0)
        if BF16_BITS:
            x = bf16_bits_to_f32(x)
        m = tl.load(M + m_base + d64, mask=d_ok, other=0.0)
        x = tl.where(ok, x.to(tl.float32) - m[None, :], 0.0)
        return x, tl.max(tl.abs(x), 1)

    def _kv_quant_kernel(K, V, MK, MV, IDX, K8, SK, V8, SV, rows, H, D,
                         k_sb, k_sr, k_sh, k_sd, v_sb, v_sr, v_sh, v_sd, mk_sb, mk_sh, mv_sb, mv_sh,
                         k8_sb, k8_ss, k8_sh, sk_sb, sk_ss, sk_sh, v8_sb, v8_sh, v8_sd, sv_sb, sv_ss, sv_sh,
                         k_tiny, v_tiny, HEAD: tl.constexpr, BLOCK_R: tl.constexpr, LEVELS: tl.constexpr,
                         FP8_MAX: tl.constexpr, ROUND_INT: tl.constexpr, ROUND_FP8: tl.constexpr,
                         BF16_BITS: tl.constexpr):
        b, h, r64, r_ok = head_rows(rows, H, BLOCK_R)
        d = tl.arange(0, HEAD)
        d_ok = d < D
        ok = r_ok[:, None] & d_ok[None, :]
        d64 = d.to(tl.int64)
        slot = tl.load(IDX + r64, mask=r_ok, other=0)
        # keys: int8 codes and steps (int8_tokens of k - mk)
        x, amax = _smoothed_rows(K, MK, b * k_sb + h * k_sh, b * mk_sb + h * mk_sh, r64, d64, k_sr, k_sd, ok, d_ok,
                                 BF16_BITS)
        step = tl.math.div_rn(tl.maximum(amax, k_tiny), LEVELS)
        x = tl.minimum(tl.maximum(tl.math.div_rn(x, step[:, None]), -LEVELS), LEVELS)
        x = (x + ROUND_INT) - ROUND_INT
        tl.store(K8 + b * k8_sb + h * k8_sh + slot[:, None] * k8_ss + d64[None, :], x.to(tl.int8), mask=ok)
        tl.store(SK + b * sk_sb + h * sk_sh + slot * sk_ss, step, mask=r_ok)
        # values: e4m3 codes (keys-fastest) and scales (the fp8 row quantize of v - mv)
        y, amax = _smoothed_rows(V, MV, b * v_sb + h * v_sh, b * mv_sb + h * mv_sh, r64, d64, v_sr, v_sd, ok, d_ok,
                                 BF16_BITS)
        scale = tl.math.div_rn(tl.maximum(amax, v_tiny), FP8_MAX)
        y = tl.minimum(tl.maximum(tl.math.div_rn(y, scale[:, None]), -FP8_MAX), FP8_MAX)
        if ROUND_FP8:
            y = e4m3_grid(y)
        tl.store(V8 + b * v8_sb + h * v8_sh + d64[None, :] * v8_sd + slot[:, None],
                 y.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=ok)
        tl.store(SV + b * sv_sb + h * sv_sh + slot * sv_ss, scale, mask=r_ok)


_KERNEL_NAME = _common.kernel_name(NAME, _kv_quant_kernel) if tl is not None else NAME
FAMILY = "kv_write.fp8"
registry.pack_family(FAMILY, "the KV cache's fp8 copy, written as keys/values enter it (per call: problem)",
                     _common.triton_problem, capability=CAPABILITY)


def problem(k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the kernel does not write k, v [B, rows, H, D] (None: it does)."""
    if tl is None or not _common.use_triton(k, v):
        return "no Triton for this device"
    if k.dtype not in DTYPES or v.dtype != k.dtype:
        return f"k and v must share one of {', '.join(_common.dtype_name(d) for d in DTYPES)}"
    if k.dim() != 4 or k.shape != v.shape:
        return "k and v must be [B, rows, H, D] of one shape"
    if k.numel() == 0:
        return "nothing to write"
    why = registry.walk(FAMILY, k.device)[1]["pack"]       # e4m3 conversions (SM 8.9+); an override
    if why:
        return why
    if _common.needs_autograd(k, v):
        return "autograd tracks k or v"
    return None


def write(k: torch.Tensor, v: torch.Tensor, k_mean: torch.Tensor, v_mean: torch.Tensor, index: torch.Tensor,
          k8: torch.Tensor, sk: torch.Tensor, v8: torch.Tensor, sv: torch.Tensor, config: dict | None = None) -> bool:
    """Quantize k, v [B, rows, H, D] smoothed by k_mean, v_mean [B, H, D] into the slots ``index`` [rows] of a cache
    copy: int8 key codes k8 [B, cap, H, D] (last dimension contiguous), steps sk and scales sv [B, cap, H] (float32),
    e4m3 value codes v8 [B, H, D, cap] (slots contiguous). ``config``: an explicit one (tests), else the operator
    store's. False where the kernel does not run for these tensors or every config failed (the caller then runs
    the torch ops); nothing is written then."""
    if problem(k, v) is not None or k8.stride(-1) != 1 or v8.stride(-1) != 1:
        return False
    k_mean, v_mean = k_mean.float().contiguous(), v_mean.float().contiguous()
    index = index.to(torch.int64)
    b, rows, h, d = k.shape
    interp = _common.interpret_enabled()
    bits = interp and k.dtype == torch.bfloat16
    k_in, v_in = (k.view(torch.int16), v.view(torch.int16)) if bits else (k, v)
    head = _common.next_pow2(d)

    def launch(cfg: dict):
        _common.run_kernel(_kv_quant_kernel, (_common.cdiv(rows, cfg["BLOCK_R"]), b * h), k,
                           k_in, v_in, k_mean, v_mean, index, k8, sk, v8, sv, rows, h, d,
                           *k.stride(), *v.stride(), k_mean.stride(0), k_mean.stride(1), v_mean.stride(0),
                           v_mean.stride(1), k8.stride(0), k8.stride(1), k8.stride(2), *sk.stride(),
                           v8.stride(0), v8.stride(1), v8.stride(2), *sv.stride(), INT8_TINY, TINY,
                           HEAD=head, BLOCK_R=cfg["BLOCK_R"], LEVELS=float(LEVELS), FP8_MAX=float(FP8_MAX),
                           ROUND_INT=ROUND_INT, ROUND_FP8=interp, BF16_BITS=bits, num_warps=cfg["num_warps"])

    key = f"D={d}|rows={_common.rows_bucket(rows)}|h={h}|{_common.dtype_name(k)}"
    return _common.launched(_KERNEL_NAME, key, CANDIDATES, launch, config, k)
