"""comfyui-wan-accel: fast, memory-safe Wan and causal Wan video diffusion for ComfyUI.

Importing this package is cheap: no torch, no CUDA, no optional imports. The library modules load when a node
runs or a command is called. Loaded by ComfyUI from ``custom_nodes/<any folder name>`` or installed as
``wan_accel``.
"""
__version__ = "0.1.0"

WEB_DIRECTORY = "./web"

# Run as a lone file outside any package (pytest's importlib mode does so with a checkout whose folder name is no
# Python name, e.g. a clone in "comfyui-wan-accel"): nothing to register, and no relative import to fail.
if __package__:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: E402
    from .server_routes import register_routes as _register_routes  # noqa: E402,F401  (web panel routes; no-op outside ComfyUI)

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY", "__version__"]
