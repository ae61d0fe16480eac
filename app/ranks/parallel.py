"""Starting the ranks of a sequence-parallel run (``model/seq_parallel.py``) on ``torch.distributed``.

Two ways in:

* ``torchrun --nproc-per-node N -m wan_accel generate ...``: every process calls ``group_from_env()``, which reads
  torchrun's RANK / WORLD_SIZE / LOCAL_RANK, picks NCCL on GPUs (one GPU per rank, ``cuda:LOCAL_RANK``) or gloo on
  CPUs, and returns the rank's ``SeqParallel``;
* ``run_ranks(fn, world, ...)``: this process starts ``world`` worker processes on this machine (loopback only, a
  file store in a temporary folder, no port to pick), each runs ``fn(sp, *args)``; it returns their results by rank
  or raises one ``ParallelError`` that names the rank that failed first, within a deadline, and leaves no worker
  behind (the tests and ``bench sampler --world-size`` use it). Its workers, and those of the ComfyUI face's pool
  (``pool.py``), are started, watched and stopped by ``RankWorkers``.

Every collective of the group has a timeout (``SeqParallel.timeout_s``), also the group's own set-up.
"""
from __future__ import annotations

import datetime
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch
import torch.distributed as dist

from ...model.kv_cache import KVCache
from ...model.seq_parallel import DEFAULT_TIMEOUT_S, ParallelError, SeqParallel, enable
from ...profiling.child import child_argv, one_line, worker_message

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
    backend = "gloo"
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))
        kwargs["device_id"] = torch.device(device)
        backend = "nccl"
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
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


# ---------------------------------------------------------------------------------------------- worker processes
# A worker rank is a fresh interpreter (not a multiprocessing child: a host such as ComfyUI loads this package under a
# path-like module name and runs its own main module, neither of which a spawned child can re-import). It loads the
# package from its folder (profiling/child.py), reads its messages from its stdin and answers on its stdout (the
# process's own prints are sent to stderr): (kind, value, traceback), kind "error" or "parallel" when it failed.
def worker_setup(argv) -> tuple:
    """(rank, world, init method, collective timeout, device, inbox, outbox) of a worker started by
    ``RankWorkers.spawn``: its arguments and its message connections (fd 1 then points at stderr)."""
    out = os.dup(1)
    os.dup2(2, 1)
    _loopback()
    return (int(argv[0]), int(argv[1]), argv[2], float(argv[3]), argv[4], Connection(0, writable=False),
            Connection(out, readable=False))


def failure(exc: BaseException) -> tuple:
    """A worker's answer for an exception: a broken group ("parallel") or its own error."""
    kind = "parallel" if isinstance(exc, ParallelError) else "error"
    return kind, one_line(exc if kind == "error" else str(exc)), traceback.format_exc()


class RankWorkers:
    """Worker processes for some ranks of a group: started, watched and stopped one way, and their failures
    reported as one ``ParallelError`` that names the rank."""

    def __init__(self):
        self.procs: list = []
        self.conns: list = []           # (to the worker, from the worker)
        self.ranks: list = []
        self._tmp = None

    def spawn(self, target: str, ranks, world: int, timeout_s: float, devices, *args) -> str:
        """Start ``target`` ('module:function' of this pack) for each of ``ranks`` with (rank, world, the group's
        file store, timeout_s, its device, *args) as arguments; returns the store (a temporary folder's file)."""
        self.world = world
        self._tmp = tempfile.TemporaryDirectory(prefix="wan_accel_ranks_")
        init = Path(self._tmp.name, "store").as_uri()
        for rank in ranks:
            p = subprocess.Popen(child_argv(target, rank, world, init, timeout_s, devices[rank], *args),
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            self.procs.append(p)
            self.ranks.append(rank)
            self.conns.append((Connection(os.dup(p.stdin.fileno()), readable=False),
                               Connection(os.dup(p.stdout.fileno()), writable=False)))
            p.stdin.close()
            p.stdout.close()
        return init

    def send(self, message) -> None:
        for out, _inbox in self.conns:
            out.send(message)

    def collect(self, want: str, timeout_s: float, wait_all: bool = True) -> list:
        """The workers' answers ``want`` within ``timeout_s``: their values by rank. A worker that answers otherwise
        or dies (``wait_all`` False: the first one), or that does not answer in time, gives one ParallelError."""
        got: dict = {}
        details: dict = {}                          # rank -> a failed rank's traceback
        pending = {conn: (rank, p) for rank, p, (_out, conn) in zip(self.ranks, self.procs, self.conns)}
        deadline = time.monotonic() + timeout_s
        while pending and time.monotonic() < deadline:
            for conn in wait(list(pending), timeout=0.1):
                rank, p = pending.pop(conn)
                try:
                    kind, value, details[rank] = conn.recv()
                except EOFError:                    # it closed its end: it exited without answering
                    kind, value = "died", f"rank {rank} died (exit code {p.wait(5)})"
                got[rank] = (kind, value)
            if not wait_all and any(kind != want for kind, _ in got.values()):
                break
        late = sorted(rank for rank, _p in pending.values()) if time.monotonic() >= deadline else []
        # the first cause: a rank that raised or died, then one that hangs, before the peers that only saw the group
        # break
        failed = [r for r in self.ranks if got.get(r, (want,))[0] not in (want, "parallel")]
        if not failed and late:
            raise ParallelError(f"sequence-parallel ranks {late} did not finish within {timeout_s:g} s; "
                                f"they were stopped")
        failed += [r for r in self.ranks if got.get(r, (want,))[0] != want]
        if not failed:
            return [got[r][1] for r in self.ranks]
        kind, value = got[failed[0]]
        exc = ParallelError(worker_message(f"sequence-parallel run failed on rank {failed[0]} of {self.world}: "
                                           f"{value}" if kind != "died" else f"sequence-parallel run failed: {value}",
                                           details.get(failed[0])))
        exc.outcomes = got              # rank -> (kind, result or message), for callers that report all
        raise exc

    def stop(self, leave_group: bool = False) -> None:
        """Stop the workers (idempotent): the stop message, then those still running after 2 s (busy in a
        collective of a broken group) are killed; ``leave_group``: this process then leaves its group too."""
        for out, _inbox in self.conns:
            try:
                out.send(None)
            except Exception:  # noqa: BLE001 - the worker may be gone
                pass
        for p in self.procs:
            try:
                p.wait(timeout=2)
            except Exception:  # noqa: BLE001
                p.kill()
                p.wait(5)
        for pair in self.conns:
            for conn in pair:
                conn.close()
        self.procs, self.conns, self.ranks = [], [], []
        if leave_group:
            stop_group(quiet=True)      # a broken group
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _rank(*argv: str) -> None:
    """A rank of ``run_ranks``: join the group, run the function it is sent and answer its result."""
    rank, world, init, timeout_s, device, inbox, outbox = worker_setup(argv)
    torch.set_num_threads(1)
    try:
        path, job = inbox.recv()
        sys.path[:0] = [p for p in path if p not in sys.path]       # where the function's module is found
        fn, args = pickle.loads(job)
        sp = start_group(rank, world, init, device, timeout_s)
        outbox.send(("ok", pickle.dumps(fn(sp, *args)), ""))         # by value: the worker exits right after
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        outbox.send(failure(exc))
    finally:
        stop_group(quiet=True)


def run_ranks(fn, world: int, args: tuple = (), timeout_s: float = 60.0, devices=None,
              collective_timeout_s: float | None = None) -> list:
    """Run ``fn(sp, *args)`` on ``world`` new local processes (``fn`` must be importable: a module-level function);
    returns its results by rank. Raises ``ParallelError`` when a rank raises or dies (naming it; the other ranks
    stop within ``collective_timeout_s``) or when the whole run passes ``timeout_s``. No worker outlives the call."""
    if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= MAX_WORLD:
        raise ValueError(f"world must be 1 to {MAX_WORLD} ranks, got {world!r}")
    collective = float(collective_timeout_s or min(timeout_s, DEFAULT_TIMEOUT_S))
    workers = RankWorkers()
    try:
        workers.spawn("app.ranks.parallel:_rank", range(world), world, collective, devices or ["cpu"] * world)
        workers.send((list(sys.path), pickle.dumps((fn, tuple(args)))))
        return [pickle.loads(value) for value in workers.collect("ok", timeout_s)]
    finally:
        workers.stop()
