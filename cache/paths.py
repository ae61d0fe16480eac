"""Where the limit cache lives."""
from __future__ import annotations

import os
import sys
from pathlib import Path

ENV_VAR = "WAN_ACCEL_CACHE"
FILE_NAME = "limits.json"
APP_NAME = "wan_accel"


def _comfy_user_directory() -> Path | None:
    # Only when running inside ComfyUI: its ``folder_paths`` module is already imported then.
    fp = sys.modules.get("folder_paths")
    getter = getattr(fp, "get_user_directory", None) if fp is not None else None
    if getter is None:
        return None
    try:
        return Path(getter())
    except Exception:  # noqa: BLE001 - fall back to the platform folder
        return None


def default_cache_path() -> Path:
    """``$WAN_ACCEL_CACHE`` (a file, or a folder that gets ``limits.json``) wins; inside ComfyUI the
    ``wan_accel`` folder of its user directory; else the platform user-cache directory."""
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        p = Path(env).expanduser()
        if p.is_dir() or env.endswith(("/", os.sep)):
            return p / FILE_NAME
        return p
    comfy = _comfy_user_directory()
    if comfy is not None:
        return comfy / APP_NAME / FILE_NAME
    try:
        from platformdirs import user_cache_dir

        return Path(user_cache_dir(APP_NAME, appauthor=False)) / FILE_NAME
    except ImportError:  # platformdirs is a dependency; keep a sane fallback anyway
        return Path.home() / ".cache" / APP_NAME / FILE_NAME
