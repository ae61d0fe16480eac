"""The operator-limit store: the pack's own autotuner for its Triton kernels.

For one (kernel, tuning key) on the current fingerprint (the limit cache scopes entries by GPU and software),
``Autotuner.tune`` benchmarks candidate configs with a pluggable timer and records, in the ``operator``
namespace of the limit cache::

    {"kernel": ..., "key": ..., "metric": "median_ms", "policy": "default" | "extreme",
     "timings": {config_id: ms}, "best": {"id", "config", "ms"} | None, "last_working": config | None,
     "failed": {config_id: {"config", "error": {"type", "message", "name", "required", "limit", ...}}},
     "locked": bool, "timestamp": unix time of the last change}

Rules:
- a config recorded as failed is never compiled or launched again on that fingerprint (early prune);
- a config whose estimated shared memory exceeds the device limit is pruned before it is compiled;
- a config that already has a timing is not benchmarked again, so a second process with the same cache
  performs zero benchmark runs for a known key;
- policy "extreme": a new measurement replaces a stored timing (and the best) only when it is faster;
- a locked entry is never re-benchmarked nor replaced;
- when every config fails, ``tune`` logs one clear error naming kernel, key and failures and returns None:
  the caller then runs its torch implementation.

Plain ``@triton.jit`` kernels are launched with explicit meta-parameters by the caller's ``run(config)``;
Triton's own ``triton.autotune`` is not used (its benchmarker needs a GPU driver even in interpreter mode).

This module imports nothing else from the pack except the limit cache, and neither torch nor triton at import.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import logging
import math
import os
import statistics
import threading
import time
from typing import Callable, Iterable

from .entries import finite_number, register_shape

log = logging.getLogger("wan_accel.autotune")

NAMESPACE = "operator"
METRIC = "median_ms"
POLICIES = ("default", "extreme")


# ----------------------------------------------------------------------------- errors
def optional_types(*names: str) -> tuple[type, ...]:
    """The exception types named ``"module.Type"`` that this install has, in order; one whose module is absent
    or reorganised (no triton, an older torch) is left out."""
    found: list[type] = []
    for name in names:
        module, _, attr = name.rpartition(".")
        try:
            found_type = getattr(importlib.import_module(module), attr)
        except Exception:  # noqa: BLE001 - any failure to import means: not on this install
            continue
        if isinstance(found_type, type):
            found.append(found_type)
    return tuple(found)


def tuning_errors() -> tuple[type, ...]:
    """Exception types that mean "this config can never work on this device" (recorded permanently)."""
    return optional_types("triton.runtime.errors.OutOfResources", "triton.runtime.errors.PTXASError",
                          "triton.compiler.errors.CompileTimeAssertionFailure")


def _is_transient(exc: BaseException) -> bool:
    """Errors that say nothing about the config (out of memory now, interrupted): never recorded."""
    from .oom import is_oom

    return isinstance(exc, KeyboardInterrupt) or is_oom(exc)


def describe_error(exc: BaseException) -> dict:
    """A JSON-safe description of a failed config's exception."""
    info: dict = {"type": type(exc).__name__, "message": str(exc)[:500]}
    for attr in ("name", "required", "limit"):  # triton OutOfResources(required, limit, name)
        value = getattr(exc, attr, None)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            info[attr] = value
    return info


def config_id(config: dict) -> str:
    """Canonical, order-independent id of a config dict, e.g. ``RBLOCK=64,YBLOCK=4,num_warps=4``."""
    return ",".join(f"{k}={config[k]}" for k in sorted(config))


# ----------------------------------------------------------------------------- provisional results
_PROVISIONAL = {"count": 0}
_PROVISIONAL_LOCK = threading.Lock()


def provisional_count() -> int:
    """How many times, in this process, ``tune`` returned None only because nothing was measured yet (measuring
    was not allowed, e.g. during a CUDA graph capture, or hit a transient error): the caller ran its torch
    fallback this time, but a later call would get a tuned kernel. The graph manager compares this count around a
    capture and does not keep a graph that baked such a fallback in."""
    return _PROVISIONAL["count"]


def _note_provisional() -> None:
    with _PROVISIONAL_LOCK:
        _PROVISIONAL["count"] += 1


# ----------------------------------------------------------------------------- timers
def cpu_timer(fn: Callable[[], object], repeats: int = 3) -> float:
    """Median wall time of ``fn`` in ms (used for CPU / interpreter runs)."""
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def cuda_timer(fn: Callable[[], object]) -> float:
    """Median GPU time of ``fn`` in ms, call by call: triton.testing.do_bench when available, else CUDA events.
    The host's time per call counts wherever it leaves the GPU idle between the events."""
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=5, rep=25, return_mode="median"))
    except TypeError:  # older do_bench without return_mode
        return float(do_bench(fn, warmup=5, rep=25))
    except ImportError:
        pass
    import torch

    fn()
    return statistics.median([event_ms(torch.cuda, fn) for _ in range(10)])


def event_ms(cuda, fn: Callable[[], object]) -> float:
    """GPU time in ms between CUDA events recorded around one ``fn()`` on the current stream."""
    start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


TIMING = "graph-replay"   # how default_timer measures on a GPU; part of the store names of choices between paths
GRAPH_CALLS = 8      # at most this many back-to-back calls of fn in one captured graph
GRAPH_REPLAYS = 5    # timed replays (the median is kept)
GRAPH_BUDGET_MS = 2.0    # GPU time aimed at per replay: a slow call is captured fewer times (down to once)
SLOW_REPLAY_MS = 20.0    # a replay longer than this is timed twice, not GRAPH_REPLAYS times


def graph_timer(fn: Callable[[], object], calls: int | None = None, replays: int = GRAPH_REPLAYS) -> float | None:
    """Median GPU time of one ``fn()`` in ms, from CUDA-graph replays of back-to-back calls, or None when ``fn``
    cannot be captured (it synchronises with the host, or a stream is being captured already).

    This is what a call costs where the sampler runs: its model calls replay CUDA graphs, so the host's own time per
    call (Python, argument checks, the launch) is never on the GPU's timeline. Timing call by call instead charges
    that host time as GPU idle time wherever it exceeds the GPU's, which ranks a one-kernel Python launcher behind
    a few cheaper-to-launch library kernels that take longer on the GPU. ``calls`` (default: as many as fit
    GRAPH_BUDGET_MS by one eager call's time, 1 to GRAPH_CALLS) keeps a slow candidate (plain softmax attention at a
    long call) from costing seconds."""
    import torch

    cuda = torch.cuda
    if cuda.is_current_stream_capturing():
        return None
    side = cuda.Stream()
    side.wait_stream(cuda.current_stream())
    try:
        with cuda.stream(side):                  # one call outside the capture (lazy init, workspaces), one timed
            fn()
            eager_ms = event_ms(cuda, fn)       # an upper bound: the host's time may be in it
        if calls is None:
            calls = max(1, min(GRAPH_CALLS, int(GRAPH_BUDGET_MS / max(eager_ms, 1e-3))))
        cuda.current_stream().wait_stream(side)
        graph = cuda.CUDAGraph()
        # thread_local: CUDA work of other threads (a ComfyUI server's, a prefetch stream's) is not refused
        with cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(max(1, calls)):
                fn()
    except Exception as exc:  # noqa: BLE001 - not capturable: the caller times it call by call
        log.debug("wan_accel autotune: not timed in a CUDA graph (%s); timed call by call", exc)
        with contextlib.suppress(Exception):
            cuda.synchronize()
        return None
    try:
        graph.replay()
        times = [event_ms(cuda, graph.replay) / max(1, calls)
                 for _ in range(max(1, replays if eager_ms * calls < SLOW_REPLAY_MS else 2))]
        return float(statistics.median(times))
    finally:
        del graph


def _gpu_timed() -> bool:
    """Whether ``default_timer`` measures GPU time here (a CUDA GPU, not Triton's interpreter)."""
    try:
        import torch

        interpreting = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")
        return torch.cuda.is_available() and not interpreting
    except Exception:  # noqa: BLE001 - no usable torch.cuda: wall time
        return False


def default_timer(fn: Callable[[], object]) -> float:
    """On a CUDA GPU: GPU time per call in a CUDA graph (``graph_timer``), call by call where ``fn`` cannot be
    captured (``cuda_timer``); elsewhere wall time."""
    if not _gpu_timed():
        return cpu_timer(fn, repeats=1)
    try:
        graphed = graph_timer(fn)
    except Exception as exc:  # noqa: BLE001 - a replay that failed: time it call by call
        log.debug("wan_accel autotune: graph timing failed (%s); timed call by call", exc)
        graphed = None
    return cuda_timer(fn) if graphed is None else graphed


def device_shared_memory_limit() -> int | None:
    """Largest shared memory per block (bytes) the current CUDA device allows, or None when unknown."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        for attr in ("shared_memory_per_block_optin", "max_shared_memory_per_block_optin",
                     "shared_memory_per_block"):
            value = getattr(props, attr, None)
            if isinstance(value, int) and value > 0:
                return value
        from triton.runtime import driver

        return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception:  # noqa: BLE001 - unknown limit: nothing is pruned by estimate
        return None


# ----------------------------------------------------------------------------- the autotuner
class Autotuner:
    """Benchmarks candidate configs once per (kernel, key, fingerprint) and remembers the outcome.

    cache:   a LimitCache, or None for an in-memory tuner (nothing persisted).
    timer:   ``timer(run) -> ms``; ``run()`` launches the kernel once with the config being measured.
    shared_memory_limit: bytes; configs whose ``smem(config)`` estimate exceeds it are pruned before
             compiling. None -> asked from the device when the first CUDA tune happens.
    """

    def __init__(self, cache=None, *, timer: Callable[[Callable[[], object]], float] | None = None,
                 shared_memory_limit: int | None = None):
        self.cache = cache
        self.timer = timer or default_timer
        self.shared_memory_limit = shared_memory_limit
        self._memo: dict[tuple, dict | None] = {}
        self._fast: dict[tuple, tuple] = {}
        self._reported: set[tuple] = set()
        self._lock = threading.RLock()
        self._mem_entries: dict[str, dict] = {}  # the store when no cache is given
        self._transient = False  # set by _tune_locked when a config hit a transient error (out of memory)
        self._provisional = False  # set by _tune_locked when None only means "not measured yet"
        self.stats = {"benchmarks": 0, "launch_checks": 0, "memo_hits": 0, "cache_hits": 0,
                      "pruned_known_failed": 0, "pruned_shared_memory": 0, "failures": 0}

    # ---------------------------------------------------------------- storage
    @staticmethod
    def entry_key(kernel: str, key: str) -> str:
        return f"{kernel}|{key}"

    def entry(self, kernel: str, key: str) -> dict | None:
        """The stored entry (see module doc) or None."""
        if self.cache is None:
            value = self._mem_entries.get(self.entry_key(kernel, key))
            return json.loads(json.dumps(value)) if value is not None else None
        return self.cache.get(NAMESPACE, self.entry_key(kernel, key))

    def _update(self, kernel: str, key: str, fn: Callable[[dict | None], dict | None]) -> dict | None:
        ek = self.entry_key(kernel, key)
        if self.cache is None:
            new = fn(self.entry(kernel, key))
            if new is None:
                self._mem_entries.pop(ek, None)
            else:
                self._mem_entries[ek] = new
            return new
        try:
            return self.cache.update(NAMESPACE, ek, fn)
        except Exception as exc:  # noqa: BLE001 - a read-only or locked cache must not break a run
            log.warning("wan_accel: could not write the operator store %s (%s); keeping results in memory",
                        getattr(self.cache, "path", "?"), exc)
            return fn(self.entry(kernel, key))

    def forget(self) -> None:
        """Drop the in-process memo (the next ``tune`` reads the store again)."""
        with self._lock:
            self._memo.clear()
            self._fast.clear()

    def record_failure(self, kernel: str, key: str, config: dict, exc: BaseException) -> None:
        """Remember that ``config`` failed (e.g. at a later real launch); it is never used again here."""
        if _is_transient(exc):
            return
        cid, err = config_id(config), describe_error(exc)

        def change(old):
            new = dict(old or _new_entry(kernel, key, "default"))
            new.setdefault("failed", {})[cid] = {"config": dict(config), "error": err}
            new.get("timings", {}).pop(cid, None)
            if (new.get("best") or {}).get("id") == cid:
                new["best"] = None
            new["timestamp"] = time.time()
            return new

        self.stats["failures"] += 1
        self._update(kernel, key, change)
        self.forget()

    # ---------------------------------------------------------------- tuning
    def tune(self, kernel: str, key: str, configs: Iterable[dict], run: Callable[[dict], object], *,
             smem: Callable[[dict], int] | None = None, policy: str = "default", force: bool = False,
             benchmark: bool = True) -> dict | None:
        """The best working config among ``configs`` for (kernel, key), benchmarking only what is unknown.

        run(config) launches the kernel once with ``config``. Returns a config dict, or None when every
        candidate failed (an error naming kernel, key and failures is logged once).
        benchmark=False (e.g. while a CUDA graph is being captured) only consults what is known: it returns
        the stored best or None, and measures nothing.
        """
        fast_key = (kernel, key, id(configs))
        hit = self._fast.get(fast_key)
        if hit is not None and hit[0] is configs and not force:  # the hot path: same candidate tuple again
            self.stats["memo_hits"] += 1
            return hit[1]
        if policy not in POLICIES:
            raise ValueError(f"autotune policy {policy!r} must be one of {POLICIES}")
        given = configs
        configs = [dict(c) for c in configs]
        if not configs:
            raise ValueError(f"autotune {kernel} [{key}]: no candidate configs given")
        ids = tuple(config_id(c) for c in configs)
        memo_key = (kernel, key, ids)
        with self._lock:
            if not force and memo_key in self._memo:
                self.stats["memo_hits"] += 1
                return self._memo[memo_key]
            self._transient = False
            self._provisional = False
            from .warmup import spent
            with spent("autotune") if benchmark else contextlib.nullcontext():
                result = self._tune_locked(kernel, key, configs, ids, run, smem, policy, force and benchmark,
                                           benchmark)
            # a None caused by a transient error (out of memory now) is not final: the next call measures again
            if result is None and self._provisional:
                _note_provisional()
            if (benchmark and not self._transient) or result is not None:
                self._memo[memo_key] = result
                if isinstance(given, tuple):  # immutable: safe to recognise by identity next time
                    self._fast[fast_key] = (given, result)
            return result

    def slower_than_exact(self, kernel: str, key: str, mode: str, run_mode: Callable[..., object],
                          run_exact: Callable[..., object], make: Callable[[], tuple]) -> tuple[bool | None, str]:
        """(slower, the two timings in words) of an opt-in approximate ``mode`` against the exact path, tuned as the
        configs {'impl': mode} and {'impl': 'exact'} of ``kernel@TIMING`` at ``key`` (one verdict per fingerprint and key:
        a second process times nothing). slower is None when nothing could be measured. ``make()`` gives the
        inputs both runs take (``run_mode(*inputs)``): made only when something is timed, once, and dropped after,
        so a stored verdict costs no allocation and no copy to the device."""
        made: list = []

        def call(fn):
            if not made:
                made.append(make())
            return fn(*made[0])

        fns = {mode: run_mode, "exact": run_exact}
        kernel = f"{kernel}@{TIMING}"          # a verdict timed another way is measured again
        best = self.tune(kernel, key, ({"impl": mode}, {"impl": "exact"}), lambda cfg: call(fns[cfg["impl"]]))
        made.clear()
        timings = (self.entry(kernel, key) or {}).get("timings") or {}
        t_mode, t_exact = timings.get(f"impl={mode}"), timings.get("impl=exact")
        shown = (f"{t_mode:.3g} ms against {t_exact:.3g} ms exact" if t_mode is not None and t_exact is not None
                 else "timings unknown")
        return (None if best is None else best["impl"] != mode), shown

    def _tune_locked(self, kernel, key, configs, ids, run, smem, policy, force, benchmark=True):
        stored = self.entry(kernel, key) or {}
        failed: dict = dict(stored.get("failed") or {})
        timings: dict = dict(stored.get("timings") or {})
        locked = bool(stored.get("locked"))
        if stored:
            self.stats["cache_hits"] += 1

        limit = self.shared_memory_limit
        if limit is None and smem is not None:
            limit = device_shared_memory_limit()
        new_failed: dict = {}
        candidates = []
        for cid, cfg in zip(ids, configs):
            if cid in failed:
                self.stats["pruned_known_failed"] += 1
                continue
            if smem is not None and limit is not None:
                need = int(smem(cfg))
                if need > limit:
                    self.stats["pruned_shared_memory"] += 1
                    new_failed[cid] = {"config": cfg, "error": {
                        "type": "OutOfResources", "name": "shared memory", "required": need, "limit": int(limit),
                        "message": f"estimated shared memory {need} B exceeds the device limit {limit} B; "
                                   f"pruned before compiling", "estimated": True}}
                    continue
            candidates.append((cid, cfg))

        # a locked entry is frozen: nothing is benchmarked, the stored timings decide
        to_measure = [] if locked or not benchmark else [(c, cfg) for c, cfg in candidates
                                                          if force or c not in timings]
        measured: dict = {}
        last_working = None
        errors = tuning_errors()
        wall = self.timer is default_timer and not _gpu_timed()
        for cid, cfg in to_measure:
            try:
                self.stats["launch_checks"] += 1
                t0 = time.perf_counter()
                run(cfg)  # compile + first launch: resource errors surface here
                self.stats["benchmarks"] += 1
                # wall time (a CPU, Triton's interpreter: nothing is compiled, so the first launch is a launch like
                # any other and is the timing); on a GPU the timer measures further calls
                ms = (time.perf_counter() - t0) * 1e3 if wall else float(self.timer(lambda cfg=cfg: run(cfg)))
            except Exception as exc:  # noqa: BLE001 - any failing config is skipped, the run goes on
                if not isinstance(exc, errors) and _is_transient(exc):
                    log.warning("wan_accel autotune %s [%s]: config %s hit a transient error (%s); skipped",
                                kernel, key, cid, exc)
                    self._transient = True
                    continue
                new_failed[cid] = {"config": cfg, "error": describe_error(exc)}
                self.stats["failures"] += 1
                continue
            if not math.isfinite(ms):
                new_failed[cid] = {"config": cfg, "error": {"type": "NonFiniteTiming", "message": repr(ms)}}
                continue
            measured[cid] = (cfg, ms)
            last_working = cfg

        if measured or new_failed:
            stored = self._update(kernel, key, lambda old: _merge(old, kernel, key, policy, measured,
                                                                   new_failed, last_working)) or stored
            failed = dict(stored.get("failed") or {})
            timings = dict(stored.get("timings") or {})

        usable = [(timings[c], c, cfg) for c, cfg in zip(ids, configs) if c in timings and c not in failed]
        if not usable and (not benchmark or self._transient):
            # nothing known yet (or only transient errors); the caller runs torch this time
            self._provisional = any(c not in failed for c, _cfg in candidates)
            return None
        if not usable:
            report = (kernel, key)
            if report not in self._reported:
                self._reported.add(report)
                reasons = "; ".join(f"{c}: {_short(failed[c]['error'])}" for c in ids if c in failed) or "none ran"
                log.error("wan_accel: every config of kernel %s failed for key %s (%s); "
                          "using the torch implementation instead", kernel, key, reasons)
            return None
        usable.sort(key=lambda t: t[0])
        return dict(usable[0][2])


def _short(err: dict) -> str:
    if err.get("type") == "OutOfResources":
        return f"OutOfResources {err.get('name')} required {err.get('required')} > limit {err.get('limit')}"
    return f"{err.get('type')}: {str(err.get('message', ''))[:120]}"


def _new_entry(kernel: str, key: str, policy: str) -> dict:
    return {"kernel": kernel, "key": key, "metric": METRIC, "policy": policy, "timings": {}, "best": None,
            "last_working": None, "failed": {}, "locked": False, "timestamp": time.time()}


def _merge(old, kernel, key, policy, measured, new_failed, last_working) -> dict:
    """Fold fresh results into the stored entry (runs under the cache's cross-process lock)."""
    new = _new_entry(kernel, key, policy)
    if old:
        new.update(old)
        new["timings"] = dict(old.get("timings") or {})
        new["failed"] = dict(old.get("failed") or {})
    if new.get("locked"):
        return new  # another process locked it meanwhile: keep as is
    extreme = policy == "extreme" or new.get("policy") == "extreme"
    for cid, (cfg, ms) in measured.items():
        prev = new["timings"].get(cid)
        if extreme and prev is not None and prev <= ms:
            continue  # only a faster measurement replaces one
        new["timings"][cid] = ms
        new.setdefault("configs", {})[cid] = cfg
    new["failed"].update(new_failed)
    for cid in new_failed:
        new["timings"].pop(cid, None)
    best = new.get("best")
    fastest = min(((ms, cid) for cid, ms in new["timings"].items()), default=None)
    if fastest is not None:
        ms, cid = fastest
        cfg = (new.get("configs") or {}).get(cid) or measured.get(cid, ({},))[0]
        if not (extreme and best and best.get("ms") is not None and best["ms"] <= ms
                and best.get("id") in new["timings"]):
            new["best"] = {"id": cid, "config": cfg, "ms": ms}
    elif best and best.get("id") in new["failed"]:
        new["best"] = None
    if last_working is not None:
        new["last_working"] = dict(last_working)
    if extreme:
        new["policy"] = "extreme"
    new["metric"] = METRIC
    new["timestamp"] = time.time()
    return new


# ----------------------------------------------------------------------------- the stored shape
def operator_shape(value: dict) -> None:
    """The fields ``tune`` reads from a stored entry; anything else makes the entry set aside (register_shape)."""
    timings = value.get("timings", {})
    if not isinstance(timings, dict) or not all(finite_number(ms) for ms in timings.values()):
        raise ValueError("'timings' must map config ids to finite numbers")
    failed = value.get("failed", {})
    if not isinstance(failed, dict) or not all(isinstance(f, dict) and isinstance(f.get("error", {}), dict)
                                               for f in failed.values()):
        raise ValueError("'failed' must map config ids to objects with an 'error' object")
    best = value.get("best")
    if best is not None and not (isinstance(best, dict) and (best.get("ms") is None or finite_number(best["ms"]))):
        raise ValueError("'best' must be null or an object whose 'ms' is a finite number")
    for name in ("last_working", "configs"):
        if value.get(name) is not None and not isinstance(value[name], dict):
            raise ValueError(f"{name!r} must be an object or null")
    if not isinstance(value.get("locked", False), bool):
        raise ValueError("'locked' must be true or false")


register_shape(NAMESPACE, operator_shape)


# ----------------------------------------------------------------------------- the shared instance
_DEFAULT: dict[str, Autotuner] = {}
_DEFAULT_LOCK = threading.Lock()


def get_autotuner() -> Autotuner:
    """The process's autotuner on the default limit cache (follows ``$WAN_ACCEL_CACHE``).

    Falls back to an in-memory tuner, with one warning, when the cache cannot be opened.
    """
    marker = os.environ.get("WAN_ACCEL_CACHE", "")
    tuner = _DEFAULT.get(marker)
    if tuner is not None:
        return tuner
    with _DEFAULT_LOCK:
        tuner = _DEFAULT.get(marker)
        if tuner is None:
            from .open import open_cache
            tuner = _DEFAULT[marker] = Autotuner(open_cache(None, "kernel tuning results are kept in memory"))
    return tuner


def reset_autotuners() -> None:
    """Forget the shared tuners (the next ``get_autotuner`` reads the store afresh, as a new process would)."""
    with _DEFAULT_LOCK:
        _DEFAULT.clear()
