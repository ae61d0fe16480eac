"""Fused gated residual: ``x + y * gate`` with a per-frame gate.

x, y [B, L, D]; gate [B, F, D] (or [B, D] for F=1; batch 1 broadcasts) with F dividing L: token l uses frame
``l // (L // F)``. Math in float32; the result has x's dtype.
"""
import torch

from . import _common, registry
from ._tiles import round_bf16, tile_rows, tl

NAME = "gated_residual"

# 2-D tiles: YBLOCK rows x XBLOCK columns per program. Capped by the compile preset.
CANDIDATES = tuple({"YBLOCK": y, "XBLOCK": xb, "num_warps": w} for y, xb, w in (
    (1, 64, 1), (4, 64, 2), (8, 64, 4), (8, 64, 8),
    (2, 128, 2), (8, 128, 4), (16, 128, 8), (16, 128, 16)))


def _check(x, y, gate):
    if x.dim() != 3 or y.shape != x.shape:
        raise ValueError(f"gated_residual: x and y must both be [B, L, D], got {tuple(x.shape)} and "
                         f"{tuple(y.shape)}")
    return _common.per_frame("gated_residual", x, gate=gate)[0]


def gated_residual_reference(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The torch definition the kernel must match."""
    gate = _check(x, y, gate)
    b, l, d = x.shape
    f = gate.shape[1]
    out = x.float().view(b, f, l // f, d) + y.float().view(b, f, l // f, d) * gate.float().unsqueeze(2)
    return out.view(b, l, d).to(x.dtype)


if tl is not None:
    def _gres_kernel(x_ptr, y_ptr, g_ptr, out_ptr, n_rows, D, L, tokens_per_frame, g_bstride,
                     YBLOCK: tl.constexpr, XBLOCK: tl.constexpr, ROUND_BF16: tl.constexpr):
        rows64, row_ok = tile_rows(n_rows, YBLOCK)
        cols = tl.program_id(1) * XBLOCK + tl.arange(0, XBLOCK)
        mask = row_ok[:, None] & (cols < D)[None, :]
        offs = rows64[:, None] * D + cols[None, :]
        g_rows = (rows64 // L) * g_bstride + ((rows64 % L) // tokens_per_frame) * D
        xv = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        yv = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        gv = tl.load(g_ptr + g_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        o = xv + yv * gv
        if ROUND_BF16:  # interpreter only: emulate the GPU's round-to-nearest-even bf16 conversion
            o = round_bf16(o)
        tl.store(out_ptr + offs, o.to(out_ptr.dtype.element_ty), mask=mask)


def _smem(cfg: dict) -> int:
    return 0  # pointwise: no shared memory


_KERNEL_NAME = _common.kernel_name(NAME, _gres_kernel) if tl is not None else NAME


def _launcher(x, y, gate):
    b, l, d = x.shape
    x2, y2, g = x.contiguous(), y.contiguous(), gate.contiguous()
    out = torch.empty_like(x2)
    rows, f = b * l, g.shape[1]
    bstride = _common.frame_batch_stride(g, b, d)
    rnd = _common.round_bf16(out)

    def launch(cfg: dict):
        grid = (_common.cdiv(rows, cfg["YBLOCK"]), _common.cdiv(d, cfg["XBLOCK"]))
        _common.run_kernel(_gres_kernel, grid, x2, x2, y2, g, out, rows, d, l, l // f, bstride,
                           YBLOCK=cfg["YBLOCK"], XBLOCK=cfg["XBLOCK"], ROUND_BF16=rnd, num_warps=cfg["num_warps"])

    key = (f"D={d}|rows={_common.rows_bucket(rows)}|F={'1' if f == 1 else 'n'}|{_common.dtype_name(x)}|"
           f"y={_common.dtype_name(y)}|g={_common.dtype_name(g)}")
    return launch, key, out


def run_triton(x, y, gate, config: dict | None = None) -> torch.Tensor:
    """The Triton path, explicit config (tests) or tuned (None); the torch reference where every config fails."""
    gate = _check(x, y, gate)
    launch, key, out = _launcher(x, y, gate)
    if _common.launched(_KERNEL_NAME, key, CANDIDATES, launch, config, x, smem=_smem):
        return out
    return gated_residual_reference(x, y, gate)


def _eager(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return _common.fused(run_triton, gated_residual_reference, x, y, gate)


_OP = _common.register_op(NAME, _eager)
registry.pack_family(NAME, "x + y * gate, the blocks' gated residual (fused_kernels)", _common.triton_problem)


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x + y * gate with a per-frame gate [B, F, D]; float32 math, x's dtype out.

    Triton or torch as the package doc says; ``torch.ops.wan_accel.gated_residual`` inside torch.compile.
    """
    return _common.call_op(_OP, _eager, x, y, gate)
