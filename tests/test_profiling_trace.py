"""profile_run: the trace file, the report, and the pure trace statistics (GPU idle, top kernels)."""
from __future__ import annotations

import json

import pytest
import torch

from wan_accel.profiling.runner import profile_run, profiler_busy
from wan_accel.profiling.trace_stats import gpu_idle_stats, merge_intervals, top_kernels


class TwoLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 4)

    def forward(self, x):
        with torch.profiler.record_function("two_layer_marker"):
            return self.b(torch.relu(self.a(x)))


def test_trace_is_valid_json_with_the_profiled_ops(tmp_path):
    model, x = TwoLayer(), torch.randn(8, 16)
    report = profile_run(lambda: model(x), runs=2, out_dir=tmp_path / "traces", trace_name="tiny run", device="cpu")

    assert report.runs == 2 and len(report.run_times_s) == 2
    assert report.result.shape == (8, 4)
    with open(report.trace_path, encoding="utf-8") as fh:
        trace = json.load(fh)
    names = [e.get("name") for e in trace["traceEvents"]]
    # one annotation per run, the function's own marker (once per run), and the real ops it ran
    assert "tiny run/run0" in names and "tiny run/run1" in names
    assert names.count("two_layer_marker") == 2
    assert "aten::addmm" in names and "aten::relu" in names
    assert report.trace_path.startswith(str(tmp_path / "traces"))
    assert {r["name"] for r in report.top_ops} & {"aten::addmm", "aten::linear", "aten::relu"}
    assert all(not r["name"].startswith("tiny run/") for r in report.top_ops)  # annotations are not ops


def test_report_on_cpu_says_na_for_gpu_idle_and_is_json(tmp_path):
    model, x = TwoLayer(), torch.randn(4, 16)
    report = profile_run(lambda: model(x), out_dir=tmp_path, trace_name="cpu", device="cpu")
    assert report.gpu is None
    assert report.peak_memory["bytes"] > 0 and "RSS" in report.peak_memory["kind"]
    text = report.to_text()
    assert "GPU idle      : N/A" in text and report.trace_path in text
    data = json.loads(json.dumps(report.to_dict()))
    assert "result" not in data
    assert data["run_times_s"] == report.run_times_s and data["trace_path"] == report.trace_path


def test_warmup_runs_are_not_traced(tmp_path):
    calls = []

    def fn():
        calls.append(1)
        with torch.profiler.record_function("inside_fn"):
            return torch.ones(3) * 2

    report = profile_run(fn, runs=1, warmup=2, out_dir=tmp_path, trace_name="w", device="cpu")
    assert len(calls) == 3 and report.warmup == 2 and len(report.warmup_times_s) == 2
    names = [e.get("name") for e in json.load(open(report.trace_path))["traceEvents"]]
    assert names.count("inside_fn") == 1


def test_a_failing_run_leaves_no_profiler_running(tmp_path):
    def boom():
        raise ValueError("planted failure")

    with pytest.raises(ValueError, match="planted failure"):
        profile_run(boom, out_dir=tmp_path, trace_name="boom", device="cpu")
    assert not profiler_busy()
    ok = profile_run(lambda: torch.zeros(2) + 1, out_dir=tmp_path, trace_name="after", device="cpu")
    assert ok.runs == 1


def test_a_profiler_that_will_not_start_stops_the_window(tmp_path, monkeypatch):
    """The failure is the profiler's own (another tool holds it, say): the compile-statistics window is closed as
    for a failing run, so dynamo's logger keeps no handler of the session's."""
    import logging

    def refuse(self):
        raise RuntimeError("planted: profiler already running")

    monkeypatch.setattr(torch.profiler.profile, "start", refuse)
    before = list(logging.getLogger("torch._dynamo").handlers)
    with pytest.raises(RuntimeError, match="planted"):
        profile_run(lambda: torch.zeros(2), out_dir=tmp_path, trace_name="refused", device="cpu")
    assert logging.getLogger("torch._dynamo").handlers == before


def test_runs_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="runs must be >= 1"):
        profile_run(lambda: None, runs=0, out_dir=tmp_path, device="cpu")


def _kernel(ts, dur, name="k"):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_gpu_idle_detects_launch_bound_short_kernels():
    # a 1000 us run window holding 50 kernels of 4 us, 20 us apart: busy 200 us, idle 80 %
    events = [{"ph": "X", "cat": "user_annotation", "name": "s/run0", "ts": 0.0, "dur": 1000.0}]
    events += [_kernel(10.0 + 20.0 * i, 4.0) for i in range(50)]
    stats = gpu_idle_stats(events, ["s/run0"])
    assert stats["kernel_count"] == 50
    assert stats["busy_us"] == pytest.approx(200.0)
    assert stats["idle_fraction"] == pytest.approx(0.8)
    assert stats["largest_gap_us"] == pytest.approx(16.0)
    assert stats["launch_bound"] is True and "launch-bound" in stats["verdict"]


def test_gpu_idle_busy_gpu_and_overlapping_kernels():
    events = [{"ph": "X", "cat": "user_annotation", "name": "s/run0", "ts": 100.0, "dur": 1000.0},
              _kernel(100.0, 600.0), _kernel(500.0, 500.0),  # overlap (two streams): union 100..1000
              _kernel(1050.0, 100.0)]                         # partly outside the window: clipped at 1100
    stats = gpu_idle_stats(events, ["s/run0"])
    assert stats["busy_us"] == pytest.approx(950.0)
    assert stats["idle_fraction"] == pytest.approx(0.05)
    assert stats["launch_bound"] is False and "busy" in stats["verdict"]


def test_gpu_idle_is_none_without_gpu_events():
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 5.0}]
    assert gpu_idle_stats(events, ["x"]) is None


def test_top_kernels_and_interval_union():
    events = [_kernel(0, 5, "gemm"), _kernel(10, 5, "gemm"), _kernel(20, 3, "softmax")]
    rows = top_kernels(events)
    assert rows[0] == {"name": "gemm", "count": 2, "total_us": 10.0, "mean_us": 5.0}
    assert rows[1]["name"] == "softmax"
    assert merge_intervals([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]


def test_profilers_do_not_nest(tmp_path):
    from wan_accel.profiling.session import ProfileRequest

    req = ProfileRequest(runs=1, out_dir=tmp_path, history=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert profiler_busy()
        with pytest.raises(RuntimeError, match="already recording"):
            profile_run(lambda: 1, out_dir=tmp_path, device="cpu")
        assert req.run(lambda: 7) == 7  # the request steps aside and says why
    assert req.latest is None and req.remaining == 1 and "cannot nest" in req.text()
    assert not profiler_busy()
