"""What a doctor's verdict is about, and what a readable verdict looks like.

A verdict holds for the code it judged: the pack's version (``pack_version``) and a digest of the code the probe
exercised (``code_digest``: the probe's own functions, the modules it runs and, for a Triton kernel, the source hash
the operator store already keys kernels by, ``kernels._common.kernel_name``; ``kernels._common.code_digest``). A verdict recorded for another version
or other code is probed again, so an update that changes a kernel re-checks it (and turns a fixed one back on).

The digest is taken from the code loaded in this process (bytecode, names, constants), not from the files on disk,
so a file edited while a long-running process still runs the old code never lends the old code's verdict to the
new code, nor the other way round.

``verdict_problem`` is the one check of a stored verdict's shape (the doctor's reads and the limit cache's
``register_shape`` both use it): a hand-edited or damaged verdict is ignored and probed again.
"""
from __future__ import annotations

import math
import re
from functools import lru_cache
from pathlib import Path

from ...cache import register_shape
from ...cache.fingerprint import package_version

NAMESPACE = "doctor"
DIST_NAME = "comfyui-wan-accel"
STATUSES = ("passed", "failed", "slower")
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]          # the folder holding the pack (and its pyproject.toml)


# ----------------------------------------------------------------------------------------------- pack version
def _pyproject_version(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return None
    try:
        import tomllib
        version = tomllib.loads(text).get("project", {}).get("version")
    except Exception:  # noqa: BLE001 - no tomllib (Python < 3.11) or a damaged file: read the one line
        match = re.search(r'(?ms)^\[project\].*?^version\s*=\s*"([^"]+)"', text)
        version = match.group(1) if match else None
    return str(version) if version else None


@lru_cache(maxsize=1)
def pack_version() -> str:
    """The pack's version, read once: the pyproject.toml beside the package (the code that runs), else the
    installed distribution's metadata, else 'unknown'."""
    version = _pyproject_version(_PACKAGE_ROOT / "pyproject.toml") or package_version(DIST_NAME)
    return "unknown" if version == "none" else version


# ----------------------------------------------------------------------------------------------- shape
_NUMBERS = ("difference", "tolerance", "feature_ms", "fallback_ms", "checked")
_TEXTS = ("error", "note", "library", "dtype", "pack", "source", "shape")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def verdict_problem(value) -> str | None:
    """None when ``value`` has a verdict's shape; else what is wrong with it (one line)."""
    if not isinstance(value, dict):
        return f"a verdict must be an object, got {type(value).__name__}"
    if value.get("status") not in STATUSES:
        return f"'status' is {value.get('status')!r}, expected one of {STATUSES}"
    probe = value.get("probe")
    if not isinstance(probe, int) or isinstance(probe, bool):
        return f"'probe' is {probe!r}, expected an integer"
    for field in _NUMBERS:
        if value.get(field) is not None and not _number(value[field]):
            return f"'{field}' is {value[field]!r}, expected a finite number or null"
    for field in _TEXTS:
        if value.get(field) is not None and not isinstance(value[field], str):
            return f"'{field}' is {value[field]!r}, expected text or null"
    if not isinstance(value.get("speed_judged", False), bool):
        return f"'speed_judged' is {value['speed_judged']!r}, expected true or false"
    if value["status"] != "passed" and not (value.get("error") or "").strip():
        return f"a '{value['status']}' verdict without its 'error'"
    return None


register_shape(NAMESPACE, verdict_problem)      # the limit cache sets aside a damaged verdict by the same check
