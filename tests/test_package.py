"""Packaging and ComfyUI-facing contracts that hold for every node of the pack."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

IMPORT_CHECK = r"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location(
    "{name}", r"{init}", submodule_search_locations=[r"{folder}"])
mod = importlib.util.module_from_spec(spec)
sys.modules["{name}"] = mod
spec.loader.exec_module(mod)
heavy = sorted(m for m in ("torch", "triton", "flash_attn", "comfy", "folder_paths") if m in sys.modules)
print(len(mod.NODE_CLASS_MAPPINGS), ",".join(heavy) or "-", mod.WEB_DIRECTORY)
"""


def _load_as(folder: Path) -> list[str]:
    """(node count, heavy modules imported, WEB_DIRECTORY) of the pack in ``folder`` loaded as ComfyUI loads a custom
    node folder: by path, under its path as the module name with each "." made "_x_" (no dotted parent package)."""
    name = str(folder).replace(".", "_x_")
    code = IMPORT_CHECK.format(name=name, init=folder / "__init__.py", folder=folder)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=folder.parent,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_pack_imports_cheaply_under_any_folder_name(tmp_path):
    # as ComfyUI does: the folder under custom_nodes is imported by path, under whatever name it has
    folder = tmp_path / "ComfyUI-Wan Accel-main"
    shutil.copytree(REPO, folder, ignore=shutil.ignore_patterns(".git", ".venv", "tests", "__pycache__"))
    count, heavy, web = _load_as(folder)
    from wan_accel import NODE_CLASS_MAPPINGS
    assert int(count) == len(NODE_CLASS_MAPPINGS), "a node module failed to import from the copy"
    assert heavy == "-", f"importing the pack pulled in heavy modules: {heavy}"
    assert web == "./web"


def test_every_node_has_tooltips_and_required_attributes():
    from wan_accel import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
    from wan_accel.nodes import IMPORT_ERRORS

    assert not IMPORT_ERRORS, IMPORT_ERRORS
    assert set(NODE_DISPLAY_NAME_MAPPINGS) == set(NODE_CLASS_MAPPINGS)
    for name, cls in NODE_CLASS_MAPPINGS.items():
        spec = cls.INPUT_TYPES()
        for section in ("required", "optional"):
            for inp, decl in spec.get(section, {}).items():
                opts = decl[1] if len(decl) > 1 else {}
                assert opts.get("tooltip"), f"{name}.{inp} has no tooltip"
                if isinstance(decl[0], list):
                    assert "default" not in opts or opts["default"] in decl[0], f"{name}.{inp} default not in choices"
                if decl[0] in ("INT", "FLOAT"):
                    d, lo, hi = opts.get("default"), opts.get("min"), opts.get("max")
                    assert d is not None, f"{name}.{inp} has no default"
                    assert (lo is None or d >= lo) and (hi is None or d <= hi), f"{name}.{inp} default out of range"
        assert cls.CATEGORY.startswith("wan_accel"), name
        assert hasattr(cls, cls.FUNCTION), name
        assert isinstance(cls.RETURN_TYPES, tuple), name
        assert getattr(cls, "DESCRIPTION", ""), f"{name} has no DESCRIPTION"


def test_pyproject_lists_every_subpackage_and_metadata():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert meta["project"]["name"] == "comfyui-wan-accel"
    assert meta["project"]["requires-python"] == ">=3.10"
    for field in ("PublisherId", "DisplayName", "Icon"):
        assert field in meta["tool"]["comfy"]
    listed = set(meta["tool"]["setuptools"]["packages"])
    found = {"wan_accel"} | {
        "wan_accel." + ".".join(p.parent.relative_to(REPO).parts)
        for p in REPO.rglob("__init__.py")
        if p.parent != REPO and not {"tests", "build", "tools"} & set(p.relative_to(REPO).parts)   # tools/: repo scripts
        and not any(part.startswith(".") for part in p.relative_to(REPO).parts)}   # hidden folders hold no package
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"


def test_cli_entry_point_and_cache_commands(tmp_path):
    """The entry point in a new process; the cache commands through the same ``main`` in this one (every command
    also runs in a new process in tests/test_cli_smoke.py)."""
    from cli_run import run_cli_in
    limits = tmp_path / "c" / "limits.json"
    env = dict(os.environ, WAN_ACCEL_CACHE=str(limits))
    out = subprocess.run([sys.executable, "-m", "wan_accel", "--help"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0 and "cache" in out.stdout

    def run(*a):
        code, stdout, stderr = run_cli_in(tmp_path, *a, env={"WAN_ACCEL_CACHE": str(limits)})
        return subprocess.CompletedProcess(a, code, stdout, stderr)

    assert run("cache", "path").stdout.strip() == str(limits)
    from wan_accel.cache import LimitCache

    LimitCache(limits).put("memory", "vae-480p", {"chunk_frames": 4})
    shown = run("cache", "show")
    assert shown.returncode == 0 and "vae-480p" in shown.stdout and "memory 1" in shown.stdout
    data = json.loads(run("cache", "show", "--json").stdout)
    assert data["entries"][0]["value"] == {"chunk_frames": 4}
    assert "removed 1" in run("cache", "clear", "--namespace", "memory").stdout
    assert json.loads(run("cache", "show", "--json").stdout)["entries"] == []
    assert run("cache", "prune-stale").returncode == 0
    bad = run("cache", "frobnicate")
    assert bad.returncode != 0 and "invalid choice" in bad.stderr


def test_limit_cache_node_needs_confirmation(tmp_path, monkeypatch):
    from wan_accel.cache import LimitCache
    from wan_accel.nodes.cache_nodes import WanAccelLimitCache

    LimitCache().put("memory", "k", {"v": 1})
    node = WanAccelLimitCache()
    out = node.run(namespace="memory", action="clear", confirm_clear=False)
    assert "Nothing cleared" in out["result"][0] and LimitCache().get("memory", "k") == {"v": 1}
    assert "k" in out["ui"]["text"][0]
    out = node.run(namespace="memory", action="clear", confirm_clear=True)
    assert "Cleared 1" in out["result"][0] and LimitCache().get("memory", "k") is None


def test_readme_commands_and_ci_agree():
    readme = (REPO / "README.md").read_text()
    blocks = [b.split("```", 1)[0].strip() for b in readme.split("```sh\n")[1:3]]
    setup_and_run, tests = blocks
    assert "python -m wan_accel generate" in setup_and_run and "python -m pytest" in tests
    ci = (REPO / ".ci" / "run").read_text()
    assert tests in ci.splitlines(), ".ci/run must run exactly the README's test command"


def test_readme_generated_sections_are_current():
    from wan_accel.compile import render_presets_table
    from wan_accel.nodes.comfy.reference import render_node_reference

    readme = (REPO / "README.md").read_text()
    nodes = (REPO / "docs" / "nodes.md").read_text()
    assert render_node_reference() in nodes, "regenerate docs/nodes.md with: python -m wan_accel nodes --markdown"
    assert "docs/nodes.md" in readme and "node-reference:begin" not in readme     # the README links to it
    assert render_presets_table().strip() in (REPO / "docs" / "compile.md").read_text(), \
        "the presets table changed: update docs/compile.md"


def test_readme_nodes_at_a_glance_names_every_node_in_its_category():
    from wan_accel import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

    section = (REPO / "README.md").read_text().split("## Nodes at a glance", 1)[1].split("\n## ", 1)[0]
    rows = {row.split(" | ")[0].strip("| `").split("`")[0]: row for row in section.splitlines() if row.startswith("| `")}
    for key, cls in NODE_CLASS_MAPPINGS.items():
        name = NODE_DISPLAY_NAME_MAPPINGS[key]
        assert cls.CATEGORY in rows and name in rows[cls.CATEGORY].split(" | ")[1].split(", "), \
            f"the README's Nodes at a glance should list {name} under `{cls.CATEGORY}`"


def test_a_built_wheel_carries_every_file_the_pack_runs(tmp_path):
    """A non-editable install (``pip install .``, a wheel) from a clone: every module, web file and workflow
    (with its API copy and thumbnail) is inside the wheel under ``wan_accel/``."""
    import zipfile
    from pack_contents import copy_files, runtime_files, tracked_files

    src = copy_files(tracked_files(), tmp_path / "src")
    out = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                          "print(b.build_wheel(sys.argv[1]))", str(tmp_path / "dist")], cwd=src, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    with zipfile.ZipFile(tmp_path / "dist" / out.stdout.split()[-1]) as wheel:
        members = set(wheel.namelist())
    missing = sorted(f for f in runtime_files() if f"wan_accel/{f}" not in members)
    assert not missing, f"the wheel lacks (add to [tool.setuptools] packages or package-data): {missing[:10]}"


def test_the_suite_runs_in_a_clone_whose_folder_name_is_no_python_name(tmp_path):
    """``git clone`` names the folder ``comfyui-wan-accel``, which no Python module can be called: pytest's importlib
    mode then runs the package's ``__init__.py`` as a lone file while setting up the tests, and it must not fail
    there (every test of such a clone would error)."""
    from pack_contents import copy_files, runtime_files

    clone = copy_files(runtime_files() + ["pyproject.toml", "tests/conftest.py", "tests/test_cache_store.py"],
                       tmp_path / "comfyui-wan-accel")
    path = tmp_path / "path"
    path.mkdir()
    (path / "wan_accel").symlink_to(clone, target_is_directory=True)      # `import wan_accel` finds the clone
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/test_cache_store.py::test_round_trip_and_api"], cwd=clone,
                         env=dict(os.environ, PYTHONPATH=str(path)), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]
