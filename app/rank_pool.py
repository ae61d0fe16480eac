"""Worker ranks kept beside a loaded model, for a host process that is rank 0 (the ComfyUI server).

``RankPool.attach(handle, world)`` prepares a pool for a model handle; the first ``sample`` starts ranks 1..N-1 as
worker processes (the next GPUs, ``cuda:1`` ...; CPU processes on gloo when the model is on the CPU), each loading
the same checkpoint with the same settings, and joins them as rank 0. Each ``sample`` sends the job to the workers
over a pipe, samples as rank 0 and collects their status. A worker that fails, dies or hangs gives one
``ParallelError`` (every collective and every wait has a timeout); any error or interrupt on rank 0 tears the
workers down (the next ``sample`` starts them again), and so does dropping the model: no rank is left behind.
Idle workers wait on their pipe, never in a collective, and exit when this process goes away.
"""
from __future__ import annotations

import tempfile
import time
import traceback
import weakref
from pathlib import Path

import torch

from ..model.seq_parallel import DEFAULT_TIMEOUT_S, ParallelError, check_heads, enable
from .parallel import _loopback, start_group, stop_group

POOL_KEY = "rank_pool"          # in ModelHandle.extra


def _serve(rank: int, world: int, init: str, timeout_s: float, spec: dict, device: str, conn) -> None:
    """A worker rank: load the model, join the group, then run jobs from the pipe until it closes."""
    _loopback()
    try:
        from .handle import load_model_handle
        from .job import sample_latents, sampler_setup
        handle = load_model_handle(spec["source"], spec["dtype"], spec["precision"], spec["attention"], device,
                                   plan=spec.get("plan"), num_heads=spec.get("num_heads"))
        conn.send(("loaded", rank))
        sp = start_group(rank, world, init, device, timeout_s)
        enable(handle.model, sp)
        conn.send(("ready", rank))
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    try:
        while True:
            try:
                job = conn.recv()
            except (EOFError, OSError):          # rank 0 went away: leave
                return
            if job is None:
                return
            try:
                options = sampler_setup(handle, job["path"], **job["setup"])
                with torch.no_grad():
                    sample_latents(handle.model, *job["args"], path=job["path"], fast_options=options,
                                   oom_retry="off", **job["kwargs"])
                conn.send(("done", rank))
            except BaseException as exc:  # noqa: BLE001
                conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"))
    finally:
        try:
            stop_group()
        except Exception:  # noqa: BLE001
            pass


class RankPool:
    """Ranks 1..world-1 of a sequence-parallel group whose rank 0 is this process (see the module doc)."""

    def __init__(self, world: int, spec: dict, devices: list, timeout_s: float = DEFAULT_TIMEOUT_S,
                 load_timeout_s: float = 900.0):
        self.world, self.spec, self.devices = int(world), dict(spec), list(devices)
        self.timeout_s, self.load_timeout_s = float(timeout_s), float(load_timeout_s)
        self.procs: list = []
        self.conns: list = []
        self.sp = None
        self._tmp = None

    @classmethod
    def attach(cls, handle, world: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> "RankPool":
        """The pool of a model handle (replacing an earlier one); checks the head count and the GPUs now."""
        check_heads(handle.model.config.num_heads, world)
        device = handle.model.device
        if device.type == "cuda":
            first = device.index if device.index is not None else torch.cuda.current_device()
            count = torch.cuda.device_count()
            if first + world > count:
                raise ValueError(f"{world} ranks need {world} GPUs from cuda:{first}; this machine has {count}: "
                                 f"use at most {max(1, count - first)} ranks")
            devices = [f"cuda:{first + r}" for r in range(world)]
        else:
            devices = ["cpu"] * world
        old = handle.extra.get(POOL_KEY)
        if old is not None:
            old.close(handle.model)
        spec = {"source": handle.source, "dtype": handle.dtype, "precision": handle.precision,
                "attention": handle.attention, "plan": handle.plan,
                "num_heads": handle.model.config.num_heads}
        pool = cls(world, spec, devices, timeout_s)
        handle.extra[POOL_KEY] = pool
        weakref.finalize(handle.model, pool.close)       # the workers go with the model
        return pool

    @property
    def running(self) -> bool:
        return self.sp is not None

    def start(self, model) -> None:
        if self.running:
            return
        import torch.multiprocessing as mp
        ctx = mp.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory(prefix="wan_accel_pool_")
        init = Path(self._tmp.name, "store").as_uri()
        try:
            for rank in range(1, self.world):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_serve, args=(rank, self.world, init, self.timeout_s, self.spec,
                                                     self.devices[rank], child), daemon=True)
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
            self._collect("loaded", self.load_timeout_s)     # notices a worker that dies while loading
            _loopback()
            sp = start_group(0, self.world, init, self.devices[0], self.timeout_s)
            self._collect("ready", self.timeout_s)
            enable(model, sp)
            self.sp = sp
        except BaseException:
            self.close(model)
            raise

    def _collect(self, want: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while not conn.poll(0.1):
                if not p.is_alive():
                    raise ParallelError(f"sequence-parallel worker rank {rank} died (exit code {p.exitcode})")
                if time.monotonic() > deadline:
                    raise ParallelError(f"sequence-parallel worker rank {rank} did not answer within "
                                        f"{timeout_s:g} s")
            kind, value = conn.recv()
            if kind != want:
                raise ParallelError(f"sequence-parallel worker rank {rank} failed: {value}")

    def sample(self, model, *args, callback=None, path="auto", fast_options=None, setup=None, report=None,
               **kwargs):
        """``job.sample_latents(model, *args, ...)`` on every rank; rank 0's latents. Any error or interrupt
        tears the workers down before it propagates."""
        from .job import sample_latents
        self.start(model)
        cpu = lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v      # noqa: E731
        job = {"args": tuple(cpu(a) for a in args), "kwargs": {k: cpu(v) for k, v in kwargs.items()}, "path": path,
               "setup": dict(setup or {})}
        try:
            for conn in self.conns:
                conn.send(job)
            latents = sample_latents(model, *args, callback=callback, path=path, fast_options=fast_options,
                                     report=report, oom_retry="off", **kwargs)
            self._collect("done", self.timeout_s)
            return latents
        except BaseException:
            self.close(model)
            raise

    def close(self, model=None) -> None:
        """Stop the workers and leave the group (idempotent); the model samples on one GPU again."""
        for conn in self.conns:
            try:
                conn.send(None)
            except Exception:  # noqa: BLE001 - the worker may be gone
                pass
        for p in self.procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join(5)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
        if self.sp is not None or model is not None:
            try:
                stop_group()
            except Exception:  # noqa: BLE001 - a broken group
                pass
        self.sp = None
        if model is not None:
            enable(model, None)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
