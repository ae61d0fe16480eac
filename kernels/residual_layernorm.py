"""Fused residual + LayerNorm: the residual stream updated and normalised in one pass over its rows.

Between the sublayers of a Wan block the residual stream ``x`` [B, L, D] is first updated, then normalised for
the next sublayer: after self-attention ``x + y * gate`` then the cross-attention's affine LayerNorm (norm3),
after cross-attention ``x + y`` then LayerNorm + modulation (norm2). Unfused these are two kernels that each read
``x`` (the second reads the first's output back); fused, one kernel reads ``x`` and ``y`` once and writes both
results:

    x_new = (x + y * gate)  rounded to x's dtype          (gate None: x + y)
    h     = LN(x_new) [* weight + bias] [* (1 + scale) + shift]   rounded to x's dtype

``gate``, ``shift``, ``scale``: per frame, [B, F, D] (or [B, D] for F=1; batch 1 broadcasts), token l using frame
``l // (L // F)``, as in ``kernels/residual.py`` and ``kernels/norm_modulate.py``; ``weight``, ``bias``: [D]. The
statistics are taken from the rounded ``x_new``, exactly the value the unfused path normalises, so ``x_new`` is
bit for bit the gated residual's and ``h`` differs from the unfused LayerNorm only by the order of float32 sums.
Math in float32.
"""
import sys
from typing import Optional

import torch
import torch.nn.functional as torch_F

from . import _common, registry
from ._tiles import merge_row_stats, normalised, round_bf16, row_moments, tile_rows, tl, triton

NAME = "residual_norm"
candidates = _common.row_candidates


def _check(x, y, gate, weight, bias, shift, scale):
    """The per-frame tensors as [B or 1, F, D] (gate, shift, scale); ValueError saying what is wrong."""
    if x.dim() != 3 or y.shape != x.shape:
        raise ValueError(f"residual_norm: x and y must both be [B, L, D], got {tuple(x.shape)} and {tuple(y.shape)}")
    d = x.shape[2]
    if (shift is None) != (scale is None):
        raise ValueError("residual_norm: shift and scale go together (modulation), give both or neither")
    if bias is not None and weight is None:
        raise ValueError("residual_norm: a bias needs a weight (LayerNorm's affine pair)")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (d,):
            raise ValueError(f"residual_norm: {name} must be [{d}], got {tuple(t.shape)}")
    return _common.per_frame("residual_norm", x, gate=gate, shift=shift, scale=scale)


def _per_token(t: torch.Tensor, l: int) -> torch.Tensor:
    """[B or 1, F, D] per frame -> [B or 1, L, D] float32 per token."""
    f = t.shape[1]
    return t.float().repeat_interleave(l // f, dim=1)


def residual_norm_reference(x, y, gate=None, weight=None, bias=None, shift=None, scale=None, eps: float = 1e-6):
    """The torch definition the kernel must match: (x_new, h) as the module doc says."""
    gate, shift, scale = _check(x, y, gate, weight, bias, shift, scale)
    _b, l, d = x.shape
    s = x.float() + (y.float() if gate is None else y.float() * _per_token(gate, l))
    x_new = s.to(x.dtype)
    h = torch_F.layer_norm(x_new.float(), (d,), eps=eps)
    if weight is not None:
        h = h * weight.float() + (0.0 if bias is None else bias.float())
    if shift is not None:
        h = h * (1.0 + _per_token(scale, l)) + _per_token(shift, l)
    return x_new, h.to(x.dtype)


if tl is not None:
    @triton.jit
    def _updated(x_ptr, y_ptr, g_ptr, offs, g_offs, mask, GATE: tl.constexpr, ROUND_BF16: tl.constexpr):
        # x + y * gate (x + y) in float32 (the interpreter: already on the bf16 grid, as the GPU rounds)
        s = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        yv = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if GATE:
            s = s + yv * tl.load(g_ptr + g_offs, mask=mask, other=0.0).to(tl.float32)
        else:
            s = s + yv
        if ROUND_BF16:
            s = round_bf16(s)
        return s

    def _resnorm_kernel(x_ptr, y_ptr, g_ptr, w_ptr, b_ptr, sh_ptr, sc_ptr, xo_ptr, ho_ptr,
                        n_rows, D, L, tokens_per_frame, mod_bstride, eps,
                        GATE: tl.constexpr, AFFINE: tl.constexpr, BIAS: tl.constexpr, MODULATE: tl.constexpr,
                        YBLOCK: tl.constexpr, RBLOCK: tl.constexpr, ROW: tl.constexpr,
                        ROUND_BF16: tl.constexpr):
        rows64, row_ok = tile_rows(n_rows, YBLOCK)
        frame_rows = (rows64 // L) * mod_bstride + ((rows64 % L) // tokens_per_frame) * D
        cols0 = tl.arange(0, RBLOCK)
        out_ty = xo_ptr.dtype.element_ty
        if ROW:  # one pass: the whole row (RBLOCK >= D) in registers; mean, then squared deviations from it
            col_ok = cols0 < D
            mask = row_ok[:, None] & col_ok[None, :]
            offs = rows64[:, None] * D + cols0[None, :]
            mod_offs = frame_rows[:, None] + cols0[None, :]
            xr = _updated(x_ptr, y_ptr, g_ptr, offs, mod_offs, mask, GATE, ROUND_BF16).to(out_ty)
            tl.store(xo_ptr + offs, xr, mask=mask)
            v = xr.to(tl.float32)
            mean, rstd = row_moments(v, mask, D, eps)
            h = normalised(v, mean, rstd, w_ptr, b_ptr, sh_ptr, sc_ptr, cols0, col_ok, mod_offs, mask,
                           AFFINE, BIAS, MODULATE, ROUND_BF16)
            tl.store(ho_ptr + offs, h.to(ho_ptr.dtype.element_ty), mask=mask)
        else:
            # pass 1: x_new stored; its mean and M2 per row, merging per-step statistics (Chan et al.)
            mean = tl.zeros([YBLOCK], dtype=tl.float32)
            m2 = tl.zeros([YBLOCK], dtype=tl.float32)
            count = tl.zeros([YBLOCK], dtype=tl.float32)
            for start in range(0, D, RBLOCK):
                cols = start + cols0
                mask = row_ok[:, None] & (cols < D)[None, :]
                offs = rows64[:, None] * D + cols[None, :]
                xr = _updated(x_ptr, y_ptr, g_ptr, offs, frame_rows[:, None] + cols[None, :], mask, GATE,
                              ROUND_BF16).to(out_ty)
                tl.store(xo_ptr + offs, xr, mask=mask)
                mean, m2, count = merge_row_stats(mean, m2, count, xr.to(tl.float32), mask)
            rstd = 1.0 / tl.sqrt(m2 / tl.maximum(count, 1.0) + eps)
            # pass 2: x_new of the step recomputed from x, y, gate (the same rounding), normalised, stored
            for start in range(0, D, RBLOCK):
                cols = start + cols0
                col_ok = cols < D
                mask = row_ok[:, None] & col_ok[None, :]
                offs = rows64[:, None] * D + cols[None, :]
                mod_offs = frame_rows[:, None] + cols[None, :]
                v = _updated(x_ptr, y_ptr, g_ptr, offs, mod_offs, mask, GATE, ROUND_BF16).to(out_ty).to(tl.float32)
                h = normalised(v, mean, rstd, w_ptr, b_ptr, sh_ptr, sc_ptr, cols, col_ok, mod_offs, mask,
                               AFFINE, BIAS, MODULATE, ROUND_BF16)
                tl.store(ho_ptr + offs, h.to(ho_ptr.dtype.element_ty), mask=mask)


def _smem(cfg: dict) -> int:
    # layout changes of the x_new and h tiles and the cross-warp reductions (upper estimate)
    return _common.row_smem(cfg, tiles=2)


# the store's name hashes the whole module: the kernel and the helpers it calls
_KERNEL_NAME = _common.kernel_name(NAME, sys.modules[__name__])


def _launcher(x, y, gate, weight, bias, shift, scale, eps):
    b, l, d = x.shape
    x2, y2 = x.contiguous(), y.contiguous()
    g = None if gate is None else gate.contiguous()
    sh = None if shift is None else shift.contiguous()
    sc = None if scale is None else scale.contiguous()
    w = None if weight is None else weight.contiguous()
    bi = None if bias is None else bias.contiguous()
    x_new, h = torch.empty_like(x2), torch.empty_like(x2)
    per_frame = next((t for t in (g, sh) if t is not None), None)
    f = 1 if per_frame is None else per_frame.shape[1]
    bstride = 0 if per_frame is None else _common.frame_batch_stride(per_frame, b, d)
    rnd = _common.round_bf16(x_new)
    dummy = x2                       # a pointer for the absent operands (their loads are compiled out)

    def launch(cfg: dict):
        _common.run_rows(_resnorm_kernel, cfg, b * l, d, x2, x2, y2, dummy if g is None else g,
                         dummy if w is None else w, dummy if bi is None else bi, dummy if sh is None else sh,
                         dummy if sc is None else sc, x_new, h, b * l, d, l, l // f, bstride, float(eps),
                         GATE=g is not None, AFFINE=w is not None, BIAS=bi is not None, MODULATE=sh is not None,
                         ROUND_BF16=rnd)

    parts = "".join(c for c, t in zip("gwbm", (g, w, bi, sh)) if t is not None) or "-"
    key = (f"D={d}|rows={_common.rows_bucket(b * l)}|F={'1' if f == 1 else 'n'}|{parts}|{_common.dtype_name(x)}|"
           f"y={_common.dtype_name(y)}|" + ",".join(_common.dtype_name(t) for t in (g, w, sh) if t is not None))
    return launch, key, x_new, h


def run_triton(x, y, gate=None, weight=None, bias=None, shift=None, scale=None, eps: float = 1e-6,
               config: dict | None = None):
    """The Triton path, explicit config (tests) or tuned (None); the torch reference where every config fails."""
    gate, shift, scale = _check(x, y, gate, weight, bias, shift, scale)
    launch, key, x_new, h = _launcher(x, y, gate, weight, bias, shift, scale, eps)
    if _common.launched(_KERNEL_NAME, key, candidates(x.shape[2]), launch, config, x, smem=_smem):
        return x_new, h
    return residual_norm_reference(x, y, gate, weight, bias, shift, scale, eps)


def _eager(x: torch.Tensor, y: torch.Tensor, gate: Optional[torch.Tensor], weight: Optional[torch.Tensor],
           bias: Optional[torch.Tensor], shift: Optional[torch.Tensor], scale: Optional[torch.Tensor],
           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _common.fused(run_triton, residual_norm_reference, x, y, gate, weight, bias, shift, scale, eps)


def _fake(x, y, gate, weight, bias, shift, scale, eps):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


_OP = _common.register_op(NAME, _eager, _fake)
registry.pack_family(NAME, "gated residual + LayerNorm (+ modulate) (fused_kernels)", _common.triton_problem)


def residual_norm(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None = None,
                  weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                  shift: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                  eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + y * gate, LN(that) [* weight + bias] [* (1 + scale) + shift]), both in x's dtype (module doc).

    Triton or torch as the package doc says; ``torch.ops.wan_accel.residual_norm`` inside torch.compile.
    """
    return _common.call_op(_OP, _eager, x, y, gate, weight, bias, shift, scale, float(eps))
