"""Fused RMS norm over channels (+ SiLU) of the Wan 2.1 VAE decoder, written where the next convolution reads it.

x channels-first: the decoder's [B, C, T, H, W], or [N, C, H, W] for its attention's norm; each frame (H, W)
contiguous, the other strides free (the frames after an up-sampling are a permuted view). gamma [C] (any shape of C
elements). One pass over x:

    y = x / max(||x||_C, 1e-12) * sqrt(C) * gamma        (F.normalize's clamp of the norm at eps)
    y = silu(y)                                           (with ``silu``; the attention's norm has none)

in float32, written once in x's dtype. ``out`` may be a view into a larger tensor as long as each frame lies
contiguous in it: the decoder passes the frames after the 2 history frames of a causal
convolution's input buffer ``[B, C, 2 + T, H, W]``, so the convolution reads [history | new frames] without the
``torch.cat`` copy (``vae/wan21.py``).

Triton for CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), tuned through the operator store; torch
otherwise. The decoder is not compiled, so no custom op wraps the kernel (inside a compile trace torch runs).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as torch_F

from . import _common, registry
from ._tiles import round_bf16, tl

NAME = "vae_norm_silu"
EPS = 1e-12                      # F.normalize's default: the norm is clamped at this
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# registers per program: a tile of CBLOCK channels x PBLOCK positions in float32 holds at most this many values
TILE_LIMIT = 8192

# Tiles: PBLOCK positions of a frame per program (the contiguous axis) and CBLOCK channels per step; CBLOCK 0 holds
# all the channels at once (one read of x; the width rounded up to a power of two), others loop over them twice.
_LOOPED = tuple({"PBLOCK": p, "CBLOCK": c, "num_warps": w} for p, c, w in (
    (128, 16, 4), (256, 16, 8), (512, 8, 8), (256, 32, 8)))
_WHOLE = tuple({"PBLOCK": p, "CBLOCK": 0, "num_warps": w} for p, w in (
    (16, 4), (32, 4), (32, 8), (64, 8), (128, 8), (256, 8)))
_BY_WIDTH: dict[int, tuple] = {}


def candidates(channels: int) -> tuple[dict, ...]:
    """The tiles worth trying for ``channels`` (the whole-width ones whose tile fits TILE_LIMIT), one tuple per
    width (the tuner recognises a candidate tuple by identity)."""
    cands = _BY_WIDTH.get(channels)
    if cands is None:
        width = _common.next_pow2(channels)
        cands = tuple(c for c in _WHOLE if width * c["PBLOCK"] <= TILE_LIMIT) + _LOOPED
        _BY_WIDTH[channels] = cands
    return cands


def _check(x: torch.Tensor, gamma: torch.Tensor, out: torch.Tensor | None) -> None:
    if x.dim() not in (4, 5):
        raise ValueError(f"vae_norm_silu: x must be [B, C, T, H, W] or [N, C, H, W], got shape {tuple(x.shape)}")
    if gamma.numel() != x.shape[1]:
        raise ValueError(f"vae_norm_silu: gamma must have C = {x.shape[1]} elements, got {tuple(gamma.shape)}")
    if out is not None:
        if tuple(out.shape) != tuple(x.shape) or out.dtype != x.dtype or out.device != x.device:
            raise ValueError(f"vae_norm_silu: out must be {tuple(x.shape)} {x.dtype} on {x.device}, got "
                             f"{tuple(out.shape)} {out.dtype} on {out.device}")
        if not frames_contiguous(out):
            raise ValueError(f"vae_norm_silu: out's frames must each lie contiguous (H, W), got strides "
                             f"{out.stride()}")


def frames_contiguous(t: torch.Tensor) -> bool:
    """True when each frame (the last two dims, H and W) of each (batch, channel) of ``t`` lies contiguous."""
    h, w = t.shape[-2:]
    return (w == 1 or t.stride(-1) == 1) and (h == 1 or t.stride(-2) == w)


def norm_silu_reference(x: torch.Tensor, gamma: torch.Tensor, silu: bool = True) -> torch.Tensor:
    """The torch definition the kernel must match (float32 math, x's dtype out)."""
    _check(x, gamma, None)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    y = torch_F.normalize(x.float(), dim=1, eps=EPS) * math.sqrt(x.shape[1]) * gamma.float().reshape(shape)
    return (torch_F.silu(y) if silu else y).to(x.dtype)


if tl is not None:
    def _norm_silu_kernel(x_ptr, g_ptr, out_ptr, C, S, x_bstride, x_cstride, x_tstride, out_bstride, out_cstride,
                          out_tstride, scale, eps, PBLOCK: tl.constexpr, CBLOCK: tl.constexpr, WHOLE: tl.constexpr,
                          SILU: tl.constexpr, ROUND_BF16: tl.constexpr):
        # program: PBLOCK positions of one frame (contiguous in x and out) of one batch element, all channels
        pos = tl.program_id(0) * PBLOCK + tl.arange(0, PBLOCK)
        t = tl.program_id(1).to(tl.int64)
        b = tl.program_id(2).to(tl.int64)
        pos_ok = pos < S
        x_base = x_ptr + b * x_bstride + t * x_tstride
        o_base = out_ptr + b * out_bstride + t * out_tstride
        chans0 = tl.arange(0, CBLOCK)
        if WHOLE:   # every channel in one tile: x is read once
            ok = (chans0 < C)[:, None] & pos_ok[None, :]
            v = tl.load(x_base + chans0.to(tl.int64)[:, None] * x_cstride + pos[None, :], mask=ok, other=0.0)
            v = v.to(tl.float32)
            norm = tl.sqrt_rn(tl.sum(v * v, axis=0))
        else:
            acc = tl.zeros([PBLOCK], dtype=tl.float32)
            for start in range(0, C, CBLOCK):
                chans = start + chans0
                ok = (chans < C)[:, None] & pos_ok[None, :]
                w = tl.load(x_base + chans.to(tl.int64)[:, None] * x_cstride + pos[None, :], mask=ok, other=0.0)
                w = w.to(tl.float32)
                acc += tl.sum(w * w, axis=0)
            norm = tl.sqrt_rn(acc)
        denom = tl.maximum(norm, eps)[None, :]        # F.normalize's clamp, then its operations in its order
        for start in range(0, C, CBLOCK):
            chans = start + chans0
            c_ok = chans < C
            ok = c_ok[:, None] & pos_ok[None, :]
            if WHOLE:
                u = v
            else:
                u = tl.load(x_base + chans.to(tl.int64)[:, None] * x_cstride + pos[None, :], mask=ok, other=0.0)
                u = u.to(tl.float32)
            g = tl.load(g_ptr + chans, mask=c_ok, other=0.0).to(tl.float32)
            y = u / denom * scale * g[:, None]
            if SILU:
                y = y / (1.0 + tl.exp(-y))
            if ROUND_BF16:  # interpreter only: emulate the GPU's round-to-nearest-even bf16 conversion
                y = round_bf16(y)
            tl.store(o_base + chans.to(tl.int64)[:, None] * out_cstride + pos[None, :],
                     y.to(out_ptr.dtype.element_ty), mask=ok)


_KERNEL_NAME = _common.kernel_name(NAME, _norm_silu_kernel) if tl is not None else NAME


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, channel, frame) strides of [B, C, T, H, W] or [N, C, H, W] (one frame: 0)."""
    return t.stride(0), t.stride(1), (t.stride(2) if t.dim() == 5 else 0)


registry.pack_family(NAME, "the VAE's channel RMS norm (+ SiLU)", _common.triton_problem, dtypes=DTYPES)


def usable(x: torch.Tensor, gamma: torch.Tensor) -> bool:
    """True when ``norm_silu`` runs the Triton kernel for these inputs (else it runs torch)."""
    return (tl is not None and x.dim() in (4, 5) and not _common.is_compiling() and _common.use_triton(x, gamma)
            and registry.walk(NAME, x.device, x.dtype)[1]["pack"] is None and not _common.needs_autograd(x, gamma))


def run_triton(x: torch.Tensor, gamma: torch.Tensor, silu: bool = True, out: torch.Tensor | None = None,
               config: dict | None = None) -> torch.Tensor:
    """The Triton path with an explicit config (tests) or tuned through the operator store (config=None).
    Falls back to the torch reference (written into ``out``) when every config fails."""
    _check(x, gamma, out)
    x = x if frames_contiguous(x) else x.contiguous()
    out = torch.empty_like(x) if out is None else out
    if x.numel() == 0:
        return out
    b, c = x.shape[:2]
    frames = x.shape[2] if x.dim() == 5 else 1
    s = x.shape[-2] * x.shape[-1]
    g = gamma.reshape(c).contiguous()
    rnd = _common.round_bf16(out)

    def launch(cfg: dict):
        whole = cfg["CBLOCK"] == 0
        cblock = _common.next_pow2(c) if whole else cfg["CBLOCK"]
        _common.run_kernel(_norm_silu_kernel, (_common.cdiv(s, cfg["PBLOCK"]), frames, b), x, x, g, out, c, s,
                           *_strides(x), *_strides(out), math.sqrt(c), EPS, PBLOCK=cfg["PBLOCK"], CBLOCK=cblock,
                           WHOLE=whole, SILU=bool(silu), ROUND_BF16=rnd, num_warps=cfg["num_warps"])

    key = (f"C={c}|HW={_common.rows_bucket(s)}|frames={_common.rows_bucket(b * frames)}|silu={int(bool(silu))}|"
           f"{_common.dtype_name(x)}")
    if _common.launched(_KERNEL_NAME, key, candidates(x.shape[1]), launch, config, x):
        return out
    return out.copy_(norm_silu_reference(x, gamma, silu))


def norm_silu(x: torch.Tensor, gamma: torch.Tensor, silu: bool = True, out: torch.Tensor | None = None
              ) -> torch.Tensor:
    """silu(x / max(||x||_C, 1e-12) * sqrt(C) * gamma) (no SiLU with ``silu=False``), float32 inside, x's dtype
    out; written into ``out`` when given (each of its frames contiguous) and returned."""
    if usable(x, gamma):
        return run_triton(x, gamma, silu, out)
    _check(x, gamma, out)
    y = norm_silu_reference(x, gamma, silu)
    return y if out is None else out.copy_(y)
