"""Graph-break analysis with ``torch._dynamo.explain``, always in a separate process.

``explain`` calls ``torch._dynamo.reset()``, which throws away every compiled model of the process it runs in;
so it never runs here. ``explain_in_subprocess`` starts a fresh interpreter on ``explain_worker.run`` (through
``run_for_json``) and reads back the graph breaks with their reasons.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess

from .child import child_argv, one_line, pack_name, run_for_json, worker_message
from .explain_worker import RESULT_MARK


class ExplainError(RuntimeError):
    """The explain subprocess failed; the message carries its error and the end of its output."""


class ExplainTargetError(ExplainError, ValueError):
    """The target is not 'package.module:factory' or its module or factory cannot be loaded: the caller's input,
    not a failed run."""


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
            lines.append(f"  {i}. {one_line(str(br.get('reason', '')))}")
            if br.get("location"):
                lines.append(f"     at {br['location']}")
        if not self.break_reasons:
            lines.append("  no graph breaks: the target compiles into one graph.")
        return "\n".join(lines)


def package_target(relative: str) -> str:
    """A target inside this pack, under whatever name the pack was imported:
    ``package_target("app.jobs.profile_targets:explain_model")``."""
    return f"{pack_name()}.{relative}"


def explain_in_subprocess(target: str, *, kwargs: dict | None = None, sys_path=None,
                          timeout: float = 600.0) -> ExplainResult:
    """Run ``torch._dynamo.explain`` on ``target`` ('package.module:factory', see explain_worker.py) in a new
    process; returns its graph breaks with reasons. Raises ExplainError when the target fails or times out.

    ``sys_path`` entries are prepended in the subprocess; the pack is loaded under this process's name for it, so
    targets inside the pack import (see ``package_target``).
    """
    if ":" not in str(target):
        raise ExplainTargetError(f"target must look like 'package.module:factory', got {target!r}")
    try:
        data = run_for_json(child_argv("profiling.explain_worker:run", target, json.dumps(kwargs or {}),
                                       *(sys_path or [])), mark=RESULT_MARK, what=f"explain worker of {target} crashed",
                            error=ExplainError, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise ExplainError(f"explain of {target} did not finish within {timeout:.0f} s") from exc
    if not data.get("ok") and data.get("stage") == "load":
        raise ExplainTargetError(worker_message(f"{target} cannot be loaded ({data.get('error')})",
                                                data.get("traceback")))
    if not data.get("ok"):
        raise ExplainError(worker_message(f"explain worker of {target} failed: {data.get('error')}",
                                          data.get("traceback")))
    names = {f.name for f in dataclasses.fields(ExplainResult)}
    return ExplainResult(**{k: v for k, v in data.items() if k in names})
