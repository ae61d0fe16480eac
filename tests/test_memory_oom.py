"""OOM retry: shrink on out-of-memory, learn the size that worked, persist it for a new process."""
from __future__ import annotations

import os
import subprocess
import sys
import weakref

import pytest
import torch

from wan_accel.cache import LimitCache
from wan_accel.cache.oom import SoftOOM
from wan_accel.memory.limits import NAMESPACE
from wan_accel.memory.oom import NoFitError, free_memory, is_oom, oom_retry, run_chunks

KEY = "test/op/480p"


def _oom_above(limit, tried, keep=None):
    def fn(size):
        tried.append(size)
        if size > limit:
            big = torch.empty(1 << 16)   # partial state of the failed attempt
            if keep is not None:
                keep.append(weakref.ref(big))
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size} GiB")
        return f"done at {size}"
    return fn


def test_learns_the_size_that_worked_and_starts_there_next_time(tmp_path):
    cache = LimitCache(tmp_path / "limits.json")
    tried, cleaned, refs = [], [], []

    def on_oom(size):
        cleaned.append(size)
        assert all(r() is None for r in refs), "the failed attempt's tensors must be released before cleanup"

    assert oom_retry(_oom_above(5, tried, refs), key=KEY, start=21, cache=cache, on_oom=on_oom) == "done at 5"
    assert tried == [21, 10, 5] and cleaned == [21, 10]
    assert cache.get(NAMESPACE, KEY)["size"] == 5 and cache.get(NAMESPACE, KEY)["failed"] == 10
    tried.clear()
    fresh = LimitCache(tmp_path / "limits.json")
    assert oom_retry(_oom_above(5, tried), key=KEY, start=21, cache=fresh) == "done at 5"
    assert tried == [5]                       # starts at the learned size, no OOM this time
    tried.clear()
    oom_retry(_oom_above(5, tried), key=KEY, start=3, cache=fresh)
    assert tried == [3]                       # a smaller request is honoured


NEW_PROCESS = r"""
import sys
from wan_accel.cache import LimitCache
from wan_accel.memory.oom import oom_retry
tried = []
def fn(size):
    tried.append(size)
    return size
oom_retry(fn, key=sys.argv[1], start=64, cache=LimitCache())
print(tried[0])
"""


def test_learned_limit_is_used_by_a_new_process(tmp_path):
    path = tmp_path / "shared" / "limits.json"
    oom_retry(_oom_above(12, []), key=KEY, start=64, cache=LimitCache(path))   # 64, 32, 16 fail; 8 works
    env = dict(os.environ, WAN_ACCEL_CACHE=str(path), PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, "-c", NEW_PROCESS, KEY], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "8"


def test_nothing_fits_raises_a_clear_error_and_learns_nothing(tmp_path):
    cache = LimitCache(tmp_path / "limits.json")
    with pytest.raises(NoFitError) as info:
        oom_retry(_oom_above(0, []), key=KEY, start=4, cache=cache, unit="latent frames", what="VAE decode",
                  hint=lambda size: f"Lower the resolution (tried down to {size}).")
    msg = str(info.value)
    assert "VAE decode ran out of memory even at latent frames 1" in msg and "Lower the resolution" in msg
    assert "CUDA out of memory" in msg and info.value.key == KEY
    assert info.value.__cause__ is None and info.value.__context__ is None   # no frames kept alive
    assert cache.get(NAMESPACE, KEY) is None
    with pytest.raises(NoFitError, match="at size 2"):
        oom_retry(_oom_above(0, []), key=None, start=6, minimum=2, shrink=lambda size: size - 4 if size >= 4 else None)


def test_only_out_of_memory_errors_are_retried():
    assert is_oom(torch.OutOfMemoryError("x")) and is_oom(MemoryError()) and is_oom(SoftOOM("tiled"))
    assert is_oom(RuntimeError("CUDA error: out of memory")) and is_oom(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED"))
    assert not is_oom(RuntimeError("shape mismatch")) and not is_oom(ValueError("out of memory"))
    calls = []

    def bad(size):
        calls.append(size)
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        oom_retry(bad, key=None, start=8)
    assert calls == [8]
    with pytest.raises(KeyboardInterrupt):
        oom_retry(lambda s: (_ for _ in ()).throw(KeyboardInterrupt()), key=None, start=8)
    free_memory()   # safe without CUDA


def test_run_chunks_redoes_only_the_failed_chunk(tmp_path):
    cache = LimitCache(tmp_path / "limits.json")
    done = []

    def step(pos, size):
        if pos >= 8 and size > 3:       # memory gets tight in the middle of the run
            raise torch.OutOfMemoryError("out of memory")
        done.append((pos, min(pos + size, 20)))
        return min(pos + size, 20)

    progress = []
    used = run_chunks(20, step, key=KEY, start=8, cache=cache, between=progress.append)
    assert used == 2 and done == [(0, 8), (8, 10), (10, 12), (12, 14), (14, 16), (16, 18), (18, 20)]
    assert progress[-1] == 20 and cache.get(NAMESPACE, KEY)["size"] == 2
    with pytest.raises(RuntimeError, match="did not advance"):
        run_chunks(4, lambda pos, size: pos, key=None, start=2)
