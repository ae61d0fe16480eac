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

import os
import tempfile
import time
import traceback
import weakref
from pathlib import Path

import torch

from ...model.seq_parallel import DEFAULT_TIMEOUT_S, ParallelError, check_heads, enable
from ...profiling.child import child_argv, one_line, worker_message
from ..validate import DTYPE_ALIASES
from .parallel import _loopback, start_group, stop_group

POOL_KEY = "rank_pool"          # in ModelHandle.extra


def _plain(value):
    """A job argument as plain data: tensors on the CPU (a RunInputs' too), a Schedule as resolve_schedule arguments."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if hasattr(value, "steps_config") and hasattr(value, "warp"):
        return {"preset": "custom", "steps": list(value.steps_config), "shift": float(value.shift),
                "warp": bool(value.warp)}
    if hasattr(value, "__dataclass_fields__") and hasattr(value, "replace"):
        return value.replace(**{name: _plain(getattr(value, name)) for name in value.__dataclass_fields__})
    return value


# The worker is a fresh interpreter (not a multiprocessing child: a host such as ComfyUI loads this package under a
# path-like module name and runs its own main module, neither of which a spawned child can re-import). It loads the
# package from its folder (profiling/child.py), then serves jobs from its stdin; replies go to its stdout (the
# process's own prints are sent to stderr). Jobs are plain data (no classes of this package).
def _channel():
    """(reader of stdin, writer to the real stdout) as message connections; fd 1 then points at stderr."""
    from multiprocessing.connection import Connection
    out = os.dup(1)
    os.dup2(2, 1)
    return Connection(0, writable=False), Connection(out, readable=False)


def serve(*argv: str) -> None:
    """A worker rank: load the model, join the group, then run jobs until its stdin closes."""
    import json
    rank, world, init, timeout_s, device = int(argv[0]), int(argv[1]), argv[2], float(argv[3]), argv[4]
    spec = json.loads(argv[5])
    inbox, outbox = _channel()
    _loopback()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    try:
        from ..jobs.handle import load_model_handle
        from ..prepare import RunSpec, sample_video
        handle = load_model_handle(spec["source"], spec["dtype"], spec["precision"], spec["attention"], device,
                                   num_heads=spec.get("num_heads"), lora=spec.get("lora"),
                                   lora_strength=spec.get("lora_strength", 1.0))
        outbox.send(("loaded", rank))
        sp = start_group(rank, world, init, device, timeout_s)
        enable(handle.model, sp)
        outbox.send(("ready", rank))
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0
        outbox.send(("error", one_line(exc), traceback.format_exc()))
        return
    try:
        while True:
            try:
                job = inbox.recv()
            except (EOFError, OSError):          # rank 0 went away: leave
                return
            if job is None:
                return
            try:
                spec = RunSpec.for_handle(handle, **job["spec"])      # this rank's own swap and compile
                with torch.no_grad():
                    sample_video(handle.model, spec, *job["args"], **job["kwargs"])
                outbox.send(("done", rank))
            except BaseException as exc:  # noqa: BLE001
                outbox.send(("error", one_line(exc), traceback.format_exc()))
    finally:
        stop_group(quiet=True)


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
        spec = {"source": handle.source, "dtype": DTYPE_ALIASES[str(handle.dtype)], "precision": handle.precision,
                "attention": handle.attention, "num_heads": handle.model.config.num_heads,
                "lora": getattr(handle, "lora", None), "lora_strength": getattr(handle, "lora_strength", 1.0)}
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
        import json
        import subprocess
        from multiprocessing.connection import Connection
        self._tmp = tempfile.TemporaryDirectory(prefix="wan_accel_pool_")
        init = Path(self._tmp.name, "store").as_uri()
        try:
            for rank in range(1, self.world):
                p = subprocess.Popen(child_argv("app.ranks.pool:serve", rank, self.world, init, self.timeout_s,
                                                self.devices[rank], json.dumps(self.spec)),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                self.procs.append(p)
                self.conns.append((Connection(os.dup(p.stdin.fileno()), readable=False),
                                   Connection(os.dup(p.stdout.fileno()), writable=False)))
                p.stdin.close()
                p.stdout.close()
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
        for rank, (p, (_out, conn)) in enumerate(zip(self.procs, self.conns), start=1):
            while not conn.poll(0.1):
                if p.poll() is not None:
                    raise ParallelError(f"sequence-parallel worker rank {rank} died (exit code {p.returncode})")
                if time.monotonic() > deadline:
                    raise ParallelError(f"sequence-parallel worker rank {rank} did not answer within "
                                        f"{timeout_s:g} s")
            kind, value, *details = conn.recv()
            if kind != want:
                raise ParallelError(worker_message(f"sequence-parallel worker rank {rank} failed: {value}",
                                                   *details[:1]))

    def sample(self, model, spec, *args, setup=None, hooks=None, **kwargs):
        """``prepare.sample_video(model, spec, *args, ...)`` on every rank (each prepares its own model from the
        spec); rank 0's latents (its hooks: callback and on_chunk_latents run on rank 0 only). Any error or
        interrupt tears the workers down before it propagates."""
        from ..prepare import sample_video
        self.start(model)
        spec = spec.replace(oom_retry="off")
        job = {"args": tuple(_plain(a) for a in args), "kwargs": {k: _plain(v) for k, v in kwargs.items()},
               "spec": {k: _plain(v) for k, v in spec.plain().items()}}
        try:
            for out, _inbox in self.conns:
                out.send(job)
            latents = sample_video(model, spec, *args, setup=setup, hooks=hooks, **kwargs)
            self._collect("done", self.timeout_s)
            return latents
        except BaseException:
            self.close(model)
            raise

    def alive(self) -> list:
        """Whether each worker process is still running."""
        return [p.poll() is None for p in self.procs]

    def close(self, model=None) -> None:
        """Stop the workers and leave the group (idempotent); the model samples on one GPU again."""
        for out, _inbox in self.conns:
            try:
                out.send(None)
            except Exception:  # noqa: BLE001 - the worker may be gone
                pass
        for p in self.procs:
            try:
                p.wait(timeout=2)
            except Exception:  # noqa: BLE001 - busy in a collective of a broken group: stop it
                p.kill()
                p.wait(5)
        for pair in self.conns:
            for conn in pair:
                conn.close()
        self.procs, self.conns = [], []
        if self.sp is not None or model is not None:
            stop_group(quiet=True)      # a broken group
        self.sp = None
        if model is not None:
            enable(model, None)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
