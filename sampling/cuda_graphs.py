"""CUDA graphs for the optimized causal sampler: one graph per (step kind, chunk shape, cache write plan).

A chunk's forward depends on host values only through its shape and its KV-cache plan (slots written, slots
attended), so those are the graph key; everything else enters through static input buffers (latent chunk,
time embeddings, RoPE tables, conditioning) that are refilled before each replay. KV and cross-attention buffers
live for the whole session, so their addresses are fixed. With a global cache the key is the chunk position;
with a rolling window positions that map to the same ring slots share a graph.

Lifecycle of a key: the first call runs eagerly (warm-up: compiles, autotunes, initialises libraries), on the
capture stream, so cuBLAS/cuBLASLt create their per-stream workspace there outside any graph pool; the second
captures and replays, later calls replay. A key may name a ``warm_key`` (e.g. the chunk shape and cache plan
without the step kind): once any key with that warm key has run eagerly, a new key captures at its first call, so
the refresh pass, which runs once per chunk, is graphed in the first run too.

Capture uses ``capture_begin``/``capture_end`` in thread-local mode (a CUDA call of another thread, e.g. the
server's, no longer invalidates it) without the synchronize + empty_cache that ``torch.cuda.graph`` does on every
capture. If a capture fails the manager turns itself off, the call runs eagerly, the graph's private pool is
released and a new pool is used from then on, and the failure is recorded in the limit cache (namespace
``sampler``, key ``cuda_graphs/<model signature>``, with the torch and driver versions) so later runs on this
machine do not try again, until torch or the driver changes (then it is tried once more). A graph captured while
a kernel could only run its torch fallback because its tuning was not known yet (``autotune.provisional_count``)
is used once and dropped: the key warms up again and is captured with the tuned kernel. Outputs of a replay are
the graph's static tensors: use them before the next replay.
"""
from __future__ import annotations

import logging
import time

import torch

from ..cache import autotune
from ..cache.oom import is_oom

from ..cache.warmup import spent

log = logging.getLogger("wan_accel")
NAMESPACE = "sampler"


def limit_key(signature: str) -> str:
    return f"cuda_graphs/{signature}"


def _software() -> dict:
    """torch and driver versions a capture result was recorded with."""
    out = {"torch": torch.__version__, "driver": "unknown"}
    try:
        from ..cache.fingerprint import fingerprint

        out["driver"] = str(fingerprint().get("driver", "unknown"))
    except Exception:  # noqa: BLE001 - unknown driver: only the torch version is compared
        pass
    return out


def recorded_failure(cache, signature: str) -> str | None:
    """The recorded capture error for this model on this machine with this torch and driver, or None (never
    failed, or failed under another torch or driver: worth one more try)."""
    if cache is None:
        return None
    try:
        value = cache.get(NAMESPACE, limit_key(signature))
    except Exception as exc:  # noqa: BLE001 - the cache is an optimisation only
        log.warning("wan_accel: could not read the limit cache (%s)", exc)
        return None
    if not (isinstance(value, dict) and value.get("ok") is False):
        return None
    now = _software()
    then = {k: value.get(k) for k in now}
    changed = [k for k in now if then[k] is not None and then[k] != now[k] and now[k] != "unknown"]
    if changed or then["torch"] is None:
        log.info("wan_accel: CUDA graph capture failed earlier under %s; %s changed since: trying again", then,
                 ", ".join(changed) or "the record has no versions")
        return None
    return str(value.get("error") or "capture failed earlier")


def record(cache, signature: str, ok: bool, error: str | None = None) -> None:
    if cache is None:
        return
    try:
        cache.put(NAMESPACE, limit_key(signature), dict(_software(), ok=bool(ok), error=error, when=time.time()))
    except Exception as exc:  # noqa: BLE001
        log.warning("wan_accel: could not record the CUDA graph result in the limit cache (%s)", exc)


class CudaGraphBackend:
    """Capture/replay with torch.cuda.CUDAGraph on one side stream; all graphs share one memory pool (they never
    run at once) until ``new_pool`` (after a release or a failed capture)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(self.device)

    def _on_stream(self, body):
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        torch.cuda.set_stream(self.stream)
        try:
            return body()
        finally:
            torch.cuda.set_stream(current)       # also after a failed capture: the thread gets its stream back
            current.wait_stream(self.stream)

    # warmup(fn): fn run eagerly on the capture stream (libraries set up their per-stream state outside a graph)
    warmup = _on_stream

    def capture(self, fn):
        graph = torch.cuda.CUDAGraph()

        def body():
            graph.capture_begin(self.pool, capture_error_mode="thread_local")
            try:
                out = fn()
            except BaseException:
                try:
                    graph.capture_end()
                except Exception:  # noqa: BLE001 - the error of fn is the one to report
                    pass
                raise
            graph.capture_end()
            return out

        try:
            out = self._on_stream(body)
        except BaseException:
            self._drop_failed(graph)
            raise
        return graph, out

    def _drop_failed(self, graph) -> None:
        """After a failed capture: free what the graph holds, release its private pool (a capture that never
        ended leaves it in use) and capture into a new pool from now on, so freed blocks are reused."""
        for step in (lambda: graph.reset(),
                     lambda: torch._C._cuda_releasePool(self.device.index if self.device.index is not None
                                                        else torch.cuda.current_device(), self.pool),
                     self.new_pool, torch.cuda.empty_cache):
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - best effort; the pool may already be released
                log.debug("wan_accel: cleanup after a failed capture: %s", exc)

    def new_pool(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    @staticmethod
    def replay(graph) -> None:
        graph.replay()


class _Entry:
    __slots__ = ("calls", "graph", "out", "inputs", "recaptures")

    def __init__(self):
        self.calls, self.graph, self.out, self.inputs, self.recaptures = 0, None, None, None, 0


class GraphManager:
    """Per-session graphs. ``run(key, inputs, fn, warm_key=None)``: fn(inputs) -> output tensor or None.

    ``inputs`` is a dict of tensors; for a captured key they are copied into static buffers (shared between keys
    with the same names and shapes) before the replay."""

    MAX_RECAPTURES = 2

    def __init__(self, backend, *, cache=None, signature: str = "", max_graphs: int = 64):
        self.backend, self.cache, self.signature, self.max_graphs = backend, cache, signature, int(max_graphs)
        self.entries: dict = {}
        self.static: dict = {}
        self.warmed: set = set()
        self.enabled = True
        self.error: str | None = None
        self.stats = {"eager_calls": 0, "captures": 0, "replays": 0, "capture_s": 0.0, "provisional": 0}
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

    def run(self, key, inputs: dict, fn, warm_key=None):
        warm_key = key if warm_key is None else warm_key
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = _Entry()
        entry.calls += 1
        if entry.graph is not None:
            self._fill(entry.inputs, inputs)
            self.backend.replay(entry.graph)
            self.stats["replays"] += 1
            return entry.out
        if not self.enabled or self.graphs >= self.max_graphs:
            self.stats["eager_calls"] += 1
            return fn(inputs)
        if entry.calls < 2 and warm_key not in self.warmed:
            self.stats["eager_calls"] += 1
            warmup = getattr(self.backend, "warmup", None)
            out = warmup(lambda: fn(inputs)) if warmup is not None else fn(inputs)
            self.warmed.add(warm_key)
            return out
        return self._capture(entry, inputs, fn, warm_key)

    def _capture(self, entry: _Entry, inputs: dict, fn, warm_key):
        static = self._static_for(inputs)
        self._fill(static, inputs)
        t0 = time.perf_counter()
        provisional = autotune.provisional_count()
        try:
            with spent("graph_capture"):
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
        if not self._recorded_ok:
            self._recorded_ok = True
            record(self.cache, self.signature, True)
        self.backend.replay(graph)
        self.stats["replays"] += 1
        if autotune.provisional_count() != provisional and entry.recaptures < self.MAX_RECAPTURES:
            # a kernel ran its torch fallback only because its tuning was not known yet (e.g. a transient
            # out-of-memory during warm-up tuning): use this graph once, then warm up and capture again
            entry.recaptures += 1
            entry.calls = 0
            self.warmed.discard(warm_key)
            self.stats["provisional"] += 1
            return out
        entry.graph, entry.out, entry.inputs = graph, out, static
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
        """Drop every graph and static buffer; later captures use a new memory pool (a capture into the released
        pool could trip the allocator's pool checks when the shapes changed)."""
        had = bool(self.entries) or bool(self.static)
        self.entries.clear()
        self.static.clear()
        self.warmed.clear()
        new_pool = getattr(self.backend, "new_pool", None)
        if had and new_pool is not None:
            try:
                new_pool()
            except Exception as exc:  # noqa: BLE001
                log.debug("wan_accel: could not make a new graph pool: %s", exc)

    def report(self) -> dict:
        return dict(self.stats, graphs=self.graphs, enabled=self.enabled, error=self.error)
