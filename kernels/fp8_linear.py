"""Dynamic fp8 linear layers: the numerics of the opt-in ``linear: fp8`` mode, and the error it may make.

A weight ``W`` [N, K] is quantized once to ``float8_e4m3fn`` with one float32 scale per output row,
``s_w[n] = amax_k |W[n, k]| / 448`` (448: e4m3's largest finite value). Every call quantizes its input ``x``
[M, K] the same way per row (per token), ``s_x[m] = amax_k |x[m, k]| / 448``, with the scale computed on the
device (no host sync, so CUDA graphs capture it), and computes

    y = (q_x @ q_w^T) * s_x * s_w + bias,        q_x = e4m3(x / s_x),  q_w = e4m3(W / s_w)

i.e. ``(x_q * s_x) @ (w_q * s_w)^T + bias``. Two implementations of that one computation:

* ``scaled_mm``: ``torch._scaled_mm`` with row-wise scales (``scale_a`` [M, 1], ``scale_b`` [1, N], float32) and
  a bfloat16 output, on CUDA GPUs with fp8 tensor cores (SM 8.9+: Ada, Hopper and newer) where K and N are
  multiples of 16 (the weight is passed column-major, as the kernel wants). comfy-kitchen's ``scaled_mm_v2``
  is not used: it takes per-tensor scales only (its own kernels) and otherwise forwards to torch.
* ``emulated``: the same quantization, the products of the e4m3 codes summed in float32 (exact products: two
  4-bit significands), scaled, the bias added in float32, the result rounded to the input's dtype. It runs
  everywhere (a CPU included): CPU tests check the real numerics, not their speed.

The input's codes and scales come from ``quantize_input``: on CUDA GPUs with SM 8.9+ (and on a CPU under
TRITON_INTERPRET=1) one fused Triton kernel (``kernels/fp8_quant.py``) that reads each row once and writes its codes
and scale, equal bit for bit to ``quantize_rows``, the torch definition used elsewhere. Where one input feeds
several layers (separate q/k/v, the prompt's cross-attention k and v) the caller quantizes it once and passes the
pair (``quantized=``) to each layer.

A zero row gets a scale of ``TINY / 448`` (never 0), so its codes are 0 and its output is the bias, never NaN.
``error_bound`` states the tolerance of both against exact real arithmetic; its docstring derives it.
"""
from __future__ import annotations

import math

import torch

from . import _common, fp8_quant, registry
from ._common import is_compiling

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                              # e4m3fn's largest finite value
UNIT_ROUNDOFF = 2.0 ** -4                    # 3 mantissa bits: half the spacing at 1
SUBNORMAL_HALF_STEP = 2.0 ** -10             # half the spacing of e4m3's subnormals (2^-9)
TINY = FP8_MAX * torch.finfo(torch.float32).tiny   # smallest row maximum given its own scale (scale >= tiny)
MM_CAPABILITY = (8, 9)                       # fp8 tensor cores: Ada, Hopper and later
MM_MULTIPLE = 16                             # torch._scaled_mm: K and N multiples of 16
MM_OUT = torch.bfloat16                      # row-wise scaled matmuls write bfloat16
TILE_K = 128                                 # the scaled matmul moves its partial sums into float32 every 128 k
TENSOR_CORE_U = 2.0 ** -14                   # ... which the fp8 tensor cores keep to about 14 bits before that
SLACK = 2.0 ** -20                           # float32 division, clamp and scale rounding (see error_bound)
PATHS = ("scaled_mm", "emulated")
_STATE: dict = {"failed": {}}


def row_scales(t: torch.Tensor) -> torch.Tensor:
    """float32 [rows, 1]: max|row| / 448, at least TINY / 448 (a zero row gets codes 0, not NaN)."""
    # |t| and its maximum are exact in t's own dtype: one float32 value per row, no float32 copy of the rows
    return _common.divide(t.abs().amax(dim=-1, keepdim=True).float().clamp_min(TINY), FP8_MAX)   # as the kernels


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes [rows, K], float32 scales [rows, 1]) of a 2-D tensor, one scale per row."""
    scale = row_scales(t)
    codes = (t / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)      # the division promotes to float32 itself
    return codes, scale


def quantize_tensor(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes, float32 scale of shape ()) of a whole tensor with one scale: max|t| / 448, at least
    TINY / 448 (the per-tensor form of ``quantize_rows``; what a scaled fp8 checkpoint stores per weight)."""
    scale = _common.divide(t.detach().abs().amax().float().clamp_min(TINY), FP8_MAX)
    codes = (t.detach() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return codes.contiguous(), scale.reshape(())


def quantize_input(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows`` of a layer's input [M, K], in one fused kernel where it runs (``kernels/fp8_quant.py``:
    CUDA SM 8.9+, or a CPU under TRITON_INTERPRET=1; the same codes and scales bit for bit), else in torch. Inside
    torch.compile it is one opaque op (``torch.ops.wan_accel.fp8_quantize_rows``)."""
    if FP8 != fp8_quant.CODES or fp8_quant.problem(x2d) is not None:
        return quantize_rows(x2d)
    return _common.call_op(_QUANT_OP, _quantize_eager, x2d)


def _quantize_eager(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if fp8_quant.problem(x2d) is None:
        out = fp8_quant.run_triton(x2d, FP8_MAX, TINY)
        if out is not None:
            return out
    return quantize_rows(x2d)


def _quantize_fake(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(x2d.shape, dtype=fp8_quant.CODES, device=x2d.device),
            torch.empty((x2d.shape[0], 1), dtype=torch.float32, device=x2d.device))


_QUANT_OP = _common.register_op(fp8_quant.NAME, _quantize_eager, _quantize_fake)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight [N, K], contiguous; float32 scales [N]) of a linear layer's weight [N, K]."""
    codes, scale = quantize_rows(weight.detach())
    return codes.contiguous(), scale.reshape(-1).contiguous()


FAMILY = "linear.fp8"
registry.register(FAMILY, "the opt-in fp8 linear layers' matmul (per layer size: mm_problem)", [
    registry.Candidate(FAMILY, "scaled_mm", "torch", summary="torch._scaled_mm, row-wise scales", devices=("cuda",),
                       capability=MM_CAPABILITY),
    registry.Candidate(FAMILY, "emulated", "torch", summary="emulated in float32")])


def mm_problem(device, in_features: int, out_features: int) -> str | None:
    """Why the scaled matmul does not run a layer of this size on ``device`` (None: it does)."""
    device = torch.device(device)
    why = registry.walk(FAMILY, device)[1]["scaled_mm"]
    if why:
        return f"scaled_mm {why} (emulated{' in float32' if device.type != 'cuda' else ''})"
    if in_features % MM_MULTIPLE or out_features % MM_MULTIPLE:
        return f"{in_features}x{out_features} is not a multiple of {MM_MULTIPLE} (emulated)"
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no _scaled_mm (emulated)"
    failed = _STATE["failed"].get((device.index, in_features, out_features))
    if failed:
        return f"torch._scaled_mm failed here ({failed}; emulated)"
    return None


def path_for(device, in_features: int, out_features: int) -> tuple[str, str]:
    """('scaled_mm' | 'emulated', why) of a layer of this size on ``device``."""
    why = mm_problem(device, in_features, out_features)
    return ("scaled_mm", "torch._scaled_mm, row-wise scales") if why is None else ("emulated", why)


def emulated(x2d: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias=None,
             out_dtype: torch.dtype | None = None, quantized: tuple | None = None) -> torch.Tensor:
    """The fp8 linear in float32 (module doc): x2d [M, K], weight_q [N, K] e4m3, weight_scale [N]; ``quantized``:
    x2d's (codes, scales) from ``quantize_input`` where the caller shares them between layers."""
    q, s = quantize_input(x2d) if quantized is None else quantized
    y = (q.float() @ weight_q.float().t()) * s * weight_scale.reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x2d.dtype)


def scaled_mm(x2d: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias=None,
              quantized: tuple | None = None) -> torch.Tensor:
    """``torch._scaled_mm`` of the per-row quantized input (``quantized``, or quantized here) and weight;
    bfloat16 [M, N]."""
    q, s = quantize_input(x2d) if quantized is None else quantized
    out = torch._scaled_mm(q, weight_q.t(), scale_a=s, scale_b=weight_scale.reshape(1, -1),
                           bias=None if bias is None else bias.to(MM_OUT), out_dtype=MM_OUT)
    return out[0] if isinstance(out, tuple) else out


def fp8_linear(x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias=None,
               quantized: tuple | None = None) -> torch.Tensor:
    """y [..., N] in x's dtype for x [..., K]: the scaled matmul where it runs, else the emulation. A scaled
    matmul that raises is remembered for this size and device (it is emulated from then on). ``quantized``: x's
    (codes [M, K], scales [M, 1]) from ``quantize_input``, where one input feeds several layers (quantized once)."""
    n, k = weight_q.shape
    x2d = x.reshape(-1, k)
    quantized = quantize_input(x2d) if quantized is None else quantized
    if mm_problem(x.device, k, n) is None:
        if is_compiling():
            out = scaled_mm(x2d, weight_q, weight_scale, bias, quantized)
        else:
            try:
                out = scaled_mm(x2d, weight_q, weight_scale, bias, quantized)
            except (RuntimeError, TypeError, ValueError, NotImplementedError) as exc:
                _STATE["failed"][(x.device.index, k, n)] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                out = None
        if out is not None:
            return out.to(x.dtype).reshape(*x.shape[:-1], n)
    return emulated(x2d, weight_q, weight_scale, bias, x.dtype, quantized).reshape(*x.shape[:-1], n)


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the spacing of ``dtype`` at 1 (2**-8 bf16, 2**-11 fp16, 2**-24 fp32); 0 for float64 (exact here)."""
    return 0.0 if dtype == torch.float64 else float(torch.finfo(dtype).eps) / 2


def underflow(dtype: torch.dtype) -> float:
    """Half the smallest subnormal of ``dtype``: the absolute error of one rounding below its normal range."""
    if dtype == torch.float64:
        return 0.0
    info = torch.finfo(dtype)
    return float(info.tiny) * float(info.eps) / 2


def _gamma(n: int, u: float) -> float:
    """n u / (1 - n u): the worst relative error of a sum of n + 1 terms rounded with unit roundoff u."""
    nu = n * u
    if nu >= 1:
        raise ValueError(f"no rounding bound for {n} additions at unit roundoff {u:g}")
    return nu / (1 - nu)


def accumulation_error(k: int, path: str = "emulated") -> float:
    """Relative bound (to sum |terms|) on the rounding of a K-term dot product of e4m3 products: float32 for the
    emulation; for the scaled matmul, tiles of TILE_K terms kept to TENSOR_CORE_U, then summed in float32."""
    if path == "emulated":
        return _gamma(max(k - 1, 0), unit_roundoff(torch.float32))
    if path != "scaled_mm":
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    tile = min(k, TILE_K)
    inner = _gamma(max(tile - 1, 0), TENSOR_CORE_U)
    outer = _gamma(max(math.ceil(k / TILE_K) - 1, 0), unit_roundoff(torch.float32))
    return inner + outer + inner * outer


def output_roundings(path: str, dtype: torch.dtype) -> tuple:
    """The dtypes the float32 result is rounded to on its way to ``dtype``."""
    if path == "emulated":
        return (dtype,)
    return (MM_OUT,) + ((dtype,) if dtype not in (MM_OUT, torch.float32) else ())


def error_bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                path: str = "emulated") -> torch.Tensor:
    """Per-element bound on |fp8_linear(x) - (x W^T + b)| for x [..., K], W [N, K] (exact real arithmetic on the
    given x, W, b; ``path`` 'emulated' or 'scaled_mm'). Returns float64 [..., N].

    Derivation. u = 2^-4 is e4m3's unit roundoff (3 mantissa bits). With s the row's scale, a value's code is
    q = e4m3(fl(x / s)) clamped to +-448, and it stands for x^ = s q. In e4m3's normal range the rounding is
    relative (<= u |x / s|), in its subnormal range absolute (<= 2^-10, half the subnormal step 2^-9); the float32
    division and the clamp (s = fl(amax / 448) may be a rounding below amax / 448) add under 2^-21 relative, so
        |x^ - x| <= u' |x| + a,     u' = u + 2^-20 (SLACK),   a = 2^-10 s.
    Per product, with x^ = x + dx and w^ = w + dw,
        |x^ w^ - x w| <= |dx||w| + |x||dw| + |dx||dw| <= (2u' + u'^2)|x||w| + (1 + u')(a_x |w| + a_w |x|) + a_x a_w,
    the brief form (2u + u^2)|x_k||w_k| plus the terms of the subnormal range, summed over k:
        E_q = (2u' + u'^2) A + (1 + u')(a_x ||w||_1 + a_w ||x||_1) + K a_x a_w,     A = sum_k |x_k| |w_k|.
    The products of two e4m3 codes are exact in float32; their sum is not: at most g B with B = sum_k |x^_k w^_k|
    and g from ``accumulation_error`` (float32: K u32 / (1 - K u32); the scaled matmul: tiles of 128 terms kept to
    about 14 bits, then float32). Multiplying by s_x and s_w and adding the bias in float32 add 3 u32 (B + |b|),
    and 3 eta32 where a result falls below float32's normal range (eta: half the dtype's smallest subnormal); a
    bias the scaled matmul takes in bfloat16 adds u_bf16 |b|. So the float32 result z is within
        E_1 = (E_q + g B + 3 u32 (B + |b|) + 3 eta32 [+ u_bf16 |b|]) (1 + SLACK)
    of y = x W^T + b, and each rounding of z to an output dtype (the input's dtype; the scaled matmul writes
    bfloat16, then the input's dtype) makes E <- E (1 + u_o) + u_o |y| + eta_o. A bound on the worst case: errors
    of random inputs stay far below it (a third or less), while inputs placed half a step between two codes reach 85 %
    of it (tests/test_fp8_linear.py)."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    k = weight.shape[-1]
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {k}")
    x2 = x.reshape(-1, k)
    xd, wd = x2.double(), weight.double()
    up = UNIT_ROUNDOFF + SLACK
    a_x = row_scales(x2).double() * SUBNORMAL_HALF_STEP                      # [M, 1]
    a_w = row_scales(weight).double().reshape(1, -1) * SUBNORMAL_HALF_STEP  # [1, N]
    big_a = xd.abs() @ wd.abs().t()
    e_q = (2 * up + up * up) * big_a + (1 + up) * (a_x * wd.abs().sum(-1).reshape(1, -1)
                                                  + a_w * xd.abs().sum(-1, keepdim=True)) + k * a_x * a_w
    qx, sx = quantize_rows(x2)
    qw, sw = quantize_rows(weight)
    big_b = (qx.double().abs() @ qw.double().abs().t()) * sx.double() * sw.double().reshape(1, -1)
    b = torch.zeros(1, 1, dtype=torch.float64, device=x.device) if bias is None else bias.double().abs().reshape(1, -1)
    u32 = unit_roundoff(torch.float32)
    err = e_q + accumulation_error(k, path) * big_b + 3 * u32 * (big_b + b) + 3 * underflow(torch.float32)
    if path == "scaled_mm" and bias is not None and bias.dtype != MM_OUT:
        err = err + unit_roundoff(MM_OUT) * b
    err = err * (1 + SLACK)
    y = (xd @ wd.t() + (0 if bias is None else bias.double().reshape(1, -1))).abs()
    for dtype in output_roundings(path, x.dtype):
        u_o = unit_roundoff(dtype)
        err = err * (1 + u_o) + u_o * y + underflow(dtype)
    return err.reshape(*x.shape[:-1], weight.shape[0])
