"""``python -m wan_accel profile`` (profile one sampler run) and ``python -m wan_accel report`` (metrics history)."""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from ..app.progress import format_table
from ..cache.json_out import print_json
from ..profiling.history import KINDS as HISTORY_KINDS
from ..app.jobs import profile_targets as targets
from ..app.validate import (TORCH_NAMES, UsageError, check_device, check_geometry, check_input_file,
                       check_int, check_output_dir, check_schedule_args, dtype_arg)

# Defaults in the units every command uses (video frames, pixels): the tiny model's 6x8x8 latent and 81 frames
# at 480x832 for a checkpoint.
TINY_DEFAULTS = {"frames": 21, "height": 64, "width": 64}
CHECKPOINT_DEFAULTS = {"frames": 81, "height": 480, "width": 832}
PROFILE_NAMES = {"frames": "--frames", "height": "--height", "width": "--width"}


def register(sub) -> None:
    p = sub.add_parser("profile", help="profile one sampler run (trace, compile stats, graph breaks, GPU idle)",
                       description="Runs the causal sampler under torch.profiler on the built-in tiny model or a "
                                   "checkpoint; writes a Perfetto/Chrome trace and prints a report.")
    p.add_argument("--checkpoint", help="Wan/causal Wan .safetensors checkpoint (default: the built-in tiny model)")
    p.add_argument("--shape", choices=targets.SHAPES, default="tiny",
                   help="without --checkpoint: the built-in tiny model (default) or random weights of Wan 2.1 "
                        "1.3B's architecture (81 frames at 480x832 by default)")
    p.add_argument("--sampler", choices=targets.SAMPLER_PATHS, default="auto",
                   help="sampler path: auto (optimized on CUDA, reference elsewhere; default), optimized, reference")
    p.add_argument("--compile", default="none", metavar="MODE",
                   help="regional compile before profiling: none, default, reduce-overhead, max-autotune, "
                        "max-autotune-no-cudagraphs, eager, aot_eager (default: none)")
    p.add_argument("--out", default="wan_accel_profiles", help="folder for the trace (default: ./wan_accel_profiles)")
    p.add_argument("--runs", type=int, default=1, help="profiled runs (default 1)")
    p.add_argument("--warmup", type=int, default=1, help="unprofiled runs first, compile happens there (default 1)")
    p.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda when available)")
    p.add_argument("--dtype", type=dtype_arg("--dtype"), metavar="{bf16,fp16,fp32}",
                   help="default: fp32 on CPU, bf16 on GPU (bfloat16/float16/float32 are accepted too)")
    p.add_argument("--frames", type=int, help="video frames, 4k+1 in whole 3-frame latent blocks "
                                              "(default 21 tiny, 81 checkpoint)")
    p.add_argument("--height", type=int, help="pixels, multiple of 16 (default 64 tiny, 480 checkpoint)")
    p.add_argument("--width", type=int, help="pixels, multiple of 16 (default 64 tiny, 832 checkpoint)")
    p.add_argument("--steps", help="sampler step list, e.g. 1000,750,500,250 (default: the preset's)")
    p.add_argument("--preset", help="sampler schedule preset: self_forcing, causvid, custom (default self_forcing)")
    p.add_argument("--seed", type=int, default=0, help="seed of the tiny model's weights and of the inputs "
                   "(default 0)")
    p.add_argument("--explain", action="store_true",
                   help="also list graph breaks with reasons (torch._dynamo.explain, in a separate process)")
    p.add_argument("--explain-only", action="store_true", help="only the explain step, no profiled run")
    p.add_argument("--explain-scope", choices=("block", "model"), default=None,
                   help="with --explain or --explain-only: explain one transformer block call (what regional "
                        "compile compiles; default) or one chunk call")
    p.add_argument("--explain-target", metavar="MODULE:FACTORY",
                   help="explain your own target instead (a factory returning (fn, args[, kwargs]))")
    p.add_argument("--no-history", action="store_true", help="do not append this run to the metrics history")
    p.add_argument("--json", action="store_true", help="print JSON instead of the text report")
    p.set_defaults(func=run_profile)

    r = sub.add_parser("report", help="the metrics history of generate/bench/profile runs (table, plot)",
                       description="Prints the metrics history (history.jsonl beside the limit cache) as a table "
                                   "and optionally plots speed and peak memory over runs.")
    r.add_argument("--json", action="store_true", help="print the records as JSON")
    r.add_argument("--plot", metavar="OUT.png", help="write a PNG plot of speed and peak memory (needs matplotlib)")
    r.add_argument("--kind", choices=HISTORY_KINDS, help="only records of this kind")
    r.add_argument("--last", type=int, help="only the last N records")
    r.add_argument("--history", metavar="FILE", help="history file (default: history.jsonl beside the limit cache)")
    r.add_argument("--plain", action="store_true", help="plain text table even on a terminal with rich installed")
    r.set_defaults(func=run_report)


# ---------------------------------------------------------------------- profile
@contextmanager
def _without_profiler_chatter():
    """The profiler library prints 'USDT:' marker lines straight to the process's stderr; drop those lines and
    pass every other line through as it comes."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
        read_fd, write_fd = os.pipe()
    except (OSError, ValueError, AttributeError):
        yield
        return

    def pump():
        with os.fdopen(read_fd, "rb") as src:
            for line in src:
                if not line.startswith(b"USDT:"):
                    os.write(saved, line)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    try:
        yield
    finally:
        try:
            sys.stderr.flush()
        except Exception:  # noqa: BLE001
            pass
        os.dup2(saved, 2)   # closes the pipe's last write end: the pump sees the end and stops
        thread.join(timeout=5)
        os.close(saved)


def _with_progress(fn, warmup: int, runs: int, compile_mode: str):
    """``fn`` announcing each warm-up and profiled run on stderr (the first warm-up compiles: it can be long)."""
    state = {"n": 0}
    total = warmup + runs

    def run():
        i = state["n"]
        state["n"] += 1
        phase = f"warm-up {i + 1}/{warmup}" if i < warmup else f"profiled run {i - warmup + 1}/{runs}"
        if i == 0 and compile_mode != "none":
            phase += f" (compiling the blocks with '{compile_mode}'; the first run can take a minute)"
        print(f"profile: {phase} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        out = fn()
        if i == 0 or i == total - 1:
            print(f"profile: {phase.split(' (')[0]} done in {time.perf_counter() - t0:.1f} s", file=sys.stderr,
                  flush=True)
        return out

    return run


def profile_geometry(args) -> dict:
    """--frames/--height/--width (video frames, pixels, as every command) checked and turned into the latent
    sizes the profiled sampler takes."""
    d = CHECKPOINT_DEFAULTS if args.checkpoint or getattr(args, "shape", "tiny") != "tiny" else TINY_DEFAULTS
    return check_geometry(d["frames"] if args.frames is None else args.frames,
                          d["height"] if args.height is None else args.height,
                          d["width"] if args.width is None else args.width, 3, names=PROFILE_NAMES)


def check_profile_combinations(args) -> None:
    """An option another one makes ignored is refused before any work (exit 2, one line saying what to change)."""
    explains = args.explain or args.explain_only
    if args.explain_scope is not None and (args.explain_target or not explains):
        raise UsageError(f"--explain-scope {args.explain_scope} chooses what the pack's own explain step looks at"
                         + (", and --explain-target explains your target instead: leave out --explain-scope"
                            if args.explain_target else ": add --explain (or --explain-only), or leave it out"))
    if args.explain_only:               # no profiled run: its options would be ignored
        dropped = [o for o, given in (("--compile", args.compile != "none"), ("--runs", args.runs != 1),
                                      ("--warmup", args.warmup != 1), ("--no-history", args.no_history))
                   if given]
        if dropped:
            raise UsageError(f"{dropped[0]} sets the profiled run, and --explain-only runs only the explain step: "
                             f"leave out {' and '.join(dropped)}, or --explain-only (use --explain for both)")


def run_profile(args) -> int:
    from ..profiling import history
    from ..profiling.explain import ExplainError, ExplainTargetError, explain_in_subprocess, package_target
    from ..profiling.runner import profile_run

    if args.checkpoint and args.shape != "tiny":
        raise UsageError("--shape picks a random-weight model; with --checkpoint leave it out")
    check_profile_combinations(args)
    if args.checkpoint is not None:
        check_input_file("--checkpoint", args.checkpoint)
    if args.compile not in targets.COMPILE_MODES:
        raise UsageError(f"--compile must be one of {', '.join(targets.COMPILE_MODES)}, got {args.compile!r}")
    check_int("--runs", args.runs, 1, 1000)
    check_int("--warmup", args.warmup, 0, 100)
    check_int("--seed", args.seed, 0, 0xFFFFFFFFFFFFFFFF)
    check_schedule_args(args.preset or "self_forcing", args.steps, names={"preset": "--preset", "steps": "--steps"})
    check_output_dir("--out", args.out)
    check_device("--device", args.device)
    geo = profile_geometry(args)
    target = targets.ProfileTarget(checkpoint=args.checkpoint, device=args.device,
                                   dtype=TORCH_NAMES[args.dtype] if args.dtype else None,
                                   frames=geo["latent_frames"], height=geo["latent_height"],
                                   width=geo["latent_width"], steps=args.steps, preset=args.preset,
                                   seed=args.seed, shape=args.shape, sampler=args.sampler).resolved()
    result: dict = {}
    if args.explain or args.explain_only or args.explain_target:
        # First, before this process loads the model: the subprocess needs the memory too.
        # a failed explain run is the run's error (exit 1); a target that cannot be loaded is the user's input
        if args.explain_target:
            name, kwargs, search = args.explain_target, {}, [os.getcwd()]   # as `python -m`: this folder first
        else:
            name, search = package_target("app.jobs.profile_targets:explain_model"), []
            kwargs = {"scope": args.explain_scope or "block", **target.settings()}
        try:
            explained = explain_in_subprocess(name, kwargs=kwargs, sys_path=search)
        except ExplainTargetError as exc:
            if not args.explain_target:
                raise ExplainError(str(exc)) from None
            raise UsageError(f"--explain-target: {exc}; give MODULE:FACTORY, importable from this folder or "
                             f"PYTHONPATH") from None
        result["explain"] = explained.to_dict()
        if not args.json:
            print(explained.to_text())
        if args.explain_only:
            if args.json:
                print_json(result, sort_keys=True)
            return 0

    model = targets.load_model(target)
    targets.apply_compile(model, args.compile)
    inputs = targets.make_inputs(model, target)
    fn = _with_progress(targets.sampler_call(model, target, inputs), args.warmup, args.runs, args.compile)
    label = Path(args.checkpoint).stem if args.checkpoint else args.shape
    calls, class_flops = targets.work_per_run(model, target)
    with _without_profiler_chatter():
        report = profile_run(fn, runs=args.runs, warmup=args.warmup, out_dir=args.out,
                             trace_name=f"profile_{label}_{args.compile}", device=target.device,
                             model_calls=calls, class_flops=class_flops)
    report.result = None
    if report.kernel_classes is not None:
        from ..profiling.ceilings import measure_ceilings
        report.ceilings = measure_ceilings(target.device)
    settings = {**target.settings(), "compile": args.compile, "runs": args.runs, "warmup": args.warmup,
                "video_frames": geo["frames"], "pixel_height": geo["height"], "pixel_width": geo["width"]}
    if not args.no_history:
        try:
            history.append(report.history_record(settings))
        except Exception as exc:  # noqa: BLE001 - the report matters more than the history line
            print(f"warning: could not append to the metrics history: {exc}", file=sys.stderr)
    result["profile"] = report.to_dict()
    if args.json:
        print_json(result, sort_keys=True)
    else:
        if "explain" in result:
            print()
        print(report.to_text())
    return 0


# ---------------------------------------------------------------------- report
def _print_rich_table(rows: list[dict], columns: list[str]) -> bool:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return False
    table = Table(title="wan_accel metrics history")
    for c in columns:
        table.add_column(c, no_wrap=c != "settings", overflow="ellipsis")
    for r in rows:
        table.add_row(*[r.get(c, "") for c in columns])
    Console().print(table)
    return True


def run_report(args) -> int:
    from ..profiling import history
    from ..profiling.history_view import COLUMNS, plot_history, table_rows

    if args.json and args.plain:        # --plain chooses how the table looks; --json prints no table
        raise UsageError("--plain shapes the text table, and --json prints the records instead: leave out one")
    if args.last is not None:
        check_int("--last", args.last, 1, 10**9)
    if args.plot:  # refused before anything is read: no link, pipe, folder or limit cache file
        from ..cache.owned_files import check_target
        check_target(args.plot, option="--plot", purpose="the history plot")
    if args.history is not None and Path(args.history).expanduser().exists():
        check_input_file("--history", args.history, kind="jsonl")
    path = history.history_path(args.history)
    records = history.read(path, kind=args.kind, last=args.last)
    if args.json:
        print_json(records, sort_keys=True)
    elif not records:
        if not args.plot:   # with --plot, the plot's own error says the history is empty: one message
            print(f"no runs recorded yet in {path} (generate, bench and profile runs add lines)")
    else:
        rows = table_rows(records)
        # rich only on a terminal: piped output stays a plain, greppable table
        if args.plain or not sys.stdout.isatty() or not _print_rich_table(rows, COLUMNS):
            print(format_table(rows, COLUMNS))
        print(f"{len(records)} record(s) from {path}")
    if args.plot:
        out = plot_history(records, args.plot)   # no matplotlib (exit 1) or nothing to plot (exit 2): one error
        print(f"wrote {out}", file=sys.stderr if args.json else sys.stdout)
    return 0
