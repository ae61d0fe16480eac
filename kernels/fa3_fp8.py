"""fp8 attention as FlashAttention 3's e4m3 kernels compute it: the quantization, the same math in torch ops, and
the error it may make.

FA3's fp8 forward (upstream's ``hopper`` build, PyPI's ``fa3-fwd``) takes Q, K and V as ``float8_e4m3fn`` codes
[B, L, H, D] with one float32 descale per (batch, head) each (``q_descale`` / ``k_descale`` / ``v_descale``
[B, H]) and writes a bf16 output. The pack's use of it (the opt-in ``fp8`` attention mode, where FA3 runs):

* Smoothing, as in the pack's own fp8 scheme (``kernels/fp8_attention.py``): one key vector ``mk`` and one value
  vector ``mv`` per (batch, head) subtracted from every key and value; softmax ignores the keys' shift and ``mv``
  is added back to the output (the weights sum to 1). The KV cache fixes the pair at a layer's first write.
* Keys and values are quantized once, as they enter the cache: ``code = e4m3(x' / scale)`` with one scale per
  (batch, head) fixed at that same first write, ``scale = HEADROOM * max|x'| / 448`` over the first rows, so later
  rows up to HEADROOM times larger still fit. e4m3 is a floating format: the headroom costs relative precision
  only to values within 2^-6 of the largest code (subnormals; their absolute error stays under 2^-10 of a scale),
  while a value beyond 448 scales saturates to +-448 (the bound then counts the whole clamped amount). A call
  without a cached copy quantizes its own keys and values with its own maxima (no headroom).
* Queries are quantized per call, one scale per (batch, head) from their own maximum.
* The kernel: logits ``(Q8 . K8) * dq * dk / sqrt(D)`` (fp8 tensor cores), flash attention's online softmax in
  base 2 with FA3's fp8 offset: the weights ``p = 2^(logit - running maximum + 8)`` in [0, 256] (so small weights
  keep e4m3's normal range eight binades longer), rounded to e4m3, summed with the V codes; the row sum over the
  unrounded ``p`` (the offset cancels); the output ``acc * dv / l`` in bf16, then ``+ mv``.

``fa3_fp8_torch`` is that math in torch ops (any device; tests, and ``bench fidelity`` states its whole-video
effect on a machine without FA3); ``error_bound`` states the tolerance of both against exact attention.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .fp8_attention import (F32_U, GROUP_K, LOG2E, MANTISSA_BITS, SUBNORMAL_STEP, TILE, Z, check_call,
                            exact_softmax, first_order, online_softmax, p_rounding, round_e4m3, rounding_variance,
                            token_mean, unit_roundoff)
from .fp8_linear import FP8, FP8_MAX, TENSOR_CORE_U, TINY

HEADROOM = 16.0            # a cache's fixed scales: the first rows' maximum at 448 / 16 (four binades above it free)
P_OFFSET = 8               # FA3's fp8 softmax weights are exp2(logit - max + 8): in [0, 256], not [0, 1]
P_SCALE = float(1 << P_OFFSET)
KINDS = ("fa3", "fa3-torch")   # FA3's kernels; the same math in torch ops


class Fa3KV(NamedTuple):
    """Keys and values as FA3's fp8 kernels take them: the smoothed keys' and values' e4m3 codes [B, L, H, D],
    their float32 descales [B, H] (one per batch and head), and the vectors subtracted from every key and every
    value, float32 [B, H, D]."""
    k: torch.Tensor
    v: torch.Tensor
    k_descale: torch.Tensor
    v_descale: torch.Tensor
    k_mean: torch.Tensor
    v_mean: torch.Tensor


def head_scales(x: torch.Tensor, headroom: float = 1.0) -> torch.Tensor:
    """float32 [B, H]: ``headroom`` times the largest |x| of each (batch, head) of x [B, L, H, D], over 448."""
    return (x.abs().amax(dim=(1, 3)).float().clamp_min(TINY) * headroom / FP8_MAX).contiguous()


def quantize_heads(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes [B, L, H, D], descale [B, H]) of x [B, L, H, D]: ``x / scale`` rounded to nearest (ties to even),
    saturated at +-448; ``scale`` default: each head's own maximum at 448."""
    scale = head_scales(x) if scale is None else scale.float()
    codes = (x.float() / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale


def quantize_kv(k: torch.Tensor, v: torch.Tensor, k_mean: torch.Tensor | None = None,
                v_mean: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> Fa3KV:
    """k, v [B, L, H, D] smoothed by ``k_mean`` / ``v_mean`` [B, H, D] (default: their own means, of the attended
    tokens where ``keep`` [B, L] says which) and quantized with the scales given (a cache's fixed ones; default:
    each head's own maximum)."""
    k_mean = token_mean(k, keep) if k_mean is None else k_mean.float()
    v_mean = token_mean(v, keep) if v_mean is None else v_mean.float()
    k8, dk = quantize_heads(k.float() - k_mean[:, None], k_scale)
    v8, dv = quantize_heads(v.float() - v_mean[:, None], v_scale)
    return Fa3KV(k8, v8, dk, dv, k_mean, v_mean)


def fa3_fp8_torch(q, k, v, key_padding_mask: torch.Tensor | None = None, kv: Fa3KV | None = None,
                  tile: int = TILE) -> torch.Tensor:
    """FA3's fp8 math (module doc) in torch ops, float32 sums: q [B, Lq, H, D], k/v [B, Lk, H, D] (used when
    ``kv``, their quantized copy, is not given), key_padding_mask [B, Lk] bool (True = attended). [B, Lq, H, D] in
    q's dtype."""
    check_call(q, k, v, kv)
    kv = kv if kv is not None else quantize_kv(k, v, keep=key_padding_mask)
    q8, dq = quantize_heads(q)
    qf = q8.float().transpose(1, 2)                                              # [B, H, Lq, D]
    row = (dq * kv.k_descale)[:, :, None, None] * (q.shape[-1] ** -0.5 * LOG2E)   # [B, H, 1, 1]
    keep = None if key_padding_mask is None else key_padding_mask.to(q.device)[:, None, None, :]
    acc, l = online_softmax(
        qf, k.shape[1], lambda t0, t1: torch.matmul(qf, kv.k[:, t0:t1].float().permute(0, 2, 3, 1)) * row,
        lambda p, t0, t1: torch.matmul(round_e4m3(p), kv.v[:, t0:t1].float().transpose(1, 2)), keep, tile, P_OFFSET)
    out = acc * kv.v_descale[:, :, None, None] / l
    return (out.to(q.dtype).float() + kv.v_mean[:, :, None, :]).transpose(1, 2).to(q.dtype)


def error_bound(q, k, v, key_padding_mask: torch.Tensor | None = None, kernel: str = "fa3-torch",
                rows: torch.Tensor | slice | None = None, z: float = Z, kv: Fa3KV | None = None) -> torch.Tensor:
    """Per-element bound on |FA3 fp8 attention - exact attention| for q [B, Lq, H, D], k/v [B, Lk, H, D]; the exact
    attention being softmax(q k^T / sqrt(D)) v in float32 from the same inputs. ``kernel``: 'fa3-torch' (float32
    sums) or 'fa3' (the fp8 tensor cores). ``kv``: the quantized copy the call read (a cache's: its smoothing
    vectors and fixed scales; default: the call's own, as ``quantize_kv`` takes them). ``rows``: the query tokens to
    bound (default all). Returns float32 [B, rows, H, D].

    Derivation: the pack's fp8 bound (``fp8_attention.error_bound``) with FA3's quantization. Every element x of
    Q, K' = K - mk and V' = V - mv is rounded to e4m3 after division by its head's scale sc: modelled as independent,
    zero-mean, uniform, variance ulp^2 / 12 with the spacing ``sc * 2^(e-3)`` of its binade (``rounding_variance``),
    and at most half of it: |error| <= 2^-4 |x| + 2^-10 sc. A key or value element beyond 448 sc is saturated: its
    whole error e (exactly known) is counted outright, the keys' through the logits (delta_ij = s sum_d (|q_id|
    rounded up) |e_jd|: every weight then moves by a factor within exp(+-2 max_j delta_ij), so the output by at most
    expm1(2 max_j delta_ij) sum_j p_ij |v'_jc - o'_ic|, whatever their size) and the values' as sum_j p_ij |e_jc|.
    The logits' first order through the softmax (Q and K terms), V's own rounding and the second
    order are as in that derivation, each element with its own variance. P: the weights as rounded are
    x = 256 p_ij L_i relative to the running maximum (FA3's offset of 8 binades; at least x_f, taken with the final
    one): relative variance 2^-6 / 12 where x_f >= 2^-6, else min(x_f, 2^-10) / (256 L_i) per key times
    |V code| dv outright. Deterministic
    additions: the Q8 . K8 sums (D float32 roundings, 2^-24 each, relative to s sum_d |q8 dq| |k8 dk|; the fp8
    tensor cores keep about 14 bits of each group of 32 products: cdiv(D, 32) 2^-14 more), the P . V sums (Lk
    float32 roundings relative to the sum of |terms|; on the tensor cores every group of 32 keys added to the
    running output keeps about 14 bits of it: cdiv(Lk, 32) 2^-14 more), a few float32 roundings of the softmax
    (17 * 2^-24), the kernel's bf16 output and the output after mv is added (q's unit roundoff each, relative to
    sum_j p_ij |v'_jc| and sum_j p_ij |v_jc|).
    """
    if kernel not in KINDS:
        raise ValueError(f"kernel must be one of {', '.join(KINDS)}, got {kernel!r}")
    check_call(q, k, v, kv)
    keep = None if key_padding_mask is None else key_padding_mask.to(q.device)
    kv = kv if kv is not None else quantize_kv(k, v, keep=keep)
    qh, kh, vh = (t.transpose(1, 2).float() for t in (q, k, v))                 # [B, H, L, D]
    ks, vs = kh - kv.k_mean[:, :, None], vh - kv.v_mean[:, :, None]              # smoothed
    d, lk = q.shape[-1], k.shape[1]
    s = d ** -0.5
    dq = quantize_heads(q)[1][:, :, None, None]                                  # [B, H, 1, 1]
    dk, dv = kv.k_descale[:, :, None, None].float(), kv.v_descale[:, :, None, None].float()
    half = 2.0 ** -MANTISSA_BITS / 2                                             # e4m3: half a relative step
    sel = slice(None) if rows is None else rows
    qh = qh[:, :, sel]
    p, o, big = exact_softmax(qh, kh, vs, keep, s)
    if keep is not None:                  # a padded key takes no part: neither its rounding nor its clamping
        ks, vs = ks * keep[:, None, :, None], vs * keep[:, None, :, None]
    k_in, v_in = ks.clamp(-FP8_MAX * dk, FP8_MAX * dk), vs.clamp(-FP8_MAX * dv, FP8_MAX * dv)
    k_clip, v_clip = (ks - k_in).abs(), (vs - v_in).abs()                        # saturated amounts (0 if none)
    q_big = qh.abs() * (1 + half) + SUBNORMAL_STEP / 2 * dq
    var, sigma_logit = first_order(p, o, ks, vs, rounding_variance(qh, dq), rounding_variance(k_in, dk), q_big, s)
    var += torch.matmul(p.square(), rounding_variance(v_in, dv))                # V term
    v_codes = (v_in.abs() / dv) * (1 + half) + SUBNORMAL_STEP / 2               # |V codes| (rounded up)
    p_var, deterministic = p_rounding(p, P_SCALE * p * big, dv / (P_SCALE * big), vs, v_codes)
    var += p_var
    pv_abs = torch.matmul(p, vs.abs())
    w_abs = pv_abs + o.abs()
    # saturated keys and values, counted outright
    clip_logit = (s * torch.matmul(q_big, k_clip.transpose(-1, -2))).amax(-1, True)   # [B, H, R, 1]
    deterministic += torch.expm1(2 * clip_logit) * w_abs + torch.matmul(p, v_clip)
    # the sums' roundings
    gamma_qk, gamma_pv = d * F32_U, lk * F32_U
    if kernel == "fa3":
        gamma_qk += -(-d // GROUP_K) * TENSOR_CORE_U
        gamma_pv += -(-lk // GROUP_K) * TENSOR_CORE_U
    k_big = k_in.abs() * (1 + half) + SUBNORMAL_STEP / 2 * dk
    logit_abs = (torch.matmul(q_big, k_big.transpose(-1, -2)) * s * (gamma_qk + 4 * F32_U)).amax(-1, True)
    grow = (1 + half) ** 2                                                       # P and V codes rounded up
    deterministic += logit_abs * 1.01 * w_abs + (gamma_pv * grow + 17 * F32_U) * (pv_abs + dv * SUBNORMAL_STEP)
    deterministic += F32_U * kv.v_mean.abs()[:, :, None, :]
    deterministic += unit_roundoff(q.dtype) * (pv_abs * grow + torch.matmul(p, vh.abs()))
    spread = (torch.matmul(p, vs.square()) - o.square()).clamp_min(0).sqrt()
    bound = z * (var.clamp_min(0).sqrt() + sigma_logit.square() * spread) + deterministic
    return bound.transpose(1, 2)


def attention(fn, q, kv: Fa3KV, splits: int = 1) -> torch.Tensor:
    """FA3's e4m3 forward through ``fn`` (the installed FA3's ``flash_attn_func``): queries quantized here (per call,
    one scale per batch and head), keys and values given quantized and smoothed (``kv``: a cache's copy, or
    ``quantize_kv``); the bf16 output plus the values' smoothing vector, in q's dtype."""
    q8, q_descale = quantize_heads(q)
    with torch.no_grad():
        out = fn(q8, kv.k, kv.v, q_descale=q_descale, k_descale=kv.k_descale, v_descale=kv.v_descale,
                 num_splits=splits)
    out = out[0] if isinstance(out, (tuple, list)) else out
    return (out.to(q.dtype).float() + kv.v_mean[:, None]).to(q.dtype)
