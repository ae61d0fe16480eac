#!/usr/bin/env python3
"""Unpack the carried ComfyUI (``tools/carry_comfyui.py``) on the GPU machine and print the environment to use.

    eval "$(python tools/unpack_comfyui.py)"          # the Python that will run the bench
    cd "$COMFYUI_DIR" && python -m wan_accel bench native --shape 1.3b ...

Unpacks ``.gpu/comfyui/comfyui-carry.tar.xz`` into a new temporary folder (``--dest`` to choose): ComfyUI's source in
``ComfyUI/``, the carried wheels' files in ``site/`` (a wheel whose package this Python already imports is left
out, so nothing installed is shadowed), the import stand-ins of ``tools/comfy_stubs/`` for the packages this Python
lacks in ``stubs/``, and ``pkg/wan_accel``, a link to this repository (so ``python -m wan_accel`` imports it).
Prints ``export`` lines for ``COMFYUI_DIR`` and ``PYTHONPATH`` (pkg, ComfyUI, site, stubs, then what was set);
the notes go to stderr.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ARCHIVE = REPO / ".gpu" / "comfyui" / "comfyui-carry.tar.xz"
STUBS = REPO / "tools" / "comfy_stubs"


def importable(name: str) -> bool:
    """Whether this Python imports ``name`` without the carried files (never a stand-in)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    return spec is not None and not str(getattr(spec, "origin", "") or "").startswith(str(STUBS))


def missing_stubs(stubs: Path = STUBS) -> list:
    """The stand-in packages of ``stubs`` for the packages this Python lacks."""
    names = sorted(p.name for p in stubs.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    return [n for n in names if not importable(n)]


def unpack(archive: Path = ARCHIVE, dest: Path | None = None, repo: Path = REPO, stubs: Path = STUBS) -> dict:
    """Unpack into ``dest`` (a new temporary folder by default); returns the environment to set and what was
    left out."""
    dest = Path(dest) if dest else Path(tempfile.mkdtemp(prefix="comfyui_carry_"))
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:xz") as tar:
        manifest = json.loads(tar.extractfile("manifest.json").read())
        skip_roots = {name for w in manifest.get("wheels", {}).values() for name in w.get("imports", ())
                      if importable(name)}
        members = [m for m in tar.getmembers() if not (m.name.startswith("site/") and _top(m.name) in skip_roots)]
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(dest, members=members, **kwargs)
    (dest / "site").mkdir(exist_ok=True)
    stub_dir = dest / "stubs"
    stub_dir.mkdir(exist_ok=True)
    wanted = missing_stubs(stubs)
    if wanted:
        shutil.copy2(stubs / "_comfy_stub.py", stub_dir / "_comfy_stub.py")
        for name in wanted:
            shutil.copytree(stubs / name, stub_dir / name, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__"))
    pkg = dest / "pkg"
    pkg.mkdir(exist_ok=True)
    link = pkg / "wan_accel"
    if not link.exists():
        link.symlink_to(Path(repo).resolve(), target_is_directory=True)
    paths = [str(pkg), str(dest / "ComfyUI"), str(dest / "site"), str(stub_dir)]
    return {"COMFYUI_DIR": str(dest / "ComfyUI"), "paths": paths, "stubbed": wanted,
            "wheels_skipped": sorted(skip_roots), "manifest": manifest, "dest": str(dest)}


def _top(name: str) -> str:
    """The import name a ``site/`` member belongs to: ``site/psutil/...`` and ``site/psutil-7.2.2.dist-info/...``
    both give ``psutil``."""
    return name.split("/")[1].split("-")[0].split(".")[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--archive", default=str(ARCHIVE), help="the carried archive")
    p.add_argument("--dest", default=None, help="folder to unpack into (default: a new temporary folder)")
    a = p.parse_args(argv)
    if not Path(a.archive).is_file():
        print(f"no {a.archive}: build it where ComfyUI is, with tools/carry_comfyui.py, and carry .gpu/ here",
              file=sys.stderr)
        return 2
    env = unpack(Path(a.archive), a.dest)
    old = os.environ.get("PYTHONPATH")
    path = os.pathsep.join(env["paths"] + ([old] if old else []))
    c = env["manifest"].get("comfyui", {})
    print(f"# ComfyUI {c.get('version')} ({(c.get('commit') or '')[:10]}) unpacked in {env['dest']}; stand-ins for: "
          f"{', '.join(env['stubbed']) or 'none'}; wheels already installed here: "
          f"{', '.join(env['wheels_skipped']) or 'none'}", file=sys.stderr)
    print(f"export COMFYUI_DIR={shlex.quote(env['COMFYUI_DIR'])}")
    print(f"export PYTHONPATH={shlex.quote(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
