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
    "sampler": ("..bench.sampler", "reference vs optimized causal sampler"),
    "compile": ("..bench.compile", "cold vs warm compile of the tiny model"),
    "kernels": ("..bench.kernels", "fused kernels vs torch, autotune cold vs warm"),
    "attention": ("..bench.attention", "every attention implementation at a run's own calls, TFLOP/s"),
    "offload": ("..bench.memory", "block swap step time and peak VRAM"),
    "play": ("..bench.play", "Matrix-Game-2 play chunks: caches in place vs copied"),
    "fidelity": ("..bench.fidelity", "int8 attention / fp8 linear vs exact on the recorded fixtures"),
    "native": ("..bench.native", "ComfyUI's MODEL: core's SamplerARVideo vs the Wan Accel AR Sampler vs the pack's "
               "own path (needs ComfyUI)"),
}
# bench name -> modules imported first: they register what app/ may not import itself (ComfyUI, the nodes)
SIDES = {"native": ("..nodes.comfy.native_bench",)}


# bench options that must be positive numbers: (attribute, exclusive low, high)
POSITIVE_NUMBERS = (("peak_tflops", 0.0, 1e6), ("timeout", 0.0, 86400.0), ("memory_cap_gb", 0.0, 1e6))


def check_bench_args(what: str, ns) -> None:
    """The values every bench shares, checked before anything runs (0 or a negative count is an error)."""
    from ..app.validate import (check_device, check_float, check_geometry, check_input_file, check_int,
                                check_output_dir, check_pixels)

    for name, convert in (("checkpoint", "convert"), ("vae", None)):   # weights files: readable safetensors, first
        if getattr(ns, name, None) is not None:        # '' too: an empty path is refused, never taken as "none"
            check_input_file("--" + name, getattr(ns, name), convert=convert)
    if getattr(ns, "workdir", None) is not None:     # the folder bench native writes: checked before anything runs
        check_output_dir("--workdir", ns.workdir)
    if getattr(ns, "device", None) is not None:          # one check of --device for every bench
        ns.device = check_device("--device", ns.device)
    for name, lo, hi in POSITIVE_NUMBERS:        # rates and times: a figure made from 0 or a negative one is wrong
        value = getattr(ns, name, None)
        if value is not None:
            check_float("--" + name.replace("_", "-"), value, lo, hi, lo_open=True)
    for name in ("repeat", "repeats", "blocks", "dim", "kv_frames", "frames_per_block", "chunks"):
        value = getattr(ns, name, None)
        if value is not None:
            check_int("--" + name.replace("_", "-"), value, 1, 100000)
    if getattr(ns, "warmup", None) is not None:
        check_int("--warmup", ns.warmup, 0, 1000)
    for name in ("height", "width"):
        if getattr(ns, name, None) is not None:
            check_pixels("--" + name, getattr(ns, name))
    if what == "sampler" and ns.frames is not None:
        check_geometry(ns.frames, 16, 16, 3, names={"frames": "--frames"})
    elif getattr(ns, "frames", None) is not None:
        check_int("--frames", ns.frames, 1, 4096)
    if what == "sampler" and hasattr(ns, "world_size"):
        from ..bench.parallel import check_world_args    # world size and torchrun's variables, before any rank
        check_world_args(ns)


# a bench run with one of these options -> the module that runs it
ROUTES = {("sampler", "--world-size"): ("..bench.parallel", "one process vs N sequence-parallel ranks")}


def _route(what: str, bench_args: list) -> tuple:
    for (name, option), target in ROUTES.items():
        if name == what and any(a == option or a.startswith(option + "=") for a in bench_args):
            return target
    return BENCHES[what]


def _options(module: str):
    """The function that adds the options of the bench ``module``: from bench/options.py where the module
    imports torch (its --help and usage errors answer before torch loads), else the module's own add_arguments."""
    from ..bench.options import ARGUMENTS

    return (ARGUMENTS.get(module.rpartition(".")[2])
            or importlib.import_module(importlib.util.resolve_name(module, __package__)).add_arguments)


def _run(args) -> int:
    module, help_text = _route(args.what, args.bench_args)
    parser = argparse.ArgumentParser(prog=f"python -m wan_accel bench {args.what}", description=help_text)
    _options(module)(parser)
    from ..app.validate import friendly_numbers
    friendly_numbers(parser)
    ns = parser.parse_args(args.bench_args)
    check_bench_args(args.what, ns)
    for side in SIDES.get(args.what, ()):
        importlib.import_module(importlib.util.resolve_name(side, __package__))
    mod = importlib.import_module(importlib.util.resolve_name(module, __package__))
    return int(mod.run(ns) or 0)


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (tables and ratios)",
                       description="Benchmarks: " + "; ".join(f"{k}: {v}" for k, (_, v) in BENCHES.items())
                       + ". Options of one benchmark: python -m wan_accel bench WHAT --help")
    p.add_argument("what", choices=sorted(BENCHES), help="which benchmark")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="options of that benchmark (see WHAT --help)")
    p.set_defaults(func=_run)
