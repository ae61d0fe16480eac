"""``python -m wan_accel bench <what>``: benchmarks print a table and ratios measured side by side.

Bench modules (and with them torch and triton) are imported only when a benchmark is asked for, so the other
commands start fast.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util

# bench name -> module (relative to the package) providing add_arguments(parser) and run(args) -> int
BENCHES = {
    "sampler": ("..app.bench_sampler", "reference vs optimized causal sampler"),
    "compile": ("..app.bench_compile", "cold vs warm compile of the tiny model"),
    "kernels": ("..app.bench_kernels", "fused kernels vs torch, autotune cold vs warm"),
    "offload": ("..app.bench_memory", "block swap step time and peak VRAM"),
}


# a bench run with one of these options -> the module that runs it
ROUTES = {("sampler", "--world-size"): ("..app.bench_parallel", "one process vs N sequence-parallel ranks")}


def _route(what: str, bench_args: list) -> tuple:
    for (name, option), target in ROUTES.items():
        if name == what and any(a == option or a.startswith(option + "=") for a in bench_args):
            return target
    return BENCHES[what]


def _run(args) -> int:
    module, help_text = _route(args.what, args.bench_args)
    mod = importlib.import_module(importlib.util.resolve_name(module, __package__))
    parser = argparse.ArgumentParser(prog=f"python -m wan_accel bench {args.what}", description=help_text)
    mod.add_arguments(parser)
    return int(mod.run(parser.parse_args(args.bench_args)) or 0)


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (tables and ratios)",
                       description="Benchmarks: " + "; ".join(f"{k}: {v}" for k, (_, v) in BENCHES.items())
                       + ". Options of one benchmark: python -m wan_accel bench WHAT --help")
    p.add_argument("what", choices=sorted(BENCHES), help="which benchmark")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="options of that benchmark (see WHAT --help)")
    p.set_defaults(func=_run)
