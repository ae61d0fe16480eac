"""Profiling: torch.profiler wrapper and reports, graph-break analysis, the metrics history and its plots.

Importing this package is cheap (torch loads when a function runs).
"""
