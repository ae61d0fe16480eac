"""Int8 attention in the manner of SageAttention: the opt-in ``int8`` attention mode, and the error it may make.

Two implementations of one computation, layout ``[B, L, heads, head_dim]`` (the pack's; both transpose to
``[B, heads, L, head_dim]`` inside):

* ``kitchen``: comfy-kitchen's ``int8_attention`` (an optional extra). Its kernel is CUDA only (SM 7.5 or newer;
  comfy-kitchen 0.2.31 to 0.2.40 have no eager implementation), so it is used when ``int8_attention_is_available``
  says so for the tensors' device. comfy-kitchen also splits the same kernel in two
  (``prequantize_int8_attention``, then ``int8_attention_from_prequantized``: the float Q/K/V may be freed between);
  that pair is a second candidate, ``kitchen.prequantized``, used only where it is verified equal to the one-call
  kernel (``candidates.VERIFY_ULPS`` of the dtype's resolution) and measured faster for the call's shapes
  (``kitchen_call``, operator store op ``int8_attention``). It also quantizes V (int8 per channel) and P (unsigned int8), and rotates Q and K by a
  block Hadamard transform before quantizing them; for float32 inputs it computes in bf16.
* ``torch``: the pack's own version of the same math, which runs everywhere (CPU included) and is what CI tests:
  K is smoothed by subtracting its mean over tokens (softmax-invariant: every logit of a query moves by the same
  ``q . mean(k)``), Q is quantized per block of ``BLOCK_Q`` tokens and K per block of ``BLOCK_K`` tokens to int8
  with the step ``max|block| / 127``, ``Q8 . K8^T`` is summed exactly (float32 holds every integer sum below
  2**24 and ``127**2 * head_dim`` stays under it for ``head_dim <= MAX_HEAD_DIM``), dequantized by the two block
  steps and the softmax scale, the softmax runs in float32, and ``P . V`` in the input precision. It is no faster
  than SDPA: on a GPU without comfy-kitchen the mode reproduces int8's numerics, not its speed.

``error_bound`` is the stated tolerance of both against exact attention (see its docstring for the derivation).
Nothing here imports comfy-kitchen at module import.
"""
from __future__ import annotations

import logging
import math

import torch

from . import _common, kitchen, registry
from . import candidates as op_candidates
from .fp8_attention import tile_maxima, unit_roundoff

log = logging.getLogger("wan_accel")

BLOCK_Q = 128            # query tokens sharing one int8 step (SageAttention's query block)
BLOCK_K = 64             # key tokens sharing one int8 step
LEVELS = 127             # int8 codes -127..127
P_LEVELS = 255           # comfy-kitchen's unsigned int8 P
MAX_HEAD_DIM = 1024      # 127**2 * 1024 < 2**24: the int8 dot products are exact in float32
Z = 6.0                  # standard deviations of the bound (error_bound)
TILE_ELEMENTS = 1 << 26  # most float32 logits one step of the torch version holds
_STATE: dict = {}


# comfy-kitchen's int8 entry points: candidate -> the functions it calls
KITCHEN_CALLS = {"kitchen": ("int8_attention",),
                 "kitchen.prequantized": ("prequantize_int8_attention", "int8_attention_from_prequantized")}
STORE_OP = "int8_attention"


def kitchen_problem(device, dtype: torch.dtype = torch.bfloat16, head_dim: int = 128,
                    call: str = "kitchen") -> str | None:
    """None when comfy-kitchen's int8 kernel (through ``call``, a key of KITCHEN_CALLS) runs for these tensors;
    else why not (in words)."""
    ck = kitchen.module()
    needs = KITCHEN_CALLS[call]
    if ck is None or not all(hasattr(ck, name) for name in needs):
        return f"comfy-kitchen (with {' and '.join(needs)}) is not installed"
    device = torch.device(device)
    if device.type != "cuda":
        return "comfy-kitchen's int8 kernel needs a CUDA GPU (it has no eager implementation)"
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"comfy-kitchen's int8 kernel takes fp32/fp16/bf16, not {_common.dtype_name(dtype)}"
    if not 0 < head_dim <= 256:
        return f"comfy-kitchen's int8 kernel takes head sizes up to 256, not {head_dim}"
    key = ("available", device.index)
    if key not in _STATE:
        try:
            _STATE[key] = bool(ck.int8_attention_is_available(device))
        except Exception:  # noqa: BLE001 - a failing probe means: not available
            _STATE[key] = False
    return None if _STATE[key] else "comfy-kitchen's int8 kernel is not available on this GPU (needs SM 7.5+)"


FAMILY = "attention.int8"
registry.register(FAMILY, "the opt-in int8 attention mode", [
    registry.Candidate(FAMILY, "kitchen", "kitchen", summary="int8 (comfy-kitchen int8_attention)",
                       problem=lambda d, dt, hd: kitchen_problem(d, dt, hd)),
    registry.Candidate(FAMILY, "torch", "torch", summary="int8 (the pack's torch version)")])


def implementation(device, dtype: torch.dtype, head_dim: int) -> tuple[str, str]:
    """('kitchen' | 'torch', reason in words) for int8 attention on this device, dtype and head size."""
    return registry.choice(FAMILY, device, dtype, head_dim)


def _check(q, k, v) -> None:
    _common.check_qkv(q, k, v, "int8 attention")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"int8 attention takes head sizes up to {MAX_HEAD_DIM}; got {q.shape[-1]}")


def block_steps(x: torch.Tensor, block: int) -> torch.Tensor:
    """The int8 step of every token of x [B, H, L, D]: max|x| over its block of ``block`` tokens / 127,
    as [B, H, L, 1] float32 (a block of zeros gets step 1, so its codes are 0)."""
    amax = tile_maxima(x.float().abs().amax(-1), block)                       # [B, H, L]
    step = torch.where(amax > 0, amax / LEVELS, torch.ones_like(amax))
    return step[..., None]


def quantize(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes, steps [B, H, L, 1]) of x [B, H, L, D] in blocks of ``block`` tokens."""
    step = block_steps(x, block)
    codes = torch.round(x.float() / step).clamp_(-LEVELS, LEVELS).to(torch.int8)
    return codes, step


def smooth_keys(k: torch.Tensor) -> torch.Tensor:
    """k [B, H, L, D] minus its mean over tokens (float32)."""
    k = k.float()
    return k - k.mean(dim=2, keepdim=True)


def int8_attention_torch(q, k, v, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The pack's int8 attention (module doc): q [B, Lq, H, D], k/v [B, Lk, H, D], key_padding_mask [B, Lk] bool
    (True = attended). Returns [B, Lq, H, D] in q's dtype."""
    _check(q, k, v)
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    scale = q.shape[-1] ** -0.5
    q8, q_step = quantize(qh, BLOCK_Q)
    k8, k_step = quantize(smooth_keys(kh), BLOCK_K)
    kf = k8.float().transpose(-1, -2)
    k_scale = k_step.transpose(-1, -2) * scale                                # [B, H, 1, Lk]
    mask = None if key_padding_mask is None else ~key_padding_mask[:, None, None, :].to(q.device)
    b, h, lq, _ = qh.shape
    rows = max(BLOCK_Q, TILE_ELEMENTS // max(1, b * h * kh.shape[2]) // BLOCK_Q * BLOCK_Q)
    out = []
    for r in range(0, lq, rows):
        logits = torch.matmul(q8[:, :, r:r + rows].float(), kf)               # exact integer sums
        logits.mul_(q_step[:, :, r:r + rows]).mul_(k_scale)
        if mask is not None:
            logits.masked_fill_(mask, float("-inf"))
        p = torch.softmax(logits, dim=-1)
        out.append(torch.matmul(p.to(vh.dtype), vh))
    return torch.cat(out, dim=2).transpose(1, 2).to(q.dtype)


def _kitchen_one_call(q, k, v) -> torch.Tensor:
    out = kitchen.module().int8_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          scale=q.shape[-1] ** -0.5)
    return out.transpose(1, 2).to(q.dtype)


def _kitchen_prequantized(q, k, v) -> torch.Tensor:
    ck = kitchen.module()
    packed = ck.prequantize_int8_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           scale=q.shape[-1] ** -0.5)
    return ck.int8_attention_from_prequantized(packed).transpose(1, 2).to(q.dtype)


_KITCHEN_FNS = {"kitchen": _kitchen_one_call, "kitchen.prequantized": _kitchen_prequantized}
_CALLS: dict = {}            # store key -> the entry point chosen with measuring allowed


def _store_key(q, k) -> str:
    return (f"{q.device.type}|h{q.shape[2]}|d{q.shape[3]}|{_common.dtype_name(q)}"
            f"|q{q.shape[1]}|k{k.shape[1]}")


def kitchen_call(q, k, v, tuner=None) -> tuple[str | None, str]:
    """(comfy-kitchen entry point for this call, why): the one-call kernel, or the prequantized pair where it runs
    here, is verified equal to the one-call kernel on seeded inputs of these shapes and is the faster of the two
    (the operator store remembers both per GPU). (None, why) when neither runs. Nothing is measured during a
    CUDA graph capture or under compile (the one-call kernel then, unless a choice is known)."""
    key = _store_key(q, k)
    if key in _CALLS:                       # every later call of these shapes: no availability check, no lookup
        return _CALLS[key], "chosen before in this process"
    rows = [(name, kitchen_problem(q.device, q.dtype, q.shape[-1], name)) for name in KITCHEN_CALLS]
    usable = [op_candidates.Candidate(STORE_OP, name, "kitchen", _KITCHEN_FNS[name], lambda d: None,
                                      f"comfy-kitchen {' + '.join(KITCHEN_CALLS[name])}")
              for name, why in rows if why is None]
    skipped = [f"{name}: {why}" for name, why in rows if why is not None]
    if len(usable) < 2:
        if usable:
            _CALLS[key] = usable[0].name
            return usable[0].name, "the only comfy-kitchen entry point here"
        return None, "; ".join(skipped)
    measuring = not (_common.is_compiling() or _common.capturing(q))
    best, why = op_candidates.pick(STORE_OP, usable, skipped, (q, k, v), key=key, reference=_kitchen_one_call,
                                   tuner=tuner, benchmark=measuring)
    if best is None:
        return "kitchen", f"the one-call kernel ({why})"
    if measuring:
        _CALLS[key] = best
    return best, why


def int8_attention_kitchen(q, k, v, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """comfy-kitchen's int8 kernel on the pack's layout, through the entry point ``kitchen_call`` chooses (masked
    calls run the torch version)."""
    if key_padding_mask is not None:
        return int8_attention_torch(q, k, v, key_padding_mask)
    return _KITCHEN_FNS[kitchen_call(q, k, v)[0] or "kitchen"](q, k, v)


def int8_attention(q, k, v, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Int8 attention by the best implementation for these tensors (comfy-kitchen's kernel where it runs)."""
    if implementation(q.device, q.dtype, q.shape[-1])[0] == "kitchen":
        return int8_attention_kitchen(q, k, v, key_padding_mask)
    if q.is_cuda and not _STATE.get("warned"):
        _STATE["warned"] = True
        log.warning("wan_accel: int8 attention runs the pack's torch version here (%s): int8 numerics, no speed-up",
                    kitchen_problem(q.device, q.dtype, q.shape[-1]))
    return int8_attention_torch(q, k, v, key_padding_mask)


def error_bound(q, k, v, key_padding_mask: torch.Tensor | None = None, kernel: str = "torch",
                rows: torch.Tensor | slice | None = None, z: float = Z) -> torch.Tensor:
    """Per-element bound on |int8 attention - exact attention| for q [B, Lq, H, D], k/v [B, Lk, H, D]; the exact
    attention being softmax(q k^T / sqrt(D)) v computed in float32 from the same inputs. ``rows``: the query
    tokens to bound (default all). Returns float32 [B, rows, H, D].

    Derivation. Per head, write s = 1/sqrt(D), k'_j = k_j - mean(k) (smoothing: softmax-invariant), and for the
    int8 codes q^_i = dq_i * round(q_i / dq_i), k^_j = dk_j * round(k'_j / dk_j), where dq_i = max|block(i)|/127
    is the step of query i's block of 128 tokens and dk_j that of key j's block of 64. The rounding errors
    e_q = q - q^, e_k = k' - k^ are each uniform in [-d/2, d/2] (variance d^2/12) and independent. The logits move
    by exactly delta_ij = s (e_q,i . k'_j + q^_i . e_k,j). With p = softmax(exact logits) and o_i = sum_j p_ij v_j,
    to first order p'_ij - p_ij = p_ij (delta_ij - sum_l p_il delta_il), so the output error is
        E_ic = sum_j p_ij delta_ij w_ijc,     w_ijc = v_jc - o_ic,
    a sum of independent zero-mean terms with variance
        Var E_ic = s^2 dq_i^2/12 * ||sum_j p_ij w_ijc k'_j||^2 + s^2 ||q^_i||^2/12 * sum_j p_ij^2 dk_j^2 w_ijc^2.
    comfy-kitchen's kernel also quantizes V per channel (step dv_c = max_j |v_jc|/127: adds dv_c^2/12 sum_j p_ij^2)
    and P in [0, 1] relative to the row maximum with step 1/255 (adds (max_j p_ij / 255)^2 / 12 * sum_j v_jc^2);
    its Hadamard rotation keeps the dot products and its finer scale blocks only shrink dq, dk, so the pack's
    steps bound its own. Being a sum of many bounded independent terms, E is close to normal: |E| <= z sigma with
    z = 6 fails with probability about 2e-9 per element (measured on random Wan-shaped inputs, the largest of
    4 * 10^5 errors stays near 3.7 sigma). The second-order term of the softmax,
    sum_j p_ij ((delta_ij - mean_p delta)^2 - var_p delta) w_ijc / 2, has the size sigma_L,i^2 * std_p(v_c)
    (sigma_L,i: the largest logit error deviation of query i); it gets the same factor z. Rounding P to
    the input precision for P . V, the product and the output add at most 3 u sum_j p_ij |v_jc| (u: the unit
    roundoff of the input dtype; bf16 for comfy-kitchen's float32 path, which computes in bf16).
    The bound tracks the error's real size: int8 steps two or three times coarser than 1/127
    exceed it (measured: 1.1-1.3 and 1.7-2 times the bound).
    """
    if kernel not in ("torch", "kitchen"):
        raise ValueError(f"kernel must be 'torch' or 'kitchen', got {kernel!r}")
    _check(q, k, v)
    qh, kh, vh = (t.transpose(1, 2).float() for t in (q, k, v))               # [B, H, L, D]
    s = q.shape[-1] ** -0.5
    dq = block_steps(qh, BLOCK_Q)                                              # [B, H, Lq, 1]
    ks = smooth_keys(kh)
    dk = block_steps(ks, BLOCK_K).squeeze(-1)[:, :, None, :]                   # [B, H, 1, Lk]
    qhat = torch.round(qh / dq).clamp(-LEVELS, LEVELS) * dq
    sel = slice(None) if rows is None else rows
    qh, dq, qhat = qh[:, :, sel], dq[:, :, sel], qhat[:, :, sel]
    logits = torch.matmul(qh, kh.transpose(-1, -2)) * s
    if key_padding_mask is not None:
        logits = logits.masked_fill(~key_padding_mask[:, None, None, :].to(q.device), float("-inf"))
    p = torch.softmax(logits, dim=-1)                                          # [B, H, R, Lk]
    o = torch.matmul(p, vh)                                                    # [B, H, R, D]
    # Q term: a_icd = sum_j p_ij v_jc k'_jd - o_ic sum_j p_ij k'_jd
    a = torch.einsum("bhrj,bhjc,bhjd->bhrcd", p, vh, ks) - o[..., None] * torch.matmul(p, ks)[..., None, :]
    var = (s * dq) ** 2 / 12 * a.square().sum(-1)
    # K term: sum_j p_ij^2 dk_j^2 (v_jc - o_ic)^2
    pk = p.square() * dk.square()
    var += s * s * qhat.square().sum(-1, keepdim=True) / 12 * (
        torch.matmul(pk, vh.square()) - 2 * o * torch.matmul(pk, vh) + o.square() * pk.sum(-1, keepdim=True))
    u = unit_roundoff(v.dtype)
    if kernel == "kitchen":
        dv = vh.abs().amax(dim=2, keepdim=True) / LEVELS                       # [B, H, 1, D]
        var += dv.square() / 12 * p.square().sum(-1, keepdim=True)
        var += (p.amax(-1, keepdim=True) / P_LEVELS) ** 2 / 12 * vh.square().sum(2, keepdim=True)
        u = max(u, unit_roundoff(torch.bfloat16))
    sigma_logit = s / math.sqrt(12) * torch.sqrt(
        (dq.square() * ks.square().sum(-1)[:, :, None, :]
         + qhat.square().sum(-1, keepdim=True) * dk.square()).amax(-1, keepdim=True))
    spread = (torch.matmul(p, vh.square()) - o.square()).clamp_min(0).sqrt()
    bound = z * (var.clamp_min(0).sqrt() + sigma_logit.square() * spread) + 3 * u * torch.matmul(p, vh.abs())
    return bound.transpose(1, 2)
