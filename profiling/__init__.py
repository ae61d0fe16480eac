"""Profiling: torch.profiler wrapper and reports, graph-break analysis, the metrics history and its plots.

Importing this package is cheap (torch loads when a function runs).
"""
from .explain import ExplainError, ExplainResult, ExplainTargetError, explain_in_subprocess, package_target
from .report import ProfileReport
from .runner import ProfileSession, default_out_dir, profile_run, profiler_busy
from .session import ProfileRequest, attach_profile_request, get_profile_request, maybe_profile

__all__ = ["profile_run", "ProfileSession", "ProfileReport", "default_out_dir", "profiler_busy",
           "ProfileRequest", "maybe_profile", "attach_profile_request", "get_profile_request",
           "explain_in_subprocess", "ExplainResult", "ExplainError", "ExplainTargetError",
           "package_target"]
