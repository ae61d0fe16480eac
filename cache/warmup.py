"""What a run spends before it is warm: seconds per kind of one-time work, counted process-wide.

The first video of a process costs several times a warm one (on an H200: 9.3 s against 2.0 s). The kinds:
``doctor`` (probing a feature's self-check), ``autotune`` (the operator store measuring kernel configs and
implementations), ``attention_plans`` (the attention choice of every length a run meets, made before its first
chunk), ``graph_capture`` (recording CUDA graphs) and ``compile`` (the first calls of compiled blocks). Each place
that does such work wraps it in ``spent(kind)``; a run takes ``snapshot()`` before and ``since(before)`` after, and
its report shows the breakdown. Nested work is counted once, in the outermost kind (a probe that autotunes is
doctor time).
"""
from __future__ import annotations

import contextlib
import threading
import time

KINDS = ("doctor", "autotune", "attention_plans", "graph_capture", "compile")
_SECONDS: dict = {k: 0.0 for k in KINDS}
_LOCK = threading.Lock()
_DEPTH = threading.local()


@contextlib.contextmanager
def spent(kind: str):
    """Count the wall time of the block under ``kind`` (not again inside another counted block)."""
    if kind not in KINDS:
        raise ValueError(f"warm-up kind must be one of {KINDS}, got {kind!r}")
    depth = getattr(_DEPTH, "n", 0)
    _DEPTH.n = depth + 1
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _DEPTH.n = depth
        if depth == 0:
            with _LOCK:
                _SECONDS[kind] += time.perf_counter() - t0


def snapshot() -> dict:
    with _LOCK:
        return dict(_SECONDS)


def since(before: dict) -> dict:
    """Seconds per kind spent since ``before`` (a ``snapshot()``), rounded; kinds with nothing spent left out."""
    now = snapshot()
    out = {k: round(now[k] - before.get(k, 0.0), 4) for k in KINDS}
    return {k: v for k, v in out.items() if v > 0}


def line(costs: dict) -> str:
    """The breakdown in words, or '' when the run had nothing to warm."""
    if not costs:
        return ""
    return "one-time work in this run: " + ", ".join(f"{k.replace('_', ' ')} {v:.2f} s" for k, v in costs.items())
