"""One bad entry never costs the whole cache: damaged entries are set aside alone; the lock says who holds it;
the routes answer a damaged cache and a deeply nested body without a server error."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import types
import warnings

import pytest

from wan_accel import server_routes as sr
from wan_accel.cache import LimitCache, store
from wan_accel.cli import main

GOOD = {("memory", "good"): {"size": 4, "failed": 8, "unit": "blocks", "ooms": 1},
        ("operator", "good"): {"timings": {"a": 0.5}, "best": {"id": "a", "config": {}, "ms": 0.5}}}
STAMP = '"created": 1.0, "updated": 1.0, "last_used": 1.0'
# name -> (namespace, key or None for a fingerprint record, the raw JSON text of the bad part, words of the reason)
SAMPLES = {
    "hits-string": ("memory", "bad", '{"value": {"size": 2}, %s, "hits": "3"}' % STAMP, "'hits'"),
    "nan-value": ("operator", "bad", '{"value": {"timings": {"a": NaN}}, %s, "hits": 0}' % STAMP, "NaN"),
    "infinity-stamp": ("sampler", "bad", '{"value": {"ok": false}, "created": Infinity, "updated": 1.0, '
                                         '"last_used": 1.0, "hits": 0}', "Infinity"),
    "1e999-value": ("compile", "bad", '{"value": {"bytes": 1e999}, %s, "hits": 0}' % STAMP, "1e999"),
    "string-fingerprint": (None, None, '"not a fingerprint record"', "fingerprint"),
    "memory-limit-string": ("memory", "bad", '{"value": {"size": "3"}, %s, "hits": 0}' % STAMP, "'size'"),
    "memory-limit-infinity": ("memory", "bad", '{"value": {"size": Infinity}, %s, "hits": 0}' % STAMP,
                              "Infinity"),
}


def _strict(text: str):
    def refuse(token):
        raise ValueError(f"non-finite {token}")
    return json.loads(text, parse_constant=refuse)


def _damage(cache_path, names) -> str:
    """A cache with the GOOD entries and the named bad parts; returns this machine's fingerprint id."""
    cache = LimitCache(cache_path)
    for (ns, key), value in GOOD.items():
        cache.put(ns, key, value)
    fid = cache.fingerprint_id
    data = json.loads(cache_path.read_text())
    raw = {}
    for i, name in enumerate(names):
        ns, key, text, _ = SAMPLES[name]
        mark = f"__BAD{i}__"
        raw[mark] = text
        if key is None:
            data["fingerprints"][f"other{i}"] = mark
        else:
            data["namespaces"].setdefault(ns, {}).setdefault(fid, {})[key + str(i)] = mark
    text = json.dumps(data)
    for mark, bad in raw.items():
        text = text.replace(f'"{mark}"', bad)
    cache_path.write_text(text)
    return fid


def _quiet(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_a_bad_entry_is_set_aside_alone(cache_path, name, capsys):
    ns, key, _, words = SAMPLES[name]
    fid = _damage(cache_path, [name])
    cache = LimitCache(cache_path)
    with pytest.warns(RuntimeWarning, match="set aside"):
        for (gns, gkey), value in GOOD.items():
            assert cache.get(gns, gkey) == value                # every valid entry is still used
    assert not list(cache_path.parent.glob("limits.json.corrupt-*"))
    if key is not None:
        assert cache.get(ns, key + "0") is None
    side = _strict(cache.set_aside_path.read_text())["items"]
    assert len(side) == 1
    item = side[0]
    assert (item["namespace"], item["key"]) == (ns, None if key is None else key + "0")
    assert item["fingerprint"] == ("other0" if key is None else fid)
    assert words in item["reason"] and item["entry"]
    cache.put("memory", "new", {"size": 2})                    # the next write: strict JSON, bad part gone
    after = _strict(cache_path.read_text())
    assert after["namespaces"]["memory"][fid]["good"]["value"] == GOOD[("memory", "good")]
    assert LimitCache(cache_path).get("memory", "new") == {"size": 2}
    assert LimitCache(cache_path).set_aside() == side          # still readable after the bad part left the file
    capsys.readouterr()
    assert main(["cache", "show"]) == 0
    err = capsys.readouterr().err
    assert "1 entry" in err and str(cache.set_aside_path) in err and "set aside" in err
    assert main(["cache", "set-aside", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["count"] == 1


def test_commands_run_on_a_damaged_file(cache_path):
    _damage(cache_path, sorted(SAMPLES))
    before = cache_path.read_bytes()
    env = dict(os.environ, WAN_ACCEL_CACHE=str(cache_path))
    lines = []
    for args in (["cache", "show"], ["plan", "--model", "1.3b", "--frames", "21", "--height", "480", "--width",
                                       "832", "--vram-gb", "8"], ["cache", "prune-stale"], ["cache", "set-aside"]):
        proc = subprocess.run([sys.executable, "-m", "wan_accel", *args], capture_output=True, text=True,
                              env=env, timeout=300)
        assert proc.returncode == 0, (args, proc.stderr)
        assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
        lines.append(proc.stdout + proc.stderr)
    assert f"{len(SAMPLES)} entries" in lines[0] and "set aside" in lines[0]
    assert cache_path.read_bytes() != before                   # prune-stale rewrote it, strictly
    _strict(cache_path.read_text())
    assert len(_strict(LimitCache(cache_path).set_aside_path.read_text())["items"]) == len(SAMPLES)
    assert _quiet(LimitCache(cache_path).get, "memory", "good") == GOOD[("memory", "good")]


def test_put_of_a_non_finite_or_misshapen_value_is_refused(cache_path):
    cache = LimitCache(cache_path)
    with pytest.raises(ValueError, match="memory/k"):
        cache.put("memory", "k", {"size": float("inf")})
    with pytest.raises(ValueError, match="memory/k.*'size'"):
        cache.put("memory", "k", {"size": "3"})
    assert not cache_path.exists()


def test_learned_size_ignores_an_infinite_limit():
    from wan_accel.memory.limits import learned_size

    fake = types.SimpleNamespace(get=lambda ns, key: {"size": float("inf")})
    assert learned_size(fake, "k") is None


# ---------------------------------------------------------------- routes
class _Request:
    def __init__(self, raw: bytes):
        self._raw, self.content_length = raw, len(raw)

    async def read(self):
        return self._raw


@pytest.fixture
def handlers(monkeypatch):
    added = {}

    def adder(method):
        return lambda path: (lambda fn: added.setdefault((method, path), fn))

    routes = types.SimpleNamespace(get=adder("GET"), post=adder("POST"))
    web = types.SimpleNamespace(json_response=lambda data, status=200: types.SimpleNamespace(data=data,
                                                                                             status=status))
    monkeypatch.setitem(sys.modules, "aiohttp", types.SimpleNamespace(web=web))
    monkeypatch.setattr(sr, "_registered", False)
    assert sr.register_routes(types.SimpleNamespace(routes=routes)) is True
    return added


def test_routes_answer_a_damaged_cache(cache_path, handlers):
    _damage(cache_path, sorted(SAMPLES))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        limits = asyncio.run(handlers[("GET", sr.ROUTE_LIMITS)](_Request(b"")))
        doctor = asyncio.run(handlers[("GET", sr.ROUTE_DOCTOR)](_Request(b"")))
    for r in (limits, doctor):
        assert r.status == 200, r.data
        _strict(json.dumps(r.data, allow_nan=False))
        assert r.data["set_aside"]["count"] == len(SAMPLES)
        assert {i["reason"] for i in r.data["set_aside"]["items"]}
    counts = {n["name"]: n["count"] for n in limits.data["namespaces"]}
    assert counts["memory"] == 1 and counts["operator"] == 1


@pytest.mark.parametrize("raw", [b"[" * 100000, b"[" * 4000, b'{"namespace": ' * 300])
def test_a_deeply_nested_body_is_a_400(handlers, raw):
    for route in (sr.ROUTE_CLEAR, sr.ROUTE_RECHECK, sr.ROUTE_PLAY_TOUCH, sr.ROUTE_PLAY_END):
        r = asyncio.run(handlers[("POST", route)](_Request(raw)))
        assert r.status == 400 and r.data["error"], (route, r.data)


def test_decode_refuses_nesting_and_non_finite_numbers():
    with pytest.raises(sr.RequestError, match="nested too deeply"):
        sr.decode_json_body(b"[" * 4000)
    with pytest.raises(sr.RequestError, match="NaN"):
        sr.decode_json_body(b'{"namespace": NaN}')
    with pytest.raises(sr.RequestError, match="beyond a float"):
        sr.decode_json_body(b'{"namespace": "all", "x": 1e999}')
    assert sr.decode_json_body(b'{"x": 1.5e3}') == {"x": 1500.0}


# ---------------------------------------------------------------- the lock says who holds it
HOLDER = """
import sys
from wan_accel.cache import LimitCache
c = LimitCache(sys.argv[1])
with c._locked():
    print("held", flush=True)
    sys.stdin.read()        # hold the lock until the test closes our stdin
"""


def _hold(cache_path):
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(cache_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_held_lock_is_announced_early_with_its_holder(cache_path, monkeypatch):
    monkeypatch.setattr(store, "LOCK_TIMEOUT_S", 120.0)
    proc = _hold(cache_path)
    done = threading.Event()
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            waiter = threading.Thread(target=lambda: (LimitCache(cache_path).put("memory", "k", {"size": 1}),
                                                      done.set()))
            waiter.start()
            deadline = time.monotonic() + 30      # far below the lock timeout: the notice comes after 1 s
            while time.monotonic() < deadline and not any("waiting" in str(w.message) for w in record):
                time.sleep(0.05)
            waiting = [str(w.message) for w in record if "waiting for the limit cache lock" in str(w.message)]
            assert not done.is_set()              # still waiting when it said so
            proc.stdin.close()                    # the holder lets go: the waiter goes on
            waiter.join(60)
    finally:
        proc.kill()
        proc.wait(30)
    assert len(waiting) == 1 and f"PID {proc.pid}" in waiting[0], waiting
    assert done.is_set() and LimitCache(cache_path).get("memory", "k") == {"size": 1}
    assert not LimitCache(cache_path).lock_owner_path.exists()


def test_a_lock_timeout_names_the_holder(cache_path, monkeypatch):
    monkeypatch.setattr(store, "LOCK_TIMEOUT_S", 1.5)
    proc = _hold(cache_path)
    try:
        with pytest.warns(RuntimeWarning, match=f"PID {proc.pid}"), pytest.raises(TimeoutError) as err:
            LimitCache(cache_path).put("memory", "k", {"size": 1})
        assert f"PID {proc.pid}" in str(err.value)
    finally:
        proc.kill()
        proc.wait(30)


def test_a_cache_saved_with_a_bom_keeps_its_entries(tmp_path):
    """An editor that saves the file with a UTF-8 byte-order mark: the entries stay in use (nothing moved aside)
    and the next write is plain UTF-8 JSON again."""
    path = tmp_path / "limits.json"
    c = LimitCache(path)
    c.put("memory", "kept", {"size": 3})
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    again = LimitCache(path)
    assert again.get("memory", "kept") == {"size": 3} and not again.quarantined
    again.put("memory", "other", {"size": 4})
    assert not path.read_bytes().startswith(b"\xef\xbb\xbf") and LimitCache(path).get("memory", "kept")
