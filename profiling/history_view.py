"""Views of the metrics history: table rows and a PNG plot of speed and peak memory over runs.

The plot needs matplotlib (optional extra ``plot``); it draws on an Agg canvas without touching pyplot's global
state, so it is safe inside a running ComfyUI.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from ..cache.owned_files import write_with

# Speed keys of ``timings``, best first: higher is better for these.
SPEED_KEYS = ("frames_per_s", "steps_per_s", "it_per_s")
COLUMNS = ["n", "time", "kind", "label", "speed", "total_s", "peak_mem", "cache_hits", "machine", "settings"]


class PlotUnavailable(RuntimeError):
    """matplotlib is missing."""


def speed_metric(records: list[dict]) -> str | None:
    """The speed key present in the most records (ties: the earlier key of SPEED_KEYS); None if none has one."""
    counts = {k: sum(1 for r in records if _num((r.get("timings") or {}).get(k)) is not None) for k in SPEED_KEYS}
    best = max(SPEED_KEYS, key=lambda k: counts[k])
    return best if counts[best] else None


def _num(v):
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _gib(b):
    b = _num(b)
    return None if b is None else b / 2**30


def _short(v, width: int = 48) -> str:
    if v in (None, "", {}, []):
        return ""
    s = v if isinstance(v, str) else json.dumps(v, sort_keys=True, separators=(",", ":"), default=str)
    return s if len(s) <= width else s[: width - 3] + "..."


def table_rows(records: list[dict]) -> list[dict]:
    """One display row (strings) per record, for the report table."""
    metric = speed_metric(records)
    rows = []
    for i, r in enumerate(records, start=1):
        t = r.get("timings") or {}
        ts = _num(r.get("timestamp"))
        speed = _num(t.get(metric)) if metric else None
        total = _num(t.get("total_s"))
        mem = _gib(r.get("peak_memory_bytes"))
        rows.append({
            "n": str(i),
            "time": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts is not None else "?",
            "kind": str(r.get("kind", "?")),
            "label": _short(r.get("label"), 24),
            "speed": f"{speed:.3f} {metric.replace('_per_s', '/s')}" if speed is not None else "",
            "total_s": f"{total:.3f}" if total is not None else "",
            "peak_mem": f"{mem:.2f} GiB" if mem is not None else "",
            "cache_hits": _short(r.get("cache_hits"), 24),
            "machine": str(r.get("fingerprint") or "")[:8],
            "settings": _short(r.get("settings")),
        })
    return rows


def plot_history(records: list[dict], out_path) -> Path:
    """Write a PNG with two panels over the run index: speed (or run time) and peak memory."""
    from ..cache.guarded_import import ImportProblem, guarded_import
    try:                        # one that is installed but fails is named with its error, never "install it"
        FigureCanvasAgg = guarded_import("matplotlib.backends.backend_agg").FigureCanvasAgg
        Figure = guarded_import("matplotlib.figure").Figure
        MaxNLocator = guarded_import("matplotlib.ticker").MaxNLocator
    except ImportProblem as problem:
        raise PlotUnavailable(f"plotting needs matplotlib: {problem}" + ("" if problem.installed else
                              "; pip install matplotlib (or install this pack with the 'plot' extra)")) from None
    if not records:
        raise ValueError("the metrics history is empty: nothing to plot (run generate, bench or profile first)")
    metric = speed_metric(records)
    key, ylabel = (metric, metric.replace("_per_s", " / s")) if metric else ("total_s", "run time (s, lower is better)")
    fig = Figure(figsize=(9, 6), dpi=100)
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(2, 1, sharex=True)
    kinds = sorted({str(r.get("kind", "?")) for r in records})
    for kind in kinds:
        xs = [i for i, r in enumerate(records, 1) if str(r.get("kind", "?")) == kind]
        speed = [_num((records[i - 1].get("timings") or {}).get(key)) for i in xs]
        mem = [_gib(records[i - 1].get("peak_memory_bytes")) for i in xs]
        for ax, ys, marker in ((ax1, speed, "o"), (ax2, mem, "s")):
            pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
            if pts:
                ax.plot(*zip(*pts), marker=marker, linestyle="-", label=kind)
    ax1.set_ylabel(ylabel)
    ax1.set_title("wan_accel metrics history")
    ax2.set_ylabel("peak memory (GiB)")
    ax2.set_xlabel("run (oldest to newest)")
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    return write_with(out_path, lambda tmp: fig.savefig(tmp, format="png"), purpose="the history plot")
