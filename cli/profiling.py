"""``python -m wan_accel profile`` (profile one sampler run) and ``python -m wan_accel report`` (metrics history)."""
from __future__ import annotations

import sys
from pathlib import Path

from .output import format_table, print_json


def register(sub) -> None:
    p = sub.add_parser("profile", help="profile one sampler run (trace, compile stats, graph breaks, GPU idle)",
                       description="Runs the causal sampler under torch.profiler on the built-in tiny model or a "
                                   "checkpoint; writes a Perfetto/Chrome trace and prints a report.")
    p.add_argument("--checkpoint", help="Wan/causal Wan .safetensors checkpoint (default: the built-in tiny model)")
    p.add_argument("--compile", default="none", metavar="MODE",
                   help="regional compile before profiling: none, default, reduce-overhead, max-autotune, "
                        "max-autotune-no-cudagraphs, eager, aot_eager (default: none)")
    p.add_argument("--out", default="wan_accel_profiles", help="folder for the trace (default: ./wan_accel_profiles)")
    p.add_argument("--runs", type=int, default=1, help="profiled runs (default 1)")
    p.add_argument("--warmup", type=int, default=1, help="unprofiled runs first, compile happens there (default 1)")
    p.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="default: float32 on CPU, bfloat16 on GPU")
    p.add_argument("--frames", type=int, help="latent frames (default 6 tiny, 21 checkpoint)")
    p.add_argument("--height", type=int, help="latent height (default 8 tiny, 60 checkpoint)")
    p.add_argument("--width", type=int, help="latent width (default 8 tiny, 104 checkpoint)")
    p.add_argument("--steps", help="sampler step list, e.g. 1000,750,500,250 (default: the preset's)")
    p.add_argument("--preset", help="sampler schedule preset: self_forcing, causvid, custom (default self_forcing)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--explain", action="store_true",
                   help="also list graph breaks with reasons (torch._dynamo.explain, in a separate process)")
    p.add_argument("--explain-only", action="store_true", help="only the explain step, no profiled run")
    p.add_argument("--explain-scope", choices=("block", "model"), default="block",
                   help="explain one transformer block call (what regional compile compiles) or one chunk call")
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
    r.add_argument("--kind", choices=("generate", "bench", "profile"), help="only records of this kind")
    r.add_argument("--last", type=int, help="only the last N records")
    r.add_argument("--history", metavar="FILE", help="history file (default: history.jsonl beside the limit cache)")
    r.add_argument("--plain", action="store_true", help="plain text table even on a terminal with rich installed")
    r.set_defaults(func=run_report)


# ---------------------------------------------------------------------- profile
def run_profile(args) -> int:
    from ..profiling import ExplainError, explain_in_subprocess, package_target, profile_run
    from ..app import profile_targets as targets
    from ..profiling import history

    if args.checkpoint and not Path(args.checkpoint).is_file():
        print(f"checkpoint not found: {args.checkpoint}", file=sys.stderr)
        return 2
    if args.compile not in targets.COMPILE_MODES:
        print(f"--compile must be one of {', '.join(targets.COMPILE_MODES)}", file=sys.stderr)
        return 2
    if args.runs < 1 or args.warmup < 0:
        print("--runs must be >= 1 and --warmup >= 0", file=sys.stderr)
        return 2
    target = targets.ProfileTarget(checkpoint=args.checkpoint, device=args.device, dtype=args.dtype,
                                   frames=args.frames, height=args.height, width=args.width, steps=args.steps,
                                   preset=args.preset, seed=args.seed).resolved()
    result: dict = {}
    if args.explain or args.explain_only or args.explain_target:
        # First, before this process loads the model: the subprocess needs the memory too.
        if args.explain_target:
            name, kwargs = args.explain_target, {}
        else:
            name = package_target("app.profile_targets:explain_model")
            kwargs = {"scope": args.explain_scope, **target.settings()}
        try:
            explained = explain_in_subprocess(name, kwargs=kwargs)
        except ExplainError as exc:
            print(f"explain failed: {exc}", file=sys.stderr)
            return 1
        result["explain"] = explained.to_dict()
        if not args.json:
            print(explained.to_text())
        if args.explain_only:
            if args.json:
                print_json(result)
            return 0

    model = targets.load_model(target)
    targets.apply_compile(model, args.compile)
    inputs = targets.make_inputs(model, target)
    fn = targets.sampler_call(model, target, inputs)
    label = Path(args.checkpoint).stem if args.checkpoint else "tiny"
    report = profile_run(fn, runs=args.runs, warmup=args.warmup, out_dir=args.out,
                         trace_name=f"profile_{label}_{args.compile}", device=target.device)
    report.result = None
    settings = {**target.settings(), "compile": args.compile, "runs": args.runs, "warmup": args.warmup}
    if not args.no_history:
        try:
            history.append(report.history_record(settings))
        except Exception as exc:  # noqa: BLE001 - the report matters more than the history line
            print(f"warning: could not append to the metrics history: {exc}", file=sys.stderr)
    result["profile"] = report.to_dict()
    if args.json:
        print_json(result)
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
    from ..profiling.history_view import COLUMNS, PlotUnavailable, plot_history, table_rows

    path = history.history_path(args.history)
    records = history.read(path, kind=args.kind, last=args.last)
    if args.json:
        print_json(records)
    elif not records:
        print(f"no runs recorded yet in {path} (generate, bench and profile runs add lines)")
    else:
        rows = table_rows(records)
        # rich only on a terminal: piped output stays a plain, greppable table
        if args.plain or not sys.stdout.isatty() or not _print_rich_table(rows, COLUMNS):
            print(format_table(rows, COLUMNS))
        print(f"{len(records)} record(s) from {path}")
    if args.plot:
        try:
            out = plot_history(records, args.plot)
        except PlotUnavailable as exc:
            print(str(exc), file=sys.stderr)
            return 1
        except ValueError as exc:
            print(str(exc), file=sys.stderr)
            return 1
        print(f"wrote {out}", file=sys.stderr if args.json else sys.stdout)
    return 0
