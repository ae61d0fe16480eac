"""CLI of the model area: generate, convert, check-reference."""
from __future__ import annotations

import argparse
import json
import sys

from ..app.validate import (UsageError, check_device, check_float, check_geometry, check_input_file,
                       check_int, check_output_dir, check_steps, dtype_arg)


def register(subparsers) -> None:
    _add_generate(subparsers)
    _add_convert(subparsers)
    _add_check(subparsers)


def _add_generate(subparsers) -> None:
    p = subparsers.add_parser("generate", help="sample a causal Wan video latent (tiny built-in model by default)",
                              description="Sample latents with the causal few-step sampler; writes "
                                          "latents.safetensors, preview.webp and report.json.")
    p.add_argument("--out", default="wan_accel_out", help="output directory (default: wan_accel_out)")
    p.add_argument("--checkpoint", help=".safetensors DiT checkpoint (default: built-in tiny random model)")
    p.add_argument("--text-embeds", help=".safetensors with the prompt's umt5 embedding ('context', [L, 4096])")
    p.add_argument("--frames", type=int, help="video frames, 4k+1 (default 33 tiny / 81 checkpoint)")
    p.add_argument("--height", type=int, help="pixels, multiple of 16 (default 128 tiny / 480 checkpoint)")
    p.add_argument("--width", type=int, help="pixels, multiple of 16 (default 128 tiny / 832 checkpoint)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-kind", default="wan", choices=["wan", "matrix-game2"],
                   help="wan: text-to-video causal Wan (default); matrix-game2: action-conditioned world model")
    p.add_argument("--preset", help="wan: self_forcing (default) / causvid / custom; "
                                    "matrix-game2: its mode preset (default universal)")
    p.add_argument("--steps", help="step list for --preset custom (or to override a preset), e.g. 1000,750,500,250")
    p.add_argument("--shift", type=float, help="timestep shift (overrides the preset)")
    p.add_argument("--no-warp", action="store_true", help="use the step list as raw timesteps (custom preset)")
    p.add_argument("--device", help="cuda / cpu (default: cuda if available)")
    p.add_argument("--dtype", type=dtype_arg("--dtype"), metavar="{bf16,fp16,fp32}",
                   help="default: bf16 on cuda, fp32 on cpu (bfloat16/float16/float32 are accepted too)")
    p.add_argument("--precision", default="self_forcing", choices=["float32", "wan21", "self_forcing"])
    p.add_argument("--attention", default="auto", choices=["auto", "sdpa", "flash_attn", "fa3", "fa2"],
                   help="auto: FlashAttention 3, then 2, then SDPA, by what is installed and the GPU supports")
    p.add_argument("--frames-per-block", type=int, default=3, help="latent frames per chunk, 1-64 (default 3)")
    p.add_argument("--kv-window", type=int, default=-1, help="rolling KV window in latent frames (-1: global)")
    p.add_argument("--sink", type=int, default=0, help="sink frames kept in a rolling window")
    p.add_argument("--skip-last-refresh", action="store_true", help="skip the final chunk's cache refresh")
    p.add_argument("--num-heads", type=int, help="heads, for checkpoints whose dim is not a multiple of 128")
    p.add_argument("--no-preview", action="store_true")
    p.add_argument("--sampler", default="auto", choices=["auto", "optimized", "reference"],
                   help="sampling path: auto (optimized on CUDA, reference elsewhere), optimized, reference")
    p.add_argument("--cuda-graphs", default="auto", choices=["auto", "off"], help="CUDA graphs (optimized path)")
    p.add_argument("--no-fused-kernels", action="store_true", help="plain torch ops instead of the fused kernels")
    p.add_argument("--compile", action="store_true", help="regional torch.compile of the blocks (optimized path)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    mg2 = p.add_argument_group("matrix-game2 (with --model-kind matrix-game2)")
    mg2.add_argument("--actions", help="action script, e.g. 'W*8, W+D*12, mouse(0,0.1)*4'")
    mg2.add_argument("--conditioning", help=".safetensors with image_latent and visual_context (real checkpoints)")
    mg2.add_argument("--window", type=int, help="rolling cache window in latent frames")
    p.set_defaults(func=_generate)


def _run_job(args, log, parallel=None):
    if args.model_kind == "matrix-game2":
        from ..app.jobs.mg2 import MG2Options, run_mg2_generate
        from ..sampling.sampler import sampler_path
        from ..app.jobs.generate import latent_frames
        fields = dict(out_dir=args.out, checkpoint=args.checkpoint, conditioning=args.conditioning,
                      preset=args.preset, window=args.window, seed=args.seed, device=args.device, dtype=args.dtype,
                      precision=args.precision, attention=args.attention, actions=args.actions,
                      frames=latent_frames(args.frames) if args.frames is not None else None, steps=args.steps,
                      shift=args.shift, num_heads=args.num_heads,
                      skip_last_refresh=args.skip_last_refresh, preview=not args.no_preview)
        options = {"cuda_graphs": args.cuda_graphs, "fused_kernels": not args.no_fused_kernels}
        with sampler_path(args.sampler, options):
            return run_mg2_generate(MG2Options(**{k: v for k, v in fields.items() if v is not None}), log=log,
                                    parallel=parallel)
    from ..app.jobs.generate import GenerateOptions, run_generate
    opts = GenerateOptions(
        out_dir=args.out, checkpoint=args.checkpoint, text_embeds=args.text_embeds, frames=args.frames,
        height=args.height, width=args.width, seed=args.seed, preset=args.preset or "self_forcing",
        steps=args.steps, shift=args.shift, warp=False if args.no_warp else None, device=args.device,
        dtype=args.dtype, precision=args.precision, attention=args.attention,
        frames_per_block=args.frames_per_block, kv_window=args.kv_window, sink=args.sink,
        skip_last_refresh=args.skip_last_refresh, num_heads=args.num_heads, preview=not args.no_preview,
        sampler=args.sampler, cuda_graphs=args.cuda_graphs, fused_kernels=not args.no_fused_kernels,
        compile=args.compile)
    return run_generate(opts, log=log, parallel=parallel)


GENERATE_NAMES = {"frames": "--frames", "height": "--height", "width": "--width",
                  "frames_per_block": "--frames-per-block", "kv_window": "--kv-window", "sink": "--sink"}


def check_generate_args(args) -> None:
    """Every value of ``generate`` checked before anything is loaded (UsageError names the option and the fix)."""
    from ..app.jobs.generate import MODEL_DEFAULTS, TINY_DEFAULTS
    check_output_dir("--out", args.out)
    if args.checkpoint:
        check_input_file("--checkpoint", args.checkpoint)
    if args.text_embeds:
        check_input_file("--text-embeds", args.text_embeds)
    if getattr(args, "conditioning", None):
        check_input_file("--conditioning", args.conditioning)
    check_int("--seed", args.seed, 0, 0xFFFFFFFFFFFFFFFF)
    check_steps("--steps", args.steps)
    if args.shift is not None:
        check_float("--shift", args.shift, 0.0, 100.0, lo_open=True)
    if args.num_heads is not None:
        check_int("--num-heads", args.num_heads, 1, 1024)
    check_device("--device", args.device)
    if args.model_kind == "matrix-game2":
        for opt, value in (("--height", args.height), ("--width", args.width), ("--text-embeds", args.text_embeds)):
            if value is not None:
                raise UsageError(f"{opt} is not used with --model-kind matrix-game2 (the size comes from the start "
                                 f"latent of --conditioning); leave it out")
        if args.window is not None:
            check_int("--window", args.window, 3, 1024, hint=" (latent frames, at least one 3-frame chunk)")
        if args.frames is not None:
            check_geometry(args.frames, 128, 128, 3, names=GENERATE_NAMES)
        return
    if args.actions is not None or args.conditioning is not None or args.window is not None:
        raise UsageError("--actions, --conditioning and --window are for --model-kind matrix-game2; leave them out "
                         "or add --model-kind matrix-game2")
    defaults = MODEL_DEFAULTS if args.checkpoint else TINY_DEFAULTS
    check_geometry(args.frames if args.frames is not None else defaults["frames"],
                   args.height if args.height is not None else defaults["height"],
                   args.width if args.width is not None else defaults["width"],
                   args.frames_per_block, args.kv_window, args.sink, names=GENERATE_NAMES)


def _generate(args) -> int:
    log = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if args.json else print
    check_generate_args(args)
    # under torchrun (WORLD_SIZE > 1): one rank of a sequence-parallel run, one GPU (or CPU process) each
    from ..app.ranks.parallel import group_from_env, stop_group
    parallel, device = group_from_env(args.device)
    if parallel is not None:
        args.device = str(device)
        if parallel.rank != 0:
            log = lambda *a, **k: None      # noqa: E731 - rank 0 speaks for the run
    try:
        report = _run_job(args, log, parallel)
    except Exception:
        if parallel is not None:            # which rank; run_guarded prints the one error line
            print(f"rank {parallel.rank} of {parallel.world}:", file=sys.stderr, end=" ")
        raise
    finally:
        stop_group()
    if parallel is not None and parallel.rank != 0:
        return 0
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{report['model']} on {report['device']} ({report['dtype']}, {report['precision']}): "
              f"latents {report['latent_shape']} in {report['sample_seconds']:.2f} s")
        for key, path in report["files"].items():
            print(f"  {key}: {path}")
    return 0


def _add_convert(subparsers) -> None:
    p = subparsers.add_parser("convert", help="convert a Self-Forcing/CausVid .pt checkpoint to .safetensors",
                              description="Reads the .pt with torch.load(weights_only=True), takes 'generator' "
                                          "(or 'generator_ema' with --ema), strips the 'model.' prefix, "
                                          "checks the keys and writes safetensors with the config in metadata.")
    p.add_argument("src", help="input .pt/.pth checkpoint")
    p.add_argument("dst", help="output .safetensors")
    p.add_argument("--ema", action="store_true", help="take the EMA weights ('generator_ema')")
    p.add_argument("--num-heads", type=int, help="heads, when dim is not a multiple of 128")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_convert)


def _convert(args) -> int:
    from pathlib import Path

    from ..model.convert import convert_pt_to_safetensors
    src = check_input_file("SRC", args.src, kind="pt")
    if src.suffix.lower() == ".safetensors":
        check_input_file("SRC", args.src)  # a damaged file gets its own message first
        raise UsageError(f"SRC {src} is already a .safetensors file: load it directly (convert reads .pt/.pth "
                         f"training checkpoints)")
    dst = Path(args.dst)
    if dst.suffix.lower() != ".safetensors":
        raise UsageError(f"DST {dst} must end in .safetensors")
    check_output_dir("DST's folder", dst.parent if str(dst.parent) else ".")
    if dst.exists() and not dst.is_file():
        raise UsageError(f"DST {dst} exists and is not a file; choose another output path")
    if args.num_heads is not None:
        check_int("--num-heads", args.num_heads, 1, 1024)
    summary = convert_pt_to_safetensors(args.src, args.dst, ema=args.ema, num_heads=args.num_heads)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        c = summary["config"]
        print(f"wrote {summary['output']}: {summary['tensors']} tensors from '{summary['entry']}' "
              f"({c['model_type']}, dim {c['dim']}, {c['num_layers']} layers, {c['num_heads']} heads)")
    return 0


def _add_check(subparsers) -> None:
    p = subparsers.add_parser("check-reference", help="compare the model with reference fixtures",
                              description="Runs every recognised fixture in DIR (float32) and prints the max "
                                          "abs difference of every recorded tensor; exits 1 above --tol.")
    p.add_argument("dir", help="fixture directory (*_config.json + weights + io safetensors)")
    p.add_argument("--tol", type=float, default=1e-4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_check)


def _check(args) -> int:
    from ..app.jobs.reference import check_reference, format_table
    try:
        rows = check_reference(args.dir, device=args.device)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    worst = max(d for _, d in rows)
    if args.json:
        print(json.dumps({"rows": [{"tensor": n, "max_abs_diff": d} for n, d in rows], "worst": worst,
                          "tolerance": args.tol, "pass": worst <= args.tol}, indent=2))
    else:
        print(format_table(rows, args.tol))
    return 0 if worst <= args.tol else 1


def main(argv=None) -> int:
    """Stand-alone entry (the package CLI registers these subcommands itself)."""
    parser = argparse.ArgumentParser(prog="wan_accel")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    from .errors import clean_warnings, run_guarded
    with clean_warnings():
        return run_guarded(args.func, args)
