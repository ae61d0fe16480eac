"""``python -m wan_accel doctor [--json] [--report FILE] [--recheck] [--feature NAME] [--with-compile] [--ops]``."""
from __future__ import annotations

from ..app.validate import TORCH_NAMES, UsageError, check_device, check_int
from ..profiling.child import one_line
from ..cache.json_out import print_json

MAX_HEAD_DIM = 512      # the largest head the attention kernels are probed with


def _doctor(args):
    import torch

    from ..app.doctor.core import doctor_for, default_context
    from ..nodes.comfy import native_probe  # noqa: F401 - the native MODEL path's probe (real where ComfyUI imports)

    head_dim = check_int("--head-dim", args.head_dim, 2, MAX_HEAD_DIM, hint=" (an even head size; Wan: 128)")
    if head_dim % 2:
        raise UsageError(f"--head-dim {head_dim} must be even (rotary embeddings pair the channels); e.g. 128")
    device = check_device("--device", args.device) or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.with_compile and device.startswith("cuda"):     # probed on a GPU anyway: it would change nothing
        raise UsageError(f"--with-compile adds the torch.compile probe on a CPU, and {device} always probes it: "
                         f"leave --with-compile out, or add --device cpu")
    try:
        dtype = getattr(torch, TORCH_NAMES[args.dtype]) if args.dtype else None
        ctx = default_context(device, dtype, args.head_dim, with_compile=args.with_compile)
    except Exception as exc:  # noqa: BLE001 - e.g. "Torch not compiled with CUDA enabled": say what to do
        raise UsageError(f"--device {device}: cannot probe on it ({one_line(exc)}); use --device cpu or cuda[:N]")
    return doctor_for(ctx.device, ctx.dtype, ctx.head_dim, with_compile=args.with_compile)


def _run(args) -> int:
    from ..app.doctor.report import REPORT_PURPOSE, doctor_rows, doctor_text, report, write_report
    from ..cache.owned_files import check_target

    if args.ops and (args.report or args.feature or args.recheck):
        raise UsageError("--ops lists the op registry's choices and probes nothing: leave out --report, --feature "
                         "and --recheck with it")
    if args.report is not None:  # refused before any probe runs: exit 2, 'error: --report: ...'
        check_target(args.report, option="--report", purpose=REPORT_PURPOSE)
    doctor = _doctor(args)
    if args.ops:
        from ..app.doctor.ops import registry_report, registry_text
        found = registry_report(doctor.context.device, doctor.context.dtype, doctor.context.head_dim)
        print_json(found, sort_keys=True) if args.json else print(registry_text(found))
        return 0
    names = None
    if args.feature:
        unknown = [n for n in args.feature if n not in doctor.catalogue]
        if unknown:
            raise UsageError(f"--feature: unknown feature(s) {', '.join(unknown)}; known: "
                             f"{', '.join(doctor.catalogue)}")
        names = args.feature
        if args.with_compile and "compile" not in names:   # only the compile probe reads it
            raise UsageError(f"--with-compile adds the compile probe, and --feature {' '.join(names)} leaves it "
                             f"out: add --feature compile, or leave --with-compile out")
    rows = doctor_rows(doctor, names, recheck=args.recheck)
    if args.report:
        try:
            write_report(args.report, doctor, rows, option="--report")
        except OSError as exc:
            raise UsageError(f"--report {args.report}: cannot be written ({exc.strerror or exc}); choose a "
                             f"writable file") from None
    if args.json:
        print_json(report(doctor, rows), sort_keys=True)
    else:
        print(doctor_text(doctor, rows))
        if args.report:
            print(f"\nreport written to {args.report}: attach it to an issue (it holds only what is shown above, "
                  f"versions and the last errors)")
    return 0


def register(sub) -> None:
    p = sub.add_parser("doctor", help="check every accelerated path on this machine and show the verdicts",
                       description="Each accelerated feature (attention backends, fused kernels, fused q/k/v, CUDA "
                                   "graphs, compiled blocks, block swap) runs against its plain fallback on a small "
                                   "probe, once per machine; the verdict is remembered in the limit cache and a "
                                   "failed or slower feature is switched off.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--report", metavar="FILE", help="write a bug-report file (fingerprint, verdicts, versions, "
                                                    "last errors) to attach to an issue")
    p.add_argument("--recheck", action="store_true", help="probe again even where a verdict is recorded")
    p.add_argument("--feature", action="append", metavar="NAME", help="only this feature (repeatable)")
    p.add_argument("--with-compile", action="store_true",
                   help="also probe torch.compile on a CPU (tens of seconds; always probed on a GPU)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when present)")
    p.add_argument("--dtype", choices=sorted(TORCH_NAMES), help="probe dtype (default: bf16 on CUDA, fp32 on a CPU)")
    p.add_argument("--head-dim", type=int, default=128, help="head size of the probes (Wan: 128)")
    p.add_argument("--ops", action="store_true", help="every op family of the op registry, its candidates and why each "
                                                      "is chosen or rejected here (probes nothing)")
    p.set_defaults(func=_run)
