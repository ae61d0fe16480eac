"""What a user's copy of the pack holds, and what it needs from the Python that runs ComfyUI.

* ``tracked_files``: a ``git clone`` (ComfyUI-Manager's "Install via Git URL", or a clone into ``custom_nodes``);
* ``pack_files``: the registry's zip (``comfy node pack``: the tracked files minus the ``.comfyignore`` patterns,
  gitignore syntax, matched here by git itself);
* ``runtime_files``: what the pack runs (every module outside the tests and the development scripts, ``web/``,
  ``workflows/``): every one of these must reach every kind of install;
* ``third_party_imports``: the modules the pack imports that neither the standard library nor the pack provides.
"""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEV_ONLY = ("tests/", "tools/", ".ci/")            # in the repository for its development, never run by the pack

# ComfyUI 0.33.0's requirements.txt (every ComfyUI install has these; the pack adds only what is missing)
COMFYUI_REQUIREMENTS = {
    "comfyui-frontend-package", "comfyui-workflow-templates", "comfyui-embedded-docs", "torch", "torchsde",
    "torchvision", "torchaudio", "numpy", "einops", "transformers", "tokenizers", "sentencepiece", "safetensors",
    "aiohttp", "yarl", "pyyaml", "pillow", "scipy", "tqdm", "psutil", "alembic", "sqlalchemy", "filelock", "av",
    "comfy-kitchen", "comfy-aimdo", "requests", "simpleeval", "blake3", "kornia", "spandrel", "pydantic",
    "pydantic-settings", "pyopengl", "comfy-angle"}
# what torch's Linux CUDA wheels install with it (the pack detects it at run time and runs without it)
WITH_TORCH = {"triton"}
# ComfyUI's own modules (imported only inside ComfyUI, by nodes/)
COMFYUI_MODULES = {"comfy", "comfy_extras", "comfy_api", "comfy_execution", "folder_paths", "server",
                   "comfyui_version", "nodes", "execution", "node_helpers", "latent_preview"}
IMPORT_NAMES = {"PIL": "pillow", "yaml": "pyyaml", "flash_attn": "flash-attn"}   # import name -> distribution


def git_lines(*args: str, repo: Path = REPO) -> list[str]:
    try:
        out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        pytest.skip("git is not installed")
    if out.returncode != 0:
        pytest.skip(f"not a git checkout ({out.stderr.strip()[:200]})")
    return [line for line in out.stdout.splitlines() if line]


def tracked_files(repo: Path = REPO) -> list[str]:
    return git_lines("ls-files", repo=repo)


def pack_files(repo: Path = REPO) -> list[str]:
    ignored = set(git_lines("ls-files", "--cached", "--ignored", "--exclude-from=.comfyignore", repo=repo)) \
        if (repo / ".comfyignore").is_file() else set()
    return [f for f in tracked_files(repo) if f not in ignored]


def runtime_files(repo: Path = REPO) -> list[str]:
    return [f for f in tracked_files(repo) if not f.startswith(DEV_ONLY)
            and (f.endswith(".py") or f.startswith(("web/", "workflows/")))]


def copy_files(files, dest: Path, repo: Path = REPO) -> Path:
    """The files (repository paths) as they are in the work tree, copied under ``dest``: what a clone of the
    committed work tree holds."""
    for name in files:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / name, dest / name)
    return dest


def _guarded(tree: ast.AST) -> set[int]:
    """Line numbers of the imports inside a ``try`` whose handler catches ImportError (optional imports)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                h.type is None or {n.id for n in ast.walk(h.type) if isinstance(n, ast.Name)}
                & {"ImportError", "ModuleNotFoundError", "Exception"} for h in node.handlers):
            lines |= {n.lineno for stmt in node.body for n in ast.walk(stmt)
                      if isinstance(n, (ast.Import, ast.ImportFrom))}
    return lines


def third_party_imports(repo: Path = REPO) -> dict[str, dict[str, bool]]:
    """{top-level module: {"file:line": guarded}} for every absolute import of a module outside the standard
    library in the pack's run-time modules."""
    found: dict[str, dict[str, bool]] = {}
    for name in runtime_files(repo):
        if not name.endswith(".py"):
            continue
        tree = ast.parse((repo / name).read_text(encoding="utf-8"), filename=name)
        guarded = _guarded(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            else:
                continue
            for mod in mods:
                top = mod.split(".")[0]
                if top not in sys.stdlib_module_names and top != "wan_accel":
                    found.setdefault(top, {})[f"{name}:{node.lineno}"] = node.lineno in guarded
    return found


def distribution(module: str) -> str:
    return IMPORT_NAMES.get(module, module).lower().replace("_", "-")
