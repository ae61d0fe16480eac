"""``python -m wan_accel bench <what>``: benchmarks print a table and ratios measured side by side."""
from __future__ import annotations

import importlib
import importlib.util

# bench name -> module (relative to the package) providing add_arguments(parser) and run(args) -> int
BENCHES = {
    "sampler": ("..wan.bench", "reference vs optimized causal sampler"),
    "compile": ("..compile.bench", "cold vs warm compile of the tiny model"),
    "kernels": ("..kernels.bench", "fused kernels vs torch, autotune cold vs warm"),
    "offload": ("..memory.bench", "block swap step time and peak VRAM"),
}


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (tables and ratios)")
    bsub = p.add_subparsers(dest="bench_command", metavar="WHAT", required=True)
    for name, (module, help_text) in BENCHES.items():
        full = importlib.util.resolve_name(module, __package__)
        try:
            mod = importlib.import_module(full)
        except ModuleNotFoundError as exc:
            if exc.name and (full == exc.name or full.startswith(exc.name + ".")):
                continue  # that area is not part of this build
            raise
        b = bsub.add_parser(name, help=help_text)
        mod.add_arguments(b)
        b.set_defaults(func=mod.run)
