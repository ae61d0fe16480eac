"""ComfyUI adapters. Each area has one module exporting NODE_CLASS_MAPPINGS / NODE_DISPLAY_NAME_MAPPINGS.

A module that fails to import is reported and skipped, so one broken area never takes the whole pack down.
"""
from __future__ import annotations

import importlib
import logging

log = logging.getLogger("wan_accel")

AREA_MODULES = ("cache_nodes", "model_nodes", "preview_nodes", "compile_nodes", "memory_nodes", "profile_nodes", "mg2_nodes",
                "doctor_nodes", "parallel_nodes", "native_nodes", "stream_nodes", "play_nodes", "prompt_nodes")

NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}
IMPORT_ERRORS: dict[str, str] = {}

for _name in AREA_MODULES:
    try:
        _mod = importlib.import_module(f".{_name}", __name__)
    except Exception as _exc:  # noqa: BLE001 - one broken area must not break the pack
        if isinstance(_exc, ModuleNotFoundError) and _exc.name == f"{__name__}.{_name}":
            continue  # area not present in this build
        IMPORT_ERRORS[_name] = repr(_exc)
        log.warning("wan_accel: node module %s failed to import: %r", _name, _exc)
        continue
    NODE_CLASS_MAPPINGS.update(getattr(_mod, "NODE_CLASS_MAPPINGS", {}))
    NODE_DISPLAY_NAME_MAPPINGS.update(getattr(_mod, "NODE_DISPLAY_NAME_MAPPINGS", {}))
