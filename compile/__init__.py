"""Compile policy: settings and presets -> torch.compile options, per-block compile, warm start.

Importing this package does not import torch; the functions do when called.
"""
from .presets import graph_safe_settings, preset_options, render_presets_table, resolve_inductor_options
from .settings import CompileSettings, coerce_settings


def compile_model(model, settings=None, cache=None):
    """See compile.apply.compile_model."""
    from .apply import compile_model as _impl

    return _impl(model, settings, cache)


def end_warmup(model) -> bool:
    """See compile.apply.end_warmup."""
    from .apply import end_warmup as _impl

    return _impl(model)


def uncompile_model(model) -> bool:
    """See compile.apply.uncompile_model."""
    from .apply import uncompile_model as _impl

    return _impl(model)


__all__ = ["CompileSettings", "coerce_settings", "graph_safe_settings", "preset_options", "render_presets_table",
           "resolve_inductor_options", "compile_model", "end_warmup", "uncompile_model"]
