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

import weakref

import torch

from ...model.seq_parallel import DEFAULT_TIMEOUT_S, check_heads, enable
from ..validate import DTYPE_ALIASES
from .parallel import RankWorkers, _loopback, failure, start_group, stop_group, worker_setup

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


def serve(*argv: str) -> None:
    """A worker rank (``parallel.RankWorkers``): load the model, join the group, then run jobs until its stdin
    closes."""
    import json
    rank, world, init, timeout_s, device, inbox, outbox = worker_setup(argv)
    spec = json.loads(argv[5])
    torch.set_num_threads(max(1, torch.get_num_threads()))
    try:
        from ..jobs.handle import load_model_handle
        from ..prepare import RunSpec, sample_video
        handle = load_model_handle(spec["source"], spec["dtype"], spec["precision"], spec["attention"], device,
                                   num_heads=spec.get("num_heads"), lora=spec.get("lora"),
                                   lora_strength=spec.get("lora_strength", 1.0))
        outbox.send(("loaded", rank, ""))
        sp = start_group(rank, world, init, device, timeout_s)
        enable(handle.model, sp)
        outbox.send(("ready", rank, ""))
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0
        outbox.send(failure(exc))
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
                outbox.send(("done", rank, ""))
            except BaseException as exc:  # noqa: BLE001
                outbox.send(failure(exc))
    finally:
        stop_group(quiet=True)


class RankPool(RankWorkers):
    """Ranks 1..world-1 of a sequence-parallel group whose rank 0 is this process (see the module doc)."""

    def __init__(self, world: int, spec: dict, devices: list, timeout_s: float = DEFAULT_TIMEOUT_S,
                 load_timeout_s: float = 900.0):
        super().__init__()
        self.world, self.spec, self.devices = int(world), dict(spec), list(devices)
        self.timeout_s, self.load_timeout_s = float(timeout_s), float(load_timeout_s)
        self.sp = None

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
        try:
            init = self.spawn("app.ranks.pool:serve", range(1, self.world), self.world, self.timeout_s, self.devices,
                              json.dumps(self.spec))
            self.collect("loaded", self.load_timeout_s, wait_all=False)     # notices a worker that dies loading
            _loopback()
            sp = start_group(0, self.world, init, self.devices[0], self.timeout_s)
            self.collect("ready", self.timeout_s, wait_all=False)
            enable(model, sp)
            self.sp = sp
        except BaseException:
            self.close(model)
            raise

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
            self.send(job)
            latents = sample_video(model, spec, *args, setup=setup, hooks=hooks, **kwargs)
            self.collect("done", self.timeout_s, wait_all=False)
            return latents
        except BaseException:
            self.close(model)
            raise

    def close(self, model=None) -> None:
        """Stop the workers and leave the group (idempotent); the model samples on one GPU again."""
        self.stop(leave_group=self.sp is not None or model is not None)
        self.sp = None
        if model is not None:
            enable(model, None)
