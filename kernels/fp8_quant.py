"""Per-row fp8 quantization of a linear layer's input in one Triton kernel: the fused form of
``fp8_linear.quantize_rows``.

For x [M, K] (bfloat16, float16 or float32, rows contiguous) one program takes YBLOCK rows and writes their
e4m3 codes [M, K] and float32 scales [M, 1] with the numerics of the torch definition, bit for bit:

    scale = max(amax_k |x[m, k]|, TINY) / 448           (float32, a correctly rounded division)
    code  = e4m3_rtne(clamp(x[m, k] / scale, -448, 448))  (x widened to float32 exactly, a true division)

A row of at most KBLOCK elements is read once and held (ONE_PASS); a longer row is read in KBLOCK tiles twice
(its maximum, then its codes; the second read mostly hits L2). The torch definition reads the input twice and
writes a float32 intermediate as large as the input, over about six kernels. ``|x|`` and its maximum are exact
in any dtype, the widening to float32 is exact, and both divisions are ``div_rn`` (compiled Triton's ``/`` on
float32 is not correctly rounded), so the codes and scales equal torch's; the cast rounds to nearest even
(``fp_downcast_rounding='rtne'``: the GPU's ``cvt.rn.satfinite`` e4m3 conversion). Under Triton's CPU interpreter
(tests) two of its conversions are replaced by exact bit arithmetic (``ROUND_FP8``, ``BF16_BITS``): its e4m3 cast
neither rounds ties to even nor carries into the exponent, and its bfloat16 widening loses subnormals. Finite
inputs: a NaN row's scale is not defined to match. Callers keep the constants (``fp8_max``, ``tiny``): this module
imports nothing of ``fp8_linear``.
"""
from __future__ import annotations

import torch

from . import _common, registry
from ._tiles import tile_rows, tl  # None without triton: only the torch path exists

NAME = "fp8_quantize_rows"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CODES = torch.float8_e4m3fn                # what the kernel writes (tl.float8e4nv)
CAPABILITY = (8, 9)                        # e4m3 conversions in hardware: Ada, Hopper and later
ONE_PASS_MAX = 16384                       # the longest row held whole (8960, the 1.3B FFN's width, pads to it)
TILES = (1024, 2048, 4096)                 # K tiles of the two-pass form

if tl is not None:
    _triton = _common.triton_module()

    # interpreter-only exact replacements of two conversions (also used by ``kernels/kv_quant.py``); jitted here,
    # when the module loads, in the mode the kernels run in
    @_triton.jit
    def bf16_bits_to_f32(v):
        # bfloat16 given as its int16 bits -> float32 (the interpreter's own widening drops subnormals)
        return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)

    @_triton.jit
    def e4m3_grid(y):
        # float32 y (|y| <= 448) to the e4m3 grid, ties to even, carrying into the exponent (the GPU's
        # ``cvt.rn.satfinite``; the interpreter's cast does neither), as float32
        a = tl.abs(y)
        u = a.to(tl.uint32, bitcast=True)
        normal = ((u + 0x7FFFF + ((u >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        r = tl.where(a < 0.015625, (a + 16384.0) - 16384.0, normal)   # below 2^-6: steps of 2^-9
        sign = y.to(tl.uint32, bitcast=True) & 0x80000000
        return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)

    def _fp8q_kernel(x_ptr, q_ptr, s_ptr, n_rows, K, x_row_stride, tiny, YBLOCK: tl.constexpr,
                     KBLOCK: tl.constexpr, ONE_PASS: tl.constexpr, FP8_MAX: tl.constexpr, ROUND_FP8: tl.constexpr,
                     BF16_BITS: tl.constexpr):
        rows64, row_ok = tile_rows(n_rows, YBLOCK)
        x_rows = x_ptr + rows64[:, None] * x_row_stride
        q_rows = q_ptr + rows64[:, None] * K
        cols0 = tl.arange(0, KBLOCK)
        # pass 1: the row maximum (ONE_PASS: one tile, kept for pass 2)
        v = tl.zeros([YBLOCK, KBLOCK], dtype=tl.float32)
        amax = tl.zeros([YBLOCK], dtype=tl.float32)
        for start in range(0, K, KBLOCK):
            mask = row_ok[:, None] & ((start + cols0) < K)[None, :]
            v = tl.load(x_rows + (start + cols0)[None, :], mask=mask, other=0)
            if BF16_BITS:   # interpreter only: bfloat16 given as its bits (its own widening drops subnormals)
                v = bf16_bits_to_f32(v)
            v = v.to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
        scale = tl.math.div_rn(tl.maximum(amax, tiny), FP8_MAX)
        tl.store(s_ptr + rows64, scale, mask=row_ok)
        # pass 2: the codes, x / scale (a true division) clamped to +-448 (NaN kept), rounded to nearest even
        for start in range(0, K, KBLOCK):
            mask = row_ok[:, None] & ((start + cols0) < K)[None, :]
            if not ONE_PASS:
                v = tl.load(x_rows + (start + cols0)[None, :], mask=mask, other=0)
                if BF16_BITS:
                    v = bf16_bits_to_f32(v)
                v = v.to(tl.float32)
            y = tl.math.div_rn(v, scale[:, None])
            y = tl.minimum(tl.maximum(y, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX,
                           propagate_nan=tl.PropagateNan.ALL)
            if ROUND_FP8:   # interpreter only: its e4m3 cast neither rounds to even nor carries; round here
                y = e4m3_grid(y)
            tl.store(q_rows + (start + cols0)[None, :], y.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)


def _smem(cfg: dict) -> int:
    # the row maximum's cross-warp reduction (one float32 per row and warp, doubled); the tile lives in registers
    return cfg["YBLOCK"] * cfg["num_warps"] * 4 * 2 + 64


_CANDIDATES: dict[int, tuple] = {}


def candidates(k: int) -> tuple[dict, ...]:
    """Configs for rows of ``k`` elements (one tuple per k, kept: the operator store recognises it by identity):
    the whole row held where it fits (1 to 4 rows per program), else two passes over K tiles."""
    hit = _CANDIDATES.get(k)
    if hit is None:
        whole = _common.next_pow2(k)
        out = []
        if whole <= ONE_PASS_MAX:
            warps = 4 if whole <= 2048 else 8 if whole <= 8192 else 16
            for y in (1, 2, 4):
                if y * whole <= ONE_PASS_MAX:
                    out.append({"YBLOCK": y, "KBLOCK": whole, "num_warps": warps})
        for tile in TILES:
            if tile < whole:
                out += [{"YBLOCK": y, "KBLOCK": tile, "num_warps": w} for y, w in ((1, 4), (4, 8))]
        hit = _CANDIDATES[k] = tuple(out)
    return hit


_KERNEL_NAME = _common.kernel_name(NAME, _fp8q_kernel) if tl is not None else NAME


FAMILY = "fp8_quant"
registry.pack_family(FAMILY, "the fp8 linear layers' input quantization (per call: problem)", _common.triton_problem,
                     capability=CAPABILITY)


def problem(x: torch.Tensor) -> str | None:
    """Why the kernel does not take ``x`` (None: it does)."""
    if tl is None or not _common.use_triton(x):
        return "no Triton for this device"
    if x.dim() != 2 or x.dtype not in DTYPES:
        return f"x must be 2-D {', '.join(_common.dtype_name(d) for d in DTYPES)}"
    if x.numel() == 0:
        return "x is empty"
    why = registry.walk(FAMILY, x.device)[1]["pack"]       # e4m3 conversions (SM 8.9+); an override
    if why:
        return why
    if _common.needs_autograd(x):
        return "autograd tracks x"
    return None


def run_triton(x: torch.Tensor, fp8_max: float, tiny: float,
               config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(codes [M, K] e4m3, scales [M, 1] float32) of x [M, K] by the kernel, with an explicit config (tests) or
    tuned through the operator store (config=None); None when every config failed (the caller uses torch)."""
    x = _common.unit_last(x)
    m, k = x.shape
    codes = torch.empty((m, k), dtype=CODES, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    rnd = _common.interpret_enabled()
    bits = rnd and x.dtype == torch.bfloat16
    x_in = x.view(torch.int16) if bits else x

    def launch(cfg: dict):
        _common.run_kernel(_fp8q_kernel, (_common.cdiv(m, cfg["YBLOCK"]),), x, x_in, codes, scale, m, k, x.stride(0),
                           float(tiny), YBLOCK=cfg["YBLOCK"], KBLOCK=cfg["KBLOCK"], ONE_PASS=cfg["KBLOCK"] >= k,
                           FP8_MAX=float(fp8_max), ROUND_FP8=rnd, BF16_BITS=bits, num_warps=cfg["num_warps"])

    key = f"K={k}|rows={_common.rows_bucket(m)}|{_common.dtype_name(x)}|max={fp8_max:g}"
    if _common.launched(_KERNEL_NAME, key, candidates(x.shape[1]), launch, config, x, smem=_smem):
        return codes, scale
    return None
