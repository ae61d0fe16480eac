"""Profiling: torch.profiler wrapper and reports, graph-break analysis, the metrics history and its plots.

Importing this package is cheap (torch loads when a function runs).
"""
from .explain import ExplainError, ExplainTargetError, explain_in_subprocess, package_target
from .runner import default_out_dir, profile_run, profiler_busy
from .session import ProfileRequest

__all__ = ["profile_run", "default_out_dir", "profiler_busy", "ProfileRequest", "explain_in_subprocess",
           "ExplainError", "ExplainTargetError", "package_target"]
