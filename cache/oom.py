"""The pack's one definition of "out of memory" (pure: no torch import needed, none at import).

``is_oom(exc)`` is used by the OOM-retry loops (``memory/oom.py``), the CUDA-graph manager (a capture that ran
out of memory is not a capture failure) and the kernel autotuner (an out-of-memory config says nothing about the
config). ``SoftOOM`` is raised by a step that only succeeded in a degraded way.
"""
from __future__ import annotations

OOM_MESSAGES = ("out of memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed",
                "cudaerrormemoryallocation", "hiperroroutofmemory")


class SoftOOM(Exception):
    """Raised by a step that succeeded only in a degraded way (e.g. a VAE that fell back to tiling): treat the size
    as too large, like an out-of-memory error."""


def _torch_oom_types() -> tuple:
    import sys

    torch = sys.modules.get("torch")   # never imports torch: an exception of torch means torch is loaded
    if torch is None:
        return ()
    return tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                             getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)) if isinstance(t, type))


def is_oom(exc: BaseException) -> bool:
    """True for torch.OutOfMemoryError, CUDA/HIP allocation failures reported as RuntimeError, MemoryError and
    SoftOOM."""
    if isinstance(exc, (MemoryError, SoftOOM)):
        return True
    oom_types = _torch_oom_types()
    if oom_types and isinstance(exc, oom_types):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc).lower()
        return type(exc).__name__ == "OutOfMemoryError" or any(m in text for m in OOM_MESSAGES)
    return False
