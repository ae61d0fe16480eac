"""The limit cache: round trips, scoping, durability, concurrency and recovery."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest

from wan_accel.cache import LimitCache, default_cache_path, fingerprint, fingerprint_id
from wan_accel.cache.entries import FILE_KIND, SCHEMA_VERSION

FP_A = {"device": "cuda", "gpu": "GPU A", "capability": "9.0", "total_memory": 80, "driver": "1.0",
        "cuda": "12.4", "torch": "2.13.0", "triton": "3.9.0"}
FP_B = dict(FP_A, gpu="GPU B", capability="8.9")
FP_OLD_TORCH = dict(FP_A, torch="2.5.1")


def test_round_trip_and_api(cache_path):
    c = LimitCache(cache_path)
    assert c.get("operator", "k") is None
    c.put("operator", "k", {"best": {"XBLOCK": 64}, "ms": 0.5})
    assert c.get("operator", "k") == {"best": {"XBLOCK": 64}, "ms": 0.5}
    # a brand-new instance (another process would do the same) reads it from disk
    assert LimitCache(cache_path).get("operator", "k") == {"best": {"XBLOCK": 64}, "ms": 0.5}
    assert c.update("sampler", "n", lambda old: {"n": (old or {"n": 0})["n"] + 1}) == {"n": 1}
    assert c.update("sampler", "n", lambda old: {"n": old["n"] + 1}) == {"n": 2}
    assert {(r["namespace"], r["key"]) for r in c.entries()} == {("operator", "k"), ("sampler", "n")}
    assert [r["key"] for r in c.entries("sampler")] == ["n"]
    assert c.update("sampler", "n", lambda old: None) is None  # update returning None deletes
    assert c.update("operator", "k", lambda old: None) is None
    assert c.entries() == []
    on_disk = json.loads(cache_path.read_text())
    assert on_disk["kind"] == FILE_KIND and on_disk["schema"] == SCHEMA_VERSION


def test_values_are_copies_and_validated(cache_path):
    c = LimitCache(cache_path)
    v = {"a": [1, 2]}
    c.put("memory", "x", v)
    v["a"].append(3)
    got = c.get("memory", "x")
    got["a"].append(4)
    assert c.get("memory", "x") == {"a": [1, 2]}
    with pytest.raises(TypeError):
        c.put("memory", "x", [1, 2])
    with pytest.raises(ValueError, match="non-finite"):
        c.put("memory", "x", {"t": float("inf")})
    with pytest.raises(ValueError, match="namespace"):
        c.put("bad namespace!", "x", {})
    assert c.get("memory", "x") == {"a": [1, 2]}  # bad input lost nothing


def test_timestamps_and_hits(cache_path):
    c = LimitCache(cache_path)
    c.put("compile", "sig", {"artifact": "a.bin"})
    created = c.entries()[0]["created"]
    for _ in range(3):
        c.get("compile", "sig")
    assert c.entries()[0]["hits"] == 3  # pending hits are visible at once
    c.flush()
    assert LimitCache(cache_path).entries()[0]["hits"] == 3  # and durable after flush
    time.sleep(0.01)
    c.put("compile", "sig", {"artifact": "b.bin"})
    row = LimitCache(cache_path).entries()[0]
    assert row["created"] == created and row["updated"] > created and row["hits"] == 3


def test_lru_bound_per_namespace(cache_path):
    c = LimitCache(cache_path, max_entries=3)
    for i in range(3):
        c.put("operator", f"k{i}", {"i": i})
        time.sleep(0.002)
    c.get("operator", "k0")  # k0 becomes most recently used
    time.sleep(0.002)
    c.put("operator", "k3", {"i": 3})
    assert sorted(r["key"] for r in c.entries("operator")) == ["k0", "k2", "k3"]
    c.put("memory", "m", {"i": 0})  # other namespaces have their own bound
    assert len(c.entries("operator")) == 3 and len(c.entries("memory")) == 1


def test_fingerprint_isolation_and_prune(cache_path):
    a = LimitCache(cache_path, fingerprint=FP_A)
    b = LimitCache(cache_path, fingerprint=FP_B)
    old = LimitCache(cache_path, fingerprint=FP_OLD_TORCH)
    a.put("operator", "k", {"who": "A"})
    b.put("operator", "k", {"who": "B"})
    old.put("operator", "k", {"who": "old"})
    assert a.get("operator", "k") == {"who": "A"}
    assert b.get("operator", "k") == {"who": "B"}
    assert LimitCache(cache_path, fingerprint=dict(FP_A, driver="2.0")).get("operator", "k") is None
    assert len(a.entries()) == 1 and len(a.entries(all_fingerprints=True)) == 3
    assert a.prune_stale() == 1  # only the other-software entry; the other GPU stays
    assert {r["value"]["who"] for r in a.entries(all_fingerprints=True)} == {"A", "B"}
    assert a.clear("operator") == 2 and a.entries(all_fingerprints=True) == []


def test_real_fingerprint_is_stable_and_cpu_sane():
    fp = fingerprint()
    for field in ("device", "gpu", "capability", "total_memory", "driver", "cuda", "torch", "triton"):
        assert field in fp
    assert fingerprint_id(fp) == fingerprint_id(dict(fp)) and len(fingerprint_id(fp)) == 16
    if fp["device"] == "cpu":
        assert fp["total_memory"] == 0 and fp["cuda"] == "none"


def test_env_override(tmp_path, monkeypatch):
    target = tmp_path / "elsewhere" / "my_limits.json"
    monkeypatch.setenv("WAN_ACCEL_CACHE", str(target))
    assert default_cache_path() == target
    LimitCache().put("memory", "x", {"v": 1})
    assert target.exists()
    folder = tmp_path / "folder"
    folder.mkdir()
    monkeypatch.setenv("WAN_ACCEL_CACHE", str(folder))
    assert default_cache_path() == folder / "limits.json"
    monkeypatch.delenv("WAN_ACCEL_CACHE")
    assert default_cache_path().name == "limits.json" and "wan_accel" in str(default_cache_path())


# ------------------------------------------------------------------ concurrency and crashes
def _put_worker(path, worker, n):
    c = LimitCache(path, fingerprint=FP_A)
    for i in range(n):
        c.put("operator", f"w{worker}-{i}", {"worker": worker, "i": i})


def _incr_worker(path, n):
    c = LimitCache(path, fingerprint=FP_A)
    for _ in range(n):
        c.update("sampler", "counter", lambda old: {"n": (old or {"n": 0})["n"] + 1})


def test_concurrent_puts_and_updates(cache_path):
    ctx = mp.get_context("fork")
    workers, n = 8, 50          # 800 locked updates from 16 processes racing
    procs = [ctx.Process(target=_put_worker, args=(cache_path, w, n)) for w in range(workers)]
    procs += [ctx.Process(target=_incr_worker, args=(cache_path, n)) for _ in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    c = LimitCache(cache_path, fingerprint=FP_A)
    keys = {r["key"] for r in c.entries("operator")}
    assert keys == {f"w{w}-{i}" for w in range(workers) for i in range(n)}
    assert c.get("sampler", "counter") == {"n": workers * n}


KILL_SCRIPT = """
import sys
from wan_accel.cache import LimitCache
c = LimitCache(sys.argv[1], fingerprint={"device": "cpu", "gpu": "x", "capability": "x", "total_memory": 0,
                                          "driver": "none", "cuda": "none", "torch": "t", "triton": "t"})
big = {"blob": "x" * 200000}
i = 0
print("ready", flush=True)
while True:
    c.put("memory", f"k{i % 50}", dict(big, i=i))
    i += 1
"""


def test_sigkill_mid_write_leaves_valid_file(cache_path):
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    for delay in (0.3, 0.45, 0.6):
        proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(cache_path)], stdout=subprocess.PIPE,
                                env=os.environ.copy())
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        data = json.loads(cache_path.read_text())  # complete, parseable JSON
        assert data["kind"] == FILE_KIND
        c = LimitCache(cache_path)
        rows = c.entries(all_fingerprints=True)
        assert rows and all(len(r["value"]["blob"]) == 200000 for r in rows)
    assert not list(cache_path.parent.glob("*.corrupt-*"))
    orphan = cache_path.parent / ".limits.json.wan_accel-999999999-orphan.tmp"    # as a killed writer leaves it
    orphan.write_bytes(b'{"half": ')
    os.utime(orphan, (time.time() - 120, time.time() - 120))
    LimitCache(cache_path).put("memory", "after", {"ok": True})  # the next writer removes orphaned temp files
    assert not orphan.exists()


# ------------------------------------------------------------------ recovery
@pytest.mark.parametrize("content", [
    b'{"kind": "wan_accel.limit_cache", "schema": 1, "fingerp',  # truncated
    os.urandom(512),  # random bytes
    b"[1, 2, 3]",  # a JSON list
    b'{"kind": "wan_accel.limit_cache", "schema": 1, "fingerprints": {}, "namespaces": 5}',
    b'{"kind": "something else", "schema": 1}',
    b'{"kind": "wan_accel.limit_cache", "schema": 99, "fingerprints": {}, "namespaces": {}}',
    b'{"kind": "wan_accel.limit_cache", "schema": 0, "fingerprints": {}, "namespaces": {}}',
], ids=["truncated", "random-bytes", "json-list", "wrong-shape", "wrong-kind", "newer-schema", "old-schema"])
def test_damaged_file_is_quarantined_and_rebuilt(cache_path, content):
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    cache_path.write_bytes(content)
    c = LimitCache(cache_path)
    with pytest.warns(RuntimeWarning) as record:
        assert c.get("operator", "k") is None
    moved = list(cache_path.parent.glob("limits.json.corrupt-*"))
    assert len(moved) == 1 and moved[0].read_bytes() == content
    msg = str(record[0].message)
    assert str(cache_path) in msg and str(moved[0]) in msg
    c.put("operator", "k", {"ok": True})  # the cache works again
    assert LimitCache(cache_path).get("operator", "k") == {"ok": True}


def test_damaged_file_found_by_a_writer_is_quarantined(cache_path):
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    cache_path.write_bytes(b"\x00garbage")
    with pytest.warns(RuntimeWarning, match="moved it to"):
        LimitCache(cache_path).put("memory", "x", {"v": 1})
    assert LimitCache(cache_path).get("memory", "x") == {"v": 1}
