"""fp8 attention: the opt-in ``fp8`` attention mode, its two implementations, and the error it may make.

Layout ``[B, L, heads, head_dim]`` (the pack's). With ``s = 1/sqrt(D)`` and e4m3 = ``float8_e4m3fn`` (448 its
largest finite value), one computation:

* Q, K and V are quantized per (token, head): ``x = sc * e4m3(x / sc)`` with ``sc = max|x over the head's D
  values| / 448`` (``kernels.fp8_linear.row_scales``: a zero token gets a tiny scale and codes 0). Q is new every
  call; K and V are quantized once, when they enter the KV cache (``model/kv_cache.py`` keeps the codes and
  float32 scales beside the exact cache under this mode), and a call without a cached copy (cross-attention,
  a cache-less call) quantizes them itself: the scales are per token, so both give the same codes.
* The logits of one key tile (``TILE`` keys) are ``(Q8 . K8^T) * (sq_i * s * log2 e) * sk_j``: the products of
  two e4m3 codes are exact in float32 and summed in float32; the softmax is flash attention's online one in
  base 2 (a running maximum ``m_i``, ``p = 2^(logit - m_i)`` in [0, 1], the earlier sums rescaled by
  ``2^(m_old - m_new)``), its row sum ``l_i`` taken over the unquantized ``p``.
* A per-token V scale cannot be applied after ``P . V``, so it is folded into P: with ``m_T`` the largest V scale
  of the key tile, ``P'_ij = p_ij * sv_j / m_T`` lies in [0, 1]; ``e4m3(448 P')`` times the V codes is summed
  in float32 and scaled by ``m_T / 448``: ``acc_i += (P'8 . V8) * m_T / 448``. The output is ``acc_i / l_i``.

Two implementations of that one computation:

* ``triton``: a flash-attention forward kernel on CUDA GPUs with fp8 tensor cores (SM 8.9+: Ada, Hopper and
  newer), head sizes a power of two from 16 to 256, no key padding mask: one program per ``BLOCK_M`` queries of
  one (batch, head), looping over the keys ``TILE`` at a time, both products ``tl.dot`` on e4m3 operands. The V
  codes are stored keys-fastest (``[B, H, D, L]``; the cache keeps them so), the operand layout an 8-bit
  Hopper tensor-core product takes for its second factor without a transpose. Its tiles go through the operator
  store (``_common.tuned_launch``). Under ``TRITON_INTERPRET=1`` it runs on a CPU (tests); the interpreter's
  float32 -> e4m3 conversion mishandles a rounding carry into the next binade, so there the kernel rounds P
  to the e4m3 grid itself first (round to nearest even, as the GPU's conversion does).
* ``torch``: the same math in torch ops, chunked over the keys (one tile at a time, so memory stays that of one
  ``[B, H, Lq, TILE]`` block), anywhere (a CPU included): it gives the mode's numerics, not its speed.

``error_bound`` states the tolerance of both against exact attention; its docstring derives it. Nothing is
faster than exact attention until measured: ``model.attention.fp8_speed`` times it against exact on a run's
own largest call (a CPU: "not judged").
"""
from __future__ import annotations

import logging
import math
from typing import NamedTuple

import torch

from . import _common
from .fp8_linear import FP8, FP8_MAX, TENSOR_CORE_U, TINY, quantize_input, row_scales

try:
    import triton.language as tl
except Exception:  # noqa: BLE001 - no triton: only the torch version exists
    tl = None

log = logging.getLogger("wan_accel")

NAME = "fp8_attention"
TILE = 128                       # keys per tile: the keys sharing one V-scale maximum m_T (the kernel's BLOCK_N)
LOG2E = 1.4426950408889634
MANTISSA_BITS = 3                # e4m3: a spacing of 2^(e - 3) in the binade [2^e, 2^(e+1))
MIN_NORMAL = 2.0 ** -6           # e4m3's smallest normal value; below it the spacing is SUBNORMAL_STEP
SUBNORMAL_STEP = 2.0 ** -9
CAPABILITY = (8, 9)              # fp8 tensor cores: Ada, Hopper and later
HEAD_DIMS = (16, 32, 64, 128, 256)
GROUP_K = 32                     # an fp8 tensor-core product adds 32 products at a time (TENSOR_CORE_U each)
F32_U = 2.0 ** -24
TINY_SCALE = TINY / FP8_MAX          # the scale of a zero token (fp8_linear.row_scales)
Z = 6.0                          # standard deviations of the statistical part of the bound (error_bound)
CANDIDATES = tuple({"BLOCK_M": m, "num_warps": w, "num_stages": s} for m, w, s in (
    (64, 4, 2), (64, 4, 3), (128, 8, 2), (128, 8, 3), (128, 4, 3)))
_STATE: dict = {}


class Fp8KV(NamedTuple):
    """Keys and values quantized per (token, head): codes [B, L, H, D] (e4m3, any strides; the kernel wants the
    last dimension of ``k`` contiguous and reads ``v`` through its strides) and float32 scales [B, L, H]."""
    k: torch.Tensor
    k_scale: torch.Tensor
    v: torch.Tensor
    v_scale: torch.Tensor


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes like x, float32 scales x.shape[:-1]) of x [..., D], one scale per (token, head): the fp8 linear
    layers' row quantization (one fused kernel where it runs, the same codes bit for bit elsewhere)."""
    codes, scale = quantize_input(x.reshape(-1, x.shape[-1]))
    return codes.reshape(x.shape), scale.reshape(x.shape[:-1])


def quantize_kv(k: torch.Tensor, v: torch.Tensor) -> Fp8KV:
    """The per-call quantization of k, v [B, L, H, D] (what the KV cache keeps under the fp8 mode); the V codes
    keys-fastest in memory (a [B, L, H, D] view of a [B, H, D, L] tensor)."""
    k8, sk = quantize_tokens(k)
    v8, sv = quantize_tokens(v)
    return Fp8KV(k8, sk, v8.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2), sv)


def _check(q, k, v, kv8: Fp8KV | None = None) -> None:
    if q.ndim != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"fp8 attention takes q [B, Lq, H, D] and k, v [B, Lk, H, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if kv8 is not None and (kv8.k.shape != k.shape or kv8.v.shape != v.shape):
        raise ValueError(f"fp8 attention: the quantized keys/values {tuple(kv8.k.shape)} do not match k, v "
                         f"{tuple(k.shape)}")


def tile_maxima(v_scale: torch.Tensor, tile: int = TILE) -> torch.Tensor:
    """m_T of every key: the largest V scale of its tile of ``tile`` keys (tiles from key 0), v_scale [..., L]."""
    n = v_scale.shape[-1]
    pad = (-n) % tile
    padded = torch.nn.functional.pad(v_scale, (0, pad))
    return padded.unflatten(-1, (-1, tile)).amax(-1).repeat_interleave(tile, dim=-1)[..., :n]


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x (float32, |x| <= 448) rounded to the nearest e4m3 value (ties to even), as float32."""
    return x.to(FP8).float()


def fp8_attention_torch(q, k, v, key_padding_mask: torch.Tensor | None = None, kv8: Fp8KV | None = None,
                        tile: int = TILE) -> torch.Tensor:
    """The fp8 attention math (module doc) in torch ops: q [B, Lq, H, D], k/v [B, Lk, H, D] (used when ``kv8``,
    their quantized copy, is not given), key_padding_mask [B, Lk] bool (True = attended). [B, Lq, H, D] in q's
    dtype."""
    _check(q, k, v, kv8)
    kv8 = kv8 if kv8 is not None else quantize_kv(k, v)
    q8, sq = quantize_tokens(q)
    qf = q8.float().transpose(1, 2)                                            # [B, H, Lq, D]
    row = sq.transpose(1, 2)[..., None] * (q.shape[-1] ** -0.5 * LOG2E)        # [B, H, Lq, 1]
    b, h, lq, d = qf.shape
    m = torch.full((b, h, lq, 1), float("-inf"), device=q.device)
    l = torch.zeros((b, h, lq, 1), device=q.device)
    acc = torch.zeros((b, h, lq, d), device=q.device)
    keep = None if key_padding_mask is None else key_padding_mask.to(q.device)[:, None, None, :]
    for t0 in range(0, k.shape[1], tile):
        t1 = min(t0 + tile, k.shape[1])
        kt = kv8.k[:, t0:t1].float().permute(0, 2, 3, 1)                       # [B, H, D, n]
        ks = kv8.k_scale[:, t0:t1].transpose(1, 2)[:, :, None, :]             # [B, H, 1, n]
        logits = torch.matmul(qf, kt) * row * ks
        if keep is not None:
            logits = logits.masked_fill(~keep[..., t0:t1], float("-inf"))
        m_new = torch.maximum(m, logits.amax(-1, keepdim=True))
        base = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)   # a tile of padded keys only
        alpha = torch.exp2(m - base)
        p = torch.exp2(logits - base)
        l = l * alpha + p.sum(-1, keepdim=True)
        vs = kv8.v_scale[:, t0:t1].transpose(1, 2)                            # [B, H, n]
        if keep is not None:                  # a padded key's value scale takes no part in its tile's maximum
            vs = vs * keep[:, 0, :, t0:t1]
        mt = vs.amax(-1, keepdim=True).clamp_min(TINY_SCALE)                  # [B, H, 1]
        pq = round_e4m3(p * ((vs / mt) * FP8_MAX)[:, :, None, :])
        pv = torch.matmul(pq, kv8.v[:, t0:t1].float().transpose(1, 2))         # [B, H, Lq, D]
        acc = acc * alpha + pv * (mt / FP8_MAX)[..., None]
        m = m_new
    return (acc / l).transpose(1, 2).to(q.dtype)


# ----------------------------------------------------------------------------- Triton kernel
if tl is not None:
    def _fp8_attn_kernel(Q8, SQ, K8, SK, V8, SV, O, Lq, Lk, H, qk_scale,
                         q_sb, q_sm, q_sh, sq_sb, sq_sm, sq_sh,
                         k_sb, k_sn, k_sh, sk_sb, sk_sn, sk_sh,
                         v_sb, v_sn, v_sh, v_sd, sv_sb, sv_sn, sv_sh,
                         o_sb, o_sm, o_sh,
                         HEAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         EMULATE_RTNE: tl.constexpr, ROUND_BF16: tl.constexpr):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD)
        offs_t = tl.arange(0, BLOCK_N)
        m_ok = offs_m < Lq
        q = tl.load(Q8 + b * q_sb + h * q_sh + offs_m.to(tl.int64)[:, None] * q_sm + offs_d[None, :],
                    mask=m_ok[:, None], other=0.0)
        row = tl.load(SQ + b * sq_sb + h * sq_sh + offs_m * sq_sm, mask=m_ok, other=0.0) * qk_scale
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD], tl.float32)
        for start in range(0, Lk, BLOCK_N):
            offs_n = start + offs_t
            n_ok = offs_n < Lk
            n64 = offs_n.to(tl.int64)
            kt = tl.load(K8 + b * k_sb + h * k_sh + n64[None, :] * k_sn + offs_d[:, None],
                         mask=n_ok[None, :], other=0.0)                                  # [HEAD, BLOCK_N]
            ks = tl.load(SK + b * sk_sb + h * sk_sh + n64 * sk_sn, mask=n_ok, other=0.0)
            s = tl.dot(q, kt) * row[:, None] * ks[None, :]
            s = tl.where(n_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vs = tl.load(SV + b * sv_sb + h * sv_sh + n64 * sv_sn, mask=n_ok, other=0.0)
            mt = tl.max(vs, 0)
            x = p * ((vs / mt) * 448.0)[None, :]
            if EMULATE_RTNE:   # interpreter only: x >= 0 (<= 448) to the e4m3 grid, ties to even (the GPU's
                #                conversion does this itself; written inline: a compiled kernel calls no Python)
                u = x.to(tl.uint32, bitcast=True)
                normal = ((u + 0x7FFFF + ((u >> 20) & 1)) >> 20 << 20).to(tl.float32, bitcast=True)
                sub = (x + 16384.0) - 16384.0      # float32's spacing at 2^14 is 2^-9, e4m3's subnormal step
                x = tl.where(x < 0.015625, sub, normal)
            pq = x.to(tl.float8e4nv, fp_downcast_rounding="rtne")
            vt = tl.load(V8 + b * v_sb + h * v_sh + n64[:, None] * v_sn + offs_d[None, :] * v_sd,
                         mask=n_ok[:, None], other=0.0)                                  # [BLOCK_N, HEAD]
            acc = acc * alpha[:, None] + tl.dot(pq, vt) * (mt / 448.0)
            m_i = m_new
        out = acc / l_i[:, None]
        if ROUND_BF16:  # interpreter only: the GPU's round-to-nearest-even bf16 conversion
            u = out.to(tl.uint32, bitcast=True)
            out = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16).to(tl.float32, bitcast=True)
        tl.store(O + b * o_sb + h * o_sh + offs_m.to(tl.int64)[:, None] * o_sm + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=m_ok[:, None])

    _KERNEL_NAME = _common.kernel_name(NAME, _fp8_attn_kernel)
else:
    _KERNEL_NAME = NAME


def _capability(device: torch.device) -> tuple:
    key = ("capability", device.index)
    if key not in _STATE:
        _STATE[key] = tuple(torch.cuda.get_device_capability(device))
    return _STATE[key]


def kernel_problem(device, dtype: torch.dtype = torch.bfloat16, head_dim: int = 128) -> str | None:
    """None when the Triton kernel runs for tensors on this device, dtype and head size; else why not."""
    device = torch.device(device)
    if tl is None or _common.triton_module() is None:
        return "Triton is not installed"
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"the kernel takes fp32/fp16/bf16, not {str(dtype).replace('torch.', '')}"
    if head_dim not in HEAD_DIMS:
        return f"the kernel takes head sizes {', '.join(map(str, HEAD_DIMS))}, not {head_dim}"
    if device.type == "cpu" and _common.interpreter_usable():
        return None
    if device.type != "cuda":
        return "the kernel needs a CUDA GPU"
    cap = _capability(device)
    if cap < CAPABILITY:
        return f"fp8 tensor cores need SM {CAPABILITY[0]}.{CAPABILITY[1]}+, this GPU is SM {cap[0]}.{cap[1]}"
    return None


def implementation(device, dtype: torch.dtype, head_dim: int) -> tuple[str, str]:
    """('triton' | 'torch', reason in words) for fp8 attention on this device, dtype and head size."""
    why = kernel_problem(device, dtype, head_dim)
    if why is None:
        return "triton", "fp8 (the pack's Triton kernel)"
    return "torch", f"fp8 (the pack's torch version: {why})"


def _launcher(q8, sq, kv8: Fp8KV, out, tile: int):
    b, lq, h, d = q8.shape
    lk = kv8.k.shape[1]
    qk_scale = d ** -0.5 * LOG2E
    emulate = _common.interpret_enabled()
    rnd = _common.round_bf16(out)

    def launch(cfg: dict):
        kernel = _common.jit(_fp8_attn_kernel)
        grid = (_common.cdiv(lq, cfg["BLOCK_M"]), b * h)
        with _common.device_guard(q8):
            kernel[grid](q8, sq, kv8.k, kv8.k_scale, kv8.v, kv8.v_scale, out, lq, lk, h, qk_scale,
                         q8.stride(0), q8.stride(1), q8.stride(2), sq.stride(0), sq.stride(1), sq.stride(2),
                         kv8.k.stride(0), kv8.k.stride(1), kv8.k.stride(2),
                         kv8.k_scale.stride(0), kv8.k_scale.stride(1), kv8.k_scale.stride(2),
                         kv8.v.stride(0), kv8.v.stride(1), kv8.v.stride(2), kv8.v.stride(3),
                         kv8.v_scale.stride(0), kv8.v_scale.stride(1), kv8.v_scale.stride(2),
                         out.stride(0), out.stride(1), out.stride(2),
                         HEAD=d, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=tile, EMULATE_RTNE=emulate, ROUND_BF16=rnd,
                         num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

    key = f"D={d}|q={_common.rows_bucket(lq)}|k={_common.rows_bucket(lk)}|h={h}|{_common.dtype_name(out)}"
    return launch, key


def fp8_attention_triton(q, k, v, kv8: Fp8KV | None = None, config: dict | None = None,
                         tile: int = TILE) -> torch.Tensor:
    """The Triton kernel (module doc) with an explicit config (tests) or tuned through the operator store
    (config None); the torch version where every config fails. No key padding mask."""
    _check(q, k, v, kv8)
    kv8 = kv8 if kv8 is not None else quantize_kv(k, v)
    if kv8.k.stride(-1) != 1:
        kv8 = kv8._replace(k=kv8.k.contiguous())
    q8, sq = quantize_tokens(q)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    launch, key = _launcher(q8.contiguous(), sq, kv8, out, tile)
    if _common.launched(_KERNEL_NAME, key, CANDIDATES, launch, config, q):
        return out
    return fp8_attention_torch(q, k, v, None, kv8, tile)


def fp8_attention(q, k, v, key_padding_mask: torch.Tensor | None = None, kv8: Fp8KV | None = None) -> torch.Tensor:
    """fp8 attention by the best implementation for these tensors (the Triton kernel where it runs; masked calls
    and everything else the torch version). ``kv8``: k and v already quantized (the KV cache's copy)."""
    if key_padding_mask is None and implementation(q.device, q.dtype, q.shape[-1])[0] == "triton":
        return fp8_attention_triton(q, k, v, kv8)
    if q.is_cuda and not _STATE.get("warned"):
        _STATE["warned"] = True
        log.warning("wan_accel: fp8 attention runs the pack's torch version here (%s): fp8 numerics, no speed-up",
                    kernel_problem(q.device, q.dtype, q.shape[-1]) or "a key padding mask")
    return fp8_attention_torch(q, k, v, key_padding_mask, kv8)


# ----------------------------------------------------------------------------- the bound
def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the spacing of ``dtype`` at 1 (2**-8 bf16, 2**-11 fp16, 2**-24 fp32)."""
    return float(torch.finfo(dtype).eps) / 2


def rounding_variance(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """ulp^2 / 12 of every element of x rounded to e4m3 after division by its token's ``scale`` (broadcast):
    the spacing ``scale * 2^(e - 3)`` at the element's binade ``e`` (subnormals: ``scale * 2^-9``)."""
    y = (x / scale).abs().clamp_min(MIN_NORMAL)
    ulp = torch.exp2(torch.floor(torch.log2(y)) - MANTISSA_BITS) * scale
    return ulp.square() / 12


def error_bound(q, k, v, key_padding_mask: torch.Tensor | None = None, kernel: str = "torch",
                rows: torch.Tensor | slice | None = None, z: float = Z, tile: int = TILE) -> torch.Tensor:
    """Per-element bound on |fp8 attention - exact attention| for q [B, Lq, H, D], k/v [B, Lk, H, D]; the exact
    attention being softmax(q k^T / sqrt(D)) v computed in float32 from the same inputs. ``rows``: the query
    tokens to bound (default all). ``kernel``: 'torch' (float32 sums) or 'triton' (fp8 tensor cores). Returns
    float32 [B, rows, H, D].

    Derivation. Per head, every element x of Q, K and V is rounded to e4m3 after division by its token's scale
    sc: the error is at most half the spacing there, ``sc * 2^(e-3)`` in the binade [2^e, 2^(e+1)) of |x|/sc
    (e4m3's unit roundoff 2^-4 relative) and ``sc * 2^-9`` below 2^-6 (subnormals); modelled, as for any rounding
    of values spread over many spacings, as independent, zero-mean and uniform: variance ulp^2/12
    (``rounding_variance``: var_q, var_k, var_v per element). The logits move by delta_ij = s (e_q,i . k_j +
    q_i . e_k,j) to first order; with p the exact softmax, o_i = sum_j p_ij v_j and w_ijc = v_jc - o_ic the
    output moves by sum_j p_ij delta_ij w_ijc (the softmax's first order), a sum of independent zero-mean terms:
        Var = s^2 sum_d var_q,id (sum_j p_ij w_ijc k_jd)^2 + s^2 sum_j p_ij^2 w_ijc^2 sum_d q_id^2 var_k,jd
    and V's own rounding adds sum_j p_ij^2 var_v,jc. P' = p sv_j / m_T is rounded after scaling by 448 to
    x = 448 p sv_j / m_T, p relative to the running maximum, which is at most the final one: x >= x_f, x_f taken
    with the final maximum. Where x_f >= 2^-6 (normal), the error relative to x is at most 2^-4 (spacing/x at most
    2^-3): in the output it is p_ij v_jc times a zero-mean relative error of variance at most 2^-6/12. Below
    2^-6 the rounding is not zero-mean (values under half a subnormal step become 0): it is bounded outright by
    min(x_f, 2^-10) * m_T |v8_jc| / (448 L_i) per key and summed as such (L_i: the row sum of the exp2 of the
    logits less their final maximum; the running maximum only shrinks the error in output units). The statistical
    part is close to normal (many independent bounded terms): |E| <= z sigma with z = 6, plus the softmax's
    second order sigma_logit,i^2 * std_p(v_c) (sigma_logit,i: the largest logit error deviation of query i),
    with the same factor z. Deterministic additions: the sums of the two products (float32, D and TILE terms:
    n 2^-24 relative to the sum of |terms|; the fp8 tensor cores keep about 14 bits of each 32-product group,
    ``fp8_linear.TENSOR_CORE_U``, so 'triton' adds cdiv(n, 32) * 2^-14), the logits' error moving p by at most
    that relative amount times |w|, a few float32 roundings of the softmax (16 * 2^-24) and the rounding of the
    output to q's dtype (its unit roundoff), each times sum_j p_ij |v_jc|.
    """
    if kernel not in ("torch", "triton"):
        raise ValueError(f"kernel must be 'torch' or 'triton', got {kernel!r}")
    _check(q, k, v)
    qh, kh, vh = (t.transpose(1, 2).float() for t in (q, k, v))               # [B, H, L, D]
    d = q.shape[-1]
    s = d ** -0.5
    sq, sk, sv = (row_scales(t) for t in (qh, kh, vh))                     # [B, H, L, 1]
    var_q, var_k, var_v = rounding_variance(qh, sq), rounding_variance(kh, sk), rounding_variance(vh, sv)
    sel = slice(None) if rows is None else rows
    qh, var_q = qh[:, :, sel], var_q[:, :, sel]
    logits = torch.matmul(qh, kh.transpose(-1, -2)) * s
    if key_padding_mask is not None:
        logits = logits.masked_fill(~key_padding_mask[:, None, None, :].to(q.device), float("-inf"))
    p = torch.softmax(logits, dim=-1)                                          # [B, H, R, Lk]
    o = torch.matmul(p, vh)                                                    # [B, H, R, D]
    pv_abs = torch.matmul(p, vh.abs())
    # Q term: a_icd = sum_j p_ij (v_jc - o_ic) k_jd
    a = torch.einsum("bhrj,bhjc,bhjd->bhrcd", p, vh, kh) - o[..., None] * torch.matmul(p, kh)[..., None, :]
    var = s * s * (a.square() * var_q[:, :, :, None, :]).sum(-1)
    # K term: sum_j p_ij^2 (v_jc - o_ic)^2 sum_d q_id^2 var_k,jd
    kvar = torch.matmul(qh.square(), var_k.transpose(-1, -2))                  # [B, H, R, Lk]
    pk = p.square() * kvar
    var += s * s * (torch.matmul(pk, vh.square()) - 2 * o * torch.matmul(pk, vh) + o.square() * pk.sum(-1, True))
    var += torch.matmul(p.square(), var_v)                                     # V term
    # P term: x_f = 448 p_ij L_i sv_j / m_T
    mx = logits.amax(-1, keepdim=True)
    big = torch.exp(logits - mx).sum(-1, keepdim=True)                         # L_i
    sv_row = sv.squeeze(-1)[:, :, None, :]                                     # [B, H, 1, Lk]
    kept = sv.squeeze(-1) if key_padding_mask is None else sv.squeeze(-1) * key_padding_mask[:, None, :].to(sv)
    m_t = tile_maxima(kept, tile).clamp_min(TINY_SCALE)[:, :, None, :]
    x_f = FP8_MAX * p * big * sv_row / m_t
    normal = x_f >= MIN_NORMAL
    var += 2.0 ** -6 / 12 * torch.matmul(torch.where(normal, p, 0).square(), vh.square())
    v8_abs = vh.abs() / sv * (1 + 2.0 ** -MANTISSA_BITS)                       # |V codes| (rounded up)
    under = torch.where(normal, 0, x_f.clamp_max(SUBNORMAL_STEP / 2)) * m_t / (FP8_MAX * big)
    deterministic = torch.matmul(under, v8_abs)
    # second order of the softmax
    sigma_logit = s * torch.sqrt((torch.matmul(var_q, kh.square().transpose(-1, -2)) + kvar).amax(-1, True))
    spread = (torch.matmul(p, vh.square()) - o.square()).clamp_min(0).sqrt()
    # sums, float32 roundings, the output's rounding
    gamma_qk, gamma_pv = d * F32_U, tile * F32_U
    if kernel == "triton":
        gamma_qk += _common.cdiv(d, GROUP_K) * TENSOR_CORE_U
        gamma_pv += _common.cdiv(tile, GROUP_K) * TENSOR_CORE_U
    grow = (1 + 2.0 ** -MANTISSA_BITS) ** 2                                    # |codes * scales| <= (1 + 2^-4)^2 |x|
    logit_abs = (torch.matmul(qh.abs(), kh.abs().transpose(-1, -2)) * s * grow * gamma_qk).amax(-1, True)
    w_abs = torch.matmul(p, vh.abs()) + o.abs()
    deterministic += logit_abs * 1.01 * w_abs + (gamma_pv * grow + 16 * F32_U + unit_roundoff(q.dtype)) * pv_abs
    bound = z * (var.clamp_min(0).sqrt() + sigma_logit.square() * spread) + deterministic
    return bound.transpose(1, 2)
