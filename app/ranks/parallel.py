"""Starting the ranks of a sequence-parallel run (``model/seq_parallel.py``) on ``torch.distributed``.

Two ways in:

* ``torchrun --nproc-per-node N -m wan_accel generate ...``: every process calls ``group_from_env()``, which reads
  torchrun's RANK / WORLD_SIZE / LOCAL_RANK, picks NCCL on GPUs (one GPU per rank, ``cuda:LOCAL_RANK``) or gloo on
  CPUs, and returns the rank's ``SeqParallel``;
* ``run_ranks(fn, world, ...)``: this process starts ``world`` worker processes on this machine (loopback only, a
  file store in a temporary folder, no port to pick), each runs ``fn(sp, *args)``; it returns their results by rank
  or raises one ``ParallelError`` that names the rank that failed first, within a deadline, and leaves no worker
  behind (the tests and the ComfyUI face use it).

Every collective of the group has a timeout (``SeqParallel.timeout_s``), also the group's own set-up.
"""
from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from ...model.kv_cache import KVCache
from ...model.seq_parallel import DEFAULT_TIMEOUT_S, ParallelError, SeqParallel, enable
from ...profiling.child import one_line, worker_message

ENV_TIMEOUT = "WAN_ACCEL_PARALLEL_TIMEOUT"
MAX_WORLD = 64          # ranks one run may start or join, whatever the machine


def world_limit(device=None) -> tuple[int, str]:
    """(most ranks this machine can run, why): its CUDA devices for CUDA ranks, else its CPU cores."""
    if device is not None and torch.device(device).type == "cuda" or device is None and torch.cuda.is_available():
        n = torch.cuda.device_count()
        return min(MAX_WORLD, n), f"this machine has {n} CUDA device(s), one per rank"
    n = os.cpu_count() or 1
    return min(MAX_WORLD, n), f"this machine has {n} CPU core(s), one per rank"


def check_world(world, heads: int | None, *, name: str = "--world-size", device=None) -> int:
    """A world size of 1..min(heads, this machine's devices or cores, MAX_WORLD) that divides the model's heads
    (each rank holds heads / world); UsageError naming ``name`` and the sizes that work. Called before any process
    is started."""
    from ..validate import UsageError, check_int

    world = check_int(name, world, 1, MAX_WORLD, hint=" (sequence-parallel ranks)")
    limit, why = world_limit(device)
    if heads is not None:
        heads = int(heads)
        good = [n for n in range(1, min(heads, limit) + 1) if heads % n == 0]
        if world > heads or heads % world:
            raise UsageError(f"{name} {world} does not divide the model's {heads} attention heads (each rank holds "
                             f"heads / ranks); use one of {', '.join(map(str, good))}")
    if world > limit:
        raise UsageError(f"{name} {world} is more ranks than this machine can run: {why}; use at most {limit}")
    return world


def check_rank_env(heads: int | None = None, device=None, env=None) -> tuple[int, int, int] | None:
    """(world, rank, local rank) of a process started by torchrun, checked: WORLD_SIZE a whole number within
    ``check_world``, RANK in [0, WORLD_SIZE), LOCAL_RANK in [0, WORLD_SIZE), MASTER_ADDR and MASTER_PORT set;
    None when WORLD_SIZE is absent or 1. UsageError names the variable and what it must be."""
    from ..validate import UsageError, check_int

    env = os.environ if env is None else env
    raw = env.get("WORLD_SIZE")
    if raw is None or str(raw).strip() == "1":
        return None
    try:
        world = int(str(raw).strip())
    except ValueError:
        raise UsageError(f"WORLD_SIZE must be a whole number of ranks, got {raw!r}") from None
    world = check_world(world, heads, name="WORLD_SIZE", device=device)
    if world == 1:
        return None
    needed = ("RANK",) if dist.is_initialized() else ("RANK", "MASTER_ADDR", "MASTER_PORT")  # a joined group
    missing = [v for v in needed if not str(env.get(v, "")).strip()]                      # needs no rendezvous
    if missing:
        raise UsageError(f"WORLD_SIZE {world} is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                         f"not: start the ranks with torchrun --nproc-per-node {world} (it sets RANK, LOCAL_RANK, "
                         f"MASTER_ADDR and MASTER_PORT), or unset WORLD_SIZE for one process")
    rank, local = (check_int(v, str(env.get(v, "0")).strip(), 0, world - 1, hint=f" (WORLD_SIZE is {world})")
                   for v in ("RANK", "LOCAL_RANK"))            # RANK is set: checked above
    if "MASTER_PORT" in needed:
        check_int("MASTER_PORT", str(env["MASTER_PORT"]).strip(), 1, 65535)
    return world, rank, local


def _backend(device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _loopback() -> None:
    """Keep gloo's connections on the loopback interface (where the machine has one named 'lo')."""
    if Path("/sys/class/net/lo").exists():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def start_group(rank: int, world: int, init_method: str, device="cpu", timeout_s: float = DEFAULT_TIMEOUT_S
                ) -> SeqParallel:
    """Join a group of ``world`` ranks as ``rank`` (NCCL for a CUDA device, gloo otherwise)."""
    if dist.is_initialized():
        return SeqParallel(dist.get_rank(), dist.get_world_size(), None, timeout_s)
    kwargs = {}
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))
        kwargs["device_id"] = torch.device(device)
    try:
        dist.init_process_group(_backend(device), init_method=init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    except Exception as exc:  # noqa: BLE001
        raise ParallelError(f"rank {rank} of {world} could not join the sequence-parallel group within "
                            f"{timeout_s:g} s: {str(exc)[:200]}") from exc
    return SeqParallel(rank, world, None, timeout_s)


def group_from_env(device=None, timeout_s: float | None = None) -> tuple[SeqParallel | None, torch.device | None]:
    """(group, device) of a process started by torchrun (WORLD_SIZE > 1), else (None, device). On CUDA each rank
    takes ``cuda:LOCAL_RANK``."""
    ranks = check_rank_env(device=device)
    if ranks is None:
        return None, None if device is None else torch.device(device)
    world, rank, local = ranks
    if device is None:
        device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local)
    timeout_s = float(timeout_s or os.environ.get(ENV_TIMEOUT, DEFAULT_TIMEOUT_S))
    return start_group(rank, world, "env://", device, timeout_s), device


def stop_group(quiet: bool = False) -> None:
    """Leave the group, if any; ``quiet``: an error leaving it (a broken group) is ignored."""
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the group may already be broken
        if not quiet:
            raise


def enable_parallel(model, sp: SeqParallel | None) -> None:
    """Put a job's model on this rank's group (nothing for None); counts start from zero."""
    if sp is not None:
        enable(model, sp)
        sp.reset_stats()


def kv_bytes(model, shape, kv_window: int = -1, sink: int = 0) -> tuple[int, int]:
    """(this process's, one whole process's) self-attention KV cache bytes of ``model`` for latents ``shape``
    [B, F, C, H, W]: under sequence parallelism a rank's cache holds its share of the heads. From a cache on the
    meta device (nothing is allocated)."""
    b, f, _, h, w = shape
    c = model.config
    ft = (h // c.patch_size[1]) * (w // c.patch_size[2])
    kv = KVCache.for_model(model, b, ft, f, kv_window, sink, device="meta")
    mine = sum(layer.k.nbytes + layer.v.nbytes for layer in kv.layers)
    return mine, mine * c.num_heads // kv.layers[0].k.shape[2]


def parallel_report(model, sp: SeqParallel, shape, kv_window: int, sink: int, chunks: int) -> dict:
    """What a rank did: the group, its KV bytes (1/world of one process's) and what it sent per chunk."""
    mine, whole = kv_bytes(model, shape, kv_window, sink)
    return {"world_size": sp.world, "rank": sp.rank, "backend": dist.get_backend() if dist.is_initialized() else None,
            "kv_bytes_per_rank": mine, "kv_bytes_one_process": whole,
            "comm_bytes_sent": sp.stats["bytes_sent"], "collectives": sp.stats["collectives"],
            "comm_bytes_per_chunk": sp.stats["bytes_sent"] // max(1, chunks)}


# ---------------------------------------------------------------------------------------------- local workers
def _worker(rank: int, world: int, init_method: str, timeout_s: float, fn, args, results, devices) -> None:
    _loopback()
    torch.set_num_threads(1)
    try:
        device = devices[rank] if devices else "cpu"
        sp = start_group(rank, world, init_method, device, timeout_s)
        results.put((rank, "ok", pickle.dumps(fn(sp, *args)), ""))  # by value: the worker exits right after
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        kind = "parallel" if isinstance(exc, ParallelError) else "error"
        results.put((rank, kind, one_line(exc if kind == "error" else str(exc)), traceback.format_exc()))
    finally:
        stop_group(quiet=True)


def run_ranks(fn, world: int, args: tuple = (), timeout_s: float = 60.0, devices=None,
              collective_timeout_s: float | None = None) -> list:
    """Run ``fn(sp, *args)`` on ``world`` new local processes (``fn`` must be importable: a module-level function);
    returns its results by rank. Raises ``ParallelError`` when a rank raises or dies (naming it; the other ranks
    stop within ``collective_timeout_s``) or when the whole run passes ``timeout_s``. No worker outlives the call."""
    import torch.multiprocessing as mp
    if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= MAX_WORLD:
        raise ValueError(f"world must be 1 to {MAX_WORLD} ranks, got {world!r}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    collective = float(collective_timeout_s or min(timeout_s, DEFAULT_TIMEOUT_S))
    with tempfile.TemporaryDirectory(prefix="wan_accel_ranks_") as tmp:
        init = Path(tmp, "store").as_uri()
        procs = [ctx.Process(target=_worker, args=(r, world, init, collective, fn, args, results, devices),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        got: dict = {}
        details: dict = {}                          # rank -> a failed rank's traceback
        deadline = time.monotonic() + timeout_s
        try:
            while len(got) < world and time.monotonic() < deadline:
                try:
                    rank, kind, value, details[rank] = results.get(timeout=0.2)
                    got[rank] = (kind, value)
                except queue_mod.Empty:
                    pass
                for r, p in enumerate(procs):      # a rank that died without reporting
                    if r not in got and p.exitcode is not None and results.empty():
                        got[r] = ("died", f"rank {r} died (exit code {p.exitcode})")
        finally:
            for p in procs:
                p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
            results.close()
    return _results(got, world, timeout_s, details)


def _results(got: dict, world: int, timeout_s: float, details: dict | None = None) -> list:
    missing = [r for r in range(world) if r not in got]
    if missing:
        raise ParallelError(f"sequence-parallel ranks {missing} did not finish within {timeout_s:g} s; "
                            f"they were stopped")
    # the first cause: a rank that raised or died, before the peers that only saw the group break
    for kinds in (("error", "died"), ("parallel",)):
        for r in range(world):
            kind, value = got[r]
            if kind in kinds:
                exc = ParallelError(worker_message(f"sequence-parallel run failed on rank {r} of {world}: {value}"
                                                   if kind != "died" else f"sequence-parallel run failed: {value}",
                                                   (details or {}).get(r)))
                exc.outcomes = dict(got)        # rank -> (kind, result or message), for callers that report all
                raise exc
    return [pickle.loads(got[r][1]) for r in range(world)]
