"""ProfileReport: the result of one profiled window, as readable text (for the UI) and as JSON."""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from .history import make_record
from .trace_stats import IDLE_REMARK_FRACTION, breakdown_table


def fmt_bytes(n) -> str:
    if n is None:
        return "N/A"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024.0 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024.0


def fmt_seconds(s) -> str:
    if s is None:
        return "N/A"
    s = float(s)
    if s >= 1.0:
        return f"{s:.3f} s"
    return f"{s * 1000.0:.2f} ms"


def _one_line(text: str, width: int = 160) -> str:
    text = str(text).split("Developer debug context")[0]
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 3] + "..."


@dataclasses.dataclass
class ProfileReport:
    name: str
    device: str
    runs: int = 0
    warmup: int = 0
    run_times_s: list = dataclasses.field(default_factory=list)
    warmup_times_s: list = dataclasses.field(default_factory=list)
    trace_path: str | None = None
    compile: dict = dataclasses.field(default_factory=dict)      # see dynamo_stats.DynamoWindow
    gpu: dict | None = None                                      # see trace_stats.gpu_idle_stats; None on CPU
    top_ops: list = dataclasses.field(default_factory=list)
    top_kernels: list = dataclasses.field(default_factory=list)
    kernel_classes: dict | None = None                           # see trace_stats.kernel_breakdown; None on CPU
    ceilings: dict | None = None                                 # see ceilings.measure_ceilings; None on CPU
    peak_memory: dict = dataclasses.field(default_factory=dict)  # kind, bytes, reserved_bytes, note
    torch_version: str = ""
    created: float = dataclasses.field(default_factory=time.time)
    notes: list = dataclasses.field(default_factory=list)
    result: Any = dataclasses.field(default=None, repr=False, compare=False)  # the profiled call's return value

    # ------------------------------------------------------------------ data
    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "result"}
        d["hints"] = self.hints()
        return d

    @property
    def mean_run_s(self) -> float | None:
        return sum(self.run_times_s) / len(self.run_times_s) if self.run_times_s else None

    def history_record(self, settings: dict | None = None) -> dict:
        """A record for ``profiling.history.append`` (kind 'profile')."""
        return make_record("profile", label=self.name, settings=settings,
                           timings={"total_s": self.mean_run_s, "runs_s": list(self.run_times_s),
                                    "compile_s": self.compile.get("compile_total_s")},
                           peak_memory_bytes=self.peak_memory.get("bytes"),
                           graph_breaks=self.compile.get("graph_break_count", 0),
                           recompiles=self.compile.get("recompile_count", 0),
                           gpu_idle_fraction=(self.gpu or {}).get("idle_fraction"), trace=self.trace_path)

    # ------------------------------------------------------------------ advice
    def hints(self) -> list[str]:
        out = list(self.notes)
        c = self.compile or {}
        if c.get("graph_break_count"):
            out.append(f"{c['graph_break_count']} graph break(s): each one splits a compiled region and adds "
                       "Python between graphs; the reasons are listed above. `python -m wan_accel profile "
                       "--explain` lists them without touching this process.")
        if c.get("recompile_count"):
            out.append(f"{c['recompile_count']} recompile(s) during the window: a guard failed (shape, dtype, "
                       "a Python value). Steady inputs or dynamic=True avoid the repeated compile time.")
        for w in c.get("warnings", []):
            if "recompile_limit" in w or "cache_size_limit" in w:
                out.append("dynamo hit its recompile limit: the function now runs uncompiled (slow); "
                           "see the warning above.")
                break
        if self.gpu and self.gpu.get("idle_fraction", 0) >= IDLE_REMARK_FRACTION:
            out.append(self.gpu.get("verdict", ""))
        return [h for h in out if h]

    # ------------------------------------------------------------------ text
    def to_text(self, max_ops: int = 10) -> str:
        L = [(f"Wan profile: {self.name}  (device {self.device}, {self.runs} profiled run(s), "
              f"{self.warmup} warm-up, torch {self.torch_version})")]
        runs = ", ".join(fmt_seconds(t) for t in self.run_times_s)
        L.append(f"  run time      : {fmt_seconds(self.mean_run_s)} mean" + (f"  [{runs}]" if runs else ""))
        if self.warmup_times_s:
            L.append("  warm-up       : " + ", ".join(fmt_seconds(t) for t in self.warmup_times_s))
        c = self.compile or {}
        if not c.get("available", True):
            L.append("  compile       : N/A (torch._dynamo unavailable)")
        else:
            phases = list(c.get("compile_phases_s", {}).items())[:4]
            ph = ", ".join(f"{k} {fmt_seconds(v)}" for k, v in phases)
            L.append(f"  compile       : {fmt_seconds(c.get('compile_total_s', 0.0))} in "
                     f"{c.get('frames_compiled', 0)} frame(s)" + (f"  ({ph})" if ph else ""))
            L.append(f"  graph breaks  : {c.get('graph_break_count', 0)}")
            for b in c.get("graph_breaks", [])[:8]:
                L.append(f"    - x{b['count']}: {_one_line(b['reason'])}")
            L.append(f"  recompiles    : {c.get('recompile_count', 0)}")
            for r in c.get("recompiles", [])[:8]:
                L.append(f"    - {r['function']}: {_one_line(r['reason'])}")
            for w in c.get("warnings", [])[:3]:
                L.append(f"    ! {_one_line(w)}")
        if self.gpu is None:
            L.append("  GPU idle      : N/A (no GPU activity profiled)")
        else:
            g = self.gpu
            L.append(f"  GPU idle      : {100.0 * g['idle_fraction']:.1f}% of {fmt_seconds(g['wall_us'] / 1e6)} wall "
                     f"({g['kernel_count']} kernels, median {g['median_kernel_us']:.1f} us, largest gap "
                     f"{g['largest_gap_us'] / 1000.0:.2f} ms)")
            L.append(f"                  {g['verdict']}")
        pm = self.peak_memory or {}
        extra = f", reserved {fmt_bytes(pm['reserved_bytes'])}" if pm.get("reserved_bytes") else ""
        L.append(f"  peak memory   : {fmt_bytes(pm.get('bytes'))} ({pm.get('kind', 'N/A')}{extra})")
        if self.top_ops:
            L.append("  top ops by self time:")
            L.append(f"    {'self cpu ms':>11} {'self dev ms':>11} {'calls':>6}  name")
            for r in self.top_ops[:max_ops]:
                L.append(f"    {r['self_cpu_us'] / 1000:11.3f} {r['self_device_us'] / 1000:11.3f} "
                         f"{r['count']:6d}  {_one_line(r['name'], 90)}")
        if self.kernel_classes:
            L.append("  GPU time by kernel class (per profiled run):")
            L.extend("    " + line for line in breakdown_table(self.kernel_classes, self.ceilings).splitlines())
        if self.top_kernels:
            L.append("  top GPU kernels:")
            for r in self.top_kernels[:max_ops]:
                L.append(f"    {r['total_us'] / 1000:11.3f} ms {r['count']:6d}x  {_one_line(r['name'], 90)}")
        if self.trace_path:
            L.append(f"  trace         : {self.trace_path}")
            L.append("                  (open in https://ui.perfetto.dev or chrome://tracing)")
        hints = self.hints()
        if hints:
            L.append("  hints:")
            L.extend(f"    * {h}" for h in hints)
        return "\n".join(L)

    def __str__(self) -> str:
        return self.to_text()
