"""The CUDA graph backend and manager on a fake CUDA (counted calls): thread-local capture without a sync or
cache flush per capture, warm-up on the capture stream, a new pool after a release or a failed capture (whose pool
is released), failures recorded with torch/driver and retried after an upgrade, refresh keys graphed in the first
run, and no graph kept that baked in an untuned kernel fallback."""
from __future__ import annotations

import pytest
import torch

from wan_accel.cache import autotune
from wan_accel.sampling import cuda_graphs as cg


class _Stream:
    def __init__(self, name):
        self.name, self.waited = name, []

    def wait_stream(self, other):
        self.waited.append(other)

    def __repr__(self):
        return self.name


class FakeCuda:
    def __init__(self, monkeypatch, fail_end: bool = False):
        self.state = {"current": _Stream("compute")}
        self.compute = self.state["current"]
        self.calls = {"synchronize": 0, "empty_cache": 0, "host_empty": 0, "pools": 0, "released": [], "begin": []}
        self.fail_end = fail_end
        fake = self
        cuda = cg.torch.cuda

        class Graph:
            def __init__(self):
                self.reset_called = False

            def capture_begin(self, pool=None, capture_error_mode="global", **kw):
                fake.calls["begin"].append((pool, capture_error_mode, fake.state["current"]))

            def capture_end(self):
                if fake.fail_end:
                    raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

            def replay(self):
                pass

            def reset(self):
                self.reset_called = True

        def pool():
            fake.calls["pools"] += 1
            return (0, fake.calls["pools"])

        monkeypatch.setattr(cuda, "graph_pool_handle", pool)
        monkeypatch.setattr(cuda, "Stream", lambda device=None: _Stream("capture"))
        monkeypatch.setattr(cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(cuda, "current_stream", lambda device=None: fake.state["current"])
        monkeypatch.setattr(cuda, "set_stream", lambda stream: fake.state.__setitem__("current", stream))
        monkeypatch.setattr(cuda, "current_device", lambda: 0)
        monkeypatch.setattr(cuda, "synchronize", lambda *a: fake.calls.__setitem__("synchronize", fake.calls["synchronize"] + 1))
        monkeypatch.setattr(cuda, "empty_cache", lambda: fake.calls.__setitem__("empty_cache", fake.calls["empty_cache"] + 1))
        monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda dev, pool: fake.calls["released"].append(pool),
                            raising=False)
        monkeypatch.setattr(torch._C, "_host_emptyCache",
                            lambda: fake.calls.__setitem__("host_empty", fake.calls["host_empty"] + 1), raising=False)

    @property
    def current(self):
        return self.state["current"]


def test_capture_is_thread_local_on_the_capture_stream_without_sync_or_flush(monkeypatch):
    fake = FakeCuda(monkeypatch)
    backend = cg.CudaGraphBackend("cuda:0")
    manager = cg.GraphManager(backend)
    ran_on = []

    def fn(inputs):
        ran_on.append(fake.current)
        return inputs["x"] * 2

    x = torch.ones(3)
    for _ in range(3):
        assert manager.run("k", {"x": x}, fn) is not None
    # warm-up and capture both on the capture stream (cuBLAS workspaces are made outside the graph pool)
    assert ran_on == [backend.stream, backend.stream] and fake.current is fake.compute
    assert [(mode, stream) for _pool, mode, stream in fake.calls["begin"]] == [("thread_local", backend.stream)]
    assert fake.calls["synchronize"] == fake.calls["empty_cache"] == fake.calls["host_empty"] == 0
    assert manager.stats["captures"] == 1 and manager.stats["replays"] == 2


def test_a_failed_capture_releases_its_pool_and_gives_the_thread_its_stream_back(monkeypatch):
    fake = FakeCuda(monkeypatch, fail_end=True)
    backend = cg.CudaGraphBackend("cuda:0")
    first_pool = backend.pool
    manager = cg.GraphManager(backend)
    ran_on = []

    def fn(inputs):
        ran_on.append(fake.current)
        return inputs["x"] * 2

    x = torch.ones(3)
    assert torch.equal(manager.run("k", {"x": x}, fn), x * 2)      # warm-up
    assert torch.equal(manager.run("k", {"x": x}, fn), x * 2)      # capture fails, eager fallback
    assert ran_on == [backend.stream, backend.stream, fake.compute] and fake.current is fake.compute
    assert not manager.enabled and "previous error" in manager.error
    assert first_pool in fake.calls["released"] and backend.pool != first_pool


def test_release_gives_the_next_capture_a_new_pool(monkeypatch):
    FakeCuda(monkeypatch)
    backend = cg.CudaGraphBackend("cuda:0")
    manager = cg.GraphManager(backend)
    x = torch.ones(2)
    for _ in range(2):
        manager.run("k", {"x": x}, lambda i: i["x"] + 1)
    pool = backend.pool
    manager.release()
    assert backend.pool != pool


def test_a_warm_key_lets_once_per_chunk_keys_capture_at_their_first_call(monkeypatch):
    FakeCuda(monkeypatch)
    manager = cg.GraphManager(cg.CudaGraphBackend("cuda:0"))
    x = torch.ones(2)
    fn = lambda i: i["x"] + 1  # noqa: E731
    for chunk in range(3):
        for _ in range(2):                      # denoising steps of the chunk
            manager.run(("denoise", chunk), {"x": x}, fn, warm_key=("shape", chunk))
        manager.run(("refresh", chunk), {"x": x}, fn, warm_key=("shape", chunk))   # once per chunk
    assert manager.graphs == 6     # every refresh key too, in the first run
    assert manager.stats["eager_calls"] == 3


def test_a_graph_that_baked_an_untuned_fallback_is_not_kept(monkeypatch):
    FakeCuda(monkeypatch)
    manager = cg.GraphManager(cg.CudaGraphBackend("cuda:0"))
    x = torch.ones(2)
    state = {"tuned": False, "capturing_fallbacks": 0}

    def fn(inputs):
        if not state["tuned"]:
            autotune._note_provisional()        # what tune() does when it may not measure yet
        return inputs["x"] + 1

    manager.run("k", {"x": x}, fn)              # warm-up (tuning hit a transient OOM: still untuned)
    manager.run("k", {"x": x}, fn)              # captured with the fallback: used once, not kept
    assert manager.graphs == 0 and manager.stats["provisional"] == 1
    state["tuned"] = True
    manager.run("k", {"x": x}, fn)              # warms up again (tunes)
    manager.run("k", {"x": x}, fn)              # captured with the tuned kernel: kept
    assert manager.graphs == 1


def test_autotune_counts_provisional_results_only():
    tuner = autotune.Autotuner(None, timer=lambda run: 1.0)
    configs = ({"BLOCK": 1},)
    before = autotune.provisional_count()
    assert tuner.tune("k", "key", configs, lambda cfg: None, benchmark=False) is None   # nothing measured yet
    assert autotune.provisional_count() == before + 1
    assert tuner.tune("k", "key", configs, lambda cfg: None) == {"BLOCK": 1}
    assert autotune.provisional_count() == before + 1


class _Cache:
    def __init__(self):
        self.data = {}

    def get(self, ns, key):
        return self.data.get((ns, key))

    def put(self, ns, key, value):
        self.data[(ns, key)] = value


def test_a_recorded_failure_is_retried_once_after_a_torch_or_driver_change(monkeypatch):
    cache = _Cache()
    monkeypatch.setattr(cg, "_software", lambda: {"torch": "2.13.0", "driver": "570.1"})
    cg.record(cache, "sig", False, "RuntimeError: capture invalidated")
    assert cache.get(cg.NAMESPACE, cg.limit_key("sig"))["torch"] == "2.13.0"
    assert "invalidated" in cg.recorded_failure(cache, "sig")
    monkeypatch.setattr(cg, "_software", lambda: {"torch": "2.14.0", "driver": "570.1"})
    assert cg.recorded_failure(cache, "sig") is None
    monkeypatch.setattr(cg, "_software", lambda: {"torch": "2.13.0", "driver": "580.2"})
    assert cg.recorded_failure(cache, "sig") is None
    cache.put(cg.NAMESPACE, cg.limit_key("sig"), {"ok": False, "error": "old record"})     # no versions
    assert cg.recorded_failure(cache, "sig") is None
