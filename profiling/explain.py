"""Graph-break analysis with ``torch._dynamo.explain``, always in a separate process.

``explain`` calls ``torch._dynamo.reset()``, which throws away every compiled model of the process it runs in;
so it never runs here. ``explain_in_subprocess`` starts a fresh interpreter on ``explain_worker.py`` and reads
back the graph breaks with their reasons.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = Path(__file__).with_name("explain_worker.py")
# Not resolved: the pack may sit behind a link whose name is the import name.
PACKAGE_ROOT = Path(os.path.abspath(__file__)).parent.parent


class ExplainError(RuntimeError):
    """The explain subprocess failed; the message carries its error and the end of its output."""


@dataclasses.dataclass
class ExplainResult:
    target: str
    graph_count: int = 0
    graph_break_count: int = 0
    op_count: int = 0
    ops_per_graph: list = dataclasses.field(default_factory=list)
    break_reasons: list = dataclasses.field(default_factory=list)  # dicts: reason, location, user_stack
    torch_version: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_text(self) -> str:
        lines = [f"explain {self.target}: {self.graph_count} graph(s), {self.graph_break_count} graph break(s), "
                 f"{self.op_count} op(s)" + (f" (ops per graph: {self.ops_per_graph})" if self.ops_per_graph else "")]
        for i, br in enumerate(self.break_reasons, 1):
            reason = " ".join(str(br.get("reason", "")).split())
            lines.append(f"  {i}. {reason}")
            if br.get("location"):
                lines.append(f"     at {br['location']}")
        if not self.break_reasons:
            lines.append("  no graph breaks: the target compiles into one graph.")
        return "\n".join(lines)


def _pack_name() -> str:
    """The name this pack was imported under (``wan_accel``, or a ComfyUI custom_nodes folder name)."""
    return __name__.rsplit(".", 2)[0] if __name__.count(".") >= 2 else PACKAGE_ROOT.name


def _pack_search_path() -> Path:
    """The sys.path entry from which ``_pack_name()`` imports."""
    return PACKAGE_ROOT.parents[_pack_name().count(".")]


def package_target(relative: str) -> str:
    """A target inside this pack, under whatever name the pack was imported:
    ``package_target("app.jobs.profile_targets:explain_model")``."""
    return f"{_pack_name()}.{relative}"


def explain_in_subprocess(target: str, *, kwargs: dict | None = None, sys_path=None, timeout: float = 600.0,
                          python: str | None = None, env: dict | None = None) -> ExplainResult:
    """Run ``torch._dynamo.explain`` on ``target`` ('package.module:factory', see explain_worker.py) in a new
    process; returns its graph breaks with reasons. Raises ExplainError when the target fails or times out.

    ``sys_path`` entries are prepended in the subprocess; the folder that holds this pack is always added, so
    targets inside the pack import (see ``package_target``).
    """
    if ":" not in str(target):
        raise ExplainError(f"target must look like 'package.module:factory', got {target!r}")
    paths = [str(p) for p in (sys_path or [])] + [str(_pack_search_path())]
    with tempfile.TemporaryDirectory(prefix="wan_accel_explain_") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [python or sys.executable, str(WORKER), "--target", target, "--out", str(out),
               "--kwargs", json.dumps(kwargs or {})]
        for p in paths:
            cmd += ["--sys-path", p]
        child_env = dict(os.environ if env is None else env)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env)
        except subprocess.TimeoutExpired as exc:
            raise ExplainError(f"explain of {target} did not finish within {timeout:.0f} s") from exc
        tail = ((proc.stdout or "") + (proc.stderr or ""))[-3000:]
        if not out.exists():
            raise ExplainError(f"explain of {target} crashed (exit code {proc.returncode}); output:\n{tail}")
        data = json.loads(out.read_text(encoding="utf-8"))
    if not data.get("ok"):
        raise ExplainError(f"explain of {target} failed: {data.get('error')}\n{data.get('traceback', '')}")
    names = {f.name for f in dataclasses.fields(ExplainResult)}
    return ExplainResult(**{k: v for k, v in data.items() if k in names})
