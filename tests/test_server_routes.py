"""The web panel's routes: plain functions (JSON shape, refusals) and registration, all without ComfyUI."""
from __future__ import annotations

import asyncio
import json
import re
import sys
import types
from pathlib import Path

import pytest

from wan_accel import server_routes as sr
from wan_accel.cache import KNOWN_NAMESPACES, LimitCache

FP_HERE = {"device": "cuda", "gpu": "GPU A", "capability": "9.0", "total_memory": 80, "driver": "1.0",
           "cuda": "12.4", "torch": "2.13.0", "triton": "3.9.0"}
FP_OTHER = dict(FP_HERE, gpu="GPU B", capability="8.9")


@pytest.fixture
def cache(cache_path):
    other = LimitCache(cache_path, fingerprint=FP_OTHER)
    other.put("operator", "matmul:4096", {"best": {"BLOCK_M": 64}, "ms": 0.7})
    here = LimitCache(cache_path, fingerprint=FP_HERE)
    here.put("operator", "matmul:4096", {"best": {"BLOCK_M": 128, "num_warps": 8}, "ms": 0.41})
    here.put("operator", "rmsnorm:5120", {"best": {"XBLOCK": 32}, "ms": 0.02})
    here.put("memory", "wan14b:480p", {"max_frames": 81, "peak_bytes": 61_000_000_000})
    here.put("custom_ns", "x", {"note": "y" * 300})
    return here


def test_limits_payload_shape_counts_and_machines(cache):
    p = sr.limits_payload(cache)
    assert p["fingerprint_id"] == cache.fingerprint_id
    assert p["fingerprint"]["gpu"] == "GPU A"
    assert p["path"] == str(cache.path)
    assert p["known_namespaces"] == list(KNOWN_NAMESPACES)
    by_name = {ns["name"]: ns for ns in p["namespaces"]}
    # known namespaces are always listed; extra ones appear when present; names sorted
    assert set(by_name) == set(KNOWN_NAMESPACES) | {"custom_ns"}
    assert [ns["name"] for ns in p["namespaces"]] == sorted(by_name)
    op = by_name["operator"]
    assert op["count"] == 2 and op["other_machines"] == 1 and op["truncated"] == 0
    best = {e["key"]: e for e in op["entries"]}
    # only this machine's values are shown as entries (the other GPU's config is counted, never shown)
    assert best["matmul:4096"]["value"] == {"best": {"BLOCK_M": 128, "num_warps": 8}, "ms": 0.41}
    assert "BLOCK_M" in best["matmul:4096"]["summary"] and "0.41" in best["matmul:4096"]["summary"]
    for e in op["entries"]:
        assert set(e) == {"key", "value", "summary", "hits", "created", "updated", "last_used"}
    assert by_name["memory"]["entries"][0]["value"]["max_frames"] == 81
    assert by_name["sampler"] == {"name": "sampler", "count": 0, "other_machines": 0, "truncated": 0, "entries": []}
    assert len(by_name["custom_ns"]["entries"][0]["summary"]) <= sr.SUMMARY_CHARS
    json.dumps(p, allow_nan=False)  # what aiohttp sends must be plain JSON


def test_limits_payload_truncates_long_namespaces(cache):
    for i in range(5):
        cache.put("sampler", f"k{i}", {"i": i})
    ns = {n["name"]: n for n in sr.limits_payload(cache, max_entries=3)["namespaces"]}["sampler"]
    assert ns["count"] == 5 and len(ns["entries"]) == 3 and ns["truncated"] == 2


def test_limits_payload_uses_default_cache_from_env(cache_path):
    # no cache given: the pack's default cache (WAN_ACCEL_CACHE points at the test's file)
    LimitCache(cache_path).put("compile", "preset", {"mode": "max-autotune"})
    p = sr.limits_payload()
    assert p["path"] == str(cache_path)
    assert {n["name"]: n["count"] for n in p["namespaces"]}["compile"] == 1


@pytest.mark.parametrize("body", [
    None, [], "all", 3, {}, {"ns": "all"}, {"namespace": None}, {"namespace": 1}, {"namespace": ["all"]},
    {"namespace": "all", "path": "/etc/passwd"}, {"namespace": "../limits"}, {"namespace": ""},
    {"namespace": "a/b"}, {"namespace": "x" * 65},
])
def test_clear_refuses_bad_bodies(cache, body):
    before = len(cache.entries(None, all_fingerprints=True))
    with pytest.raises(sr.RequestError):
        sr.clear_limits(body, cache)
    assert len(cache.entries(None, all_fingerprints=True)) == before


def test_clear_refuses_unknown_namespace_but_accepts_present_custom_one(cache):
    with pytest.raises(sr.RequestError, match="unknown namespace 'operatr'"):
        sr.clear_limits({"namespace": "operatr"}, cache)
    assert sr.clear_limits({"namespace": "custom_ns"}, cache) == {"cleared": 1, "namespace": "custom_ns"}
    assert sr.clear_limits({"namespace": "sampler"}, cache) == {"cleared": 0, "namespace": "sampler"}


def test_clear_one_namespace_then_all(cache):
    # clearing a namespace removes every machine's entries in it
    assert sr.clear_limits({"namespace": "operator"}, cache) == {"cleared": 3, "namespace": "operator"}
    left = {(r["namespace"], r["key"]) for r in cache.entries(None, all_fingerprints=True)}
    assert left == {("memory", "wan14b:480p"), ("custom_ns", "x")}
    assert sr.clear_limits({"namespace": "all"}, cache) == {"cleared": 2, "namespace": "all"}
    assert cache.entries(None, all_fingerprints=True) == []


@pytest.mark.parametrize("raw", [b"", b"{", b"\xff\xfe", b"x" * (sr.MAX_BODY_BYTES + 1)])
def test_decode_json_body_refuses_garbage(raw):
    with pytest.raises(sr.RequestError):
        sr.decode_json_body(raw)


def test_decode_json_body_accepts_json():
    assert sr.decode_json_body(b'{"namespace": "all"}') == {"namespace": "all"}


# ---------------------------------------------------------------- registration and handlers (fake aiohttp)
class _Response:
    def __init__(self, data, status=200):
        self.data, self.status = data, status


class _Routes:
    def __init__(self):
        self.added = {}

    def _adder(self, method, path):
        def deco(fn):
            self.added[(method, path)] = fn
            return fn
        return deco

    def get(self, path):
        return self._adder("GET", path)

    def post(self, path):
        return self._adder("POST", path)


class _Request:
    def __init__(self, raw: bytes):
        self._raw = raw

    async def read(self):
        return self._raw


@pytest.fixture
def fake_aiohttp(monkeypatch):
    web = types.SimpleNamespace(json_response=lambda data, status=200: _Response(data, status))
    monkeypatch.setitem(sys.modules, "aiohttp", types.SimpleNamespace(web=web))
    monkeypatch.setattr(sr, "_registered", False)
    return web


def test_register_is_a_no_op_outside_comfyui(monkeypatch, fake_aiohttp):
    monkeypatch.delitem(sys.modules, "server", raising=False)
    assert sr.register_routes() is False
    # a module named "server" that is not ComfyUI's (no PromptServer.instance) is ignored too
    monkeypatch.setitem(sys.modules, "server", types.SimpleNamespace())
    assert sr.register_routes() is False
    monkeypatch.setitem(sys.modules, "server", types.SimpleNamespace(PromptServer=types.SimpleNamespace(instance=None)))
    assert sr.register_routes() is False


def test_registered_handlers_answer_json_and_400(monkeypatch, fake_aiohttp, cache_path):
    LimitCache(cache_path).put("memory", "k", {"limit_gb": 20.5})
    routes = _Routes()
    server = types.SimpleNamespace(PromptServer=types.SimpleNamespace(instance=types.SimpleNamespace(routes=routes)))
    monkeypatch.setitem(sys.modules, "server", server)
    assert sr.register_routes() is True
    assert sr.register_routes() is False  # once only: aiohttp refuses a second GET on the same path
    assert set(routes.added) == {("GET", sr.ROUTE_LIMITS), ("POST", sr.ROUTE_CLEAR), ("GET", sr.ROUTE_DOCTOR),
                                 ("POST", sr.ROUTE_RECHECK), ("GET", sr.ROUTE_PLAY), ("POST", sr.ROUTE_PLAY_TOUCH),
                                 ("POST", sr.ROUTE_PLAY_END)}

    get_limits, post_clear = routes.added[("GET", sr.ROUTE_LIMITS)], routes.added[("POST", sr.ROUTE_CLEAR)]
    r = asyncio.run(get_limits(_Request(b"")))
    assert r.status == 200
    assert {n["name"]: n["count"] for n in r.data["namespaces"]}["memory"] == 1

    for raw in (b"not json", b'{"namespace": "../x"}', b'{"namespace": "all", "file": "a"}', b"[]"):
        r = asyncio.run(post_clear(_Request(raw)))
        assert r.status == 400 and r.data["error"], raw
    assert len(LimitCache(cache_path).entries()) == 1

    r = asyncio.run(post_clear(_Request(b'{"namespace": "memory"}')))
    assert (r.status, r.data) == (200, {"cleared": 1, "namespace": "memory"})
    assert LimitCache(cache_path).entries() == []


def test_web_extension_calls_these_routes():
    # the panel's JavaScript and the server must agree on the paths (the frontend prefixes /api)
    js = (Path(__file__).resolve().parent.parent / "web" / "wan_accel.js").read_text(encoding="utf-8")
    assert f'"{sr.ROUTE_LIMITS}"' in js and f'"{sr.ROUTE_CLEAR}"' in js
    imported = set(re.findall(r'^import .* from "([^"]+)";', js, flags=re.M))
    assert imported == {"../../scripts/app.js", "../../scripts/api.js"}  # the frontend's public modules only
