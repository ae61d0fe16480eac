"""Run work under torch.profiler and turn what happened into a ProfileReport.

``profile_run(fn, runs=..., out_dir=..., trace_name=..., device=...)`` is the one-call form. ``ProfileSession``
is the same machinery split in steps, for callers that see the work one call at a time (a ComfyUI model
wrapper profiling the next N model calls into one trace).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..cache.owned_files import write_with
from ..cache.paths import comfy_folder
from .dynamo_stats import DynamoWindow
from .report import ProfileReport
from .trace_stats import gpu_idle_stats, kernel_breakdown, top_kernels

log = logging.getLogger("wan_accel.profiling")

# Traces larger than this are written but not re-read for the idle/kernel statistics.
MAX_TRACE_BYTES_TO_ANALYSE = 768 * 1024 * 1024
TOP = 15        # rows of the top ops and top kernels tables
_LOCK = threading.Lock()


def profiler_busy() -> bool:
    """True when a torch profiler is already recording in this process (profilers cannot nest)."""
    try:
        import torch
        import torch.autograd.profiler as ap

        enabled = getattr(torch._C._autograd, "_profiler_enabled", None)
        return bool(ap._is_profiler_enabled) or (enabled is not None and bool(enabled()))
    except Exception:  # noqa: BLE001
        return False


def unique_trace_path(out_dir, trace_name: str) -> Path:
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(trace_name)).strip("._") or "profile"
    stem = f"{safe}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = out / f"{stem}.json", 1
    while os.path.lexists(path):     # a dangling link is taken too: the trace never goes through a link
        n += 1
        path = out / f"{stem}_{n}.json"
    return path


def sync_device(device) -> None:
    """Wait for the work queued on ``device`` (a torch device or its name) when it is a CUDA device."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device) -> tuple[int | None, int | None]:
    """This process's peak memory so far in bytes, (used, reserved): CUDA's max allocated and max reserved on a CUDA
    device, else the host's peak RSS and None (used is None too where there is no ``resource`` module: Windows)."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device)), int(torch.cuda.max_memory_reserved(device))
    try:
        import resource
    except ImportError:  # Windows
        return None, None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (int(rss) if sys.platform == "darwin" else int(rss) * 1024), None


def peak_memory_mb(device) -> dict:
    """``peak_memory_bytes`` in MiB, as the generate jobs' and the bench's reports give it."""
    used, reserved = peak_memory_bytes(device)
    if device.type == "cuda":
        return {"cuda_max_allocated_mb": used / 2**20, "cuda_max_reserved_mb": reserved / 2**20}
    return {"host_max_rss_mb": None if used is None else used / 2**20}


class ProfileSession:
    """One profiled window: ``begin()``, any number of ``warmup(fn)`` / ``run(fn)``, then ``finish()``.

    Compile statistics and peak memory cover the whole window (warm-up included); the trace and the
    op/kernel tables cover the profiled runs only. If a run raises, the profiler is stopped before the
    exception propagates, so the process is never left with a profiler running.
    """

    def __init__(self, *, out_dir, trace_name: str = "profile", device=None, record_shapes: bool = False,
                 model_calls: int | None = None, class_flops: dict | None = None):
        import torch

        self.model_calls, self.class_flops = model_calls, class_flops   # for the per-class breakdown
        self.out_dir = Path(out_dir).expanduser()
        self.trace_name = str(trace_name)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = device if isinstance(device, torch.device) else torch.device(str(device))
        self.record_shapes = record_shapes
        self._window = DynamoWindow()
        self._prof = None
        self._began = False
        self._finished = False
        self.run_times: list[float] = []
        self.warmup_times: list[float] = []
        self.last_result: Any = None

    # ---------------------------------------------------------------- helpers
    @property
    def is_cuda(self) -> bool:
        import torch

        return self.device.type == "cuda" and torch.cuda.is_available()

    # ---------------------------------------------------------------- steps
    def begin(self) -> "ProfileSession":
        if self._began:
            return self
        if self.is_cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
        self._window.start()
        self._began = True
        return self

    def _timed(self, times: list, scope, fn: Callable, args, kwargs):
        """``fn(*args, **kwargs)`` synchronised inside ``scope``, its seconds appended to ``times``; if it raises,
        everything is stopped before the exception propagates."""
        try:
            t0 = time.perf_counter()
            with scope:
                out = fn(*args, **kwargs)
                if self.is_cuda:
                    sync_device(self.device)
            times.append(time.perf_counter() - t0)
        except BaseException:
            self.abort()
            raise
        return out

    def warmup(self, fn: Callable, *args, **kwargs):
        """Run ``fn`` outside the profiler (compile happens here) but inside the compile-statistics window."""
        self.begin()
        return self._timed(self.warmup_times, contextlib.nullcontext(), fn, args, kwargs)

    def run(self, fn: Callable, *args, **kwargs):
        """Run ``fn`` once under the profiler, inside an annotation named ``<trace_name>/run<i>``."""
        import torch

        self.begin()
        if self._prof is None:
            acts = [torch.profiler.ProfilerActivity.CPU]
            acts += [torch.profiler.ProfilerActivity.CUDA] if self.is_cuda else []
            self._prof = torch.profiler.profile(activities=acts, record_shapes=self.record_shapes)
            try:
                self._prof.start()
            except BaseException:       # the profiler itself would not start: stop the window as a failed run does
                self.abort()
                raise
        label = torch.profiler.record_function(self.run_label(len(self.run_times)))
        self.last_result = self._timed(self.run_times, label, fn, args, kwargs)
        return self.last_result

    def run_label(self, i: int) -> str:
        return f"{self.trace_name}/run{i}"

    def abort(self) -> None:
        """Stop everything without writing a report (used when the profiled work raised)."""
        if self._prof is not None:
            try:
                self._prof.stop()
            except Exception:  # noqa: BLE001
                pass
            self._prof = None
        if self._began and not self._finished:
            self._window.stop()
        self._finished = True

    def finish(self) -> ProfileReport:
        import torch

        self.begin()
        trace_path, events = None, []
        if self._prof is not None:
            self._prof.stop()
            trace_path = unique_trace_path(self.out_dir, self.trace_name)
            write_with(trace_path, self._prof.export_chrome_trace, purpose="the profiler trace")
            events = self._load_events(trace_path)
        compile_stats = self._window.stop()
        self._finished = True
        labels = [self.run_label(i) for i in range(len(self.run_times))]
        report = ProfileReport(
            name=self.trace_name, device=str(self.device), runs=len(self.run_times), warmup=len(self.warmup_times),
            run_times_s=[round(t, 6) for t in self.run_times],
            warmup_times_s=[round(t, 6) for t in self.warmup_times],
            trace_path=str(trace_path) if trace_path else None, compile=compile_stats,
            gpu=gpu_idle_stats(events, labels) if events else None,
            top_ops=self._top_ops(), top_kernels=top_kernels(events, TOP) if events else [],
            peak_memory=self._peak_memory(), torch_version=torch.__version__)
        if report.gpu is not None:
            report.kernel_classes = kernel_breakdown(events, labels, model_calls=self.model_calls,
                                                     flops=self.class_flops, runs=len(self.run_times), idle=report.gpu)
        if self._prof is None:
            report.notes.append("no profiled run: nothing was traced.")
        report.result = self.last_result
        self._prof = None
        return report

    # ---------------------------------------------------------------- analysis
    def _load_events(self, path: Path) -> list[dict]:
        try:
            if path.stat().st_size > MAX_TRACE_BYTES_TO_ANALYSE:
                log.warning("trace %s is too large to analyse; open it in Perfetto", path)
                return []
            with open(path, encoding="utf-8") as fh:
                return list(json.load(fh).get("traceEvents", []))
        except (OSError, ValueError) as exc:
            log.warning("could not read back trace %s: %s", path, exc)
            return []

    def _top_ops(self) -> list[dict]:
        if self._prof is None:
            return []
        try:
            averages = self._prof.key_averages()
        except Exception as exc:  # noqa: BLE001 - statistics are a bonus, the trace is written already
            log.warning("profiler statistics unavailable: %s", exc)
            return []
        rows = []
        for e in averages:
            if getattr(e, "is_user_annotation", False):
                continue
            dev = getattr(e, "self_device_time_total", None)
            if dev is None:
                dev = getattr(e, "self_cuda_time_total", 0.0)
            rows.append({"name": str(e.key), "count": int(e.count),
                         "self_cpu_us": round(float(e.self_cpu_time_total), 3),
                         "self_device_us": round(float(dev or 0.0), 3),
                         "cpu_total_us": round(float(e.cpu_time_total), 3)})
        key = "self_device_us" if self.is_cuda and any(r["self_device_us"] for r in rows) else "self_cpu_us"
        rows.sort(key=lambda r: r[key], reverse=True)
        return rows[:TOP]

    def _peak_memory(self) -> dict:
        used, reserved = peak_memory_bytes(self.device)
        kind = "cuda max allocated" if self.is_cuda else "cpu peak RSS of the process"
        return {"kind": kind, "bytes": used, "reserved_bytes": reserved}


def profile_run(fn: Callable[[], Any], *, runs: int = 1, out_dir, trace_name: str = "profile", device=None,
                warmup: int = 0, record_shapes: bool = False, model_calls: int | None = None,
                class_flops: dict | None = None) -> ProfileReport:
    """Call ``fn()`` ``warmup`` times unprofiled, then ``runs`` times under torch.profiler.

    Writes a Chrome/Perfetto JSON trace into ``out_dir`` and returns a ProfileReport (its ``result`` is the last
    return value of ``fn``). Compile times, graph breaks and recompiles cover warm-up and runs. Raises
    RuntimeError when another profiler is already recording in this process. ``model_calls`` (model forwards per
    run) and ``class_flops`` ({'gemm' | 'attention': FLOPs per run}) feed the per-class kernel breakdown.
    """
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    if profiler_busy():
        raise RuntimeError("a torch profiler is already recording in this process; finish it before starting "
                           "another (profilers cannot nest)")
    with _LOCK:
        session = ProfileSession(out_dir=out_dir, trace_name=trace_name, device=device,
                                 record_shapes=record_shapes, model_calls=model_calls, class_flops=class_flops)
        for _ in range(int(warmup)):
            session.warmup(fn)      # a warm-up or run that raises stops the window before it propagates
        for _ in range(int(runs)):
            session.run(fn)
        return session.finish()


def default_out_dir() -> Path:
    """ComfyUI's output folder (``<output>/wan_accel_profiles``) inside ComfyUI, else ``./wan_accel_profiles``.

    ComfyUI is detected by its ``folder_paths`` module being loaded already (``cache.paths.comfy_folder``).
    """
    output = comfy_folder("get_output_directory")
    return (output if output is not None else Path(os.getcwd())) / "wan_accel_profiles"
