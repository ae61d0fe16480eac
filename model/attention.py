"""The one attention entry point of the model, and the choice of attention backend.

Layout everywhere is ``[B, L, heads, head_dim]``. Backends:

* ``fa3``: FlashAttention 3 (``flash_attn_interface``), Hopper GPUs (compute capability 9.x);
* ``fa2``: FlashAttention 2 (``flash_attn``), compute capability 8.0 or newer *and* kernels for this GPU in the
  installed build: wheels built without sm_100 / sm_120 code fail with "no kernel image is available", so a tiny
  probe call decides once per device (and a kernel-image error at run time falls back to SDPA for good);
* ``sdpa``: torch's scaled_dot_product_attention (always available; it picks its own fused kernel);
* ``int8``: opt-in, never chosen by ``auto``: SageAttention-style int8 Q/K (``kernels/int8_attention.py``):
  comfy-kitchen's int8 kernel where it runs (CUDA), else the pack's torch version of the same math (anywhere).
  It changes the numerics within ``kernels.int8_attention.error_bound``; every other backend is exact.

A request (``auto``, ``flash_attn``, ``fa3``, ``fa2``, ``sdpa``) is resolved by capability detection: the package
imports, the GPU's compute capability, the dtype (half precision) and the head size. GPU names are never looked
at. ``resolve_backend`` does this once (the optimized sampler calls it when a run starts); ``attention`` also
accepts an unresolved request and resolves it per call (cached), which is what the reference path does.
FlashAttention's return type differs between releases (a tensor, or a tuple whose first item is the output):
both are handled.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from ..kernels import int8_attention as int8

log = logging.getLogger("wan_accel")

BACKENDS = ("auto", "sdpa", "flash_attn", "fa3", "fa2", "int8")
RESOLVED = ("fa3", "fa2", "sdpa", "int8")
_MODULES = {"fa3": "flash_attn_interface", "fa2": "flash_attn"}
_FUNCS: dict = {}          # "fa3"/"fa2" -> flash_attn_func or None (import attempted once)


def _load(name: str):
    """flash_attn_func of FA3 / FA2, or None when the package does not import (never required)."""
    if name not in _FUNCS:
        fn = None
        try:
            module = __import__(_MODULES[name], fromlist=["flash_attn_func"])
            fn = getattr(module, "flash_attn_func", None)
        except Exception:  # noqa: BLE001 - any import failure means: not available
            fn = None
        _FUNCS[name] = fn
    return _FUNCS[name]


def fa_available(name: str) -> bool:
    """True when FlashAttention ``name`` ('fa3' or 'fa2') imports."""
    return _load(name) is not None


def flash_attn_available() -> bool:
    return fa_available("fa3") or fa_available("fa2")


def check_backend(backend: str) -> str:
    """Validate a backend request; raise a clear error when a FlashAttention package it needs is missing."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "flash_attn" and not flash_attn_available():
        raise RuntimeError("attention backend 'flash_attn' was requested but the flash-attn package "
                           "is not installed; install flash-attn or choose 'auto' / 'sdpa'.")
    if backend in _MODULES and not fa_available(backend):
        raise RuntimeError(f"attention backend {backend!r} was requested but {_MODULES[backend]} does not import; "
                           f"install {'FlashAttention 3 (hopper build)' if backend == 'fa3' else 'flash-attn 2'} "
                           f"or choose 'auto' / 'sdpa'.")
    return backend


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple:
    return tuple(torch.cuda.get_device_capability(device_index))


def capability_supports(name: str, capability: tuple) -> bool:
    """Compute-capability rule of each FlashAttention generation."""
    if name == "fa3":
        return capability[0] == 9
    if name == "fa2":
        return capability[0] >= 8
    return True


_BUILD: dict = {}          # (name, device index) -> None (ok) or the probe's error


NO_KERNEL_MESSAGES = ("no kernel image", "invalid device function", "not compiled for", "unsupported gpu",
                      "sm_", "only supports ampere")


def _is_no_kernel_error(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in NO_KERNEL_MESSAGES)


def _probe_inputs(device, dtype):
    """Tiny q/k/v for the build probe on ``device``, or None where they cannot be made (no CUDA here)."""
    try:
        q = torch.zeros(1, 1, 1, 64, dtype=dtype, device=device)
    except Exception:  # noqa: BLE001 - no CUDA in this process: nothing to probe
        return None
    return q, q, q


def build_supports(name: str, device, dtype=torch.float16) -> str | None:
    """None when the installed FlashAttention ``name`` runs on ``device`` (one tiny call, cached per device);
    else the error it gave (e.g. "no kernel image is available")."""
    device = torch.device(device)
    key = (name, device.index)
    if key not in _BUILD:
        fn = _FUNCS.get(name) or _load(name)
        inputs = _probe_inputs(device, dtype) if fn is not None else None
        error = None
        if inputs is not None:
            try:
                fn(*inputs)
            except Exception as exc:  # noqa: BLE001 - whatever fails here would fail in the model
                error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:200]
        _BUILD[key] = error
    return _BUILD[key]


def _mark_unusable(name: str, device, error: BaseException) -> None:
    _BUILD[(name, torch.device(device).index)] = f"{type(error).__name__}: {str(error).strip()[:200]}"
    resolve_backend.cache_clear()
    log.warning("wan_accel: %s has no kernels for this GPU in the installed build (%s); using SDPA from now on",
                _MODULES[name], str(error).strip()[:200])


def head_dim_supported(head_dim: int) -> bool:
    return head_dim % 8 == 0 and 0 < head_dim <= 256


def _candidates(requested: str) -> tuple:
    return {"auto": ("fa3", "fa2", "sdpa"), "flash_attn": ("fa3", "fa2", "sdpa"),
            "fa3": ("fa3", "sdpa"), "fa2": ("fa2", "sdpa"), "sdpa": ("sdpa",)}[requested]


def explain_backend(requested: str, device, dtype: torch.dtype, head_dim: int,
                    capability: tuple | None = None) -> tuple[str, str]:
    """(resolved backend, reason in words) for a request on this device, dtype and head size."""
    if requested not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {requested!r}")
    device = torch.device(device)
    if requested == "int8":
        return "int8", int8.implementation(device, dtype, head_dim)[1]
    why = []
    for name in _candidates(requested):
        if name == "sdpa":
            break
        if device.type != "cuda":
            why.append(f"{name}: needs a CUDA device")
            continue
        if dtype not in (torch.float16, torch.bfloat16):
            why.append(f"{name}: needs fp16/bf16 (got {str(dtype).replace('torch.', '')})")
            continue
        if not fa_available(name):
            why.append(f"{name}: {_MODULES[name]} not installed")
            continue
        cap = capability or _capability(device.index if device.index is not None else torch.cuda.current_device())
        if not capability_supports(name, cap):
            why.append(f"{name}: compute capability {cap[0]}.{cap[1]} not supported")
            continue
        if not head_dim_supported(head_dim):
            why.append(f"{name}: head size {head_dim} not supported")
            continue
        failed = build_supports(name, device, dtype)
        if failed:
            why.append(f"{name}: the installed build does not run on SM {cap[0]}.{cap[1]} ({failed})")
            continue
        skipped = f" (skipped {'; '.join(why)})" if why else ""
        return name, f"{name} ({_MODULES[name]}) for requested '{requested}'{skipped}"
    reason = "torch SDPA" + (f" ({'; '.join(why)})" if why else "")
    if requested in ("fa3", "fa2", "flash_attn") and why:
        log.warning("wan_accel: attention '%s' is not usable here, using SDPA: %s", requested, "; ".join(why))
    return "sdpa", reason


@functools.lru_cache(maxsize=64)
def resolve_backend(requested: str, device, dtype: torch.dtype, head_dim: int) -> str:
    """'fa3' | 'fa2' | 'sdpa' | 'int8' for a request (cached per device, dtype and head size)."""
    return explain_backend(requested, device, dtype, head_dim)[0]


def _flash(name: str, q, k, v):
    fn = _FUNCS.get(name) or _load(name)
    if fn is None:
        raise RuntimeError(f"attention backend {name!r} needs {_MODULES[name]}, which does not import")
    if _BUILD.get((name, q.device.index)):
        return _sdpa(q, k, v)       # this build has no kernels for this GPU (found at run time)
    try:
        out = fn(q, k, v)
    except RuntimeError as exc:
        if not _is_no_kernel_error(exc):
            raise
        _mark_unusable(name, q.device, exc)
        return _sdpa(q, k, v)
    return out[0] if isinstance(out, (tuple, list)) else out


def _sdpa(q, k, v, mask=None):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              key_padding_mask: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """Softmax attention, scale 1/sqrt(head_dim), no dropout, dense (every query sees every key).

    q [B, Lq, H, D], k/v [B, Lk, H, D]; key_padding_mask [B, Lk] bool, True = real key (attended).
    backend: a resolved name ('fa3', 'fa2', 'sdpa', 'int8': dispatched directly) or a request ('auto',
    'flash_attn'). Returns [B, Lq, H, D] in q's dtype.
    """
    if backend == "int8":
        return int8.int8_attention(q, k, v, key_padding_mask)
    if key_padding_mask is not None:
        return _sdpa(q, k, v, key_padding_mask[:, None, None, :])
    if backend == "sdpa" or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return _sdpa(q, k, v)
    if backend not in RESOLVED:
        backend = resolve_backend(backend, q.device, q.dtype, q.shape[-1])
        if backend == "sdpa":
            return _sdpa(q, k, v)
    return _flash(backend, q, k, v)
