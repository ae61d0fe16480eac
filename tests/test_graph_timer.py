"""The operator store's GPU timer: GPU time per call from CUDA-graph replays, call by call where a call cannot be
captured. A stand-in for ``torch.cuda`` plays the GPU: each captured call adds its simulated GPU time to the graph,
and an event pair around a replay reads the graph's total."""
import contextlib

import pytest
import torch

from wan_accel.cache import autotune


class FakeCuda:
    def __init__(self, gpu_ms_per_call=0.25):
        self.gpu_ms_per_call = gpu_ms_per_call
        self.capturing = False
        self.already_capturing = False
        self.replays = 0
        self.graph_ms = 0.0
        self.last_replay_ms = 0.0
        self.modes = []
        self.eager_ms = 0.0

    # what graph_timer / default_timer use
    def is_available(self):
        return True

    def is_current_stream_capturing(self):
        return self.already_capturing

    def Stream(self):  # noqa: N802 - torch's name
        return type("S", (), {"wait_stream": lambda self, other: None})()

    def current_stream(self):
        return self.Stream()

    @contextlib.contextmanager
    def stream(self, s):
        yield

    def CUDAGraph(self):  # noqa: N802
        cuda = self

        class Graph:
            def replay(self):
                cuda.replays += 1
                cuda.last_replay_ms = cuda.graph_ms
        return Graph()

    @contextlib.contextmanager
    def graph(self, g, capture_error_mode="global"):
        self.modes.append(capture_error_mode)
        self.capturing = True
        self.graph_ms = 0.0
        try:
            yield
        finally:
            self.capturing = False

    def Event(self, enable_timing=False):  # noqa: N802
        cuda = self

        class Ev:
            def record(self):
                self.at = (cuda.replays, cuda.eager_ms)

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return cuda.last_replay_ms * (end.at[0] - self.at[0]) + end.at[1] - self.at[1]
        return Ev()

    def synchronize(self):
        pass

    # what a timed call does: captured, it adds to the graph; eager, it runs now
    def call(self):
        if self.capturing:
            self.graph_ms += self.gpu_ms_per_call
        else:
            self.eager_ms += self.gpu_ms_per_call


@pytest.fixture()
def fake(monkeypatch):
    cuda = FakeCuda()
    monkeypatch.setattr(torch, "cuda", cuda)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return cuda


def test_the_gpu_time_per_call_is_a_replay_over_its_calls(fake):
    calls = []

    def fn():
        calls.append(fake.capturing)
        fake.call()

    ms = autotune.graph_timer(fn, calls=4, replays=3)
    assert ms == pytest.approx(fake.gpu_ms_per_call)
    # two calls outside the capture (lazy set-up, one timed), then the captured calls; replays do not call fn again
    assert calls == [False, False, True, True, True, True]
    assert fake.replays == 1 + 3
    assert fake.modes == ["thread_local"]       # other threads' CUDA work is not refused during the capture


def test_a_call_that_cannot_be_captured_is_timed_call_by_call(fake, monkeypatch):
    def fn():
        if fake.capturing:
            raise RuntimeError("operation not permitted when stream is capturing")

    assert autotune.graph_timer(fn) is None
    monkeypatch.setattr(autotune, "cuda_timer", lambda f: 7.5)
    assert autotune.default_timer(fn) == 7.5


def test_no_timing_graph_inside_a_capture(fake):
    fake.already_capturing = True
    called = []
    assert autotune.graph_timer(lambda: called.append(1)) is None
    assert called == []


def test_the_default_timer_on_a_gpu_takes_the_graph_time(fake, monkeypatch):
    monkeypatch.setattr(autotune, "cuda_timer", lambda f: pytest.fail("timed call by call though capturable"))
    assert autotune.default_timer(fake.call) == pytest.approx(fake.gpu_ms_per_call)


def test_a_failing_replay_falls_back_to_call_by_call(fake, monkeypatch):
    def boom(self):
        raise RuntimeError("replay failed")
    monkeypatch.setattr(fake, "CUDAGraph", lambda: type("G", (), {"replay": boom})())
    monkeypatch.setattr(autotune, "cuda_timer", lambda f: 3.0)
    assert autotune.default_timer(fake.call) == 3.0


def test_the_interpreter_and_a_cpu_take_wall_time(fake, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(autotune, "graph_timer", lambda f: pytest.fail("graph timing under the interpreter"))
    assert autotune.default_timer(lambda: None) >= 0.0


@pytest.mark.parametrize("gpu_ms, captured, replays", [(0.01, autotune.GRAPH_CALLS, autotune.GRAPH_REPLAYS),
                                                       (0.5, 4, autotune.GRAPH_REPLAYS), (60.0, 1, 2)])
def test_a_slow_call_is_captured_fewer_times(fake, gpu_ms, captured, replays):
    """As many calls per graph as fit the budget by one eager call's time (a 60 ms call: once, replayed twice)."""
    fake.gpu_ms_per_call = gpu_ms
    calls = []

    def fn():
        calls.append(fake.capturing)
        fake.call()

    assert autotune.graph_timer(fn) == pytest.approx(gpu_ms)
    assert calls.count(True) == captured and fake.replays == 1 + replays
