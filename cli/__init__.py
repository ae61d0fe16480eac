"""Command line: ``python -m wan_accel <command>``. Each area registers its own subcommands."""
from __future__ import annotations

import argparse
import importlib

# Modules under cli/ that define register(subparsers), imported when the parser is built (every one must exist:
# tests/test_import_strings.py imports them, tests/test_cli_smoke.py runs every command they register).
COMMAND_MODULES = ("model", "cache", "nodes", "memory", "profiling", "bench", "doctor", "selftest")


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="python -m wan_accel",
        description="Fast, memory-safe Wan and causal Wan video diffusion: jobs, benchmarks and the limit cache.")
    parser.add_argument("--version", action="version", version=f"comfyui-wan-accel {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f".{name}", __name__).register(sub)
    from ..app.validate import friendly_numbers
    friendly_numbers(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    from .errors import announce_cache_problem, clean_warnings, run_guarded

    with clean_warnings():
        announce_cache_problem(args.command)
        return run_guarded(func, args)
