"""What the pack runs in (app/doctor/versions.py): core, frontend, kitchen, aimdo, torch and Triton versions in the
doctor's text, JSON, report and route and in the selftest, with a line and a fix for each combination known to
break."""
from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from wan_accel.app.doctor import versions

RUN_033 = {"comfyui": "0.33.0", "comfyui-frontend-package": "1.49.6", "comfy-kitchen": "0.2.31",
           "comfy-aimdo": "0.4.13", "torch": "2.14.1", "triton": "3.6.0"}


@pytest.mark.parametrize("changes, expect", [
    ({}, []),                                                                   # the core the pack was run with
    ({"comfyui": "0.47.1"}, ["comfy_aimdo.malloc_graph", "input_act_weight"]),  # newer core, 0.33's pins
    ({"comfyui": "0.47.1", "comfy-aimdo": "0.6.0"}, ["input_act_weight"]),      # ... then old kitchen at run time
    ({"comfyui": "0.47.1", "comfy-aimdo": "0.6.0", "comfy-kitchen": "0.2.40"}, []),
    ({"comfyui": "0.34.0", "comfy-aimdo": "0.5.3"}, []),
    ({"comfyui": "0.30.0"}, ["WAN21_CausalAR"]),
    ({"comfyui-frontend-package": "1.58.1"}, ["Nodes 2.0"]),
    ({"comfyui": "none", "comfy-aimdo": "none", "comfy-kitchen": "none"}, []),  # outside ComfyUI: nothing claimed
])
def test_known_breaks_name_the_problem_and_the_fix(changes, expect):
    found = versions.known_breaks({**RUN_033, **changes})
    assert len(found) == len(expect)
    for hit, words in zip(found, expect):
        assert words in hit["problem"] and hit["fix"]
    if expect[:1] == ["comfy_aimdo.malloc_graph"]:
        assert "0.47.1" in found[0]["problem"] and "0.4.13" in found[0]["problem"]
        assert "comfy-aimdo" in found[0]["fix"] and "requirements.txt" in found[0]["fix"]


@pytest.fixture
def newer_stack(monkeypatch):
    """This installation as a user's: core 0.47.1 (its comfyui_version imported) beside comfy-aimdo 0.4.13."""
    monkeypatch.setitem(sys.modules, "comfyui_version", types.SimpleNamespace(__version__="0.47.1"))
    real = versions._dist
    fake = {"comfy-aimdo": "0.4.13", "comfyui-frontend-package": "1.58.1", "comfy-kitchen": "0.2.40"}
    monkeypatch.setattr(versions, "_dist", lambda name: fake.get(name) or real(name))


def test_stack_reads_every_component(newer_stack):
    found = versions.stack()
    assert list(found) == list(versions.STACK)
    assert found["comfyui"] == "0.47.1" and torch.__version__.startswith(found["torch"])
    assert found["comfy-aimdo"] == "0.4.13" and found["comfyui-frontend-package"] == "1.58.1"
    text = versions.stack_text()
    assert text.startswith("runs in: comfyui 0.47.1, comfyui-frontend-package 1.58.1, comfy-kitchen 0.2.40")
    assert "\n! ComfyUI 0.47.1 imports comfy_aimdo.malloc_graph" in text and "-> install the comfy-aimdo" in text


def test_comfyui_version_is_read_from_its_file_without_importing(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "comfyui_version", raising=False)
    (tmp_path / "comfyui_version.py").write_text('# generated\n__version__ = "0.40.2"\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    assert versions.comfyui_version() == "0.40.2" and "comfyui_version" not in sys.modules


def test_doctor_command_text_and_json_say_what_it_runs_in(newer_stack, capsys):
    from wan_accel.cli import main
    assert main(["doctor", "--device", "cpu", "--head-dim", "16", "--feature", "cuda_graphs"]) == 0
    out = capsys.readouterr().out
    assert "runs in: comfyui 0.47.1" in out and "comfy-aimdo 0.4.13" in out and f"torch {versions.stack()['torch']}" in out
    assert "! ComfyUI 0.47.1 imports comfy_aimdo.malloc_graph" in out and "Nodes 2.0" in out
    assert main(["doctor", "--device", "cpu", "--head-dim", "16", "--feature", "cuda_graphs", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["versions"]["comfyui"] == "0.47.1" and data["versions"]["comfy-aimdo"] == "0.4.13"
    assert data["known_breaks"][0]["fix"] == versions.AIMDO_FIX


def test_doctor_route_and_selftest_carry_the_stack(newer_stack):
    from wan_accel import server_routes as sr
    from wan_accel.app.doctor.core import doctor_for
    from wan_accel.checks import selftest
    page = sr.doctor_payload(doctor_for("cpu", torch.float32, 16))
    assert page["versions"]["comfyui"] == "0.47.1" and page["known_breaks"][0]["fix"] == versions.AIMDO_FIX
    machine = selftest.machine()
    assert machine["stack"]["comfy-aimdo"] == "0.4.13" and machine["known_breaks"]
    text = selftest.markdown({"machine": machine, "stages": [], "passed": True, "summary": "none"})
    assert "runs in: comfyui 0.47.1" in text and "! ComfyUI 0.47.1" in text


def test_a_failed_import_of_core_gets_the_dependency_fix():
    assert "comfy-aimdo" in versions.dependency_fix("No module named 'comfy_aimdo.storage'")
    assert "comfy-kitchen" in versions.dependency_fix("linear() got an unexpected keyword argument 'input_act_weight'")
    assert versions.dependency_fix("No module named 'einops'") is None
