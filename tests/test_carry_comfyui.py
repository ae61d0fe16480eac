"""tools/carry_comfyui.py and tools/unpack_comfyui.py, without ComfyUI: what the carry selects from a ComfyUI-like
folder (Python source only: no tokenizer data, tests or caches), which wheel files it leaves out, that the import
stand-ins of tools/comfy_stubs import and fail only when used, and that an archive unpacks into the environment
the bench is run with."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TOOLS = REPO / "tools"


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"_tool_{name}", TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


carry = _tool("carry_comfyui")
unpack = _tool("unpack_comfyui")


def _fake_comfyui(root: Path) -> Path:
    files = {
        "comfy/sd.py": "X = 1\n", "comfy/ldm/wan/model.py": "", "comfy/ldm/cosmos/cosmos_tokenizer/layers.py": "",
        "comfy/sd1_tokenizer/vocab.json": "{}", "comfy/sd1_tokenizer/merges.txt": "a b",
        "comfy/text_encoders/t5_tokenizer/tokenizer.json": "{}", "comfy/text_encoders/spiece.model": "x",
        "comfy/sd1_clip_config.json": "{}", "comfy/__pycache__/sd.cpython-312.pyc": "x",
        "comfy_extras/nodes_ar_video.py": "", "comfy_extras/tests/test_x.py": "", "comfy_api/latest/__init__.py": "",
        "comfy_execution/graph.py": "", "comfy_api_nodes/nodes_x.py": "", "tests-unit/test_y.py": "",
        "tests/inference/test_z.py": "", "folder_paths.py": "", "node_helpers.py": "", "main.py": "",
        "comfyui_version.py": '__version__ = "9.9.9"\n', "requirements.txt": "torch\ncomfy-kitchen==0.2.31\n"
                                                                            "comfy-aimdo==0.4.13 ; sys_platform\n",
        "README.md": "", "app/user_manager.py": "",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_selection_is_python_source_only(tmp_path):
    picked = carry.select_source(_fake_comfyui(tmp_path))
    assert picked == sorted([
        "comfy/sd.py", "comfy/ldm/wan/model.py", "comfy/ldm/cosmos/cosmos_tokenizer/layers.py",
        "comfy_extras/nodes_ar_video.py", "comfy_api/latest/__init__.py", "comfy_execution/graph.py",
        "folder_paths.py", "node_helpers.py", "main.py", "comfyui_version.py"])
    assert not any("tokenizer/" in p and not p.endswith(".py") for p in picked)
    assert carry.requirement_pins(tmp_path) == {"comfy-kitchen": "0.2.31", "comfy-aimdo": "0.4.13"}


def test_wheel_members_left_out():
    keep = carry.keep_wheel_member
    assert keep("comfy_kitchen/backends/eager/quantization.py") and keep("comfy_kitchen/__init__.py")
    assert keep("psutil/_psutil_linux.abi3.so") and keep("comfy_aimdo/aimdo.so")
    assert keep("comfy_kitchen-0.2.31.dist-info/METADATA")
    assert not keep("comfy_kitchen/backends/cuda/_C.abi3.so") and not keep("comfy_kitchen/backends/hip/_C.abi3.so")
    assert not keep("comfy_kitchen-0.2.31.dist-info/RECORD") and not keep("comfy_aimdo/aimdo_rocm.so")


def test_stand_ins_import_and_fail_only_when_used(tmp_path):
    """In a fresh interpreter with only the stand-ins on the path (they would shadow nothing here: each is imported
    from the stubs folder by name): imports of packages, submodules and names succeed; a call, an instance of a
    subclass or a loop raises ImportError naming the package; dunder lookups find nothing."""
    code = r"""
import sys
sys.path.insert(0, sys.argv[1])
import torchvision, torchaudio, scipy, transformers, tokenizers, av
import torchvision.transforms.functional as F
from scipy import integrate
from scipy.ndimage import gaussian_filter
from transformers import CLIPTokenizer, PreTrainedModel
import scipy.stats
assert not hasattr(scipy, "__version__")
class M(PreTrainedModel):
    pass
for use in (lambda: F.resize(1), lambda: M(), lambda: list(scipy.stats.beta), lambda: integrate.quad(1),
            lambda: CLIPTokenizer.from_pretrained("x")):
    try:
        use()
    except ImportError as e:
        assert "is not installed here" in str(e) and "tools/comfy_stubs" in str(e), e
    else:
        raise AssertionError("a stand-in ran")
print("ok", sorted(m for m in sys.modules if m.split(".")[0] in ("torchvision", "scipy"))[:3])
"""
    out = subprocess.run([sys.executable, "-c", code, str(TOOLS / "comfy_stubs")], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


def test_every_stand_in_says_why():
    stubs = sorted(p for p in (TOOLS / "comfy_stubs").iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert {p.name for p in stubs} == {"av", "scipy", "tokenizers", "torchaudio", "torchvision", "transformers"}
    for p in stubs:
        text = (p / "__init__.py").read_text()
        assert "stub_package(__name__," in text and "TODO" not in text


def _wheel(folder: Path, name: str, files: dict) -> Path:
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for rel, text in files.items():
            z.writestr(rel, text)
    return path


def test_archive_unpacks_into_the_environment_to_use(tmp_path):
    """build() of a ComfyUI-like folder and two wheels, then unpack(): ComfyUI's source, the wheel's files (less
    the compiled kitchen backend; a wheel whose package imports here, pytest, left out), the stand-ins this Python
    lacks (never one for a package it has), and the link that makes ``wan_accel`` importable."""
    comfy = _fake_comfyui(tmp_path / "ComfyUI")
    wheels = {"comfy-kitchen": _wheel(tmp_path, "comfy_kitchen", {
                  "comfy_kitchen/__init__.py": "", "comfy_kitchen/backends/cuda/_C.abi3.so": "bin",
                  "comfy_kitchen-1.0.dist-info/METADATA": "Name: comfy-kitchen\nVersion: 1.0\n"}),
              "pytest": _wheel(tmp_path, "pytest", {"pytest/__init__.py": ""})}
    monkey_wheels = dict(carry.WHEELS, pytest=("pytest",))
    old = carry.WHEELS
    carry.WHEELS = monkey_wheels
    try:
        manifest = carry.build(comfy, tmp_path / "out", wheels)
    finally:
        carry.WHEELS = old
    archive = tmp_path / "out" / carry.ARCHIVE
    assert manifest["source_files"] == 10 and manifest["comfyui"]["version"] == "9.9.9"
    assert json.loads((tmp_path / "out" / carry.MANIFEST).read_text())["archive_mib"] == manifest["archive_mib"]
    with tarfile.open(archive, "r:xz") as tar:
        names = set(tar.getnames())
    assert "ComfyUI/comfy/sd.py" in names and "ComfyUI/comfy/sd1_tokenizer/vocab.json" not in names
    assert "site/comfy_kitchen/__init__.py" in names and "site/comfy_kitchen/backends/cuda/_C.abi3.so" not in names
    env = unpack.unpack(archive, tmp_path / "dest")
    dest = tmp_path / "dest"
    assert env["COMFYUI_DIR"] == str(dest / "ComfyUI") and (dest / "ComfyUI" / "folder_paths.py").is_file()
    assert env["paths"] == [str(dest / "pkg"), str(dest / "ComfyUI"), str(dest / "site"), str(dest / "stubs")]
    here = unpack.importable("comfy_kitchen")          # the pack's optional extra may be installed in this Python
    assert (dest / "site" / "comfy_kitchen" / "__init__.py").is_file() != here
    assert not (dest / "site" / "pytest").exists()
    assert env["wheels_skipped"] == (["comfy_kitchen", "pytest"] if here else ["pytest"])
    assert (dest / "pkg" / "wan_accel").resolve() == REPO
    for name in env["stubbed"]:
        assert not unpack.importable(name) and (dest / "stubs" / name / "__init__.py").is_file()
    assert "yaml" not in env["stubbed"]             # only stand-ins are copied, and only for what is missing


def test_unpack_prints_the_exports(tmp_path, monkeypatch):
    comfy = _fake_comfyui(tmp_path / "ComfyUI")
    carry.build(comfy, tmp_path / "out", {})
    out = subprocess.run([sys.executable, str(TOOLS / "unpack_comfyui.py"), "--archive",
                          str(tmp_path / "out" / carry.ARCHIVE), "--dest", str(tmp_path / "d")],
                         capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"export COMFYUI_DIR={tmp_path / 'd' / 'ComfyUI'}"
    assert lines[1].startswith(f"export PYTHONPATH={tmp_path / 'd' / 'pkg'}:") and "ComfyUI 9.9.9" in out.stderr


def test_unpack_without_an_archive_says_how_to_make_one(tmp_path):
    out = subprocess.run([sys.executable, str(TOOLS / "unpack_comfyui.py"), "--archive", str(tmp_path / "no.tar.xz")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "carry_comfyui.py" in out.stderr


@pytest.mark.parametrize("bad", ["not_comfy"])
def test_build_refuses_a_folder_that_is_not_comfyui(tmp_path, bad):
    (tmp_path / bad).mkdir()
    with pytest.raises(SystemExit, match="not a ComfyUI folder"):
        carry.build(tmp_path / bad, tmp_path / "out", {})
