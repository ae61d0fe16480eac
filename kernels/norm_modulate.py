"""Fused LayerNorm (no affine) + per-frame adaLN modulation: ``LN(x) * (1 + scale) + shift``.

x [B, L, D]; shift, scale [B, F, D] (or [B, D] for F=1; batch 1 broadcasts) with F dividing L: token l uses
frame ``l // (L // F)`` (per-frame modulation of causal chunks; F=1 for the full model). Statistics and math
in float32; the result has x's dtype.
"""
import torch
import torch.nn.functional as torch_F

from . import _common
from ._tiles import merge_row_stats, normalised, row_moments, tile_rows, tl

NAME = "layernorm_modulate"

# Candidate tiles: YBLOCK rows per program, RBLOCK columns per step (looped, any width) and, for rows up to
# _common.ROW_WIDTH_LIMIT, one-pass tiles (ROW: the whole row in registers). Capped by the compile preset.
candidates = _common.row_candidates


def _check(x, shift, scale):
    if x.dim() != 3:
        raise ValueError(f"layernorm_modulate: x must be [B, L, D], got shape {tuple(x.shape)}")
    return _common.per_frame("layernorm_modulate", x, shift=shift, scale=scale)


def layernorm_modulate_reference(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                                 eps: float = 1e-6) -> torch.Tensor:
    """The torch definition the kernel must match."""
    shift, scale = _check(x, shift, scale)
    b, l, d = x.shape
    f = shift.shape[1]
    y = torch_F.layer_norm(x.float(), (d,), eps=eps).view(b, f, l // f, d)
    y = y * (1.0 + scale.float().unsqueeze(2)) + shift.float().unsqueeze(2)
    return y.view(b, l, d).to(x.dtype)


if tl is not None:
    def _lnmod_kernel(x_ptr, shift_ptr, scale_ptr, out_ptr, n_rows, D, L, tokens_per_frame, mod_bstride, eps,
                      YBLOCK: tl.constexpr, RBLOCK: tl.constexpr, ROW: tl.constexpr, ROUND_BF16: tl.constexpr):
        rows64, row_ok = tile_rows(n_rows, YBLOCK)
        x_rows = x_ptr + rows64[:, None] * D
        o_rows = out_ptr + rows64[:, None] * D
        frame = (rows64 % L) // tokens_per_frame      # the row's frame of shift/scale
        mod_rows = (rows64 // L) * mod_bstride + frame * D
        cols0 = tl.arange(0, RBLOCK)
        if ROW:  # one pass: the whole row (RBLOCK >= D) read once; mean, then squared deviations from it (float32)
            col_ok = cols0 < D
            mask = row_ok[:, None] & col_ok[None, :]
            v = tl.load(x_rows + cols0[None, :], mask=mask, other=0.0).to(tl.float32)
            mean, rstd = row_moments(v, mask, D, eps)
            y = normalised(v, mean, rstd, x_ptr, x_ptr, shift_ptr, scale_ptr, cols0, col_ok,
                           mod_rows[:, None] + cols0[None, :], mask, False, False, True, ROUND_BF16)
            tl.store(o_rows + cols0[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            # pass 1: mean and M2 per row, merging per-chunk statistics (Chan et al.): stable in float32
            mean = tl.zeros([YBLOCK], dtype=tl.float32)
            m2 = tl.zeros([YBLOCK], dtype=tl.float32)
            count = tl.zeros([YBLOCK], dtype=tl.float32)
            for start in range(0, D, RBLOCK):
                cols = start + cols0
                mask = row_ok[:, None] & (cols < D)[None, :]
                v = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                mean, m2, count = merge_row_stats(mean, m2, count, v, mask)
            rstd = 1.0 / tl.sqrt(m2 / tl.maximum(count, 1.0) + eps)
            # pass 2: normalise, modulate with the row's frame, store
            for start in range(0, D, RBLOCK):
                cols = start + cols0
                col_ok = cols < D
                mask = row_ok[:, None] & col_ok[None, :]
                v = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                y = normalised(v, mean, rstd, x_ptr, x_ptr, shift_ptr, scale_ptr, cols, col_ok,
                               mod_rows[:, None] + cols[None, :], mask, False, False, True, ROUND_BF16)
                tl.store(o_rows + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _smem(cfg: dict) -> int:
    # cross-warp reductions and layout changes of one [YBLOCK, RBLOCK] float32 tile (upper estimate)
    return _common.row_smem(cfg, tiles=1)


_KERNEL_NAME = _common.kernel_name(NAME, _lnmod_kernel) if tl is not None else NAME


def _launcher(x, shift, scale, eps):
    b, l, d = x.shape
    x2 = x.contiguous()
    sh, sc = shift.contiguous(), scale.contiguous()
    out = torch.empty_like(x2)
    rows, f = b * l, sh.shape[1]
    bstride = _common.frame_batch_stride(sh, b, d)
    rnd = _common.round_bf16(out)

    def launch(cfg: dict):
        _common.run_rows(_lnmod_kernel, cfg, rows, d, x2, x2, sh, sc, out, rows, d, l, l // f, bstride, float(eps),
                         ROUND_BF16=rnd)

    key = (f"D={d}|rows={_common.rows_bucket(rows)}|F={'1' if f == 1 else 'n'}|"
           f"{_common.dtype_name(x)}|{_common.dtype_name(sh)}")
    return launch, key, out


def run_triton(x, shift, scale, eps=1e-6, config: dict | None = None) -> torch.Tensor:
    """The Triton path, explicit config (tests) or tuned (None); the torch reference where every config fails."""
    shift, scale = _check(x, shift, scale)
    launch, key, out = _launcher(x, shift, scale, eps)
    if _common.launched(_KERNEL_NAME, key, candidates(x.shape[2]), launch, config, x, smem=_smem):
        return out
    return layernorm_modulate_reference(x, shift, scale, eps)


def _eager(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    return _common.fused(run_triton, layernorm_modulate_reference, x, shift, scale, eps)


_OP = _common.register_op(NAME, _eager)


def layernorm_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """LN_noaffine(x) * (1 + scale) + shift with per-frame shift/scale [B, F, D]; float32 inside, x's dtype out.

    Triton or torch as the package doc says; ``torch.ops.wan_accel.layernorm_modulate`` inside torch.compile.
    """
    return _common.call_op(_OP, _eager, x, shift, scale, float(eps))
