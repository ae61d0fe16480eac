"""A planted graph break is reported with its reason: in-process (dynamo counters) and by explain in a
subprocess (which must leave this process's compiled models alone)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from wan_accel.profiling.explain import ExplainError, explain_in_subprocess
from wan_accel.profiling.runner import profile_run

HERE = Path(__file__).resolve().parent


class PlantedBreak(torch.nn.Module):
    """Two linear layers with a graph break between them."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        x = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return self.b(x) * 2


class NoBreak(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.a(x)) + 1


def planted_break_target():
    """Explain factory used by the subprocess (imported there by module name)."""
    torch.manual_seed(0)
    return PlantedBreak(), (torch.randn(2, 8),)


def failing_target():
    raise RuntimeError("factory failed on purpose")


def test_in_process_counters_report_break_reason_and_recompile(tmp_path):
    compiled = torch.compile(PlantedBreak(), backend="eager", dynamic=False)
    inputs = iter([torch.randn(2, 8), torch.randn(3, 8)])  # the second shape forces a recompile

    report = profile_run(lambda: compiled(next(inputs)), runs=1, warmup=1, out_dir=tmp_path,
                         trace_name="planted", device="cpu")
    c = report.compile
    assert c["graph_break_count"] >= 1
    assert any("graph_break()" in b["reason"] for b in c["graph_breaks"])
    assert c["recompile_count"] >= 1
    assert any("size mismatch" in r["reason"] or "expected 2, actual 3" in r["reason"] for r in c["recompiles"])
    assert c["frames_compiled"] >= 2 and c["compile_total_s"] > 0
    text = report.to_text()
    assert "graph breaks  : " in text and "graph_break()" in text and "recompiles    : " in text


def test_counters_are_a_window_not_process_totals(tmp_path):
    compiled = torch.compile(NoBreak(), backend="eager")
    x = torch.randn(2, 8)
    compiled(x)  # compiled before the window
    report = profile_run(lambda: compiled(x), out_dir=tmp_path, trace_name="steady", device="cpu")
    assert report.compile["graph_break_count"] == 0
    assert report.compile["recompile_count"] == 0
    assert report.compile["frames_compiled"] == 0


def test_explain_subprocess_lists_the_planted_break():
    compiled = torch.compile(NoBreak(), backend="eager")
    x = torch.randn(2, 8)
    compiled(x)
    result = explain_in_subprocess("test_profiling_graph_breaks:planted_break_target", sys_path=[HERE], timeout=300)
    assert result.graph_break_count == 1 and result.graph_count == 2
    assert "graph_break()" in result.break_reasons[0]["reason"]
    assert "test_profiling_graph_breaks.py" in result.break_reasons[0]["location"]
    assert "1 graph break(s)" in result.to_text()
    # this process's compiled model is untouched: calling it compiles nothing new
    before = torch._dynamo.utils.counters["frames"]["total"]
    compiled(x)
    assert torch._dynamo.utils.counters["frames"]["total"] == before


def test_explain_subprocess_failure_is_a_clear_error():
    with pytest.raises(ExplainError, match="factory failed on purpose"):
        explain_in_subprocess("test_profiling_graph_breaks:failing_target", sys_path=[HERE], timeout=300)
    with pytest.raises(ExplainError, match="target must look like"):
        explain_in_subprocess("no_colon_here", timeout=300)
