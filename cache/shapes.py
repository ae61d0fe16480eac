"""The shapes of the values the pack's features store in the limit cache, registered with ``register_shape``.

A value that does not fit its namespace's shape (a string where a memory limit's number belongs, a timing that
is not a number) is set aside alone when the cache is read and refused when it is written. The checks look only
at the fields their readers use, so a writer may add fields. The ``operator`` shape lives beside its writer
(cache/autotune.py); upper floors may register theirs (``doctor``) the same way.
"""
from __future__ import annotations

from .autotune import operator_shape  # noqa: F401 - importing autotune registers the operator shape
from .entries import finite_number as _number, register_shape


def _field(value: dict, name: str, ok, what: str, required: bool = False) -> None:
    if name not in value:
        if required:
            raise ValueError(f"{name!r} is missing ({what} expected)")
        return
    if not ok(value[name]):
        raise ValueError(f"{name!r} is {value[name]!r:.60}, expected {what}")


def memory_shape(value: dict) -> None:
    """``{"size": n, "failed": m | None, "unit": str, "ooms": k}`` (memory/limits.py): ``size`` is the size that
    ran (resident blocks, latent frames per chunk), a finite number >= 0."""
    _field(value, "size", lambda v: _number(v) and v >= 0, "a finite number >= 0")
    _field(value, "failed", lambda v: v is None or (_number(v) and v >= 0), "a finite number >= 0 or null")
    _field(value, "ooms", lambda v: _number(v) and v >= 0, "a finite number >= 0")
    _field(value, "unit", lambda v: isinstance(v, str), "a string")


def compile_shape(value: dict) -> None:
    """``{"file": name, "bytes": n, "saved": t, "artifacts": {...}, "torch": version}`` (compile/warm_start.py)."""
    _field(value, "file", lambda v: isinstance(v, str) and v and "/" not in v and "\\" not in v,
           "a file name beside the cache")
    _field(value, "bytes", lambda v: _number(v) and v >= 0, "a finite number >= 0")
    _field(value, "saved", _number, "a time (a finite number)")
    _field(value, "artifacts", lambda v: isinstance(v, dict), "an object")
    _field(value, "torch", lambda v: isinstance(v, str), "a string")


def sampler_shape(value: dict) -> None:
    """``{"ok": bool, "error": str | None, "when": t, <software versions>}`` (sampling/cuda_graphs.py)."""
    _field(value, "ok", lambda v: isinstance(v, bool), "true or false")
    _field(value, "error", lambda v: v is None or isinstance(v, str), "a string or null")
    _field(value, "when", _number, "a time (a finite number)")


register_shape("memory", memory_shape)
register_shape("compile", compile_shape)
register_shape("sampler", sampler_shape)
