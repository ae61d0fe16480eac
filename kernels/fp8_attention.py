"""fp8 attention: the opt-in ``fp8`` attention mode, its two implementations, and the error it may make.

Layout ``[B, L, heads, head_dim]`` (the pack's). With ``s = 1/sqrt(D)``, int8 codes -127..127 and e4m3 =
``float8_e4m3fn`` (448 its largest finite value), one computation:

* Smoothing. softmax is unchanged when every logit of a query moves by the same amount, so one vector ``mk`` per
  (batch, head) is subtracted from every key a call sees (``q . (k_j - mk) = q . k_j - q . mk``): it removes the
  channel offsets keys share, which otherwise set the keys' quantization steps. One vector ``mv`` is subtracted
  from every value and added back to the output (the softmax weights sum to 1): the P . V product then carries
  only what varies between the values. A call without a cached copy takes the means of its own keys and values
  (of the attended ones under a key padding mask); the KV cache fixes one pair per layer at its first write
  (``model/kv_cache.py``), so keys quantized once, as they enter the cache, all share it.
* Q and the smoothed K are quantized to int8 per (token, head): ``x = st * round(x / st)`` with
  ``st = max|x over the head's D values| / 127`` (``int8_tokens``: round half to even; a zero token gets a tiny
  step and codes 0). Q is new every call (the kernel quantizes each block of queries as it loads it); K once,
  when it enters the KV cache (the cache keeps the codes and float32 steps beside the exact cache under this
  mode); a call without a cached copy quantizes it itself. The smoothed V is quantized to e4m3 per (token, head)
  with the scale ``sv = max|v - mv| / 448`` (``kernels.fp8_linear.row_scales``).
* The logits of one key tile (``TILE`` keys) are ``(Q8 . K8^T) * (sq_i * s * log2 e) * sk_j``: the integer products
  summed exactly (127^2 * 256 < 2^24: exact in int32 and in float32); the softmax is flash attention's online one
  in base 2 (a running maximum ``m_i``, ``p = 2^(logit - m_i)`` in [0, 1], the earlier sums rescaled by
  ``2^(m_old - m_new)``), its row sum ``l_i`` taken over the unquantized ``p``.
* A per-token V scale cannot be applied after ``P . V``, so it is folded into P: with ``m_T`` the largest V scale
  of the key tile, ``P'_ij = p_ij * sv_j / m_T`` lies in [0, 1]; ``e4m3(448 P')`` times the V codes is summed
  in float32 and scaled by ``m_T / 448``: ``acc_i += (P'8 . V8) * m_T / 448``. The output is ``acc_i / l_i + mv``.

Why int8 for Q . K and e4m3 for P . V (measured, ``bench fidelity --attention fp8`` and direct calls): with keys
smoothed, an int8 code per token rounds Gaussian-like rows about three times finer than e4m3's 3 mantissa bits
(whose relative spacing no scale improves), which cut the Q/K part of a whole video's error about fivefold; P
spans many binades along a row (a long tail of small weights), which e4m3's floating spacing keeps and 127 even
steps do not. int8 and e4m3 products run on the same tensor cores (SM 8.9+) at the same rate.

Two implementations of that one computation:

* ``triton``: a flash-attention forward kernel on CUDA GPUs with fp8 tensor cores (SM 8.9+: Ada, Hopper and
  newer), head sizes a power of two from 16 to 256, no key padding mask: one program per ``BLOCK_M`` queries of
  one (batch, head), quantizing its queries as it loads them and looping over the keys ``TILE`` at a time, the two
  products ``tl.dot`` on int8 and on e4m3 operands. The V codes are stored keys-fastest (``[B, H, D, L]``; the
  cache keeps them so), the operand layout an 8-bit Hopper tensor-core product takes for its second factor
  without a transpose. Its tiles go through the operator store (``_common.launched``). Under
  ``TRITON_INTERPRET=1`` it runs on a CPU (tests); the interpreter's float32 -> e4m3 conversion mishandles a
  rounding carry into the next binade, so there the kernel rounds P to the e4m3 grid itself first (round to
  nearest even, as the GPU's conversion does).
* ``torch``: the same math in torch ops, chunked over the keys (one tile at a time, so memory stays that of one
  ``[B, H, Lq, TILE]`` block), anywhere (a CPU included): it gives the mode's numerics, not its speed.

``error_bound`` states the tolerance of both against exact attention; its docstring derives it. Nothing is
faster than exact attention until measured: ``model.attention.fp8_speed`` times it against exact on a run's
own largest call (a CPU: "not judged").
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from . import _common, registry
from ._tiles import head_rows, round_bf16, tl
from .fp8_linear import FP8, FP8_MAX, TENSOR_CORE_U, TINY, quantize_input, row_scales

log = logging.getLogger("wan_accel")

NAME = "fp8_attention"
TILE = 128                       # keys per tile: the keys sharing one V-scale maximum m_T (the kernel's BLOCK_N)
LOG2E = 1.4426950408889634
LEVELS = 127                     # int8 codes of Q and K: -127..127
INT8_TINY = LEVELS * torch.finfo(torch.float32).tiny   # smallest row maximum given its own step (a zero token)
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
    """Keys and values as the mode keeps them: the smoothed keys' int8 codes [B, L, H, D] (any strides; the kernel
    wants the last dimension contiguous) and float32 steps [B, L, H]; the smoothed values' e4m3 codes [B, L, H, D]
    (the kernel reads them through their strides) and float32 scales [B, L, H]; the vectors subtracted from every
    key and every value, float32 [B, H, D]."""
    k: torch.Tensor
    k_scale: torch.Tensor
    v: torch.Tensor
    v_scale: torch.Tensor
    k_mean: torch.Tensor
    v_mean: torch.Tensor


def int8_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes like x, float32 steps x.shape[:-1]) of x [..., D], one step max|x| / 127 per (token, head),
    rounding half to even (the kernel's in-kernel quantization of Q gives the same codes)."""
    xf = x.float()
    amax = xf.abs().amax(-1).clamp_min(INT8_TINY)
    step = _common.divide(amax, LEVELS)         # correctly rounded on every device, as the kernels' div_rn
    return torch.round(xf / step[..., None]).clamp_(-LEVELS, LEVELS).to(torch.int8), step


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes like x, float32 scales x.shape[:-1]) of x [..., D], one scale per (token, head): the fp8 linear
    layers' row quantization (one fused kernel where it runs, the same codes bit for bit elsewhere)."""
    codes, scale = quantize_input(x.reshape(-1, x.shape[-1]))
    return codes.reshape(x.shape), scale.reshape(x.shape[:-1])


def token_mean(x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """The mean of x [B, L, H, D] over its tokens, float32 [B, H, D]; ``keep`` [B, L] bool: of those tokens only."""
    if keep is None:
        return x.float().mean(1)
    w = keep.to(device=x.device, dtype=torch.float32)[:, :, None, None]
    return (x.float() * w).sum(1) / w.sum(1).clamp_min(1)


def quantize_smoothed(k: torch.Tensor, v: torch.Tensor, k_mean: torch.Tensor, v_mean: torch.Tensor):
    """(int8 codes, steps, e4m3 codes, scales) of k - k_mean and v - v_mean (k, v [B, L, H, D]; the means
    [B, H, D]): what the KV cache writes per token and ``quantize_kv`` per call."""
    k8, sk = int8_tokens(k.float() - k_mean[:, None])
    v8, sv = quantize_tokens(v.float() - v_mean[:, None])
    return k8, sk, v8, sv


def quantize_kv(k: torch.Tensor, v: torch.Tensor, k_mean: torch.Tensor | None = None,
                v_mean: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> Fp8KV:
    """The per-call quantization of k, v [B, L, H, D] (what the KV cache keeps under the fp8 mode), smoothed by
    ``k_mean`` / ``v_mean`` [B, H, D] (default: the means of these keys and values, of the attended ones where
    ``keep`` [B, L] says which); the V codes keys-fastest in memory (a [B, L, H, D] view of a [B, H, D, L] tensor)."""
    k_mean = token_mean(k, keep) if k_mean is None else k_mean.float()
    v_mean = token_mean(v, keep) if v_mean is None else v_mean.float()
    k8, sk, v8, sv = quantize_smoothed(k, v, k_mean, v_mean)
    return Fp8KV(k8, sk, v8.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2), sv, k_mean, v_mean)


def check_call(q, k, v, kv8=None) -> None:
    """q [B, Lq, H, D] and k, v [B, Lk, H, D] of one batch and head layout; their quantized copy ``kv8`` (either
    scheme's: fields k and v) of the same shapes."""
    _common.check_qkv(q, k, v, "fp8 attention")
    if kv8 is not None and (kv8.k.shape != k.shape or kv8.v.shape != v.shape):
        raise ValueError(f"fp8 attention: the quantized keys/values {tuple(kv8.k.shape)} do not match k, v "
                         f"{tuple(k.shape)}")


def tile_maxima(v_scale: torch.Tensor, tile: int = TILE) -> torch.Tensor:
    """m_T of every key: the largest V scale of its tile of ``tile`` keys (tiles from key 0), v_scale [..., L]
    (any values >= 0: int8 attention's block maxima too)."""
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
    check_call(q, k, v, kv8)
    kv8 = kv8 if kv8 is not None else quantize_kv(k, v, keep=key_padding_mask)
    q8, sq = int8_tokens(q)
    qf = q8.float().transpose(1, 2)                                            # [B, H, Lq, D]
    row = sq.transpose(1, 2)[..., None] * (q.shape[-1] ** -0.5 * LOG2E)        # [B, H, Lq, 1]
    keep = None if key_padding_mask is None else key_padding_mask.to(q.device)[:, None, None, :]

    def logits(t0, t1):
        kt = kv8.k[:, t0:t1].float().permute(0, 2, 3, 1)                       # [B, H, D, n]
        ks = kv8.k_scale[:, t0:t1].transpose(1, 2)[:, :, None, :]             # [B, H, 1, n]
        return torch.matmul(qf, kt) * row * ks                                 # integer sums: exact

    def pv(p, t0, t1):
        vs = kv8.v_scale[:, t0:t1].transpose(1, 2)                            # [B, H, n]
        if keep is not None:                  # a padded key's value scale takes no part in its tile's maximum
            vs = vs * keep[:, 0, :, t0:t1]
        mt = vs.amax(-1, keepdim=True).clamp_min(TINY_SCALE)                  # [B, H, 1]
        pq = round_e4m3(p * ((vs / mt) * FP8_MAX)[:, :, None, :])
        return torch.matmul(pq, kv8.v[:, t0:t1].float().transpose(1, 2)) * (mt / FP8_MAX)[..., None]

    acc, l = online_softmax(qf, k.shape[1], logits, pv, keep, tile)
    return (acc / l + kv8.v_mean[:, :, None, :]).transpose(1, 2).to(q.dtype)


def online_softmax(qf, lk: int, logits_of, pv_of, keep, tile: int, offset: float = 0.0) -> tuple:
    """Flash attention's online softmax in base 2 over ``tile`` keys at a time, float32, for the queries qf
    [B, H, Lq, D]: ``logits_of(t0, t1)`` the base-2 logits [B, H, Lq, n] of keys [t0, t1), ``pv_of(p, t0, t1)`` that
    tile's P . V from its weights ``p = 2^(logit - running maximum + offset)``; ``keep`` [B, 1, 1, Lk] the attended
    keys. Returns (acc, l): the output before its division by the row sums l [B, H, Lq, 1]."""
    b, h, lq, d = qf.shape
    m = torch.full((b, h, lq, 1), float("-inf"), device=qf.device)
    l = torch.zeros((b, h, lq, 1), device=qf.device)
    acc = torch.zeros((b, h, lq, d), device=qf.device)
    for t0 in range(0, lk, tile):
        t1 = min(t0 + tile, lk)
        logits = logits_of(t0, t1)
        if keep is not None:
            logits = logits.masked_fill(~keep[..., t0:t1], float("-inf"))
        m_new = torch.maximum(m, logits.amax(-1, keepdim=True))
        base = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)   # a tile of padded keys only
        alpha = torch.exp2(m - base)
        p = torch.exp2(logits - base + offset) if offset else torch.exp2(logits - base)
        l = l * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + pv_of(p, t0, t1)
        m = m_new
    return acc, l


# ----------------------------------------------------------------------------- Triton kernel
if tl is not None:
    def _fp8_attn_kernel(Q, K8, SK, V8, SV, MV, O, Lq, Lk, H, qk_scale,
                         q_sb, q_sm, q_sh,
                         k_sb, k_sn, k_sh, sk_sb, sk_sn, sk_sh,
                         v_sb, v_sn, v_sh, v_sd, sv_sb, sv_sn, sv_sh, mv_sb, mv_sh,
                         o_sb, o_sm, o_sh,
                         HEAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         EMULATE_RTNE: tl.constexpr, ROUND_BF16: tl.constexpr):
        b, h, m64, m_ok = head_rows(Lq, H, BLOCK_M)
        offs_d = tl.arange(0, HEAD)
        offs_t = tl.arange(0, BLOCK_N)
        qf = tl.load(Q + b * q_sb + h * q_sh + m64[:, None] * q_sm + offs_d[None, :],
                     mask=m_ok[:, None], other=0.0).to(tl.float32)
        # the queries to int8 per row (int8_tokens: IEEE divisions, round half to even; written inline)
        sq = tl.math.div_rn(tl.maximum(tl.max(tl.abs(qf), 1), 127.0 * 1.1754943508222875e-38), 127.0)
        x = tl.math.div_rn(qf, sq[:, None])
        r = tl.floor(x)
        f = x - r
        odd = r - 2.0 * tl.floor(r * 0.5)
        r = tl.where((f > 0.5) | ((f == 0.5) & (odd == 1.0)), r + 1.0, r)
        q = tl.minimum(tl.maximum(r, -127.0), 127.0).to(tl.int8)
        row = sq * qk_scale
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD], tl.float32)
        for start in range(0, Lk, BLOCK_N):
            offs_n = start + offs_t
            n_ok = offs_n < Lk
            n64 = offs_n.to(tl.int64)
            kt = tl.load(K8 + b * k_sb + h * k_sh + n64[None, :] * k_sn + offs_d[:, None],
                         mask=n_ok[None, :], other=0)                                    # [HEAD, BLOCK_N]
            ks = tl.load(SK + b * sk_sb + h * sk_sh + n64 * sk_sn, mask=n_ok, other=0.0)
            s = tl.dot(q, kt).to(tl.float32) * row[:, None] * ks[None, :]
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
        mv = tl.load(MV + b * mv_sb + h * mv_sh + offs_d)
        out = acc / l_i[:, None] + mv[None, :]
        if ROUND_BF16:  # interpreter only: the GPU's round-to-nearest-even bf16 conversion
            out = round_bf16(out)
        tl.store(O + b * o_sb + h * o_sh + m64[:, None] * o_sm + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=m_ok[:, None])


_KERNEL_NAME = _common.kernel_name(NAME, _fp8_attn_kernel) if tl is not None else NAME

FAMILY = "attention.fp8"
KINDS = registry.register(FAMILY, "the opt-in fp8 attention mode", [
    registry.Candidate(FAMILY, "fa3", "flash", summary="fp8 (FlashAttention 3's e4m3 kernels)",
                       dtypes=(torch.bfloat16,), needs=("attention", "fa3"),
                       problem=lambda d, dt, hd: None if hasattr(torch, "float8_e4m3fn") else
                       f"torch {torch.__version__} has no float8_e4m3fn"),
    registry.Candidate(FAMILY, "triton", "pack", summary="fp8 (the pack's Triton kernel)", capability=CAPABILITY,
                       dtypes=(torch.float32, torch.float16, torch.bfloat16), head_dims=HEAD_DIMS,
                       problem=_common.triton_problem),
    registry.Candidate(FAMILY, "torch", "torch", summary="fp8 (the pack's torch version)"),
    registry.Candidate(FAMILY, "fa3-torch", "torch", summary="fp8 (FlashAttention 3's math in torch)", manual=True)])


def kernel_problem(device, dtype: torch.dtype = torch.bfloat16, head_dim: int = 128) -> str | None:
    """None when the Triton kernel runs for tensors on this device, dtype and head size; else why not."""
    return KINDS["triton"].rejected(device, dtype, head_dim)


def implementation(device, dtype: torch.dtype, head_dim: int) -> tuple[str, str]:
    """('triton' | 'torch', reason in words): the pack's own fp8 attention on this device, dtype and head size."""
    return registry.choice(FAMILY, device, dtype, head_dim, among=("triton", "torch"))


def fp8_attention_triton(q, k, v, kv8: Fp8KV | None = None, config: dict | None = None,
                         tile: int = TILE) -> torch.Tensor:
    """The Triton kernel (module doc) with an explicit config (tests) or tuned through the operator store
    (config None); the torch version where every config fails. No key padding mask."""
    check_call(q, k, v, kv8)
    kv8 = kv8 if kv8 is not None else quantize_kv(k, v)
    kv8 = kv8._replace(k=_common.unit_last(kv8.k), v_mean=_common.unit_last(kv8.v_mean))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    qu = _common.unit_last(q)
    b, lq, h, d = q.shape
    lk = kv8.k.shape[1]
    qk_scale = d ** -0.5 * LOG2E
    emulate = _common.interpret_enabled()
    rnd = _common.round_bf16(out)

    def launch(cfg: dict):
        _common.run_kernel(_fp8_attn_kernel, (_common.cdiv(lq, cfg["BLOCK_M"]), b * h), qu,
                           qu, kv8.k, kv8.k_scale, kv8.v, kv8.v_scale, kv8.v_mean, out, lq, lk, h, qk_scale,
                           qu.stride(0), qu.stride(1), qu.stride(2),
                           kv8.k.stride(0), kv8.k.stride(1), kv8.k.stride(2),
                           kv8.k_scale.stride(0), kv8.k_scale.stride(1), kv8.k_scale.stride(2),
                           kv8.v.stride(0), kv8.v.stride(1), kv8.v.stride(2), kv8.v.stride(3),
                           kv8.v_scale.stride(0), kv8.v_scale.stride(1), kv8.v_scale.stride(2),
                           kv8.v_mean.stride(0), kv8.v_mean.stride(1),
                           out.stride(0), out.stride(1), out.stride(2),
                           HEAD=d, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=tile, EMULATE_RTNE=emulate, ROUND_BF16=rnd,
                           num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

    key = f"D={d}|q={_common.rows_bucket(lq)}|k={_common.rows_bucket(lk)}|h={h}|{_common.dtype_name(out)}"
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


def exact_softmax(qh, kh, vs, keep, s: float) -> tuple:
    """(p, o', L) of the exact call, float32 [B, H, ...]: the softmax weights p [B, H, R, Lk] of queries qh over keys
    kh (``keep`` [B, Lk]: the attended ones), the smoothed output o' = p v' [B, H, R, D], and the row sums L_i of
    the exp of the logits less their maximum [B, H, R, 1]."""
    logits = torch.matmul(qh, kh.transpose(-1, -2)) * s
    if keep is not None:
        logits = logits.masked_fill(~keep[:, None, None, :], float("-inf"))
    p = torch.softmax(logits, dim=-1)
    big = torch.exp(logits - logits.amax(-1, keepdim=True)).sum(-1, keepdim=True)
    return p, torch.matmul(p, vs), big


def first_order(p, o, ks, vs, var_q, var_k, q_big, s: float) -> tuple:
    """(variance, sigma_logit) of the output's error from rounding Q and K' (the logits' first order through the
    softmax; ``error_bound``'s derivation). var_q: the variance of each query element's rounding, [B, H, R, D] or
    broadcastable ([B, H, R, 1]: one per token); var_k the same of each key element, [B, H, Lk, D] or
    broadcastable; q_big [B, H, R, D]: a bound on each rounded query element's size. sigma_logit [B, H, R, 1]: the
    largest standard deviation of a logit's error of each query (the softmax's second order)."""
    d = ks.shape[-1]
    var_q = var_q.expand(*var_q.shape[:-1], d)
    var_k = var_k.expand(*var_k.shape[:-1], d)
    # Q term: sum_d var_q,id (sum_j p_ij (v'_jc - o'_ic) k'_jd)^2
    a = torch.einsum("bhrj,bhjc,bhjd->bhrcd", p, vs, ks) - o[..., None] * torch.matmul(p, ks)[..., None, :]
    var = s * s * (a.square() * var_q[..., None, :]).sum(-1)
    # K term: sum_j p_ij^2 (v'_jc - o'_ic)^2 sum_d var_k,jd |q_id|^2 (the rounded query's size)
    kvar = torch.matmul(q_big.square(), var_k.transpose(-1, -2))               # [B, H, R, Lk]
    pk = p.square() * kvar
    var += s * s * (torch.matmul(pk, vs.square()) - 2 * o * torch.matmul(pk, vs) + o.square() * pk.sum(-1, True))
    sigma_logit = s * torch.sqrt((torch.matmul(var_q, ks.square().transpose(-1, -2)) + kvar).amax(-1, True))
    return var, sigma_logit


def p_rounding(p, x_f, unit, vs, v_codes_abs) -> tuple:
    """(variance, deterministic bound) of the output's error from rounding the softmax weights to e4m3: x_f the
    weight as rounded, taken with the row's final maximum [B, H, R, Lk]; ``unit`` the output value of one unit of
    x times one V code ([B, H, R, Lk] or broadcastable); v_codes_abs [B, H, Lk, D] a bound on the V codes' size.
    Normal x_f (>= 2^-6): zero-mean, relative variance at most 2^-6 / 12; below it, min(x_f, 2^-10) per key
    outright (``error_bound``'s derivation)."""
    normal = x_f >= MIN_NORMAL
    var = 2.0 ** -6 / 12 * torch.matmul(torch.where(normal, p, 0).square(), vs.square())
    under = torch.where(normal, 0, x_f.clamp_max(SUBNORMAL_STEP / 2)) * unit
    return var, torch.matmul(under, v_codes_abs)


def error_bound(q, k, v, key_padding_mask: torch.Tensor | None = None, kernel: str = "torch",
                rows: torch.Tensor | slice | None = None, z: float = Z, tile: int = TILE,
                k_mean: torch.Tensor | None = None, v_mean: torch.Tensor | None = None) -> torch.Tensor:
    """Per-element bound on |fp8 attention - exact attention| for q [B, Lq, H, D], k/v [B, Lk, H, D]; the exact
    attention being softmax(q k^T / sqrt(D)) v computed in float32 from the same inputs. ``rows``: the query
    tokens to bound (default all). ``kernel``: 'torch' (float32 sums) or 'triton' (tensor cores). ``k_mean`` /
    ``v_mean`` [B, H, D]: the smoothing vectors the call used (a KV cache's; default: the call's own means, as
    ``quantize_kv`` takes them). Returns float32 [B, rows, H, D].

    Derivation. Per head write k'_j = k_j - mk and v'_j = v_j - mv (smoothing: the logits of a query all move by
    q . mk, which softmax ignores, and the output is sum_j p_ij v'_j + mv exactly because the weights sum to 1).
    Every element of Q and K' is rounded to int8 after division by its token's step st = max|row| / 127: the
    error is uniform in [-st/2, st/2] (var_q = dq_i^2/12, var_k = dk_j^2/12). Every element x of V' is rounded to
    e4m3 after division by its token's scale sc: the error is at most half the spacing there, ``sc * 2^(e-3)`` in
    the binade [2^e, 2^(e+1)) of |x|/sc (e4m3's unit roundoff 2^-4 relative) and ``sc * 2^-9`` below 2^-6
    (subnormals); modelled, as for any rounding of values spread over many spacings, as independent, zero-mean and
    uniform: variance ulp^2/12 (``rounding_variance``: var_v). The logits move by delta_ij = s (e_q,i . k'_j +
    q_i . e_k,j) to first order; with p the exact softmax, o'_i = sum_j p_ij v'_j and w_ijc = v'_jc - o'_ic (=
    v_jc - o_ic) the output moves by sum_j p_ij delta_ij w_ijc (the softmax's first order), a sum of independent
    zero-mean terms:
        Var = s^2 var_q,i sum_d (sum_j p_ij w_ijc k'_jd)^2 + s^2 sum_j p_ij^2 w_ijc^2 var_k,j sum_d (|q_id| + dq_i/2)^2
    (the rounded query's size bounded by the exact one's plus half a step) and V's own rounding adds
    sum_j p_ij^2 var_v,jc. P' = p sv_j / m_T is rounded after scaling by 448 to x = 448 p sv_j / m_T, p relative to
    the running maximum, which is at most the final one: x >= x_f, x_f taken with the final maximum. Where x_f >=
    2^-6 (normal), the error relative to x is at most 2^-4 (spacing/x at most 2^-3): in the output it is p_ij v'_jc
    times a zero-mean relative error of variance at most 2^-6/12. Below 2^-6 the rounding is not zero-mean (values
    under half a subnormal step become 0): it is bounded outright by min(x_f, 2^-10) * m_T |v8_jc| / (448 L_i)
    per key and summed as such (L_i: the row sum of the exp2 of the logits less their final maximum; the running
    maximum only shrinks the error in output units). The statistical part is close to normal (many independent
    bounded terms): |E| <= z sigma with z = 6, plus the softmax's second order sigma_logit,i^2 * std_p(v_c)
    (sigma_logit,i: the largest logit error deviation of query i), with the same factor z. Deterministic additions:
    the integer sums of Q8 . K8 are exact (int32 on the tensor cores, float32 in the torch version: 127^2 D < 2^24)
    and the float32 scaling of a logit rounds 4 times (4 * 2^-24 relative to s sum_d (|q_id| + dq_i/2)(|k'_jd| +
    dk_j/2), which moves p by at most that relative amount times |w|); the P . V sums (float32, TILE terms:
    n 2^-24 relative to the sum of |terms|; the fp8 tensor cores keep about 14 bits of each 32-product group,
    ``fp8_linear.TENSOR_CORE_U``, so 'triton' adds cdiv(n, 32) * 2^-14), a few float32 roundings of the softmax
    (16 * 2^-24) times sum_j p_ij |v'_jc|, adding mv back (2^-24 (sum_j p_ij |v'_jc| + |mv_c|)) and the rounding of
    the output to q's dtype (its unit roundoff times sum_j p_ij |v_jc|).
    """
    if kernel not in ("torch", "triton"):
        raise ValueError(f"kernel must be 'torch' or 'triton', got {kernel!r}")
    check_call(q, k, v)
    keep = None if key_padding_mask is None else key_padding_mask.to(q.device)
    k_mean = token_mean(k, keep) if k_mean is None else k_mean.float()
    v_mean = token_mean(v, keep) if v_mean is None else v_mean.float()
    qh, kh, vh = (t.transpose(1, 2).float() for t in (q, k, v))               # [B, H, L, D]
    ks, vs = kh - k_mean[:, :, None], vh - v_mean[:, :, None]                  # smoothed
    d = q.shape[-1]
    s = d ** -0.5
    dq = int8_tokens(qh)[1][..., None]                                         # [B, H, Lq, 1]
    dk = int8_tokens(ks)[1]                                                    # [B, H, Lk]
    sv = row_scales(vs)                                                        # [B, H, Lk, 1]
    var_v = rounding_variance(vs, sv)
    sel = slice(None) if rows is None else rows
    qh, dq = qh[:, :, sel], dq[:, :, sel]
    p, o, big = exact_softmax(qh, kh, vs, keep, s)
    pv_abs = torch.matmul(p, vs.abs())
    q_big = qh.abs() + dq / 2
    var, sigma_logit = first_order(p, o, ks, vs, dq.square() / 12, (dk.square() / 12)[..., None], q_big, s)
    var += torch.matmul(p.square(), var_v)                                     # V term
    # P term: x_f = 448 p_ij L_i sv_j / m_T
    sv_row = sv.squeeze(-1)[:, :, None, :]                                     # [B, H, 1, Lk]
    kept = sv.squeeze(-1) if keep is None else sv.squeeze(-1) * keep[:, None, :].to(sv)
    m_t = tile_maxima(kept, tile).clamp_min(TINY_SCALE)[:, :, None, :]
    v8_abs = vs.abs() / sv * (1 + 2.0 ** -MANTISSA_BITS)                       # |V codes| (rounded up)
    p_var, deterministic = p_rounding(p, FP8_MAX * p * big * sv_row / m_t, m_t / (FP8_MAX * big), vs, v8_abs)
    var += p_var
    spread = (torch.matmul(p, vs.square()) - o.square()).clamp_min(0).sqrt()
    # float32 scaling of the exact integer logits, the P . V sums, float32 roundings, mv added, the output's rounding
    gamma_pv = tile * F32_U
    if kernel == "triton":
        gamma_pv += _common.cdiv(tile, GROUP_K) * TENSOR_CORE_U
    k_big = ks.abs() + dk[..., None] / 2
    logit_abs = (torch.matmul(q_big, k_big.transpose(-1, -2)) * s * 4 * F32_U).amax(-1, True)
    w_abs = pv_abs + o.abs()
    grow = 1 + 2.0 ** -MANTISSA_BITS                                           # |V codes * scales| <= (1 + 2^-4)|v'|
    deterministic += logit_abs * 1.01 * w_abs + (gamma_pv * grow + 17 * F32_U) * pv_abs
    deterministic += F32_U * v_mean.abs()[:, :, None, :] + unit_roundoff(q.dtype) * torch.matmul(p, vh.abs())
    bound = z * (var.clamp_min(0).sqrt() + sigma_logit.square() * spread) + deterministic
    return bound.transpose(1, 2)
