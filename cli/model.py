"""CLI of the model area: generate, convert, check-reference."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from ..cache.json_out import to_json
from ..cache.owned_files import check_target
from ..app.validate import (UsageError, check_device, check_fits, check_float, check_geometry, check_input_file,
                            check_int, check_output_dir, check_schedule_args, check_steps, check_text,
                            dtype_arg)


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="sample a causal Wan video latent (tiny built-in model by default)",
                              description="Sample latents with the causal few-step sampler; writes "
                                          "latents.safetensors, preview.webp and report.json, and with --decode "
                                          "(or --vae) the decoded video, video.mp4 (PyAV) or video.webp, each "
                                          "chunk written as it is decoded.")
    p.add_argument("--out", default="wan_accel_out", help="output directory (default: wan_accel_out)")
    p.add_argument("--checkpoint", help=".safetensors DiT checkpoint (default: built-in tiny random model)")
    p.add_argument("--text-embeds", help=".safetensors with the prompt's umt5 embedding ('context', [L, 4096])")
    p.add_argument("--lora", metavar="FILE", help="a LoRA .safetensors merged into the weights at load: LongLive's "
                   "(peft names) or a ComfyUI-layout one")
    p.add_argument("--lora-strength", type=float, metavar="X", help="scale of the LoRA update (default 1.0; "
                   "-100 to 100)")
    p.add_argument("--frames", type=int, help="video frames, 4k+1 (default 33 tiny / 81 checkpoint)")
    p.add_argument("--height", type=int, help="pixels, multiple of 16 (default 128 tiny / 480 checkpoint)")
    p.add_argument("--width", type=int, help="pixels, multiple of 16 (default 128 tiny / 832 checkpoint)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial noise (default 0; the same seed and "
                   "settings give the same latents)")
    p.add_argument("--model-kind", default="wan", choices=["wan", "matrix-game2"],
                   help="wan: text-to-video causal Wan (default); matrix-game2: action-conditioned world model")
    p.add_argument("--preset", help="wan: self_forcing (default) / causvid / longlive (its schedule, 3-frame "
                                    "chunks, window 12, sink 3) / krea (Krea Realtime's 4 steps, 3-frame chunks, "
                                    "context K 3, --recache krea) / custom; matrix-game2: its mode preset (default "
                                    "universal)")
    p.add_argument("--steps", help="step list for --preset custom (or to override a preset), e.g. 1000,750,500,250")
    p.add_argument("--shift", type=float, help="timestep shift (overrides the preset)")
    p.add_argument("--no-warp", action="store_true", help="use the step list as raw timesteps (custom preset)")
    p.add_argument("--device", help="cuda / cpu (default: cuda if available)")
    p.add_argument("--dtype", type=dtype_arg("--dtype"), metavar="{bf16,fp16,fp32}",
                   help="default: bf16 on cuda, fp32 on cpu (bfloat16/float16/float32 are accepted too)")
    p.add_argument("--precision", default="self_forcing", choices=["float32", "wan21", "self_forcing"],
                   help="self_forcing (default): the whole model in --dtype, as the causal checkpoints ran; wan21: "
                   "time embedding, modulation, residual stream, norms and head in float32, matmuls in --dtype; "
                   "float32: everything in float32 (parity checks)")
    p.add_argument("--attention", default="auto", choices=["auto", "sdpa", "flash_attn", "fa3", "fa2", "int8", "fp8"],
                   help="auto: FlashAttention 3, then 2, then SDPA, by what is installed and the GPU supports; "
                        "int8 (opt-in): int8 Q/K attention; fp8 (opt-in): Q, K, V and P in fp8, K/V quantized once "
                        "as they enter the KV cache; each within a stated error of exact (docs/sampler.md: Fidelity)")
    p.add_argument("--linear", default="exact", choices=["exact", "fp8"],
                   help="exact (default), or fp8 (opt-in): the blocks' linear layers in fp8 with per-row scales, "
                        "within a stated error of exact (docs/sampler.md: Fidelity); fast on CUDA GPUs with fp8 tensor cores "
                        "(SM 8.9+), emulated elsewhere; runs on the optimized sampler path")
    p.add_argument("--frames-per-block", type=int, help="latent frames per chunk, 1-64 (default 3)")
    p.add_argument("--kv-window", type=int, help="rolling KV window in latent frames (default -1: global)")
    p.add_argument("--sink", type=int, help="sink frames kept in a rolling window (default 0)")
    p.add_argument("--skip-last-refresh", action="store_true", help="skip the final chunk's cache refresh")
    p.add_argument("--prompt-schedule", metavar="FILE_OR_TEXT",
                   help="prompts per chunk, a file or the text itself: one '<chunk>: <prompt>' per line, e.g. "
                        "'0: a cat walks\n6: the cat runs (blend 2)'; mixes 'a :0.7 | b :0.3'. The tiny model "
                        "encodes the texts with its stand-in encoder; a checkpoint needs --text-embeds holding one "
                        "tensor per text, named by the text")
    p.add_argument("--recache", choices=["switch", "none", "krea"],
                   help="at a prompt switch: switch (default; re-cache the window's KV under the new prompt, as "
                        "LongLive) or none (only the cross-attention follows the prompt); krea: before every chunk "
                        "rebuild the KV cache from a context of K = --kv-window - --frames-per-block frames "
                        "(Krea Realtime; --kv-window -1: K = 3; default of --preset krea)")
    p.add_argument("--num-heads", type=int, help="heads, for checkpoints whose dim is not a multiple of 128")
    p.add_argument("--decode", choices=["wan", "tiny", "none"],
                   help="decode each chunk as it is made and write the video beside the latents (video.mp4 with "
                        "PyAV, else an animated video.webp): wan (the Wan 2.1 VAE's decoder) or tiny (the "
                        "TAEHV-class taew2_1 decoder: much faster). Default: the decoder of --vae, none without it. "
                        "Without --vae the built-in tiny model decodes with seeded random decoder weights (no "
                        "download; the frames show the pipeline, not a picture)")
    p.add_argument("--vae", metavar="FILE", help="the decoder's weights: a Wan 2.1 VAE (wan_2.1_vae.safetensors) for "
                   "--decode wan, taew2_1.safetensors for --decode tiny; needed to decode a --checkpoint's video")
    p.add_argument("--no-preview", action="store_true", help="do not write the animated preview (preview.webp) "
                   "beside the latents")
    p.add_argument("--sampler", default="auto", choices=["auto", "optimized", "reference"],
                   help="sampling path: auto (optimized on CUDA, reference elsewhere), optimized, reference")
    p.add_argument("--cuda-graphs", default="auto", choices=["auto", "off"], help="CUDA graphs (optimized path)")
    p.add_argument("--no-fused-kernels", action="store_true", help="plain torch ops instead of the fused kernels")
    p.add_argument("--ops", default="auto",
                   help="optimized path: which implementation runs LayerNorm+modulate and RMSNorm+RoPE: auto (the "
                        "fastest verified one where the fused kernels run), pack (the pack's Triton kernels), kitchen "
                        "(comfy-kitchen's backends), torch (plain torch); and/or family=candidate pairs, comma-"
                        "separated, e.g. attention.fp8=torch,rmsnorm_rope=torch (python -m wan_accel doctor --ops)")
    p.add_argument("--compile", action="store_true", help="regional torch.compile of the blocks (optimized path)")
    p.add_argument("--keep-slower", action="store_true",
                   help="keep --attention int8 / fp8 / --linear fp8 even where it is measured slower than exact at "
                        "this run's shape on this GPU (otherwise the run says so and runs exact)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    mg2 = p.add_argument_group("matrix-game2 (with --model-kind matrix-game2)")
    mg2.add_argument("--actions", help="action script, e.g. 'W*8, W+D*12, mouse(0,0.1)*4'")
    mg2.add_argument("--conditioning", help=".safetensors with image_latent and visual_context (real checkpoints)")
    mg2.add_argument("--window", type=int, help="rolling cache window in latent frames")
    p.set_defaults(func=_generate)

    p = subparsers.add_parser("convert", help="convert a Self-Forcing/CausVid .pt checkpoint to .safetensors",
                              description="Reads the .pt with torch.load(weights_only=True), takes 'generator' "
                                          "(or 'generator_ema' with --ema), strips the 'model.' prefix, "
                                          "checks the keys and writes safetensors with the config in metadata.")
    p.add_argument("src", help="input .pt/.pth checkpoint")
    p.add_argument("dst", help="output .safetensors")
    p.add_argument("--ema", action="store_true", help="take the EMA weights ('generator_ema')")
    p.add_argument("--num-heads", type=int, help="heads, when dim is not a multiple of 128")
    p.add_argument("--json", action="store_true", help="print the conversion summary as JSON")
    p.set_defaults(func=_convert)

    p = subparsers.add_parser("convert-lora", help="rename a LongLive (peft) LoRA for ComfyUI's LoRA loader",
                              description="Writes the LoRA under the diffusion_model.<layer>.lora_A/lora_B names "
                                          "ComfyUI maps on a WAN model, with each layer's alpha recorded (LongLive "
                                          "v1.0's files carry none: its config uses alpha = rank).")
    p.add_argument("src", help="input LoRA: .safetensors (peft keys base_model.model.blocks..., or any accepted layout) "
                               "or LongLive's released lora.pt (read with weights_only=True, its 'generator_lora')")
    p.add_argument("dst", help="output .safetensors")
    p.add_argument("--alpha", type=float, help="alpha for layers whose file has none (default: the rank)")
    p.set_defaults(func=_convert_lora)

    p = subparsers.add_parser("check-reference", help="compare the model with reference fixtures",
                              description="Runs every recognised fixture in DIR (float32) and prints the max "
                                          "abs difference of every recorded tensor; exits 1 above --tol.")
    p.add_argument("dir", help="fixture directory (*_config.json + weights + io safetensors)")
    p.add_argument("--tol", type=float, default=1e-4, help="largest max abs difference a recorded tensor may "
                   "have (default 1e-4); above it the check fails (exit 1)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda: where the float32 model runs")
    p.add_argument("--json", action="store_true", help="print the rows, the worst difference and the verdict as "
                   "JSON")
    p.set_defaults(func=_check)


def _job_options(cls, args, **renamed):
    """``cls`` (a generate job's options) from the parsed arguments: each field from the option of its name, or from
    ``renamed`` (an option spelled otherwise, a value converted); a field left None keeps its default."""
    import dataclasses
    given = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in dict(given, **renamed).items() if v is not None})


def _run_job(args, log, parallel=None):
    shared = dict(out_dir=args.out, preview=not args.no_preview, out_option="--out")
    if args.model_kind == "matrix-game2":
        from ..app.jobs.mg2 import MG2Options, run_mg2_generate
        from ..app.prepare import RunSpec, latent_frames
        options = _job_options(MG2Options, args, frames=latent_frames(args.frames) if args.frames is not None
                               else None, **shared)
        spec = RunSpec(path=args.sampler, cuda_graphs=args.cuda_graphs, fused_kernels=not args.no_fused_kernels,
                       ops=args.ops, linear=args.linear, keep_slower=args.keep_slower)  # run rules: in prepare
        return run_mg2_generate(options, log=log, parallel=parallel, spec=spec)
    from ..app.jobs.generate import GenerateOptions, run_generate
    opts = _job_options(GenerateOptions, args, preset=args.preset or "self_forcing",
                        warp=False if args.no_warp else None, fused_kernels=not args.no_fused_kernels,
                        prompt_schedule=getattr(args, "prompt_schedule_text", None), **shared)
    return run_generate(opts, log=log, parallel=parallel)


GENERATE_NAMES = {"frames": "--frames", "height": "--height", "width": "--width",
                  "frames_per_block": "--frames-per-block", "kv_window": "--kv-window", "sink": "--sink",
                  "recache": "--recache"}


WAN_ONLY = (("frames_per_block", "--frames-per-block", 3), ("kv_window", "--kv-window", -1), ("sink", "--sink", 0),
            ("no_warp", "--no-warp", False), ("compile", "--compile", False), ("text_embeds", "--text-embeds", None),
            ("height", "--height", None), ("width", "--width", None), ("prompt_schedule", "--prompt-schedule", None),
            ("recache", "--recache", None), ("lora", "--lora", None), ("lora_strength", "--lora-strength", None),
            ("decode", "--decode", None), ("vae", "--vae", None))


def check_generate_args(args) -> None:
    """Every value of ``generate`` checked before anything is loaded (UsageError names the option and the fix);
    options that do not apply to the model kind are refused, and the run must fit the device's memory."""
    from ..app.jobs.generate import MODEL_DEFAULTS, TINY_DEFAULTS, check_outputs
    from ..sampling.sampler import path_for_linear
    if args.model_kind == "matrix-game2":
        # given = not the parser's default (None for values, False for flags); by identity: 0 == False in Python
        given = [opt for attr, opt, _ in WAN_ONLY if getattr(args, attr, None) is not None
                 and getattr(args, attr, None) is not False]
        if given:
            raise UsageError(f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply to --model-kind "
                             f"matrix-game2 (its chunks, window and size come from the checkpoint, --window and the "
                             f"start latent of --conditioning); leave {'it' if len(given) == 1 else 'them'} out")
    else:
        from ..sampling.scheduler import PRESET_CHUNKING
        for attr, value in PRESET_CHUNKING.get(args.preset or "", {}).items():   # the preset's model's chunking
            if getattr(args, attr, None) is None:
                setattr(args, attr, value)
        for attr, _, default in WAN_ONLY[:3]:        # the Wan defaults, filled in once nothing else can give them
            if getattr(args, attr, None) is None:
                setattr(args, attr, default)
    check_output_dir("--out", args.out)
    check_outputs(args.out, "--out")         # every file it writes there: no link, pipe, folder or cache file
    if args.model_kind != "matrix-game2":
        from ..app.jobs.video import check_decode
        check_decode(args.decode, args.vae, args.checkpoint)    # --decode / --vae: the decoder and its file
    if args.checkpoint is not None:              # '' too: an empty path is refused, never read as "the tiny model"
        check_input_file("--checkpoint", args.checkpoint)
    if args.text_embeds:                         # '' means none (tests/test_bad_inputs.py embeds-empty-path)
        check_input_file("--text-embeds", args.text_embeds, convert=None)
    if args.lora is not None:
        check_input_file("--lora", args.lora, convert="convert-lora")
    if args.lora_strength is not None:
        if args.lora is None:
            raise UsageError("--lora-strength needs --lora (the LoRA file it scales); add --lora FILE or leave it out")
        check_float("--lora-strength", args.lora_strength, -100.0, 100.0)
    if getattr(args, "conditioning", None) is not None:
        check_input_file("--conditioning", args.conditioning, convert=None)
    for attr, option in (("actions", "--actions"), ("steps", "--steps"), ("preset", "--preset")):
        if getattr(args, attr, None) is not None:     # typed text: bytes that are not UTF-8 are refused now
            check_text(option, getattr(args, attr))
    check_int("--seed", args.seed, 0, 0xFFFFFFFFFFFFFFFF)
    check_steps("--steps", args.steps)
    if args.shift is not None:
        check_float("--shift", args.shift, 0.0, 100.0, lo_open=True)
    if args.num_heads is not None:
        check_int("--num-heads", args.num_heads, 1, 1024)
        if not args.checkpoint:         # the built-in tiny model has its own heads: it would be ignored
            raise UsageError(f"--num-heads {args.num_heads} sets the heads of a --checkpoint, but the built-in tiny "
                             f"model runs, which has its own: add --checkpoint FILE, or leave --num-heads out")
    check_device("--device", args.device)
    if args.keep_slower and not any(getattr(args, a) in m for a, m in APPROXIMATE_MODES.items()):
        raise UsageError(f"--keep-slower keeps --attention int8 / fp8 or --linear fp8 where measured slower, and "
                         f"this run asks for neither (--attention {args.attention}, --linear {args.linear}): add "
                         f"one of them, or leave --keep-slower out")
    _check_ops(args)
    try:
        path_for_linear(args.sampler, args.linear, names=("--sampler", "--linear"))     # the one rule, its words
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.model_kind == "matrix-game2":
        if args.window is not None:
            check_int("--window", args.window, 3, 1024, hint=" (latent frames, at least one 3-frame chunk)")
        if args.frames is not None:
            check_geometry(args.frames, 128, 128, 3, names=GENERATE_NAMES)
        _check_mg2_schedule(args)
        return
    if args.actions is not None or args.conditioning is not None or args.window is not None:
        raise UsageError("--actions, --conditioning and --window are for --model-kind matrix-game2; leave them out "
                         "or add --model-kind matrix-game2")
    defaults = MODEL_DEFAULTS if args.checkpoint else TINY_DEFAULTS
    geo = check_geometry(args.frames if args.frames is not None else defaults["frames"],
                         args.height if args.height is not None else defaults["height"],
                         args.width if args.width is not None else defaults["width"],
                         args.frames_per_block, args.kv_window, args.sink, names=GENERATE_NAMES,
                         recache=args.recache or "switch")
    check_schedule_args(args.preset or "self_forcing", args.steps, args.shift, False if args.no_warp else None,
                        names={"preset": "--preset", "steps": "--steps", "shift": "--shift"})
    from ..sampling.krea import cache_setup
    try:                                     # the one cache-mode mapping: Krea's window constraints named here
        args.kv_window = cache_setup(args.recache or "switch", args.frames_per_block, args.kv_window,
                                     names={"recache": "--recache", "preset": "--preset", **GENERATE_NAMES},
                                     sink=args.sink, preset=args.preset).kv_window
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.recache in ("switch", "none") and args.prompt_schedule is None:
        raise UsageError(f"--recache {args.recache} says what happens at a prompt switch, and without "
                         f"--prompt-schedule there is none (it would be ignored): add --prompt-schedule, or leave "
                         f"--recache out (--recache krea acts on every chunk)")
    if args.prompt_schedule is not None:
        from ..app.jobs.generate import check_prompt_schedule, read_prompt_schedule
        args.prompt_schedule_text = read_prompt_schedule("--prompt-schedule", args.prompt_schedule)
        check_prompt_schedule("--prompt-schedule", args.prompt_schedule_text, geo["latent_frames"],
                              args.frames_per_block)
        if args.checkpoint and not args.text_embeds:
            raise UsageError("--prompt-schedule with --checkpoint needs --text-embeds: a .safetensors file with one "
                             "umt5 embedding per prompt text, each named by its text")
    config, weight_bytes = _model_size(args)
    if config is not None:
        check_fits(config, geo["frames"], geo["height"], geo["width"], device=args.device, dtype=args.dtype,
                   frames_per_block=args.frames_per_block, kv_window=args.kv_window, weight_bytes=weight_bytes,
                   names=GENERATE_NAMES)


# options only the optimized sampler uses: (attribute, option, its default); given with the reference sampler
# they would be ignored while report.json says they were set, so they are refused
OPTIMIZED_ONLY = (("ops", "--ops", "auto"), ("compile", "--compile", False), ("cuda_graphs", "--cuda-graphs", "auto"),
                  ("no_fused_kernels", "--no-fused-kernels", False), ("keep_slower", "--keep-slower", False))
APPROXIMATE_MODES = {"attention": ("int8", "fp8"), "linear": ("fp8",)}   # what --keep-slower may keep


def _check_ops(args) -> None:
    """Options of the optimized sampler (--ops, --compile, --cuda-graphs, --no-fused-kernels): the optimized
    sampler must run (the reference one ignores them), and the chosen --ops family must run on the device."""
    from ..app.jobs.handle import default_device
    given = [opt for attr, opt, default in OPTIMIZED_ONLY if getattr(args, attr, default) != default]
    if not given:
        return
    device = args.device or str(default_device())
    if args.sampler == "reference" or (args.sampler == "auto" and not device.startswith("cuda")):
        where = "--sampler reference" if args.sampler == "reference" else "--sampler auto on " + device
        shown = " ".join(f"{opt} {getattr(args, attr)}" if not isinstance(default, bool) else opt
                         for attr, opt, default in OPTIMIZED_ONLY if opt in given)
        raise UsageError(f"{shown} {'applies' if len(given) == 1 else 'apply'} to the optimized sampler, but the "
                         f"reference sampler runs here ({where}), which would ignore "
                         f"{'it' if len(given) == 1 else 'them'}: add --sampler optimized, or leave "
                         f"{'it' if len(given) == 1 else 'them'} out")
    if args.ops != "auto":
        from ..kernels.candidates import mode_problem
        problem = mode_problem(args.ops, device)      # a malformed ops string: its ValueError, a usage error
        if problem:
            raise UsageError(f"--ops: {problem}")


def _model_size(args) -> tuple[dict | None, int]:
    """(config, weight bytes) of the model ``generate`` will load, from the checkpoint's header (nothing loaded)."""
    if not args.checkpoint:
        if args.model_kind == "matrix-game2":
            from ..model.mg2_model import tiny_mg2_config
            return tiny_mg2_config().to_dict(), 0
        from ..model.tiny import TINY_CONFIG
        return TINY_CONFIG.to_dict(), 0
    from ..memory.weights import weights_from_checkpoint
    try:
        weights = weights_from_checkpoint(args.checkpoint, {"num_heads": args.num_heads} if args.num_heads else None)
    except ValueError:
        return None, 0          # not sizable from its header: the loader says what is wrong with it
    elem = 4 if (args.dtype or "fp32") == "fp32" and not str(args.device or "").startswith("cuda") else 2
    return weights.sampling_config(), weights.bytes_at(elem)


def _check_mg2_schedule(args) -> None:
    from ..sampling.mg2 import resolve_preset
    from ..sampling.scheduler import ScheduleError, parse_steps
    try:
        settings = resolve_preset(args.preset or "universal", steps=parse_steps(args.steps) if args.steps else None,
                                  shift=args.shift, window=args.window)
    except ScheduleError as exc:
        raise UsageError(f"{'--shift' if args.shift is not None and 'shift' in str(exc) else '--steps'}: {exc}") \
            from None
    from ..app.jobs.mg2 import DEFAULT_SCRIPT, TINY_LATENT
    from ..sampling.actions_script import ActionScriptError, parse_action_script
    try:
        actions = parse_action_script(args.actions if args.actions is not None else DEFAULT_SCRIPT, settings.mode)
    except ActionScriptError as exc:
        raise UsageError(f"--actions: {exc}") from None
    lh, lw = TINY_LATENT
    if args.conditioning:
        from safetensors import safe_open
        with safe_open(str(args.conditioning), framework="pt", device="cpu") as f:
            if "image_latent" in f.keys():
                lh, lw = f.get_slice("image_latent").get_shape()[-2:]
    config, weight_bytes = _model_size(args)
    if config is None:
        return
    frames = args.frames if args.frames is not None else actions.video_frames
    check_fits(config, frames, 8 * int(lh), 8 * int(lw), device=args.device, dtype=args.dtype, frames_per_block=3,
               kv_window=settings.window, weight_bytes=weight_bytes, names=dict(GENERATE_NAMES, kv_window="--window"))


def _generate(args) -> int:
    log = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if args.json else print
    check_generate_args(args)
    from ..app.ranks.parallel import check_rank_env, group_from_env, stop_group
    check_rank_env((_model_size(args)[0] or {}).get("num_heads"), device=args.device)    # torchrun's variables
    # under torchrun (WORLD_SIZE > 1): one rank of a sequence-parallel run, one GPU (or CPU process) each
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
        print(to_json(report))
    else:
        print(f"{report['model']} on {report['device']} ({report['dtype']}, {report['precision']}): "
              f"latents {report['latent_shape']} in {report['sample_seconds']:.2f} s")
        for key, path in report["files"].items():
            print(f"  {key}: {path}")
    return 0


def _convert_lora(args) -> int:
    from ..model.lora import to_comfy
    released = str(args.src).lower().endswith((".pt", ".pth"))
    src = check_input_file("SRC", args.src, kind="pt" if released else "safetensors")
    tensors = None
    if released:           # LongLive's released lora.pt: read as the convert command does
        from ..model.convert import lora_state_dict
        tensors = lora_state_dict(src)
    dst = check_dst(args.dst, args.src, "the converted LoRA")
    alpha = None if args.alpha is None else check_float("--alpha", args.alpha, 0.0, None, lo_open=True)
    print(f"{to_comfy(args.src, dst, alpha, tensors=tensors)} LoRA layers written to {dst}")
    return 0


def check_dst(dst, src, purpose: str):
    """The output DST as a Path: a .safetensors file in a usable folder that the pack may write (``check_target``:
    no link, pipe or limit cache file), never the input SRC (the same name or another name of it: a link, a hard
    link, a path through a linked folder); UsageError / OwnedFileError otherwise."""
    dst = Path(dst)
    if dst.suffix.lower() != ".safetensors":
        raise UsageError(f"DST {dst} must end in .safetensors")
    check_output_dir("DST's folder", dst.parent if str(dst.parent) else ".")
    same = os.path.realpath(dst) == os.path.realpath(src)
    try:
        same = same or os.path.samefile(dst, src)
    except OSError:                      # DST not there yet (or unreadable): its resolved path decides
        pass
    if same:
        raise UsageError(f"DST {dst} is the input SRC {src} (the same file); the converter never writes over its "
                         f"input: choose another DST, a new .safetensors file")
    if dst.exists() and not dst.is_file():
        raise UsageError(f"DST {dst} exists and is not a file; choose another output path")
    return check_target(dst, option="DST", purpose=purpose)


def _convert(args) -> int:
    from ..model.convert import convert_pt_to_safetensors
    src = check_input_file("SRC", args.src, kind="pt")
    if src.suffix.lower() == ".safetensors":
        check_input_file("SRC", args.src)  # a damaged file gets its own message first
        raise UsageError(f"SRC {src} is already a .safetensors file: load it directly (convert reads .pt/.pth "
                         f"training checkpoints)")
    check_dst(args.dst, args.src, "the converted checkpoint")
    if args.num_heads is not None:
        check_int("--num-heads", args.num_heads, 1, 1024)
    summary = convert_pt_to_safetensors(args.src, args.dst, ema=args.ema, num_heads=args.num_heads)
    if args.json:
        print(to_json(summary))
    else:
        c = summary["config"]
        print(f"wrote {summary['output']}: {summary['tensors']} tensors from '{summary['entry']}' "
              f"({c['model_type']}, dim {c['dim']}, {c['num_layers']} layers, {c['num_heads']} heads)")
    return 0


def _check(args) -> int:
    from ..app.jobs.reference import check_reference, format_table, row_ok, verdict
    folder = Path(args.dir).expanduser()
    if not folder.is_dir():
        raise UsageError(f"DIR {folder}: {'not a folder' if folder.exists() else 'not found'}; give the folder "
                         f"that holds the fixtures (*_config.json, weights, io safetensors)")
    check_float("--tol", args.tol, 0.0)
    check_device("--device", args.device)
    rows = check_reference(folder, device=args.device)  # no fixture there: one error line (exit 2), as every command
    result = verdict(rows, args.tol)            # from every row: NaN, a missing tensor, an unusable fixture fail
    for note in getattr(rows, "notes", ()):
        print(f"note: {note}", file=sys.stderr)
    if args.json:
        print(to_json({"rows": [{"tensor": r[0], "max_abs_diff": r[1], "ok": row_ok(r[1], args.tol),
                                    **({"note": r.note} if getattr(r, "note", None) else {})} for r in rows],
                          "tensors": result["tensors"], "failed": result["failed"], "worst": result["worst"],
                          "tolerance": args.tol, "pass": result["pass"],
                          "notes": list(getattr(rows, "notes", ()))}, indent=2))
    else:
        print(format_table(rows, args.tol))
    return 0 if result["pass"] else 1
