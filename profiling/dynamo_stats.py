"""What torch.compile did during a window: compile time per phase, graph breaks, recompiles (with reasons).

All of it is read from process-wide counters that only grow, so a window is a snapshot before and a difference
after; nothing is reset (resetting would throw away every compiled model of the process, which is exactly what
``torch._dynamo.explain`` does and why it only ever runs in a subprocess, see ``explain.py``). The private
torch APIs used here are feature-detected; a missing one yields empty results, never an error.
"""
from __future__ import annotations

import logging
import re

# Frame-level compile time, newest name first (the name changed across torch releases).
FRAME_COMPILE_KEYS = ("_compile.compile_inner", "entire_frame_compile", "_compile.<locals>.compile_inner")
_URL_LINE = re.compile(r"\s*For more details about this graph break.*$", re.S)


def _dynamo_utils():
    try:
        import torch._dynamo.utils as utils
    except Exception:  # noqa: BLE001 - no dynamo: nothing to measure
        return None
    return utils


def _compile_time_lists(utils) -> dict[str, list[float]]:
    metrics = getattr(utils, "compilation_time_metrics", None)
    if isinstance(metrics, dict):
        return {str(k): [float(x) for x in v] for k, v in metrics.items()}
    fn = getattr(utils, "compile_times", None)  # older/newer layouts: parse the csv form
    if fn is None:
        return {}
    try:
        headers, values = fn(repr="csv", aggregate=False)
    except Exception:  # noqa: BLE001
        return {}
    out = {}
    for h, v in zip(headers, values):
        try:
            out[str(h)] = [float(x) for x in str(v).split(",") if x.strip()]
        except ValueError:
            continue
    return out


def _counters(utils) -> dict[str, dict[str, int]]:
    counters = getattr(utils, "counters", None) or {}
    return {str(k): {str(kk): int(vv) for kk, vv in dict(v).items()} for k, v in dict(counters).items()}


def _metrics(utils) -> list:
    getter = getattr(utils, "get_compilation_metrics", None)
    if getter is None:
        return []
    try:
        return list(getter())
    except Exception:  # noqa: BLE001
        return []


def short_reason(reason: str) -> str:
    """A graph-break reason without the trailing web link and blank lines."""
    text = _URL_LINE.sub("", str(reason)).strip()
    return re.sub(r"\n\s*\n", "\n", text)


class _WarningCapture(logging.Handler):
    """Collects WARNING+ records of the dynamo logger (e.g. 'hit config.recompile_limit')."""

    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):  # noqa: D102
        try:
            self.messages.append(record.getMessage())
        except Exception:  # noqa: BLE001 - a broken record must not break the run
            pass


class DynamoWindow:
    """``start()`` before the work, ``stop()`` after: it returns the difference as plain data."""

    def __init__(self):
        self._utils = _dynamo_utils()
        self._times0: dict[str, list[float]] = {}
        self._counters0: dict[str, dict[str, int]] = {}
        self._metrics0: list = []
        self._metric_ids: set[int] = set()
        self._capture = _WarningCapture()
        self._logger = logging.getLogger("torch._dynamo")

    def start(self) -> "DynamoWindow":
        if self._utils is not None:
            self._times0 = _compile_time_lists(self._utils)
            self._counters0 = _counters(self._utils)
            self._metrics0 = _metrics(self._utils)  # keep references so ids stay unique
            self._metric_ids = {id(m) for m in self._metrics0}
        self._logger.addHandler(self._capture)
        return self

    def stop(self) -> dict:
        self._logger.removeHandler(self._capture)
        out = {"available": self._utils is not None, "compile_phases_s": {}, "compile_total_s": 0.0,
               "frames_compiled": 0, "graph_break_count": 0, "graph_breaks": [], "recompile_count": 0,
               "recompiles": [], "warnings": list(self._capture.messages)}
        if self._utils is None:
            return out
        phases = {}
        for key, values in _compile_time_lists(self._utils).items():
            new = values[len(self._times0.get(key, [])):]
            if new:
                phases[key] = round(sum(new), 6)
        out["compile_phases_s"] = dict(sorted(phases.items(), key=lambda kv: kv[1], reverse=True))
        total_key = next((k for k in FRAME_COMPILE_KEYS if k in phases), None)
        out["compile_total_s"] = phases.get(total_key, max(phases.values(), default=0.0))

        counters = _counters(self._utils)

        def delta(group: str) -> dict[str, int]:
            before = self._counters0.get(group, {})
            d = {k: v - before.get(k, 0) for k, v in counters.get(group, {}).items()}
            return {k: v for k, v in d.items() if v > 0}

        out["frames_compiled"] = delta("frames").get("total", 0)
        breaks = [{"reason": short_reason(r), "count": n} for r, n in delta("graph_break").items()]
        breaks.sort(key=lambda b: b["count"], reverse=True)
        out["graph_breaks"] = breaks
        out["graph_break_count"] = sum(b["count"] for b in breaks)

        recompiles = []
        for m in _metrics(self._utils):
            if id(m) in self._metric_ids:
                continue
            reason = getattr(m, "recompile_reason", None)
            if reason:
                where = f"{getattr(m, 'co_name', '?')} ({getattr(m, 'co_filename', '?')}:" \
                        f"{getattr(m, 'co_firstlineno', '?')})"
                recompiles.append({"function": where, "reason": str(reason),
                                   "compile_id": str(getattr(m, "compile_id", ""))})
        out["recompiles"] = recompiles
        out["recompile_count"] = len(recompiles)
        return out
