"""comfyui-wan-accel: fast, memory-safe Wan and causal Wan video diffusion for ComfyUI.

Importing this package is cheap: no torch, no CUDA, no optional imports. The library modules load when a node
runs or a command is called. Loaded by ComfyUI from ``custom_nodes/<any folder name>`` or installed as
``wan_accel``.
"""
__version__ = "0.1.0"

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: E402

WEB_DIRECTORY = "./web"

from .server_routes import register_routes as _register_routes  # noqa: E402,F401  (web panel routes; no-op outside ComfyUI)

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY", "__version__"]
