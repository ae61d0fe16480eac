"""The pack as users get it: the registry's zip, requirements.txt, the registry metadata, the registry's security
scan (``comfy node validate``). ComfyUI-Manager clones the repository into ``custom_nodes`` and runs
``pip install <line>`` for each line of requirements.txt; the registry unpacks the zip of ``comfy node pack``."""
from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from pack_contents import (COMFYUI_MODULES, COMFYUI_REQUIREMENTS, REPO, WITH_TORCH, distribution, git_lines,
                           pack_files, runtime_files, third_party_imports)
from test_package import _load_as

ZIP_LIMIT = 2_000_000
FIXTURE_SUFFIXES = (".safetensors", ".pt", ".pth", ".ckpt", ".npz", ".npy", ".bin")
META = tomllib.loads((REPO / "pyproject.toml").read_text())


def _zip(files, path: Path) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:     # as comfy-cli's zip_files writes it
        for name in files:
            z.write(REPO / name, name)
    return path


def test_published_zip_is_small_holds_no_fixture_and_everything_the_pack_runs(tmp_path):
    assert not META["tool"]["comfy"].get("includes"), "[tool.comfy] includes: pack_files() does not add them yet"
    files = pack_files()
    zipped = _zip(files, tmp_path / "node.zip")
    size = zipped.stat().st_size
    assert size <= ZIP_LIMIT, f"the registry zip is {size / 1e6:.2f} MB: add what the pack does not run to .comfyignore"
    leaked = [f for f in files if f.startswith("tests/") or f.endswith(FIXTURE_SUFFIXES)]
    assert not leaked, f"test files in the registry zip: {leaked[:10]}"
    needed = set(runtime_files()) | {"pyproject.toml", "requirements.txt", "LICENSE", "README.md",
                                     META["tool"]["comfy"]["Icon"].rsplit("/main/", 1)[1]}
    missing = sorted(needed - set(files))
    assert not missing, f".comfyignore leaves out what the pack needs: {missing[:10]}"
    assert any(f.startswith("workflows/api/") for f in files) and any(f.endswith(".jpg") for f in files)


def test_the_pack_imports_from_its_published_zip(tmp_path):
    from wan_accel import NODE_CLASS_MAPPINGS

    folder = tmp_path / "comfyui-wan-accel"                        # how the registry installs it: unpacked
    with zipfile.ZipFile(_zip(pack_files(), tmp_path / "node.zip")) as z:
        z.extractall(folder)
    count, heavy, web = _load_as(folder)
    assert int(count) == len(NODE_CLASS_MAPPINGS) and web == "./web"


def test_pack_files_match_comfy_cli(tmp_path, monkeypatch):
    """Where comfy-cli is importable, its own zip_files makes the same zip (its .comfyignore matching is
    pathspec's gitwildmatch; pack_files() asks git)."""
    file_utils = pytest.importorskip("comfy_cli.file_utils", reason="comfy-cli is not installed")
    monkeypatch.chdir(REPO)
    file_utils.zip_files(tmp_path / "node.zip")
    with zipfile.ZipFile(tmp_path / "node.zip") as z:
        assert sorted(z.namelist()) == sorted(pack_files())


def _requirements() -> list[str]:
    return (REPO / "requirements.txt").read_text().splitlines()


def test_requirements_txt_adds_only_what_comfyui_lacks_and_agrees_with_pyproject():
    lines = [line.strip() for line in _requirements() if line.strip()]
    for line in lines:   # ComfyUI-Manager runs `pip install <line>` per line: no comments, options or markers
        assert not line.startswith(("#", "-")) and "#" not in line and ";" not in line, \
            f"requirements.txt: {line!r} must be a bare requirement (ComfyUI-Manager installs it line by line)"
    reqs = {distribution(Requirement(line).name): Requirement(line) for line in lines}
    assert not set(reqs) & COMFYUI_REQUIREMENTS, \
        f"{sorted(set(reqs) & COMFYUI_REQUIREMENTS)}: ComfyUI installs these (torch: its own CUDA build); drop them"
    declared = {distribution(Requirement(d).name): Requirement(d) for d in META["project"]["dependencies"]}
    for name, req in declared.items():
        assert name in COMFYUI_REQUIREMENTS or name in reqs, \
            f"pyproject dependency {req} is not in ComfyUI's requirements: add it to requirements.txt"
    for name, req in reqs.items():
        assert name in declared and str(declared[name].specifier) == str(req.specifier), \
            f"requirements.txt {req} and pyproject's dependencies must agree"


def test_every_import_of_the_pack_is_satisfied_inside_comfyui():
    """An import must come from ComfyUI itself, its requirements, requirements.txt, torch, an optional extra the
    docs name, or sit in a try/except ImportError (the pack runs without it)."""
    provided = COMFYUI_REQUIREMENTS | WITH_TORCH | {distribution(Requirement(line).name) for line in _requirements()
                                                    if line.strip()}
    extras = {distribution(Requirement(d).name) for extra, ds in META["project"]["optional-dependencies"].items()
              if extra != "test" for d in ds}
    unmet = {}
    for module, sites in third_party_imports().items():
        dist = distribution(module)
        if module in COMFYUI_MODULES or dist in provided or dist in extras or all(sites.values()):
            continue
        unmet[module] = [s for s, guarded in sites.items() if not guarded][:3]
    assert not unmet, f"imports no ComfyUI install satisfies (add to requirements.txt and pyproject): {unmet}"


def test_registry_metadata():
    urls, comfy = META["project"]["urls"], META["tool"]["comfy"]
    repo = urls["Repository"]
    m = re.fullmatch(r"https://github\.com/([\w.-]+)/([\w.-]+)", repo)
    assert m, f"[project.urls] Repository {repo!r} is not a GitHub repository address"
    assert urls["Documentation"].startswith(repo + "/") and urls["Issues"] == repo + "/issues"
    name = META["project"]["name"]
    assert re.fullmatch(r"[A-Za-z](?:[A-Za-z0-9]|[-_.](?![-_.]))*", name) and len(name) < 100, name
    assert re.fullmatch(r"[a-z0-9-]+", comfy["PublisherId"]) and comfy["DisplayName"]
    assert re.fullmatch(r"(>=|==|~=)\d+\.\d+\.\d+", comfy["requires-comfyui"])
    install = (REPO / "README.md").read_text().split("## Install into ComfyUI", 1)[1].split("\n## ", 1)[0]
    assert f"git clone {repo}\n" in install, "the README's clone command must name [project.urls] Repository"
    raw = f"https://raw.githubusercontent.com/{m[1]}/{m[2]}/main/"
    assert comfy["Icon"].startswith(raw), f"Icon must be the raw address of a file of {repo}"
    icon = comfy["Icon"][len(raw):]
    assert icon in git_lines("ls-files"), f"the icon {icon} is not in the repository"
    from PIL import Image
    with Image.open(REPO / icon) as img:       # the registry's limits: SVG, PNG, JPG or GIF, at most 800 x 400
        assert img.format in ("PNG", "JPEG", "GIF") and img.width <= 800 and img.height <= 400
    assert (REPO / icon).stat().st_size < 50_000


def _scanned_sources() -> list[str]:
    # what `ruff check .` reads in `comfy node validate`: every .py file but the git-ignored ones, .comfyignore or
    # not (tracked and untracked)
    return git_lines("ls-files", "--cached", "--others", "--exclude-standard", "*.py")


def test_no_exec_eval_or_two_statements_on_a_line():
    """The registry's security scan (``comfy node validate``: ruff S102 exec, S307 eval, E702), which it is going to
    turn into an error, on every file it reads."""
    found = []
    for name in _scanned_sources():
        text = (REPO / name).read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(text, filename=name)) if ("exec" in text or "eval" in text) else ():
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("exec", "eval"):
                found.append(f"{name}:{node.lineno} {node.func.id}()")
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline)) if ";" in text else []
        for tok, nxt in zip(tokens, tokens[1:]):
            if tok.type == tokenize.OP and tok.string == ";" and nxt.type not in (tokenize.NEWLINE, tokenize.COMMENT):
                found.append(f"{name}:{tok.start[0]} two statements on one line")
    assert not found, found


def test_comfy_node_validate_security_scan_is_clean():
    """The scan itself, where ruff is installed (``comfy node validate`` runs exactly this)."""
    pytest.importorskip("ruff", reason="ruff is not installed")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", ".", "-q", "--select", "S102,S307,E702",
                          "--exit-zero"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and not out.stdout.strip(), out.stdout[-3000:] + out.stderr[-2000:]

