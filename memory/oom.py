"""The pack's one OOM-retry mechanism: run at a size, on out-of-memory free memory, shrink, remember what worked.

``oom_retry(fn, key=..., start=...)``  one operation ``fn(size)``; retried at smaller sizes.
``run_chunks(total, step, key=..., start=...)``  a sequence of chunks ``step(pos, size) -> next_pos``; an OOM in
a chunk shrinks the size and redoes that chunk; finished chunks are kept.

The size that worked after an OOM is stored in the limit cache (namespace ``memory``, the caller's key; the
cache scopes it to this machine), so the next run, in any process, starts there. When even the smallest size
fails, ``NoFitError`` says what was tried and what to change. Before every retry, and before that error, the
failed attempt's tensors are released, ``on_oom`` lets the caller drop its partial state, and the allocator
cache is emptied, so the process stays usable.
"""
from __future__ import annotations

import gc
import logging
from typing import Callable

from ..cache.guarded_import import first_line
from ..cache.oom import is_oom
from .limits import learned_size, record_size

log = logging.getLogger("wan_accel")


class NoFitError(RuntimeError):
    """Even the smallest size ran out of memory."""

    def __init__(self, message: str, *, key: str = "", size: int = 0):
        super().__init__(message)
        self.key, self.size = key, size


def free_memory() -> None:
    """Collect garbage and return cached CUDA blocks to the driver (no-op without CUDA)."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except Exception as exc:  # noqa: BLE001 - cleanup must never raise on top of an OOM
        log.debug("wan_accel: empty_cache failed: %s", exc)


def halve(size: int) -> int | None:
    """Default shrink: half, rounded down; None when already 1."""
    return size // 2 if size > 1 else None


class _Learner:
    def __init__(self, *, key, start, shrink, cache, minimum, unit, on_oom, hint, what):
        self.key, self.shrink, self.cache, self.minimum = key, shrink or halve, cache, int(minimum)
        self.unit, self.on_oom, self.hint, self.what = unit, on_oom, hint, what
        start = int(start)
        if start < self.minimum:
            raise ValueError(f"{what}: start size {start} is below the minimum {self.minimum}")
        learned = learned_size(cache, key) if key else None
        self.size = max(self.minimum, min(start, learned)) if learned is not None else start
        if learned is not None and learned < start:
            log.info("wan_accel: %s starts at the learned %s %d (asked %d)", what, unit, self.size, start)
        self.failed: int | None = None
        self.ooms = 0

    def after_oom(self, message: str) -> None:
        """Called outside the except block (the failed attempt's frames are gone): clean up and shrink."""
        self.ooms += 1
        self.failed = self.size if self.failed is None else min(self.failed, self.size)
        if self.on_oom is not None:
            try:
                self.on_oom(self.size)
            except Exception as exc:  # noqa: BLE001 - cleanup of the caller must not hide the OOM
                log.warning("wan_accel: on_oom cleanup failed: %s", exc)
        free_memory()
        nxt = self.shrink(self.size)
        if nxt is None or nxt < self.minimum or nxt >= self.size:
            hint = self.hint(self.size) if callable(self.hint) else self.hint
            raise NoFitError(
                f"{self.what} ran out of memory even at {self.unit} {self.size} (the smallest tried; "
                f"{self.ooms} attempts). Last error: {message}." + (f" {hint}" if hint else ""),
                key=self.key, size=self.size) from None
        log.warning("wan_accel: %s ran out of memory at %s %d (%s); retrying with %d",
                    self.what, self.unit, self.size, message, nxt)
        self.size = nxt

    def finish(self) -> None:
        if self.failed is not None and self.key:
            record_size(self.cache, self.key, self.size, failed=self.failed, unit=self.unit)


def oom_retry(fn: Callable[[int], object], *, key: str | None, start: int, shrink: Callable | None = None,
              cache=None, minimum: int = 1, unit: str = "size", on_oom: Callable[[int], None] | None = None,
              hint=None, what: str = "operation"):
    """Run ``fn(size)``; on out-of-memory shrink the size (``shrink(size) -> smaller or None``, default halve)
    and retry. Starts at ``min(start, learned)``; after an OOM the size that worked is stored under ``key``.

    ``on_oom(size)`` runs after each OOM to drop partial state. ``hint`` (str or ``f(size) -> str``) ends the
    NoFitError raised when the smallest size fails. Non-OOM exceptions pass through untouched.
    """
    result: list = []
    run_chunks(1, lambda _pos, size: result.append(fn(size)) or 1, key=key, start=start, shrink=shrink, cache=cache,
               minimum=minimum, unit=unit, on_oom=on_oom, hint=hint, what=what)
    return result[0]


def run_chunks(total: int, step: Callable[[int, int], int], *, key: str | None, start: int,
               shrink: Callable | None = None, cache=None, minimum: int = 1, unit: str = "chunk",
               on_oom: Callable[[int], None] | None = None, hint=None, what: str = "chunked operation",
               between: Callable[[int], None] | None = None) -> int:
    """Process positions ``0..total`` with ``step(pos, size) -> next_pos`` (must advance). An OOM inside a step
    shrinks the size and redoes that step. ``between(pos)`` runs after each finished step (progress,
    interrupt). Returns the size in use at the end (learned under ``key`` when an OOM happened)."""
    learner = _Learner(key=key, start=start, shrink=shrink, cache=cache, minimum=minimum, unit=unit,
                       on_oom=on_oom, hint=hint, what=what)
    pos = 0
    while pos < total:
        message = None
        try:
            nxt = step(pos, learner.size)
        except BaseException as exc:  # noqa: BLE001 - filtered just below
            if not is_oom(exc):
                raise
            message = first_line(exc)
        if message is not None:
            learner.after_oom(message)
            continue
        if nxt <= pos:
            raise RuntimeError(f"{what}: step at {pos} did not advance (returned {nxt})")
        pos = nxt
        if between is not None:
            between(pos)
    learner.finish()
    return learner.size
