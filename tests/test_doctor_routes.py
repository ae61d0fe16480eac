"""The doctor in the web panel (routes: listing without probing, re-check) and the Wan Doctor node."""
from __future__ import annotations

import asyncio
import sys
import types
from pathlib import Path

import pytest
import torch

from wan_accel import server_routes as sr
from wan_accel.app.doctor.core import doctor_for


@pytest.fixture
def doctor():
    return doctor_for("cpu", torch.float32, 16)


def test_listing_never_probes_and_recheck_probes_one_feature(doctor):
    page = sr.doctor_payload(doctor)
    rows = {r["feature"]: r for r in page["features"]}
    assert doctor.probes == 0 and rows["fused_qkv"]["verified"] == "not checked yet"
    assert rows["cuda_graphs"]["available"] is False and "CUDA" in rows["cuda_graphs"]["why_off"]
    assert page["fingerprint_id"] == doctor.cache.fingerprint_id and "machine:" in page["machine"]
    after = sr.recheck_feature({"feature": "fused_qkv"}, doctor)
    assert doctor.probes == 1
    assert {r["feature"]: r for r in after["features"]}["fused_qkv"]["status"] == "passed"
    assert {r["feature"]: r for r in sr.doctor_payload(doctor)["features"]}["fused_qkv"]["verified"] == "passed"


@pytest.mark.parametrize("body", [None, [], {}, {"feature": 1}, {"feature": "nope"},
                                  {"feature": "fused_qkv", "path": "/etc"}])
def test_recheck_refuses_bad_bodies(doctor, body):
    with pytest.raises(sr.RequestError):
        sr.recheck_feature(body, doctor)
    assert doctor.probes == 0


def test_recheck_route_answers_400_and_json(monkeypatch):
    web = types.SimpleNamespace(json_response=lambda data, status=200: types.SimpleNamespace(data=data,
                                                                                            status=status))
    monkeypatch.setitem(sys.modules, "aiohttp", types.SimpleNamespace(web=web))
    get_doctor, post_recheck = sr._make_handlers(web)[2:4]

    class Req:
        def __init__(self, raw):
            self.raw = raw

        async def read(self):
            return self.raw
    r = asyncio.run(post_recheck(Req(b'{"feature": "x/../y"}')))
    assert r.status == 400 and "unknown feature" in r.data["error"]
    r = asyncio.run(get_doctor(Req(b"")))
    assert r.status == 200 and any(f["feature"] == "block_swap" for f in r.data["features"])


def test_panel_calls_the_doctor_routes():
    js = (Path(__file__).resolve().parent.parent / "web" / "wan_accel.js").read_text(encoding="utf-8")
    assert f'"{sr.ROUTE_DOCTOR}"' in js and f'"{sr.ROUTE_RECHECK}"' in js and "Re-check" in js


def test_doctor_node_shows_the_table():
    from wan_accel.nodes.doctor_nodes import FEATURE_CHOICES, WanAccelDoctor
    from wan_accel.app.doctor.core import FEATURES
    assert FEATURE_CHOICES[1:] == list(FEATURES)            # every feature can be picked
    spec = WanAccelDoctor.INPUT_TYPES()["required"]
    assert all("tooltip" in opts for _, opts in spec.values())
    out = WanAccelDoctor().run(feature="cuda_graphs")
    text = out["result"][0]
    assert out["ui"]["text"] == [text] and "cuda_graphs" in text and "CUDA graphs need a CUDA GPU" in text
    with pytest.raises(ValueError, match="feature must be one of"):
        WanAccelDoctor().run(feature="warp drive")
