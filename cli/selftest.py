"""``python -m wan_accel selftest [--json] [--out DIR] [--require-gpu] [--quick] [--only STAGE] [--goals]``."""
from __future__ import annotations

import argparse
import sys

from ..cache.json_out import to_json


def _run(args) -> int:
    from ..checks import selftest
    from ..app.validate import UsageError, check_device, check_output_dir
    if args.stage == "fp8":           # one in-process stage, run by the self-test in its own process
        device = check_device("--device", args.device or "cpu")
        print(to_json(selftest.fp8_stage(device, check_output_dir("--out", args.out)), indent=None))
        return 0
    names = [s.name for s in selftest.STAGES]
    unknown = [n for n in (args.only or []) if n not in names]
    if unknown:
        raise UsageError(f"--only {', '.join(unknown)}: no such stage; the stages are: {', '.join(names)}")
    from ..app.progress import Progress
    progress = Progress("selftest")       # stderr: stdout keeps the table (or the JSON) alone
    # --out, its files and --require-gpu are checked inside, before the first stage; selftest.json and selftest.md
    # are written after every finished stage
    try:            # --out as typed: '' is refused there, never read as the current folder
        result = selftest.run_selftest(args.out, require_gpu=args.require_gpu, quick=args.quick,
                                       stages=args.only, log=progress, only_goals=args.goals)
    except selftest.Stopped as stop:
        import signal
        print(f"stopped ({signal.Signals(stop.signum).name}): the running stage and its processes were ended; "
              f"{args.out}/selftest.json holds the finished stages, marked unfinished", file=sys.stderr)
        return 128 + stop.signum
    if args.json:
        print(to_json(result))
    else:
        print(selftest.markdown(result))
        print(f"written: {result['files']['json']}, {result['files']['markdown']}")
    return 0 if result["passed"] else 1


def register(sub) -> None:
    p = sub.add_parser("selftest", help="run every fast path on this machine: one JSON and one markdown table",
                       description="The doctor (cold), check-reference for every fixture kind, generate, an fp8 "
                                   "checkpoint, and on a CUDA GPU bench sampler at the 1.3B shape (reference, "
                                   "optimized, without graphs, compiled, int8, fp8 linear), bench attention, the sampler with "
                                   "each decoder, bench kernels, block swap and the tests marked cuda, and the speed "
                                   "goals read from those benches; where ComfyUI imports, ComfyUI's own loader "
                                   "and bench native (core's SamplerARVideo, the Wan Accel AR Sampler and the "
                                   "pack's own path on one MODEL; the tiny shape on a CPU). Each stage runs "
                                   "in its own process with its own time limit. Exit 1 on a crash, a parity over "
                                   "its tolerance or a path kept on although measured slower; a stage that needs a "
                                   "GPU is listed as such on a machine without one.")
    p.add_argument("--out", default="selftest_out", help="folder for selftest.json and selftest.md, written again "
                   "after every finished stage, and each stage's output under stages/ (default: selftest_out)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--require-gpu", action="store_true", help="a machine without a CUDA GPU is an error (refused "
                   "before any stage runs)")
    p.add_argument("--quick", action="store_true", help="smaller shapes on the GPU stages (a smoke run)")
    p.add_argument("--only", action="append", metavar="STAGE", help="run only this stage (repeatable)")
    p.add_argument("--goals", action="store_true", help="run only the stages the speed goals are read from (bench "
                   "sampler, bench attention, bench decode wan / tiny, bench native; with --only: those too)")
    p.add_argument("--stage", choices=["fp8"], help=argparse.SUPPRESS)
    p.add_argument("--device", help=argparse.SUPPRESS)
    p.set_defaults(func=_run)
