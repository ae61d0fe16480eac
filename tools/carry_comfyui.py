#!/usr/bin/env python3
"""Pack ComfyUI's Python source and the few wheels it lacks on the offline GPU machine into ``.gpu/comfyui/``.

    python tools/carry_comfyui.py --comfyui /path/to/ComfyUI        # or COMFYUI_DIR=/path/to/ComfyUI

Run here (with network for the wheels, once: they are cached in ``~/.cache/wan_accel_carry/wheels``, outside
``.gpu/``, as comfy-kitchen's full wheel alone is 58 MB). Writes
``.gpu/comfyui/comfyui-carry.tar.xz`` and ``.gpu/comfyui/manifest.json``; ``.gpu/`` is git-ignored and travels to
the GPU machine as a carried path. There, ``tools/unpack_comfyui.py`` unpacks it into a temporary folder and prints
the ``COMFYUI_DIR`` / ``PYTHONPATH`` to use (docs/benchmarks.md, "ComfyUI on the offline GPU machine").

What is carried:

* ComfyUI's Python source: every ``.py`` file of ``comfy/``, ``comfy_extras/``, ``comfy_api/`` and
  ``comfy_execution/`` and the top-level modules (``folder_paths.py``, ``node_helpers.py``, ...). No data files
  (tokenizer vocabularies, merges, SentencePiece models, CLIP configs: the bench encodes no text), no tests, no
  docs, no ``__pycache__``.
* The wheels ComfyUI imports at module level on the path of ``comfy.sd``, ``comfy.samplers``, core's
  ``SamplerARVideo`` node and the loaders ``bench native`` uses, which the GPU machine lacks (``WHEELS``): pure
  Python, or one platform-independent ``abi3`` shared library (psutil, comfy-aimdo). comfy-kitchen (ComfyUI's
  quantized tensors, needed for fp8 scaled checkpoints) is carried without its compiled CUDA and ROCm backends
  (36 MB and 31 MB compressed; its eager and Triton backends are Python). Versions pinned by ComfyUI's
  ``requirements.txt`` are taken as pinned.
* Not carried: the packages ComfyUI imports at module level but this path never calls (torchvision, torchaudio,
  scipy, transformers, tokenizers, PyAV): ``tools/comfy_stubs/`` stands in for them, put on ``PYTHONPATH`` by the
  unpack step only for the ones that machine lacks.
"""
from __future__ import annotations

import argparse
import fnmatch
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / ".gpu" / "comfyui"
WHEEL_CACHE = Path.home() / ".cache" / "wan_accel_carry" / "wheels"
ARCHIVE = "comfyui-carry.tar.xz"
MANIFEST = "manifest.json"
SOURCE_DIRS = ("comfy", "comfy_extras", "comfy_api", "comfy_execution")
SKIP_DIRS = {"__pycache__", "tests", "test", "tests-unit", "docs"}
# wheel (distribution name) -> top-level import names it provides
WHEELS = {
    "psutil": ("psutil",),
    "tqdm": ("tqdm",),
    "torchsde": ("torchsde",),
    "trampoline": ("trampoline",),
    "comfy-aimdo": ("comfy_aimdo",),
    "comfy-kitchen": ("comfy_kitchen",),
}
# files of a wheel left out (fnmatch on the member's path)
WHEEL_SKIP = ("*.dist-info/RECORD", "comfy_kitchen/backends/cuda/_C*", "comfy_kitchen/backends/hip/_C*",
              "comfy_aimdo/aimdo_rocm.so", "*/__pycache__/*")
TARGET_PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux2010_x86_64")
BUDGET_MIB = 12.0


def select_source(root) -> list:
    """ComfyUI's Python source under ``root``, as sorted relative POSIX paths: the ``.py`` files of SOURCE_DIRS
    (none under a test, docs or cache folder) and the top-level ``.py`` modules."""
    root = Path(root)
    out = [p.name for p in root.glob("*.py") if p.is_file()]
    for top in SOURCE_DIRS:
        base = root / top
        if not base.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            for name in filenames:
                if name.endswith(".py"):
                    out.append((Path(dirpath) / name).relative_to(root).as_posix())
    return sorted(out)


def requirement_pins(root) -> dict:
    """name -> version of the ``name==version`` lines of ComfyUI's requirements.txt (names normalised)."""
    pins = {}
    req = Path(root) / "requirements.txt"
    if req.is_file():
        for line in req.read_text().splitlines():
            m = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*==\s*([^\s;#]+)", line)
            if m:
                pins[_norm(m.group(1))] = m.group(2)
    return pins


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def keep_wheel_member(name: str) -> bool:
    return not any(fnmatch.fnmatch(name, pattern) for pattern in WHEEL_SKIP)


def find_wheel(folder: Path, dist: str, version: str | None) -> Path | None:
    stem = dist.replace("-", "_")
    hits = sorted(folder.glob(f"{stem}-{version or '*'}-*.whl"))
    return hits[-1] if hits else None


def download_wheels(folder: Path, pins: dict, offline: bool) -> dict:
    """dist -> wheel path, downloaded with pip (no dependencies; for CPython TARGET_PYTHON on x86-64 Linux) unless
    already in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    got = {}
    for dist in WHEELS:
        version = pins.get(_norm(dist))
        wheel = find_wheel(folder, dist, version)
        if wheel is None and not offline:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(folder),
                   "--python-version", TARGET_PYTHON, "--implementation", "cp"]
            for plat in PLATFORMS:
                cmd += ["--platform", plat]
            cmd.append(f"{dist}=={version}" if version else dist)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            wheel = find_wheel(folder, dist, version)
        if wheel is None:
            raise SystemExit(f"no wheel of {dist}{'==' + version if version else ''} in {folder}"
                             + (" (--offline)" if offline else ""))
        got[dist] = wheel
    return got


def _add(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, 0
    tar.addfile(info, io.BytesIO(data))


def build(comfy_root, out: Path = OUT, wheels: dict | None = None) -> dict:
    """Write ``out/ARCHIVE`` (``ComfyUI/<source>``, ``site/<wheel contents>``, ``MANIFEST``) and ``out/MANIFEST``;
    returns the manifest."""
    comfy_root = Path(comfy_root)
    files = select_source(comfy_root)
    if "comfy/sd.py" not in files:
        raise SystemExit(f"{comfy_root} is not a ComfyUI folder (no comfy/sd.py)")
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"comfyui": _comfy_version(comfy_root), "source_files": len(files),
                "source_bytes": sum((comfy_root / f).stat().st_size for f in files), "wheels": {},
                "stubs": sorted(p.name for p in (REPO / "tools" / "comfy_stubs").iterdir() if p.is_dir()
                                and (p / "__init__.py").is_file()),
                "target_python": TARGET_PYTHON, "built": time.strftime("%Y-%m-%dT%H:%M:%S")}
    tmp = out / (ARCHIVE + ".part")
    with tarfile.open(tmp, "w:xz", preset=9) as tar:
        for rel in files:
            _add(tar, f"ComfyUI/{rel}", (comfy_root / rel).read_bytes())
        for dist, wheel in (wheels or {}).items():
            kept = 0
            with zipfile.ZipFile(wheel) as z:
                for member in z.infolist():
                    if member.is_dir() or not keep_wheel_member(member.filename):
                        continue
                    mode = 0o755 if member.filename.endswith(".so") else 0o644
                    _add(tar, f"site/{member.filename}", z.read(member), mode)
                    kept += 1
            manifest["wheels"][dist] = {"file": wheel.name, "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
                                        "files": kept, "imports": list(WHEELS.get(dist, ()))}
        _add(tar, MANIFEST, json.dumps(manifest, indent=1).encode())
    tmp.replace(out / ARCHIVE)
    manifest["archive_mib"] = round((out / ARCHIVE).stat().st_size / 2 ** 20, 2)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def _comfy_version(root: Path) -> dict:
    out = {}
    m = re.search(r'__version__\s*=\s*"([^"]+)"', (root / "comfyui_version.py").read_text()) \
        if (root / "comfyui_version.py").is_file() else None
    out["version"] = m.group(1) if m else None
    try:
        out["commit"] = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                       text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        out["commit"] = None
    return out


def folder_problem(folder: Path, must_exist: bool = False) -> str | None:
    """Why ``folder`` cannot be used as a folder (a file, or a part of its path that is one; absent where it must
    exist), or None."""
    for p in [folder, *folder.parents]:
        if p.exists():
            if not p.is_dir():
                return f"{p} is a file, not a folder; choose a folder"
            return None
        if must_exist:
            return "not found; give ComfyUI's folder"
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--comfyui", default=os.environ.get("COMFYUI_DIR"),
                   help="ComfyUI's folder (default: $COMFYUI_DIR)")
    p.add_argument("--out", default=str(OUT), help=f"output folder (default: {OUT.relative_to(REPO)})")
    p.add_argument("--wheels", default=str(WHEEL_CACHE), help=f"folder of the cached wheels (default: {WHEEL_CACHE})")
    p.add_argument("--offline", action="store_true", help="use only the wheels already in the wheel folder")
    p.add_argument("--no-wheels", action="store_true", help="carry ComfyUI's source alone")
    a = p.parse_args(argv)
    if not a.comfyui:
        p.error("give ComfyUI's folder: --comfyui DIR or COMFYUI_DIR")
    out = Path(a.out)
    for option, folder in (("--out", out), ("--wheels", Path(a.wheels)), ("--comfyui", Path(a.comfyui))):
        problem = folder_problem(folder, must_exist=option == "--comfyui")
        if problem:
            print(f"error: {option} {folder}: {problem}", file=sys.stderr)
            return 2
    try:
        wheels = {} if a.no_wheels else download_wheels(Path(a.wheels), requirement_pins(a.comfyui), a.offline)
        m = build(a.comfyui, out, wheels)
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{out / ARCHIVE}: {m['archive_mib']} MiB (ComfyUI {m['comfyui']['version']}, {m['source_files']} source "
          f"files; wheels: {', '.join(w['file'].split('-')[0] + ' ' + w['file'].split('-')[1] for w in m['wheels'].values()) or 'none'})")
    if m["archive_mib"] > BUDGET_MIB:
        print(f"warning: over the {BUDGET_MIB} MiB this carry is given", file=sys.stderr)
    print("carry the folder .gpu (or .gpu/comfyui) to the GPU machine; there: eval \"$(python "
          "tools/unpack_comfyui.py)\"")
    return 0


if __name__ == "__main__":
    sys.exit(main())
