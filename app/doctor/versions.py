"""What the pack runs in: the versions of ComfyUI's core, its frontend, comfy-kitchen, comfy-aimdo, torch and Triton,
read in this one place (the doctor's table and report, the selftest), and the combinations known to break, each
with its fix.

Nothing here imports ComfyUI: core's version is read from its ``comfyui_version.py`` (found on the path, or as
the folder that holds ``custom_nodes/<this pack>``), the others from the installed distributions' metadata.
"""
from __future__ import annotations

import importlib.util
import platform
import re
import sys
from pathlib import Path

from ...cache.fingerprint import package_version as _dist

LIBRARIES = ("torch", "triton", "flash-attn", "flash_attn_3", "comfy-kitchen", "safetensors", "numpy")
STACK = ("comfyui", "comfyui-frontend-package", "comfy-kitchen", "comfy-aimdo", "torch", "triton")
NOT_FOUND = "none"

AIMDO_FIX = ("install the comfy-aimdo that ComfyUI's requirements.txt names (0.5.3 or newer for cores with the Comfy "
             "Compiler): `python -m pip install -r requirements.txt` in ComfyUI's folder")
KITCHEN_FIX = ("install the comfy-kitchen that ComfyUI's requirements.txt names (0.2.34 or newer for ComfyUI 0.36 "
               "and later): `python -m pip install -r requirements.txt` in ComfyUI's folder")


def _version_file() -> Path | None:
    try:
        spec = importlib.util.find_spec("comfyui_version")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        return Path(spec.origin)
    pack = Path(__file__).resolve().parents[2]          # <ComfyUI>/custom_nodes/<this pack>
    guess = pack.parent.parent / "comfyui_version.py"
    return guess if pack.parent.name == "custom_nodes" and guess.is_file() else None


def comfyui_version() -> str:
    """ComfyUI core's version, or 'none' where no ComfyUI is found."""
    loaded = getattr(sys.modules.get("comfyui_version"), "__version__", None)     # ComfyUI running: it read it
    if loaded:
        return str(loaded)
    path = _version_file()
    try:
        found = re.search(r"""__version__\s*=\s*['"]([^'"]+)['"]""", path.read_text()) if path else None
    except OSError:
        found = None
    return found.group(1) if found else NOT_FOUND


def stack() -> dict:
    """{component: version} of what the pack runs in (STACK; 'none' where absent)."""
    return {"comfyui": comfyui_version(), **{name: _dist(name) for name in STACK[1:]}}


def versions() -> dict:
    """The doctor's versions: Python, the system, the libraries, the ComfyUI stack and the pack itself."""
    out = {"python": platform.python_version(), "system": f"{platform.system()} {platform.release()}",
           "machine": platform.machine()}
    out.update({name: _dist(name) for name in LIBRARIES})
    out.update(stack())
    pack = _dist("comfyui-wan-accel")
    out["comfyui-wan-accel"] = "unknown" if pack == NOT_FOUND else pack
    return out


def _within(text, floor: tuple = (), ceiling: tuple | None = None) -> bool:
    """Whether the version ``text`` reads as (major, minor, patch) ('none' does not), at least ``floor`` and below
    ``ceiling`` when given."""
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    v = tuple(int(p or 0) for p in found.groups()) if found else None
    return v is not None and v >= floor and (ceiling is None or v < ceiling)


# (what breaks, its fix, the test on the stack). Facts from ComfyUI's releases and requirements (docs/comfyui.md).
KNOWN_BREAKS = (
    (("ComfyUI {comfyui} imports comfy_aimdo.malloc_graph and comfy_aimdo.storage (the Comfy Compiler, core 0.34 "
      "and later); comfy-aimdo {comfy-aimdo} lacks them and ComfyUI does not start"), AIMDO_FIX,
     lambda s: _within(s["comfyui"], (0, 34)) and _within(s["comfy-aimdo"], ceiling=(0, 5))),
    (("ComfyUI {comfyui} passes input_act_weight to comfy-kitchen's linear ops; comfy-kitchen {comfy-kitchen} does "
      "not take it and sampling fails at run time (core only logs that the kitchen is older than recommended)"),
     KITCHEN_FIX, lambda s: _within(s["comfyui"], (0, 36)) and _within(s["comfy-kitchen"], ceiling=(0, 2, 34))),
    (("ComfyUI {comfyui} has no causal Wan model (WAN21_CausalAR) nor core's AR video nodes: the Wan Accel AR "
      "Sampler (native MODEL) and the tiny native model need core 0.33.0 or newer"),
     "update ComfyUI (0.33.0 or newer)", lambda s: _within(s["comfyui"], ceiling=(0, 33))),
    (("frontend {comfyui-frontend-package} has Nodes 2.0 (setting Comfy.VueNodes.Enabled, on by default for new "
      "Desktop and Cloud installs): node bodies are Vue components, canvas drawing (onDrawForeground, "
      "node.onMouseDown) does not run there"),
     ("if a node pack's canvas parts are missing, switch Nodes 2.0 off in the settings (Comfy.VueNodes.Enabled) "
      "or update the pack"),
     lambda s: _within(s["comfyui-frontend-package"], (1, 58))),
)


def known_breaks(found: dict | None = None) -> list[dict]:
    """The known-bad combinations in ``found`` (default: this installation): [{'problem', 'fix'}]."""
    found = stack() if found is None else found
    return [{"problem": problem.format(**found), "fix": fix} for problem, fix, test in KNOWN_BREAKS if test(found)]


def stack_text(found: dict | None = None) -> str:
    """One line of the stack's versions, then a line per known break ('! problem -> fix')."""
    found = stack() if found is None else found
    lines = ["runs in: " + ", ".join(f"{k} {v}" for k, v in found.items())]
    lines += [f"! {b['problem']} -> {b['fix']}" for b in known_breaks(found)]
    return "\n".join(lines)


def dependency_fix(error_text: str) -> str | None:
    """The fix for an import or call of ComfyUI that failed on a dependency older than the core needs, or None."""
    if "comfy_aimdo" in error_text:
        return f"This ComfyUI needs a newer comfy-aimdo: {AIMDO_FIX}."
    if "input_act_weight" in error_text or "comfy_kitchen" in error_text:
        return f"This ComfyUI needs a newer comfy-kitchen: {KITCHEN_FIX}."
    return None
