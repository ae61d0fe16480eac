"""Fused RMSNorm over the full width + rotary embedding, as used for Wan's q/k: ``rope(rmsnorm(x) * weight)``.

x [B, L, D] with D = num_heads * head_dim; weight [D]; cos, sin [L, head_dim / 2] (any float dtype).
RMSNorm over all D channels in float32, times weight, then each adjacent pair (x[2j], x[2j+1]) of a head is
rotated as the complex number x[2j] + i x[2j+1] times cos + i sin. Returns [B, L, H, head_dim] in x's dtype.
"""
import torch

from . import _common
from ._tiles import inv_rms, rms_row, round_bf16, tile_rows, tl

NAME = "rmsnorm_rope"

# YBLOCK rows per program, RBLOCK channels per step (RBLOCK/2 rotation pairs): looped tiles for any width and, for
# rows up to _common.ROW_WIDTH_LIMIT, one-pass tiles (ROW: the whole row in registers). Capped by the compile preset.
candidates = _common.row_candidates


def _check(x, weight, cos, sin, num_heads):
    if x.dim() != 3:
        raise ValueError(f"rmsnorm_rope: x must be [B, L, D], got shape {tuple(x.shape)}")
    b, l, d = x.shape
    if num_heads < 1 or d % num_heads:
        raise ValueError(f"rmsnorm_rope: D={d} is not divisible by num_heads={num_heads}")
    hd = d // num_heads
    if hd % 2:
        raise ValueError(f"rmsnorm_rope: head_dim={hd} must be even (RoPE rotates channel pairs)")
    if weight.shape != (d,):
        raise ValueError(f"rmsnorm_rope: weight must be [D] = [{d}], got {tuple(weight.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (l, hd // 2):
            raise ValueError(f"rmsnorm_rope: {name} must be [L, head_dim/2] = [{l}, {hd // 2}], "
                             f"got {tuple(t.shape)}")
    return hd


def rmsnorm_float(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x over its last dimension times weight, in float32 (the torch definitions' common first step)."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()


def rmsnorm_rope_reference(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           num_heads: int, eps: float = 1e-6) -> torch.Tensor:
    """The torch definition the kernel must match."""
    hd = _check(x, weight, cos, sin, num_heads)
    b, l, d = x.shape
    y = rmsnorm_float(x, weight, eps).view(b, l, num_heads, hd // 2, 2)
    c = cos.float()[None, :, None, :]
    s = sin.float()[None, :, None, :]
    re, im = y[..., 0], y[..., 1]
    out = torch.stack([re * c - im * s, re * s + im * c], dim=-1)
    return out.view(b, l, num_heads, hd).to(x.dtype)


if tl is not None:
    def _rmsrope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, D, L, half_hd, eps, x_row_stride,
                        YBLOCK: tl.constexpr, RBLOCK: tl.constexpr, ROW: tl.constexpr, ROUND_BF16: tl.constexpr):
        rows64, row_ok = tile_rows(n_rows, YBLOCK)
        x_rows = x_ptr + rows64[:, None] * x_row_stride   # rows of a q/k view of the fused q/k/v output
        o_rows = out_ptr + rows64[:, None] * D
        tok = rows64 % L
        cols0 = tl.arange(0, RBLOCK)
        pairs0 = tl.arange(0, RBLOCK // 2)
        n_pairs = D // 2
        if ROW:  # one pass: the whole row (RBLOCK >= D) read once and contiguously, written from the registers
            a, mask = rms_row(x_rows, w_ptr, row_ok, D, eps, RBLOCK)
            ae, ao = tl.split(tl.reshape(a, [YBLOCK, RBLOCK // 2, 2]))    # channels 2j and 2j+1
            pmask = row_ok[:, None] & (pairs0 < n_pairs)[None, :]
            ang = tok[:, None] * half_hd + (pairs0 % half_hd)[None, :]
            c = tl.load(cos_ptr + ang, mask=pmask, other=1.0).to(tl.float32)
            s = tl.load(sin_ptr + ang, mask=pmask, other=0.0).to(tl.float32)
            y = tl.reshape(tl.join(ae * c - ao * s, ae * s + ao * c), [YBLOCK, RBLOCK])
            if ROUND_BF16:  # interpreter only: emulate the GPU's round-to-nearest-even bf16 conversion
                y = round_bf16(y)
            tl.store(o_rows + cols0[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            inv = inv_rms(x_rows, row_ok, D, eps, YBLOCK, RBLOCK)     # pass 1: mean of squares, float32
            # pass 2: scale, weight, rotate pairs (2j, 2j+1) by the token's angle of pair j within its head
            for start in range(0, n_pairs, RBLOCK // 2):
                pairs = start + pairs0
                pmask = pairs < n_pairs
                mask = row_ok[:, None] & pmask[None, :]
                even = 2 * pairs
                xe = tl.load(x_rows + even[None, :], mask=mask, other=0.0).to(tl.float32)
                xo = tl.load(x_rows + even[None, :] + 1, mask=mask, other=0.0).to(tl.float32)
                we = tl.load(w_ptr + even, mask=pmask, other=0.0).to(tl.float32)
                wo = tl.load(w_ptr + even + 1, mask=pmask, other=0.0).to(tl.float32)
                ang = tok[:, None] * half_hd + (pairs % half_hd)[None, :]
                c = tl.load(cos_ptr + ang, mask=mask, other=1.0).to(tl.float32)
                s = tl.load(sin_ptr + ang, mask=mask, other=0.0).to(tl.float32)
                ae = xe * inv[:, None] * we[None, :]
                ao = xo * inv[:, None] * wo[None, :]
                oe = ae * c - ao * s
                oo = ae * s + ao * c
                if ROUND_BF16:  # interpreter only: emulate the GPU's round-to-nearest-even bf16 conversion
                    oe = round_bf16(oe)
                    oo = round_bf16(oo)
                tl.store(o_rows + even[None, :], oe.to(out_ptr.dtype.element_ty), mask=mask)
                tl.store(o_rows + even[None, :] + 1, oo.to(out_ptr.dtype.element_ty), mask=mask)


def _smem(cfg: dict) -> int:
    # looped: layout changes of the even and odd tiles; one-pass: the split/join of the row's tile
    return _common.row_smem(cfg, tiles=1 if cfg.get("ROW") else 2)


_KERNEL_NAME = _common.kernel_name(NAME, _rmsrope_kernel) if tl is not None else NAME


def _rows_view(x):
    """x itself when its rows are evenly spaced with unit channel stride (the q or k slice of the fused q/k/v
    output: row stride 3*D), so the kernel reads it in place; a contiguous copy otherwise."""
    b, l, _d = x.shape
    if x.stride(2) == 1 and (b == 1 or x.stride(0) == l * x.stride(1)) and x.stride(1) >= x.shape[2]:
        return x
    return x.contiguous()


def _launcher(x, weight, cos, sin, num_heads, eps):
    b, l, d = x.shape
    hd = d // num_heads
    x2, w = _rows_view(x), weight.contiguous()
    c, s = cos.contiguous(), sin.contiguous()
    out = torch.empty((b, l, num_heads, hd), dtype=x.dtype, device=x.device)
    rows = b * l
    rnd = _common.round_bf16(out)

    def launch(cfg: dict):
        _common.run_rows(_rmsrope_kernel, cfg, rows, d, x2, x2, w, c, s, out, rows, d, l, hd // 2, float(eps),
                         x2.stride(1), ROUND_BF16=rnd)

    key = (f"D={d}|hd={hd}|rows={_common.rows_bucket(rows)}|{_common.dtype_name(x)}|"
           f"w={_common.dtype_name(w)}|rope={_common.dtype_name(c)}")
    return launch, key, out


def run_triton(x, weight, cos, sin, num_heads, eps=1e-6, config: dict | None = None) -> torch.Tensor:
    """The Triton path, explicit config (tests) or tuned (None); the torch reference where every config fails."""
    _check(x, weight, cos, sin, num_heads)
    launch, key, out = _launcher(x, weight, cos, sin, num_heads, eps)
    if _common.launched(_KERNEL_NAME, key, candidates(x.shape[2]), launch, config, x, smem=_smem):
        return out
    return rmsnorm_rope_reference(x, weight, cos, sin, num_heads, eps)


def _eager(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
           eps: float) -> torch.Tensor:
    return _common.fused(run_triton, rmsnorm_rope_reference, x, weight, cos, sin, num_heads, eps)


def _fake(x, weight, cos, sin, num_heads, eps):
    b, l, d = x.shape
    return x.new_empty((b, l, num_heads, d // num_heads))


_OP = _common.register_op(NAME, _eager, _fake)


def rmsnorm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                 eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm(x) over D (float32) * weight, then RoPE on adjacent pairs; [B, L, D] -> [B, L, H, hd], x's dtype.

    Triton or torch as the package doc says; ``torch.ops.wan_accel.rmsnorm_rope`` inside torch.compile.
    """
    return _common.call_op(_OP, _eager, x, weight, cos, sin, int(num_heads), float(eps))
