"""``python -m wan_accel plan``: the VRAM plan for a checkpoint or a model preset (works without a GPU)."""
from __future__ import annotations

import re

from ..app.validate import UsageError, check_float, check_geometry, check_input_file, check_int, check_window
from ..cache.json_out import print_json

PRESETS = ("1.3b", "14b", "14b-i2v", "krea-14b")


def register(sub) -> None:
    p = sub.add_parser("plan", help="VRAM plan: dtype, block swap, KV window, VAE chunk (no GPU needed)",
                       description="Plan memory for a generation from the checkpoint header (or a preset) and this "
                                   "machine (or a simulated GPU with --vram-gb). Learned limits override estimates.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="PATH", help="a Wan DiT .safetensors file (only its header is read)")
    src.add_argument("--model", choices=PRESETS, help="a model preset instead of a file")
    p.add_argument("--width", type=int, default=832, help="video width in pixels (default 832)")
    p.add_argument("--height", type=int, default=480, help="video height in pixels (default 480)")
    p.add_argument("--frames", type=int, default=81, help="video frames, 4k+1 (default 81)")
    p.add_argument("--batch", type=int, default=1, help="videos per run (default 1)")
    p.add_argument("--mode", choices=("causal", "full"), default="causal",
                   help="causal: chunks with a KV cache (Self-Forcing, CausVid); full: one bidirectional sequence")
    p.add_argument("--frames-per-block", type=int, default=3, help="latent frames per causal chunk (default 3)")
    p.add_argument("--kv-window", type=int, default=None,
                   help="latent frames in the KV cache (-1 global; default: the model's own)")
    p.add_argument("--vram-gb", type=float, default=None, help="plan for a GPU with this many GiB (all free)")
    p.add_argument("--capability", default=None, help="compute capability of the --vram-gb GPU (default 8.9)")
    p.add_argument("--ram-gb", type=float, default=None, help="host RAM in GiB (default: this machine's)")
    p.add_argument("--reserve-gb", type=float, default=0.0, help="VRAM (or RAM) to leave unused, in GiB")
    p.add_argument("--vae", choices=("auto", "wan2.1", "wan2.2"), default="auto",
                   help="the VAE that decodes, for its learned chunk limit (auto: from the model's latent channels)")
    p.add_argument("--no-learned", action="store_true", help="ignore limits learned on this machine")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_plan)


def parse_capability(text) -> tuple[int, int]:
    """'8.9' -> (8, 9): MAJOR.MINOR, major 3..20, minor 0..9 (CUDA compute capabilities)."""
    m = re.fullmatch(r"\s*(\d{1,2})\.(\d)\s*", str(text))
    if not m or not 3 <= int(m.group(1)) <= 20:
        raise UsageError(f"--capability must be a compute capability MAJOR.MINOR such as 8.9, 8.6 or 9.0, got "
                         f"{text!r}")
    return int(m.group(1)), int(m.group(2))


def _system(args):
    from ..memory.system import GiB, SystemInfo, detect_system, pinned_budget_for

    cap = parse_capability("8.9" if args.capability is None else args.capability)
    if args.vram_gb is not None:
        return SystemInfo.simulated_gpu(args.vram_gb, ram_gb=args.ram_gb, capability=cap,
                                        name=f"simulated {args.vram_gb:g} GiB GPU")
    system = detect_system()
    if args.ram_gb is not None:
        system.host_ram_total = system.host_ram_available = int(args.ram_gb * GiB)
        system.pinned_budget = pinned_budget_for(system.host_ram_total, system.host_ram_available) if system.has_gpu else 0
    return system


def _plan(args) -> int:
    from ..cache import open_cache
    from ..memory.estimate import Workload
    from ..memory.plan import make_plan
    from ..memory.system import GiB
    from ..memory.weights import preset_weights, weights_from_checkpoint

    if args.checkpoint is not None:
        check_input_file("--checkpoint", args.checkpoint)
    check_geometry(args.frames, args.height, args.width, args.frames_per_block if args.mode == "causal" else 1,
                   names={"frames": "--frames", "height": "--height", "width": "--width",
                          "frames_per_block": "--frames-per-block"})
    check_int("--batch", args.batch, 1, 64)
    if args.kv_window is not None and args.mode == "full":      # one sequence, no KV cache: it would be ignored
        raise UsageError(f"--kv-window {args.kv_window} sizes the causal KV cache, and --mode full keeps none: "
                         f"leave --kv-window out, or use --mode causal")
    if args.capability is not None:
        parse_capability(args.capability)      # a bad value is named first
        if args.vram_gb is None:               # this machine's GPU is planned for: it would be ignored
            raise UsageError(f"--capability {args.capability} describes the --vram-gb GPU, and without --vram-gb "
                             f"this machine is planned for: add --vram-gb N, or leave --capability out")
    if args.kv_window is not None and args.mode == "causal":   # the run's own window check (Krea's too)
        from ..memory.weights import PRESET_ALIASES
        model = str(getattr(args, "model", None) or "").lower()     # Krea Realtime's runs rebuild the cache
        check_window(args.frames_per_block, args.kv_window, 0,
                     "krea" if PRESET_ALIASES.get(model, model) == "krea-14b" else "switch",
                     names={"frames_per_block": "--frames-per-block", "kv_window": "--kv-window",
                            "recache": "Krea's --recache"})
    for name, value, lo in (("--vram-gb", args.vram_gb, 0.0), ("--ram-gb", args.ram_gb, 0.0)):
        if value is not None:
            check_float(name, value, lo, 100000.0, lo_open=True)
    check_float("--reserve-gb", args.reserve_gb, 0.0, 100000.0)
    weights = weights_from_checkpoint(args.checkpoint) if args.checkpoint else preset_weights(args.model)
    workload = Workload(args.width, args.height, args.frames, batch=args.batch, mode=args.mode,
                        frames_per_block=args.frames_per_block)
    system = _system(args)
    cache = None if args.no_learned else open_cache()
    plan = make_plan(weights, workload, system, reserve_bytes=int(args.reserve_gb * GiB), kv_window=args.kv_window,
                     cache=cache, vae_kind=None if args.vae == "auto" else args.vae,
                     reserve_name="--reserve-gb")
    if args.json:
        print_json(plan.to_dict(), sort_keys=True)
    else:
        print(plan.summary())
    return 0
