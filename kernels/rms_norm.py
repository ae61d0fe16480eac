"""Fused RMSNorm over the full width, without RoPE: Wan's cross-attention query norm, ``rmsnorm(x) * weight``.

x [B, L, D] (any row stride with unit channel stride: the q projection's output read in place); weight [D].
Mean of squares over all D channels in float32, x times its reciprocal square root times weight in float32, one
rounding to x's dtype. Returns [B, L, D] contiguous. One kernel where the torch module runs about six (cast, square,
mean, rsqrt, two multiplies and their casts); the same row tiles as RMSNorm+RoPE (``qk_norm_rope.py``: one-pass
tiles holding the whole row, looped two-pass ones for any width), tuned through the operator store under its own
name.
"""
import torch

from . import _common, registry
from .qk_norm_rope import _rows_view, _smem, rmsnorm_float      # the same row reads in place and the same tiles
from ._tiles import inv_rms, rms_row, round_bf16, tile_rows, tl

NAME = "rmsnorm"

# YBLOCK rows per program, RBLOCK channels per step (looped tiles, any width), and for rows up to
# _common.ROW_WIDTH_LIMIT the one-pass tiles (ROW: the whole row in registers). Capped by the compile preset.
candidates = _common.row_candidates


def _check(x, weight):
    if x.dim() != 3:
        raise ValueError(f"rmsnorm: x must be [B, L, D], got shape {tuple(x.shape)}")
    d = x.shape[2]
    if weight.shape != (d,):
        raise ValueError(f"rmsnorm: weight must be [D] = [{d}], got {tuple(weight.shape)}")


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The torch definition the kernel must match (float32 math, one rounding to x's dtype)."""
    _check(x, weight)
    return rmsnorm_float(x, weight, eps).to(x.dtype)


if tl is not None:
    def _rms_kernel(x_ptr, w_ptr, out_ptr, n_rows, D, eps, x_row_stride,
                    YBLOCK: tl.constexpr, RBLOCK: tl.constexpr, ROW: tl.constexpr, ROUND_BF16: tl.constexpr):
        rows64, row_ok = tile_rows(n_rows, YBLOCK)
        x_rows = x_ptr + rows64[:, None] * x_row_stride
        o_rows = out_ptr + rows64[:, None] * D
        cols0 = tl.arange(0, RBLOCK)
        if ROW:  # one pass: the whole row (RBLOCK >= D) read once, its mean of squares, output from the registers
            y, mask = rms_row(x_rows, w_ptr, row_ok, D, eps, RBLOCK)
            if ROUND_BF16:  # interpreter only: emulate the GPU's round-to-nearest-even bf16 conversion
                y = round_bf16(y)
            tl.store(o_rows + cols0[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            inv = inv_rms(x_rows, row_ok, D, eps, YBLOCK, RBLOCK)     # pass 1: mean of squares, float32
            # pass 2: scale and weight, one rounding on the store
            for start in range(0, D, RBLOCK):
                cols = start + cols0
                cmask = cols < D
                mask = row_ok[:, None] & cmask[None, :]
                v = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
                y = v * inv[:, None] * w[None, :]
                if ROUND_BF16:  # interpreter only: emulate the GPU's round-to-nearest-even bf16 conversion
                    y = round_bf16(y)
                tl.store(o_rows + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


_KERNEL_NAME = _common.kernel_name(NAME, _rms_kernel) if tl is not None else NAME


def _launcher(x, weight, eps):
    b, l, d = x.shape
    x2, w = _rows_view(x), weight.contiguous()
    out = torch.empty((b, l, d), dtype=x.dtype, device=x.device)
    rows = b * l
    rnd = _common.round_bf16(out)

    def launch(cfg: dict):
        _common.run_rows(_rms_kernel, cfg, rows, d, x2, x2, w, out, rows, d, float(eps), x2.stride(1), ROUND_BF16=rnd)

    key = f"D={d}|rows={_common.rows_bucket(rows)}|{_common.dtype_name(x)}|w={_common.dtype_name(w)}"
    return launch, key, out


def run_triton(x, weight, eps=1e-6, config: dict | None = None) -> torch.Tensor:
    """The Triton path, explicit config (tests) or tuned (None); the torch reference where every config fails."""
    _check(x, weight)
    launch, key, out = _launcher(x, weight, eps)
    if _common.launched(_KERNEL_NAME, key, candidates(x.shape[2]), launch, config, x, smem=_smem):
        return out
    return rmsnorm_reference(x, weight, eps)


def _eager(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _common.fused(run_triton, rmsnorm_reference, x, weight, eps)


_OP = _common.register_op(NAME, _eager)
registry.pack_family("rms_norm", "full-width RMSNorm (fused_kernels)", _common.triton_problem)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm(x) over D (float32) * weight; [B, L, D] -> [B, L, D] in x's dtype.

    Triton or torch as the package doc says; ``torch.ops.wan_accel.rmsnorm`` inside torch.compile.
    """
    return _common.call_op(_OP, _eager, x, weight, float(eps))
