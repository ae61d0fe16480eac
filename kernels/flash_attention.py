"""Exact attention: the pack's Triton flash-attention forward, one more candidate of the operator store's 'auto'.

Layout ``[B, L, heads, head_dim]`` (the pack's), read through its strides (views of a fused q/k/v projection or of
a KV cache are taken as they are: no transpose, no copy; only a head dimension that is not contiguous is copied).
Non-causal, no key padding mask (a masked call is SDPA's: ``model/attention.attention`` routes it there before
'auto'), head sizes a power of two from 16 to 256, bf16 and fp16 in, the output in q's dtype.

One program per ``BLOCK_M`` queries of one (batch, head) loops over the keys ``BLOCK_N`` at a time:

* ``s = q . k^T`` on the tensor cores, bf16/fp16 operands summed in float32;
* the softmax is the online one in base 2, the scale folded into the exponent: with ``c = log2(e) / sqrt(D)``,
  a running maximum ``m_i`` of ``c s``, ``p = 2^(c s - m_i)`` in [0, 1], the earlier row sum ``l_i`` and
  accumulator rescaled by ``2^(m_old - m_new)`` whenever the maximum grows;
* ``acc += p . v`` with p rounded to the operands' dtype (as every fused attention kernel does) and summed in
  float32; the output is ``acc / l_i`` rounded once to q's dtype.

Every key tile but the last is read unmasked; the last one, when the key count is no multiple of ``BLOCK_N``, is
masked (its missing keys get the logit -inf, their values 0), and the queries past the end are neither read nor
written. Numerically this is the class of cuDNN's and FlashAttention's kernels: float32 softmax and sums, one
rounding of P and one of the output; the store checks it against plain float32 softmax math like every other
exact candidate (``model/attention.py``, ``STORE_ULPS``) before timing it, and uses it only where it is verified
and fastest. Its tiles (``BLOCK_M`` x ``BLOCK_N``, warps, pipeline stages) go through the operator store too
(``_common.launched``), those whose shared memory exceeds the GPU's pruned by ``_smem``. Nothing about its
speed is claimed until a GPU measures it.

Under ``TRITON_INTERPRET=1`` the kernel runs on a CPU (tests). For bf16 it then emulates what the GPU does: it
rounds P and the output to bf16 itself (to nearest even, as the GPU's conversion does: the interpreter's
truncates) and multiplies float32 copies of the bf16 operands (exact: the interpreter's own product of bf16
tensors multiplies their bit patterns). The store does not list it on
a CPU (``kernel_problem``): the interpreter gives its numbers, not its speed.
"""
from __future__ import annotations

import logging
import sys

import torch

from . import _common, registry
from ._tiles import head_rows, round_bf16, tl, triton

log = logging.getLogger("wan_accel")

NAME = "flash_attention"
LOG2E = 1.4426950408889634
HEAD_DIMS = (16, 32, 64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16)
CAPABILITY = (8, 0)              # bf16 tensor cores: Ampere, Ada, Hopper and later
# Tile configs, the Hopper default first (128 x 128, 8 warps, 3 stages for head size 128: Q plus three stages of
# K and V tiles fill sm_90's 227 KiB); the smaller ones fit sm_89's 99 KiB and the large head sizes. The operator
# store prunes those whose estimated shared memory (_smem) exceeds the GPU's, then times the rest per call shape.
CANDIDATES = tuple({"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s} for m, n, w, s in (
    (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3), (64, 128, 4, 3),
    (64, 64, 4, 3), (128, 32, 4, 2), (64, 32, 4, 2), (32, 32, 4, 1)))
_STATE: dict = {}


def _smem(cfg: dict, head_dim: int, elem: int = 2, hopper: bool = True) -> int:
    """Upper estimate of the shared memory (bytes) of one program: the Q tile and the buffers of the K and V tiles
    the loop pipelines (Hopper keeps ``num_stages`` of them, older GPUs one fewer, at least one). P stays in
    registers between the two products."""
    buffers = cfg["num_stages"] if hopper else max(1, cfg["num_stages"] - 1)
    return (cfg["BLOCK_M"] + buffers * 2 * cfg["BLOCK_N"]) * head_dim * elem


# ----------------------------------------------------------------------------- Triton kernel
if tl is not None:
    @triton.jit
    def _attend_tiles(acc, l_i, m_i, q, k_base, v_base, k_sn, v_sn, start, stop, Lk, qk_scale, offs_d, offs_t,
                      BLOCK_N: tl.constexpr, MASKED: tl.constexpr, EMULATE_BF16: tl.constexpr):
        # the online softmax over the key tiles [start, stop): (acc, l_i, m_i) updated; MASKED for the last,
        # partial tile (keys from Lk on take no part)
        for s0 in range(start, stop, BLOCK_N):
            offs_n = s0 + offs_t
            n64 = offs_n.to(tl.int64)
            k_ptrs = k_base + n64[:, None] * k_sn + offs_d[None, :]                      # [BLOCK_N, HEAD]
            v_ptrs = v_base + n64[:, None] * v_sn + offs_d[None, :]
            if MASKED:
                n_ok = offs_n < Lk
                k = tl.load(k_ptrs, mask=n_ok[:, None], other=0.0)
            else:
                k = tl.load(k_ptrs)
            if EMULATE_BF16:   # interpreter only: its tl.dot multiplies bf16 bit patterns as integers
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
            else:
                s = tl.dot(q, tl.trans(k))                                                # float32 [BLOCK_M, BLOCK_N]
            if MASKED:
                s = tl.where(n_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if MASKED:
                v = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
            else:
                v = tl.load(v_ptrs)
            if EMULATE_BF16:  # interpreter only: P rounded to bf16 as the GPU converts it, both factors of the
                #               product in float32 (exact: bf16 products fit float32)
                acc = acc * alpha[:, None] + tl.dot(round_bf16(p), v.to(tl.float32))
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        return acc, l_i, m_i

    def _flash_attn_kernel(Q, K, V, O, Lq, Lk, H, qk_scale,
                           q_sb, q_sm, q_sh, k_sb, k_sn, k_sh, v_sb, v_sn, v_sh, o_sb, o_sm, o_sh,
                           HEAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           EMULATE_BF16: tl.constexpr):
        b, h, m64, m_ok = head_rows(Lq, H, BLOCK_M)
        offs_d = tl.arange(0, HEAD)
        offs_t = tl.arange(0, BLOCK_N)
        q = tl.load(Q + b * q_sb + h * q_sh + m64[:, None] * q_sm + offs_d[None, :], mask=m_ok[:, None], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD], tl.float32)
        k_base = K + b * k_sb + h * k_sh
        v_base = V + b * v_sb + h * v_sh
        full = (Lk // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_base, v_base, k_sn, v_sn, 0, full, Lk, qk_scale,
                                      offs_d, offs_t, BLOCK_N, False, EMULATE_BF16)
        if full < Lk:
            acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_base, v_base, k_sn, v_sn, full, Lk, Lk, qk_scale,
                                          offs_d, offs_t, BLOCK_N, True, EMULATE_BF16)
        out = acc / l_i[:, None]
        if EMULATE_BF16:  # interpreter only: the GPU's round-to-nearest-even bf16 conversion
            out = round_bf16(out)
        tl.store(O + b * o_sb + h * o_sh + m64[:, None] * o_sm + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=m_ok[:, None])

    # the store's name: a hash of this whole file (the kernel, its two helpers and its tile configs)
    _KERNEL_NAME = _common.kernel_name(NAME, sys.modules[__name__])
    _JITTED_INTERPRETED = _common.interpret_enabled()   # the helpers above were decorated in this mode
else:
    _KERNEL_NAME = NAME
    _JITTED_INTERPRETED = False


def _installed_problem(device=None, dtype=None, head_dim=None) -> str | None:
    if tl is None or _common.triton_module() is None:
        return "Triton is not installed"
    if _common.interpret_enabled() != _JITTED_INTERPRETED:
        return "TRITON_INTERPRET changed after the pack was imported (set it before the process starts)"
    return None


# what the kernel takes on any device, as the op registry's data (its candidate of exact attention is
# ``model/attention.py``'s 'triton')
TAKES = registry.Candidate("attention", "triton", "triton", problem=_installed_problem, dtypes=DTYPES,
                           head_dims=HEAD_DIMS, capability=CAPABILITY)


def kernel_problem(device, dtype: torch.dtype = torch.bfloat16, head_dim: int = 128,
                   masked: bool = False) -> str | None:
    """None when the kernel is a candidate for calls on this device, dtype and head size; else why not. A CPU is
    never one (the Triton interpreter gives the kernel's numbers, not a speed worth timing)."""
    if masked:
        return "the kernel takes no key padding mask (masked calls use SDPA)"
    return TAKES.rejected(device, dtype, head_dim) or (None if torch.device(device).type == "cuda" else "the kernel needs a CUDA GPU")


def runs_here(q: torch.Tensor) -> bool:
    """True when the kernel itself runs for ``q``'s call: a candidate GPU, or a CPU under the Triton interpreter."""
    if q.device.type == "cpu":
        return _common.interpreter_usable() and TAKES.rejected("cpu", q.dtype, q.shape[-1]) is None
    return kernel_problem(q.device, q.dtype, q.shape[-1]) is None


def _check(q, k, v) -> None:
    _common.check_qkv(q, k, v, "flash attention")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"flash attention takes q, k, v of one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")


def _sdpa(q, k, v):
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v by the Triton kernel (module doc): q [B, Lq, H, D], k/v [B, Lk, H, D] of one
    dtype, [B, Lq, H, D] in q's dtype. ``config``: one tile config (tests); None: the operator store's. Where the
    kernel cannot take the call (``kernel_problem``; a call that needs gradients: the kernel has no backward) or
    every tile config fails, torch's SDPA answers (exact)."""
    _check(q, k, v)
    if k.shape[1] == 0 or q.numel() == 0:          # no keys: nothing attended; no queries: nothing to do
        return q.new_zeros(q.shape)
    if not runs_here(q) or _common.needs_autograd(q, k, v):      # the kernel has no backward
        return _sdpa(q, k, v)
    q, k, v = _common.unit_last(q), _common.unit_last(k), _common.unit_last(v)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    b, lq, h, d = q.shape
    lk = k.shape[1]
    qk_scale = LOG2E / d ** 0.5
    rnd = _common.round_bf16(out)

    def launch(cfg: dict):
        _common.run_kernel(_flash_attn_kernel, (_common.cdiv(lq, cfg["BLOCK_M"]), b * h), q,
                           q, k, v, out, lq, lk, h, qk_scale,
                           q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                           v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
                           HEAD=d, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], EMULATE_BF16=rnd,
                           num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

    key = f"D={d}|q={_common.rows_bucket(lq)}|k={_common.rows_bucket(lk)}|h={h}|{_common.dtype_name(out)}"
    hopper = q.is_cuda and registry.capability(q.device)[0] >= 9
    if _common.launched(_KERNEL_NAME, key, CANDIDATES, launch, config, q,
                        smem=lambda cfg: _smem(cfg, q.shape[-1], q.element_size(), hopper)):
        return out
    if not _STATE.get("warned"):
        _STATE["warned"] = True
        log.warning("wan_accel: no tile config of the Triton flash-attention kernel launched for %s; SDPA answers",
                    key)
    return _sdpa(q, k, v)
