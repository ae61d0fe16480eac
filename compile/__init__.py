"""Compile policy: settings and presets -> torch.compile options, per-block compile, warm start.

Importing this package does not import torch; the functions do when called.
"""
from .presets import graph_safe_settings, preset_options, render_presets_table, resolve_inductor_options
from .settings import CompileSettings, coerce_settings


def __getattr__(name: str):
    """``compile_model``, ``end_warmup``, ``uncompile_model``: ``compile.apply``'s, imported when first used."""
    if name in ("compile_model", "end_warmup", "uncompile_model"):
        from . import apply
        return getattr(apply, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CompileSettings", "coerce_settings", "graph_safe_settings", "preset_options", "render_presets_table",
           "resolve_inductor_options", "compile_model", "end_warmup", "uncompile_model"]
