"""The one attention entry point of the model.

Layout everywhere is ``[B, L, heads, head_dim]``. Torch SDPA is always available; flash-attn is
detected at run time and used only when it is installed, asked for (or 'auto'), and the call fits it
(CUDA, half precision, no key mask).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "sdpa", "flash_attn")


@functools.lru_cache(maxsize=1)
def _flash_attn_func():
    """flash_attn_func of FA3 or FA2 if importable, else None (never required)."""
    try:
        from flash_attn_interface import flash_attn_func  # FA3
        return flash_attn_func
    except Exception:
        pass
    try:
        from flash_attn import flash_attn_func  # FA2
        return flash_attn_func
    except Exception:
        return None


def flash_attn_available() -> bool:
    return _flash_attn_func() is not None


def check_backend(backend: str) -> str:
    """Validate a backend name; raise a clear error when flash-attn is requested but missing."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "flash_attn" and not flash_attn_available():
        raise RuntimeError("attention backend 'flash_attn' was requested but the flash-attn package "
                           "is not installed; install flash-attn or choose 'auto' / 'sdpa'.")
    return backend


def _use_flash(q: torch.Tensor, key_padding_mask, backend: str) -> bool:
    if backend == "sdpa" or key_padding_mask is not None:
        return False
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    return flash_attn_available()


def _flash(q, k, v):
    out = _flash_attn_func()(q, k, v)
    return out[0] if isinstance(out, tuple) else out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              key_padding_mask: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """Softmax attention, scale 1/sqrt(head_dim), no dropout.

    q [B, Lq, H, D], k/v [B, Lk, H, D]; key_padding_mask [B, Lk] bool, True = real key (attended).
    Returns [B, Lq, H, D] in q's dtype.
    """
    if _use_flash(q, key_padding_mask, backend):
        return _flash(q, k, v)
    mask = None
    if key_padding_mask is not None:
        mask = key_padding_mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask)
    return out.transpose(1, 2)
