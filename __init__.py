"""comfyui-wan-accel: fast, memory-safe Wan and causal Wan video diffusion for ComfyUI.

Importing this package is cheap: no torch, no CUDA, no optional imports. The library modules load when a node
runs or a command is called. Loaded by ComfyUI from ``custom_nodes/<any folder name>`` or installed as
``wan_accel``.
"""
__version__ = "0.1.0"

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: E402

WEB_DIRECTORY = "./web"

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY", "__version__"]
