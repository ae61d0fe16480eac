"""The pack installed as ComfyUI-Manager installs it (skipped unless COMFYUI_DIR and COMFYUI_VENV are set).

    COMFYUI_DIR=<ComfyUI work tree> COMFYUI_VENV=<its venv> python -m pytest -q tests/e2e/test_install_as_users.py

COMFYUI_VENV must hold ComfyUI's own requirements only (not this pack). The pack's tracked files (what a
``git clone`` gets; as they are in the work tree) are copied into the ``custom_nodes`` folder of a separate base
directory (``main.py --base-directory``: the work tree's own ``custom_nodes`` is not read). Each line of
requirements.txt goes through ``pip install <line>`` as the Manager runs it, first as a dry run against the venv
(what would it change?), then into a folder on the server's PYTHONPATH, never into the venv. ComfyUI then starts,
lists every node of the pack with no import failure, and runs ``workflows/api/tiny_smoke.json``.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from e2e.test_comfyui_e2e import COMFY_DIR, COMFY_VENV, _python, _run_prompt, comfy_server, http
from pack_contents import (COMFYUI_REQUIREMENTS, REPO, copy_files, distribution, third_party_imports,
                           tracked_files)

pytestmark = pytest.mark.skipif(not (COMFY_DIR and COMFY_VENV),
                                reason="set COMFYUI_DIR and COMFYUI_VENV to run the install check")
FOLDER = "comfyui-wan-accel"          # the folder a clone of the repository gets


def _venv(code: str, *args: str, path: Path | None = None) -> subprocess.CompletedProcess:
    """The venv's python running ``code`` (or ``args`` alone) in ComfyUI's folder, as ComfyUI runs, with ``path`` as
    its only PYTHONPATH (never in the checkout: an editable install leaves the pack's metadata there, which a Python
    started in it would count as installed)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({"PYTHONPATH": str(path)} if path else {})
    return subprocess.run([str(_python()), *(("-c", code) if code else ()), *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=COMFY_DIR)


def _requirements(clone: Path) -> list[Requirement]:
    return [Requirement(line) for line in (clone / "requirements.txt").read_text().splitlines() if line.strip()]


def _manager_install(clone: Path, target: Path) -> None:
    """ComfyUI-Manager's install of requirements.txt (``pip install <line>`` per line): each line resolved against
    the venv in a dry run; what it would add installed into ``target``, nothing it would replace."""
    for req in _requirements(clone):
        line = str(req)
        dry = _venv("", "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-", line)
        assert dry.returncode == 0, f"pip install {line}: {dry.stderr[-2000:]}"
        for item in json.loads(dry.stdout)["install"]:
            name, version = item["metadata"]["name"], item["metadata"]["version"]
            present = _venv("import importlib.metadata as m, sys; print(m.version(sys.argv[1]))", name)
            assert present.returncode != 0, \
                f"pip install {line} would replace {name} {present.stdout.strip()} of the ComfyUI venv with {version}"
            assert distribution(name) not in COMFYUI_REQUIREMENTS, f"pip install {line} would install {name}"
            put = _venv("", "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                        f"{name}=={version}")
            assert put.returncode == 0, put.stderr[-2000:]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    probe = _venv("import importlib.util as u, importlib.metadata as m\nprint(u.find_spec('wan_accel') is not None or "
                  "'comfyui-wan-accel' in {d.metadata['Name'] for d in m.distributions()})")
    assert probe.stdout.strip() == "False", \
        f"COMFYUI_VENV={COMFY_VENV} has the pack installed: the check needs a venv with ComfyUI's requirements only"
    base = tmp_path_factory.mktemp("comfy_base")
    clone = copy_files(tracked_files(), base / "custom_nodes" / FOLDER)
    assert not (clone / "install.py").exists()          # the Manager would run it; the pack needs none
    target = base / "site"
    _manager_install(clone, target)
    yield from ({**server, "clone": clone, "site": target} for server in comfy_server(
        tmp_path_factory, ("--base-directory", str(base)), {"PYTHONPATH": str(target)}))


def test_comfyui_requirements_cover_what_the_pack_relies_on():
    lines = (raw.split("#", 1)[0].strip() for raw in (Path(COMFY_DIR) / "requirements.txt").read_text().splitlines())
    real = {distribution(Requirement(line).name) for line in lines if line}
    relied = {distribution(m) for m in third_party_imports()} & COMFYUI_REQUIREMENTS
    assert relied <= real, f"ComfyUI's requirements.txt no longer has {sorted(relied - real)}: add to requirements.txt"


def test_every_requirement_is_met_after_the_manager_install(installed):
    for req in _requirements(installed["clone"]):
        got = _venv("import importlib.metadata as m, sys; print(m.version(sys.argv[1]))", req.name,
                    path=installed["site"])
        assert got.returncode == 0 and req.specifier.contains(got.stdout.strip(), prereleases=True), (req, got)


def test_the_clone_loads_with_every_node_and_no_import_failure(installed):
    from wan_accel import NODE_CLASS_MAPPINGS        # the checkout's own list, imported here without ComfyUI

    log = installed["log"].read_text(errors="replace")
    assert str(installed["clone"]) in log, "ComfyUI did not load the pack from the clone"
    assert str(REPO) not in log, "ComfyUI loaded the work tree instead of the clone"
    assert "IMPORT FAILED" not in log and "wan_accel: node module" not in log, log[-3000:]
    status, info = http(installed["url"] + "/object_info", timeout=120)
    assert status == 200
    mine = {k for k, v in info.items() if v.get("python_module") == f"custom_nodes.{FOLDER}"}
    assert mine == set(NODE_CLASS_MAPPINGS), sorted(set(NODE_CLASS_MAPPINGS) ^ mine)


def test_tiny_smoke_runs_from_the_clone(installed):
    prompt = json.loads((installed["clone"] / "workflows" / "api" / "tiny_smoke.json").read_text())
    entry = _run_prompt(installed, prompt, timeout_s=300)
    assert entry.get("status", {}).get("status_str") == "success", entry
    images = [img for out in entry["outputs"].values() for img in out.get("images", []) if img.get("type") == "output"]
    assert images and all((installed["work"] / "output" / i.get("subfolder", "") / i["filename"]).is_file()
                          for i in images), entry["outputs"]
