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
import lzma
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


class UnpackError(Exception):
    """An archive or a folder this tool cannot use; the message names it and what to do."""


ROOTS = ("ComfyUI/", "site/")          # where a carried member may go (and MANIFEST at the top)
MANIFEST = "manifest.json"


def check_member(m: tarfile.TarInfo) -> None:
    """UnpackError unless ``m`` is a plain file or folder under ROOTS (or the manifest): no absolute path, no
    ``..``, no link or device, nothing in ``pkg/`` or ``stubs/`` (the link to this repository and the stand-ins are
    this tool's, never the archive's)."""
    parts = m.name.split("/")
    hostile = (m.name.startswith("/") or ".." in parts or not (m.isfile() or m.isdir())
               or not (m.name == MANIFEST or any(m.name.startswith(r) for r in ROOTS)))
    if hostile:
        what = "a link or special file" if not (m.isfile() or m.isdir()) else "outside ComfyUI/ and site/"
        raise UnpackError(f"the archive holds {m.name!r} ({what}), which a carry archive never holds; nothing was "
                          f"unpacked: build it again with tools/carry_comfyui.py")


def _read(archive: Path, dest: Path) -> tuple:
    """(the manifest, the wheels left out: their import names), after every member is checked and the kept ones
    extracted into ``dest`` (a wheel whose package this Python already imports is left out)."""
    try:
        with tarfile.open(archive, "r:xz") as tar:
            members = tar.getmembers()               # reads the whole archive: a truncated one fails here
            for m in members:
                check_member(m)
            if MANIFEST not in {m.name for m in members}:
                raise UnpackError(f"{archive} holds no {MANIFEST}: not an archive of tools/carry_comfyui.py; build "
                                  f"it again there")
            manifest = json.loads(tar.extractfile(MANIFEST).read())
            if not isinstance(manifest, dict):
                raise UnpackError(f"{archive}: {MANIFEST} is not a JSON object; build the archive again")
            wheels = manifest.get("wheels", {})
            skip_roots = {name for w in (wheels.values() if isinstance(wheels, dict) else ()) if isinstance(w, dict)
                          for name in w.get("imports", ()) if importable(name)}
            # a site/ member's import name: site/psutil/... and site/psutil-7.2.2.dist-info/... both give psutil
            kept = [m for m in members if m.name != MANIFEST and not (
                m.name.startswith("site/") and m.name.split("/")[1].split("-")[0].split(".")[0] in skip_roots)]
            kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(dest, members=kept, **kwargs)
    except (tarfile.TarError, EOFError, lzma.LZMAError, ValueError) as exc:
        raise UnpackError(f"{archive} is not a complete carry archive ({type(exc).__name__}: "
                          f"{str(exc).strip()[:160]}); copy it again, or build it again with "
                          f"tools/carry_comfyui.py") from None
    return manifest, skip_roots


def _dest(dest) -> Path:
    """``--dest`` as a folder to unpack into (made when absent), or UnpackError naming it."""
    if not dest:
        return Path(tempfile.mkdtemp(prefix="comfyui_carry_"))
    dest = Path(dest)
    for p in [dest, *dest.parents]:
        if p.exists():
            if not p.is_dir():
                raise UnpackError(f"--dest {dest}: {p} is a file, not a folder; choose another --dest")
            if not os.access(p, os.W_OK | os.X_OK):
                raise UnpackError(f"--dest {dest}: {p} is not writable; choose a folder you may write")
            break
    dest.mkdir(parents=True, exist_ok=True)
    return dest


def unpack(archive: Path = ARCHIVE, dest: Path | None = None, repo: Path = REPO, stubs: Path = STUBS) -> dict:
    """Unpack into ``dest`` (a new temporary folder by default); returns the environment to set and what was
    left out. UnpackError (nothing unpacked) for an archive that is truncated, lacks its manifest or holds a
    member outside ComfyUI/ and site/ (a link, ``..``, an absolute path, ``pkg/wan_accel``)."""
    dest = _dest(dest)
    link = dest / "pkg" / "wan_accel"
    if os.path.lexists(link) and not (link.is_symlink() and link.resolve() == Path(repo).resolve()):
        raise UnpackError(f"--dest {dest}: {link} exists and is not the link to this repository; remove it or "
                          f"choose another --dest")
    manifest, skip_roots = _read(Path(archive), dest)
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
    if not os.path.lexists(link):
        link.symlink_to(Path(repo).resolve(), target_is_directory=True)
    paths = [str(pkg), str(dest / "ComfyUI"), str(dest / "site"), str(stub_dir)]
    return {"COMFYUI_DIR": str(dest / "ComfyUI"), "paths": paths, "stubbed": wanted,
            "wheels_skipped": sorted(skip_roots), "manifest": manifest, "dest": str(dest)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--archive", default=str(ARCHIVE), help="the carried archive")
    p.add_argument("--dest", default=None, help="folder to unpack into (default: a new temporary folder)")
    a = p.parse_args(argv)
    if not Path(a.archive).is_file():
        print(f"error: no {a.archive}: build it where ComfyUI is, with tools/carry_comfyui.py, and carry .gpu/ here",
              file=sys.stderr)
        return 2
    try:
        env = unpack(Path(a.archive), a.dest)
    except (UnpackError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
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
