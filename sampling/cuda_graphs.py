"""CUDA graphs for the optimized causal sampler: one graph per (step kind, chunk shape, cache write plan).

A chunk's forward depends on host values only through its shape and its KV-cache plan (slots written, slots
attended), so those are the graph key; everything else enters through static input buffers (latent chunk,
time embeddings, RoPE tables, conditioning) that are refilled before each replay. KV and cross-attention buffers
live for the whole session, so their addresses are fixed. With a global cache the key is the chunk position;
with a rolling window positions that map to the same ring slots share a graph.

Lifecycle of a key: the first call runs eagerly (warm-up: compiles, autotunes, initialises libraries), the
second captures and replays, later calls replay. If a capture fails the manager turns itself off, the call runs
eagerly, and the failure is recorded in the limit cache (namespace ``sampler``, key
``cuda_graphs/<model signature>``) so later runs on this machine do not try again. Outputs of a replay are the
graph's static tensors: use them before the next replay.
"""
from __future__ import annotations

import logging
import time

import torch

from ..cache.oom import is_oom

log = logging.getLogger("wan_accel")
NAMESPACE = "sampler"


def limit_key(signature: str) -> str:
    return f"cuda_graphs/{signature}"


def recorded_failure(cache, signature: str) -> str | None:
    """The recorded capture error for this model on this machine, or None."""
    if cache is None:
        return None
    try:
        value = cache.get(NAMESPACE, limit_key(signature))
    except Exception as exc:  # noqa: BLE001 - the cache is an optimisation only
        log.warning("wan_accel: could not read the limit cache (%s)", exc)
        return None
    if isinstance(value, dict) and value.get("ok") is False:
        return str(value.get("error") or "capture failed earlier")
    return None


def record(cache, signature: str, ok: bool, error: str | None = None) -> None:
    if cache is None:
        return
    try:
        cache.put(NAMESPACE, limit_key(signature), {"ok": bool(ok), "error": error, "torch": torch.__version__,
                                                    "when": time.time()})
    except Exception as exc:  # noqa: BLE001
        log.warning("wan_accel: could not record the CUDA graph result in the limit cache (%s)", exc)


class CudaGraphBackend:
    """Capture/replay with torch.cuda.CUDAGraph; all graphs share one memory pool (they never run at once)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(self.device)

    def capture(self, fn):
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                out = fn()
        finally:
            # a failed capture raises from capture_end() before torch.cuda.graph restores the stream: without
            # this the thread would keep running (eagerly) on the capture stream
            torch.cuda.set_stream(current)
        current.wait_stream(self.stream)
        return graph, out

    @staticmethod
    def replay(graph) -> None:
        graph.replay()


class _Entry:
    __slots__ = ("calls", "graph", "out", "inputs")

    def __init__(self):
        self.calls, self.graph, self.out, self.inputs = 0, None, None, None


class GraphManager:
    """Per-session graphs. ``run(key, inputs, fn)``: fn(inputs) -> output tensor or None.

    ``inputs`` is a dict of tensors; for a captured key they are copied into static buffers (shared between keys
    with the same names and shapes) before the replay."""

    def __init__(self, backend, *, cache=None, signature: str = "", max_graphs: int = 64):
        self.backend, self.cache, self.signature, self.max_graphs = backend, cache, signature, int(max_graphs)
        self.entries: dict = {}
        self.static: dict = {}
        self.enabled = True
        self.error: str | None = None
        self.stats = {"eager_calls": 0, "captures": 0, "replays": 0, "capture_s": 0.0}
        self._recorded_ok = False

    @property
    def graphs(self) -> int:
        return sum(1 for e in self.entries.values() if e.graph is not None)

    def _static_for(self, inputs: dict) -> dict:
        out = {}
        for name, t in inputs.items():
            if t is None:
                out[name] = None
                continue
            key = (name, tuple(t.shape), t.dtype, t.device)
            buf = self.static.get(key)
            if buf is None:
                buf = self.static[key] = torch.empty_like(t, memory_format=torch.contiguous_format)
            out[name] = buf
        return out

    @staticmethod
    def _fill(static: dict, inputs: dict) -> None:
        for name, t in inputs.items():
            if t is not None:
                static[name].copy_(t)

    def run(self, key, inputs: dict, fn):
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = _Entry()
        entry.calls += 1
        if entry.graph is not None:
            self._fill(entry.inputs, inputs)
            self.backend.replay(entry.graph)
            self.stats["replays"] += 1
            return entry.out
        if not self.enabled or entry.calls < 2 or self.graphs >= self.max_graphs:
            self.stats["eager_calls"] += 1
            return fn(inputs)
        return self._capture(entry, inputs, fn)

    def _capture(self, entry: _Entry, inputs: dict, fn):
        static = self._static_for(inputs)
        self._fill(static, inputs)
        t0 = time.perf_counter()
        try:
            graph, out = self.backend.capture(lambda: fn(static))
        except Exception as exc:  # noqa: BLE001 - any capture failure: run eagerly from now on
            if is_oom(exc):
                raise
            self.disable(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300],
                         remember=True)
            self.stats["eager_calls"] += 1
            return fn(inputs)
        self.stats["capture_s"] += time.perf_counter() - t0
        self.stats["captures"] += 1
        entry.graph, entry.out, entry.inputs = graph, out, static
        if not self._recorded_ok:
            self._recorded_ok = True
            record(self.cache, self.signature, True)
        self.backend.replay(graph)
        self.stats["replays"] += 1
        return out

    def disable(self, reason: str, remember: bool = False) -> None:
        """Stop capturing (existing graphs are dropped); ``remember`` stores the reason in the limit cache."""
        if self.enabled:
            log.warning("wan_accel: CUDA graphs off for this model: %s", reason)
        self.enabled = False
        self.error = reason
        self.release()
        if remember:
            record(self.cache, self.signature, False, reason)

    def release(self) -> None:
        """Drop every graph and static buffer (frees their memory pool)."""
        self.entries.clear()
        self.static.clear()

    def report(self) -> dict:
        return dict(self.stats, graphs=self.graphs, enabled=self.enabled, error=self.error)
