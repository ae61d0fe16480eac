"""comfy-kitchen (an optional extra: ``pip install comfyui-wan-accel[kitchen]``): detection and thin wrappers.

comfy-kitchen ships ``adaln`` (LayerNorm without affine, then ``* (1 + scale) + shift``) and ``apply_rope1`` /
``apply_rope`` (interleaved RoPE: pair j is channels 2j, 2j+1) for several backends (``cuda``, ``triton``,
``eager``; ``comfy_kitchen.list_backends()`` says which run here). The wrappers below take the pack's layouts
(per-frame modulation ``[B, F, D]``, RoPE tables ``cos``/``sin`` ``[L, head_dim/2]``) and call one named backend.
Wan's q/k RMSNorm runs over the whole width, so comfy-kitchen's per-head ``rms_rope`` does not apply: only the
rotation is taken from it, after the pack's own full-width RMSNorm.

Nothing here imports comfy-kitchen at module import: without it ``available()`` is False and every backend says
why it cannot run.
"""
from __future__ import annotations

import importlib
import importlib.util

import torch

from ..cache.fingerprint import package_version
from . import _common
from .qk_norm_rope import rmsnorm_float

DISTRIBUTION = "comfy-kitchen"
BACKENDS = ("cuda", "triton", "eager")      # the ones the pack offers as candidates, fastest first
INSTALL_HINT = "pip install 'comfyui-wan-accel[kitchen]' (comfy-kitchen>=0.2.31)"
_STATE: dict = {}


def module():
    """The comfy_kitchen module, or None when it is not installed or does not import (checked once)."""
    if "module" not in _STATE:
        mod = None
        try:
            if importlib.util.find_spec("comfy_kitchen") is not None:
                mod = importlib.import_module("comfy_kitchen")
        except Exception as exc:  # noqa: BLE001 - a broken install counts as absent
            _STATE["error"] = f"{type(exc).__name__}: {exc}"[:200]
            mod = None
        _STATE["module"] = mod
    return _STATE["module"]


def available() -> bool:
    return module() is not None


def version() -> str:
    return package_version(DISTRIBUTION)


def submodule(name: str):
    """comfy-kitchen's submodule ``comfy_kitchen.<name>``, or None where comfy-kitchen or it does not import."""
    if module() is None:
        return None
    try:
        return importlib.import_module(f"comfy_kitchen.{name}")
    except Exception:  # noqa: BLE001 - a broken install counts as absent
        return None


def backend_problem(backend: str, func: str, device) -> str | None:
    """None when comfy-kitchen's ``backend`` runs ``func`` ('adaln', 'apply_rope1') on ``device``; else why not."""
    ck = module()
    if ck is None:
        return "comfy-kitchen is not installed" + (f" ({_STATE['error']})" if _STATE.get("error") else "")
    device = torch.device(device)
    if backend == "triton" and device.type == "cpu":
        # the registry counts Triton only on a GPU; the pack runs it on a CPU under the Triton interpreter
        mod = submodule("backends.triton")
        if not _common.interpreter_usable():
            return _common.triton_problem(device)
        if mod is None or not getattr(mod, "_TRITON_AVAILABLE", False) or not hasattr(mod, func):
            return "comfy-kitchen's triton backend does not import here"
        return None
    status = ck.list_backends().get(backend)
    if status is None:
        return f"comfy-kitchen {version()} has no '{backend}' backend"
    if not status.get("available") or status.get("disabled"):
        return status.get("unavailable_reason") or ("disabled" if status.get("disabled") else "not available")
    if func not in status.get("capabilities", ()):
        return f"comfy-kitchen's {backend} backend has no {func}"
    if backend in ("cuda", "triton") and device.type != "cuda":
        return f"comfy-kitchen's {backend} backend needs a CUDA tensor"
    return None


def accepted_dtypes(backend: str, func: str, param: str = "x") -> frozenset | None:
    """The dtypes comfy-kitchen's ``backend`` declares for ``func``'s ``param`` (its registry's constraints), or
    None where it declares none (any dtype)."""
    ck = module()
    try:
        constraints = ck.registry.get_constraints(backend, func) if ck is not None else None
        found = constraints.params.get(param) if constraints is not None else None
        return frozenset(found.dtypes) if found is not None and found.dtypes is not None else None
    except Exception:  # noqa: BLE001 - an older registry without constraints: any dtype
        return None


def compute_dtype(backend: str, func: str, wanted: torch.dtype, fallback: torch.dtype) -> torch.dtype | None:
    """The dtype to call ``func`` of ``backend`` with: ``wanted`` (e.g. float32 for the rotation) where the backend
    accepts it, else ``fallback`` (the call's own dtype) where it accepts that, else None (it cannot run)."""
    ok = accepted_dtypes(backend, func)
    if ok is None or wanted in ok:
        return wanted
    return fallback if fallback in ok else None


def dtype_problem(backend: str, func: str, dtype: torch.dtype) -> str | None:
    """Why ``func`` of ``backend`` cannot run a call in ``dtype`` (its declared dtypes exclude both float32 and
    ``dtype``), or None."""
    if compute_dtype(backend, func, torch.float32, dtype) is not None:
        return None
    names = ", ".join(sorted(_common.dtype_name(d) for d in accepted_dtypes(backend, func)))
    return f"comfy-kitchen's {backend} {func} takes {names}, the call is {_common.dtype_name(dtype)}"


def _impl(func: str, backend: str):
    if backend == "triton":
        mod = submodule("backends.triton")
        if mod is not None and hasattr(mod, func):
            return getattr(mod, func)
    return module().registry.get_implementation(func, backend=backend)


def adaln(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, backend: str) -> torch.Tensor:
    """The pack's ``layernorm_modulate`` through comfy-kitchen's ``adaln``: x [B, L, D], shift/scale [B or 1, F, D]
    (or [B, D]); token l uses frame ``l // (L // F)``. Result in x's dtype (each backend is called with a dtype
    its constraints accept)."""
    b, l, d = x.shape
    shift, scale = _common.per_frame("adaln", x, shift=shift, scale=scale)
    f = shift.shape[1]
    xf = x.reshape(b, f, l // f, d)
    out = _impl("adaln", backend)(x=xf, scale=scale.to(x.dtype).unsqueeze(2), shift=shift.to(x.dtype).unsqueeze(2),
                                  eps=float(eps))
    return out.reshape(b, l, d)


def freqs_cis(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """comfy-kitchen's rotation table ``[1, L, 1, hd/2, 2, 2]`` (rows [cos, -sin], [sin, cos]) from ``[L, hd/2]``."""
    row0 = torch.stack([cos, -sin], dim=-1)
    row1 = torch.stack([sin, cos], dim=-1)
    return torch.stack([row0, row1], dim=-2)[None, :, None]


def rope1(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str) -> torch.Tensor:
    """Rotate adjacent pairs of x [B, L, H, hd] by tables [L, hd/2] with comfy-kitchen's ``apply_rope1``."""
    return _impl("apply_rope1", backend)(x, freqs_cis(cos, sin))


def norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
              eps: float, backend: str) -> torch.Tensor:
    """The pack's ``rmsnorm_rope`` with the rotation from comfy-kitchen: RMSNorm over the full width in float32
    (Wan's q/k norm), times weight, then ``apply_rope1`` on [B, L, H, hd] in float32; x's dtype out."""
    b, l, d = x.shape
    y = rmsnorm_float(x, weight, eps)
    dt = compute_dtype(backend, "apply_rope1", torch.float32, x.dtype)
    if dt is None:
        raise ValueError(dtype_problem(backend, "apply_rope1", x.dtype))
    out = rope1(y.to(dt).view(b, l, num_heads, d // num_heads), cos.float(), sin.float(), backend)
    return out.to(x.dtype)
