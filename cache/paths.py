"""Where the limit cache lives."""
from __future__ import annotations

import os
import sys
from pathlib import Path

ENV_VAR = "WAN_ACCEL_CACHE"
FILE_NAME = "limits.json"
APP_NAME = "wan_accel"


def comfy_folder(getter: str) -> Path | None:
    """The folder ComfyUI's ``folder_paths.<getter>()`` names (``get_user_directory``, ``get_output_directory``),
    only when running inside ComfyUI: its ``folder_paths`` module is already imported then (never imported
    here). None outside ComfyUI or when the getter fails: the caller falls back to its own folder."""
    fp = sys.modules.get("folder_paths")
    get = getattr(fp, getter, None) if fp is not None else None
    if get is None:
        return None
    try:
        return Path(get())
    except Exception:  # noqa: BLE001 - the caller's own folder instead
        return None


def cache_path_from_env(value: str) -> Path:
    """The cache file that a ``WAN_ACCEL_CACHE`` value names.

    The value names the cache folder: ``limits.json`` and every side file (``limits.json.lock``,
    ``history.jsonl``, ``inductor/``, ``compile_artifacts/``) live inside it, and it is created on the first
    write. A value ending in ``.json`` names the cache file itself instead; its side files go beside it. The rule
    depends on the name only, never on what exists on disk, so a folder that does not exist yet is a folder."""
    p = Path(value).expanduser()
    if p.suffix.lower() == ".json" and not value.endswith(("/", os.sep)):
        return p
    return p / FILE_NAME


def default_cache_path() -> Path:
    """``$WAN_ACCEL_CACHE`` (the cache folder, or a ``.json`` file: see :func:`cache_path_from_env`) wins;
    inside ComfyUI the ``wan_accel`` folder of its user directory; else the platform user-cache directory."""
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return cache_path_from_env(env)
    comfy = comfy_folder("get_user_directory")
    if comfy is not None:
        return comfy / APP_NAME / FILE_NAME
    try:
        from platformdirs import user_cache_dir

        return Path(user_cache_dir(APP_NAME, appauthor=False)) / FILE_NAME
    except ImportError:  # platformdirs is a dependency; keep a sane fallback anyway
        return Path.home() / ".cache" / APP_NAME / FILE_NAME
