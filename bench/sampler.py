"""`python -m wan_accel bench sampler`: the reference sampler path and the optimized one, side by side.

One process, the same random weights (or checkpoint) and the same inputs for every variant:

  reference             reference path, float32 weights and math, SDPA, every refresh (the parity configuration)
  reference-same-dtype  reference path in the run dtype (bf16 on CUDA): isolates the optimized path's own gain
  optimized             optimized path (wan.fast_sampler): fused q/k/v, fused kernels, CUDA graphs where possible,
                        lean refreshes, last refresh skipped; run dtype with the 'self_forcing' policy
  optimized-no-graphs   the same without CUDA graphs
  optimized-compiled    the same plus regional torch.compile (inductor)
  optimized-ops-<mode>  the optimized path with LayerNorm+modulate and RMSNorm+RoPE run by one family
                        (``FastOptions.ops``: pack, kitchen, torch; 'optimized' itself is ops auto), side by side;
                        a mode that cannot run on the device is refused before anything runs
  <variant>-int8        any of these with int8 attention (``--attention int8`` adds every chosen variant's twin);
                        vs_exact_max_abs / vs_exact_mean_abs: its latents against the exact twin's
  <variant>-fp8att      any of these with fp8 attention (``--attention fp8``), beside its exact twin the same way
  <variant>-fp8         any optimized variant with fp8 linear layers (``--linear fp8`` adds the twin of every chosen
                        optimized variant; the reference path has none), beside its exact twin in the same way;
                        linear_ran / linear_path: what ran (fp8 through scaled_mm or emulated, or exact where fp8
                        was measured slower)

Per variant: first (warm-up) and steady seconds (median of --repeat runs), per-chunk latency, DiT-only video
FPS, FLOPs and MFU (peak by compute capability; n/a on a CPU), peak memory and speedups. The per-chunk times are
medians over the timed runs, each mark taken on a device sync:

  chunk_ms            per chunk, from the previous chunk's end (the run's start for the first) to the end of its
                      cache-refresh pass (a decode's time taken out)
  denoise_ms          per chunk, from the same start to its final latents being ready, before its refresh pass:
                      where the sampler's ``on_chunk_latents`` hands a chunk to a streaming decode
  first_latents_ms    denoise_ms[0]: from the run's start to the first chunk's latents ready (first frames sooner)

Then one more, untimed run under ``profiling.dispatch_counts`` gives the structure of the path:

  parity_max_abs / parity_mean_abs  its latents against the 'reference' variant's (float32 reference)
  ops_per_step        aten ops dispatched in one steady-state chunk step (the last chunk's last denoising step:
                      re-noise, one forward, flow -> x0): a kernel-launch proxy (a CUDA graph replay counts as none)
  host_syncs          host syncs in a whole video (item(), nonzero, device->host copies, tensor->Python conversions);
                      the schedule is resolved before the counted run (host-side tables, never on the device)
  kv_bytes_per_chunk  self-attention KV bytes written per chunk, from the cache's write plan: rows written x
                      forwards of the chunk x layers x 2 (k, v) x heads x head_dim x element size
  kv_write_bytes      KV bytes counted as ``model/kv_cache.write_kv`` wrote them over the video (a slice copy or
                      index_copy_; the self-attention KV of every chunk, plus the Matrix-Game-2 action caches)

With ``--decode wan|tiny`` every chunk is also decoded to pixels as soon as it is made, and each row gets the
decode columns (decode_s, end_to_end_s, video_fps_with_decode, first_frame_s, decoder_peak_mb, ...:
bench/decode.py); the columns above stay DiT-only.
"""
from __future__ import annotations

import copy
import gc
import statistics
import time

import torch

from ..cache.json_out import to_json
from . import print_columns
from ..cache.fingerprint import cpu_name
from ..app.validate import UsageError
from .decode import ChunkDecoder, build_bench_decoder, decode_columns, decoder_peak_mb
from .sampler_setup import run_geometry, shape_config, shape_schedule, shape_window

# the variants, shapes and options are defined without torch (bench sampler --help answers at once)
from .options import ATTENTION_TWINS, FP8, TWINS, VARIANTS, sampler as add_arguments  # noqa: E402,F401


# ----------------------------------------------------------------------------- models and inputs
def _check_host_fit(args, device, kind: str, shape: str, frames: int, height: int, width: int) -> None:
    """Off CUDA, before the model is built: the run's estimate (its float32 weights, latents, KV cache and
    activations: ``validate.check_fits``) against the available RAM, which ``WAN_ACCEL_MEMORY_LIMIT_GB`` caps; a
    run that cannot fit is refused with what would (a CUDA run has its VRAM plan: ``prepare_memory``)."""
    if device.type == "cuda":
        return
    from ..app.validate import check_fits
    if args.checkpoint:
        from ..memory.weights import weights_from_checkpoint
        weights = weights_from_checkpoint(args.checkpoint)
        config, weight_bytes = weights.sampling_config(), weights.bytes_at(4)
    else:
        from ..model.checkpoint import model_class
        cfg = shape_config(kind, shape)
        with torch.device("meta"):
            weight_bytes = 4 * sum(p.numel() for p in model_class(cfg)(cfg).parameters())
        config = cfg.to_dict()
    check_fits(config, frames, height, width, device=device, dtype="fp32", kv_window=shape_window(shape)[0],
               weight_bytes=weight_bytes, names={"frames": "--frames", "height": "--height", "width": "--width"},
               window_option=False)


def _base_model(args, kind: str, shape: str):
    """float32 model on the CPU with deterministic weights (random, or the checkpoint's)."""
    from ..model.tiny import init_tiny_weights
    if args.checkpoint:
        if kind == "matrix-game2":
            from ..app.jobs.mg2 import load_mg2_handle
            return load_mg2_handle(args.checkpoint, "fp32", "float32", "auto", "cpu").model
        from ..model.loader import load_wan_checkpoint
        return load_wan_checkpoint(args.checkpoint, device="cpu", dtype=torch.float32, precision="float32")
    from ..model.checkpoint import model_class
    cfg = shape_config(kind, shape)
    model = init_tiny_weights(model_class(cfg)(cfg), args.seed).eval().requires_grad_(False)
    if getattr(args, "weights", "bf16") == "fp8":       # block linears stored as e4m3, one scale per tensor
        from ..model.random_weights import to_fp8_weights
        to_fp8_weights(model)
    return model


class _Models:
    """Device copies of the base model per (dtype, precision, attention); one at a time on the device. ``swap``: the
    VRAM plan's block swap (SwapSettings) each copy is placed with. ``build(dtype)``: a model made on the device
    instead of a base copy (the 14B shapes: drawn once in the run dtype, kept across variants of that dtype).
    ``sampler_kwargs``: a callable giving the shape's extra sampler arguments (window, sink, Krea's recompute)."""

    def __init__(self, base, device, swap=None, build=None, sampler_kwargs=None):
        self.base, self.device, self.key, self.model = base, device, None, None
        self.swap, self.build, self.sampler_kwargs = swap, build, sampler_kwargs or (lambda: {})

    def drop(self) -> None:
        """Free the device copy now: its sampler buffers (KV cache, graphs) at once, and the model with them (the
        model and its runner reference each other, so only the cycle collector frees them; a row measured after a
        switch would otherwise carry the previous copy in its peak memory)."""
        if self.model is not None:
            from ..sampling.runner import release_buffers
            release_buffers(self.model)
        self.model, self.key = None, None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def get(self, dtype: torch.dtype, precision: str, attention: str):
        key = (dtype, precision, attention)
        if key != self.key and self.build is not None and self.key is not None and self.key[:2] == key[:2]:
            from ..sampling.runner import release_buffers      # the same drawn model, another attention backend
            release_buffers(self.model)
            self.model, self.key = self.model.set_attention_backend(attention), key
        elif key != self.key:
            from .sampler_setup import place
            self.drop()
            m = (self.build(dtype) if self.build is not None
                 else place(copy.deepcopy(self.base).set_precision(precision, dtype), self.device, self.swap))
            self.model, self.key = m.set_attention_backend(attention), key
        return self.model


def _inputs(model, kind: str, shape: str, frames: int, height: int, width: int, seed: int,
            sampler_kwargs=None) -> dict:
    """The seeded inputs of one run, with the shape's schedule (host-side tables, resolved once: the Matrix-Game-2
    preset, or the shape's) and ``sampler_kwargs`` (its window / Krea recompute: ``_Models.sampler_kwargs``)."""
    from ..app.prepare import latent_frames, latent_size
    gen = torch.Generator().manual_seed(seed + 1)
    cfg = model.config
    lf = latent_frames(frames)
    lh, lw = latent_size(height, width, cfg.patch_size[1:])
    out = {"latent_frames": lf, "lh": lh, "lw": lw, "schedule": shape_schedule(kind, shape or "tiny")}
    if sampler_kwargs is not None:
        out["sampler_kwargs"] = sampler_kwargs
    if kind == "matrix-game2":
        a = model.action_config
        video = 1 + 4 * (lf - 1)
        return {**out,
                "image": torch.randn(1, 16, 1, lh, lw, generator=gen),
                "context": torch.randn(1, cfg.clip_tokens, cfg.clip_dim, generator=gen),
                "mouse": 0.1 * torch.randn(1, video, a.mouse_dim_in, generator=gen) if a.enable_mouse else None,
                "keyboard": (torch.rand(1, video, a.keyboard_dim_in, generator=gen) > 0.5).float()
                if a.enable_keyboard else None}
    return {**out, "context": torch.randn(1, min(cfg.text_len, 16), cfg.text_dim, generator=gen)}


def _sample(model, kind, inp, v, seed, on_chunk, callback=None, report=None, on_chunk_latents=None):
    from ..app.prepare import RunInputs, RunSpec, SamplingHooks, prepare
    # the one prepare step: the doctor's verdicts, the variant's compile (kept across repeats: same settings are not
    # recompiled; None: eager, models are shared between variants) and fast options
    spec = RunSpec(path=v["path"], compile=v.get("compile"), oom_retry="off", **v.get("options", {}))
    schedule = inp["schedule"]
    hooks = SamplingHooks(callback=callback, on_chunk=on_chunk, on_chunk_latents=on_chunk_latents, report=report)
    if kind == "matrix-game2":
        from ..app.jobs.mg2 import generate_mg2      # Matrix-Game-2's run: its inputs, through the same prepare
        dev = model.device
        mouse = None if inp["mouse"] is None else inp["mouse"].to(dev)
        keyboard = None if inp["keyboard"] is None else inp["keyboard"].to(dev)
        return generate_mg2(model, inp["image"].to(dev), inp["context"].to(dev), (mouse, keyboard),
                            num_frames=inp["latent_frames"], seed=seed, preset=schedule, hooks=hooks,
                            spec=spec.replace(skip_last_refresh=v["skip_last_refresh"]))
    extra = inp.get("sampler_kwargs", dict)()       # the shape's window / Krea recompute
    policy = extra.pop("cache_policy", None)
    spec = spec.replace(seed=seed, schedule=schedule, skip_last_refresh=v["skip_last_refresh"], **extra)
    noise = (1, inp["latent_frames"], model.config.out_dim, inp["lh"], inp["lw"])
    return prepare(model, spec, RunInputs(context=inp["context"], noise=noise, cache_policy=policy), hooks).latents()


def _kv_plan(model, kind, inp, v) -> list:
    """Self-attention KV bytes written in each chunk, from the cache's write plan (a meta-device cache: no memory):
    rows the chunk's plan writes x forwards of the chunk x layers x 2 (k and v) x heads x head_dim x element size."""
    from ..model.kv_cache import KVCache
    cfg = model.config
    ft = (inp["lh"] // cfg.patch_size[1]) * (inp["lw"] // cfg.patch_size[2])
    frames = inp["latent_frames"]
    sink = 0
    if kind == "matrix-game2":
        window, steps = inp["schedule"].window, len(inp["schedule"].schedule.timesteps)
    else:
        extra = inp.get("sampler_kwargs", dict)()
        window, sink, steps = extra.get("kv_window", -1), extra.get("sink", 0), len(inp["schedule"].timesteps)
    kv = KVCache.for_model(model, 1, ft, frames, window, sink, device="meta")
    row = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * torch.empty(0, dtype=model.compute_dtype).element_size()
    starts = list(range(0, frames, 3))
    out = []
    for i, f0 in enumerate(starts):
        step = kv.plan(f0 * ft, min(3, frames - f0) * ft)
        rows = sum(s1 - s0 for _d0, _d1, s0, s1 in step.writes)
        forwards = steps + (0 if v["skip_last_refresh"] and i == len(starts) - 1 else 1)
        out.append(rows * forwards * row)
    return out


def _count_run(model, kind, inp, v, seed) -> tuple:
    """One untimed run under the dispatch counter: (latents on the CPU, structure figures)."""
    from ..profiling.dispatch_counts import DispatchCounts
    with torch.no_grad(), DispatchCounts() as counts:
        out = _sample(model, kind, inp, v, seed, None, callback=counts.step_callback())
    steady = counts.steady_step()
    plan = _kv_plan(model, kind, inp, v)
    return out.float().cpu(), {
        "ops_per_step": steady.ops, "ops_per_video": counts.ops, "host_syncs": counts.syncs,
        "host_sync_ops": dict(counts.sync_names), "syncs_per_step": steady.syncs,
        "kv_bytes_per_chunk": plan, "kv_bytes_per_video": sum(plan), "kv_write_bytes": counts.kv_write_bytes}


# ----------------------------------------------------------------------------- timing
def _time_variant(name, args, models: _Models, kind, run_dtype, frames, height, width, peak, decoder=None,
                  progress=None) -> tuple:
    """One variant's row and latents. ``progress(text)``: told of every run and chunk as it finishes (stderr); the
    time it takes is left out of every figure (each chunk's clock starts again after it)."""
    from ..model import flops as fl
    from ..app.jobs.handle import parse_dtype
    from ..profiling.runner import peak_memory_mb, sync_device
    v = VARIANTS[name]
    dtype = parse_dtype(v["dtype"] or run_dtype)
    precision = "float32" if dtype == torch.float32 else v["precision"]
    device = models.device
    tell = progress or (lambda _text: None)
    tell(f"{name}: preparing the model ({str(dtype).replace('torch.', '')}, {precision}, attention "
         f"{v['attention']})")
    model = models.get(dtype, precision, v["attention"])
    inp = _inputs(model, kind, args.shape, frames, height, width, args.seed, models.sampler_kwargs)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, chunks, ran, totals, decodes, denoised = [], [], {}, [], [], []
    first_peak = None
    runs = 1 + max(1, args.repeat)
    for i in range(runs):
        if i == 1:      # the warm-up video's peak includes one-time work (measuring, capturing); then the steady one
            first_peak = peak_memory_mb(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
        what = (f"{name}: warm-up run (first_s, with its one-time work)" if i == 0 else
                f"{name}: timed run {i}/{runs - 1}") + (f" with --decode {decoder.kind}" if decoder is not None else "")
        tell(what)
        marks, ready, resumed = [], [], []
        sync_device(device)
        t0 = time.perf_counter()
        dec = ChunkDecoder(decoder, device, t0) if decoder is not None else None

        def on_chunk(ci, n, what=what, marks=marks, resumed=resumed):
            sync_device(device)
            marks.append(time.perf_counter())
            tell(f"{what}: chunk {ci + 1}/{n} done")
            resumed.append(time.perf_counter())          # the next chunk's clock starts after the progress line

        def on_latents(ci, n, x0, dec=dec, ready=ready):     # before the chunk's refresh pass (and its decode)
            sync_device(device)
            ready.append(time.perf_counter())
            if dec is not None:
                dec(ci, n, x0)

        ran.clear()
        _sample(model, kind, inp, v, args.seed, on_chunk, report=ran, on_chunk_latents=on_latents)
        sync_device(device)
        totals.append(time.perf_counter() - t0 - sum(r - m for m, r in zip(marks, resumed)))
        decodes.append(dec)
        if dec is not None:
            dec.check(decoder.kind)                       # the frames it timed are finite, or no figure at all
        spent = dec.decode_s if dec is not None else [0.0] * len(marks)     # the DiT-only figures leave it out
        times.append(totals[-1] - sum(spent))
        starts = [t0] + resumed[:-1]
        chunks.append([b - a - d for a, b, d in zip(starts, marks, spent)])
        denoised.append([r - a for a, r in zip(starts, ready)])      # a chunk's decode comes after its mark
    peak_memory = peak_memory_mb(device)
    tell(f"{name}: one more untimed run counting the dispatched ops and host syncs")
    output, structure = _count_run(model, kind, inp, v, args.seed)
    if decoder is not None:
        structure = {**structure, "decode": decoder.kind, **decode_columns(decodes[1:], totals[1:], decoder),
                     "decoder_peak_mb": decoder_peak_mb(decoder, output, decodes[0].chunk_frames, device)}
    steady = statistics.median(times[1:])
    timed = chunks[1:]
    per_chunk = [statistics.median(c[i] for c in timed) for i in range(len(timed[0]))]
    per_denoise = [statistics.median(d[i] for d in denoised[1:]) for i in range(len(denoised[1]))]
    cfg = model.config
    ph, pw = cfg.patch_size[1:]
    steps = 3 if kind == "matrix-game2" else 4
    geo = fl.Geometry(1, inp["latent_frames"], (inp["lh"] // ph) * (inp["lw"] // pw),
                      kv_window=cfg.local_attn_size if kind == "matrix-game2" else -1)
    work = fl.run_flops(cfg, geo, steps, optimized=v["path"] == "optimized", skip_last_refresh=v["skip_last_refresh"])
    util = fl.mfu(work["flops"], steady, peak)
    from ..compile.apply import compile_handle
    compiled = compile_handle(model) if v.get("compile") is not None else None
    what_ran = {"attention_ran": str(ran.get("attention", v["attention"])),
                "linear": v.get("options", {}).get("linear", "exact"), "linear_ran": str(ran.get("linear", "exact")),
                "linear_path": ran.get("linear_path"),
                "compile_failed": compiled.failed if compiled is not None else None}
    return {**what_ran, "variant": name, "path": v["path"], "dtype": str(dtype).replace("torch.", ""), "precision": precision,
            "attention": v["attention"], "ops": variant_ops(name) if v["path"] == "optimized" else None,
            "first_s": round(times[0], 4), "steady_s": round(steady, 4),
            "chunk_ms": [round(1e3 * c, 2) for c in per_chunk],
            "chunk_ms_mean": round(1e3 * statistics.mean(per_chunk), 2),
            "denoise_ms": [round(1e3 * d, 2) for d in per_denoise], "first_latents_ms": round(1e3 * per_denoise[0], 2),
            "video_fps": round(frames / steady, 2), "latent_fps": round(inp["latent_frames"] / steady, 2),
            "forwards": work["forwards"], "flops": work["flops"], "tflop": round(work["flops"] / 1e12, 6),
            "tflops_per_s": round(work["flops"] / steady / 1e12, 4),
            "mfu": None if util is None else round(util, 4), "peak_memory": peak_memory,
            "first_video_peak_memory": first_peak,
            **structure}, output


def _differences(rows: list, outputs: list, reference) -> None:
    """parity_max_abs / parity_mean_abs of every row's latents against the reference latents (None without), and
    vs_exact_max_abs / vs_exact_mean_abs of every int8, fp8 attention or fp8 linear row against its exact twin's
    latents (when it ran)."""
    by_name = {r["variant"]: o for r, o in zip(rows, outputs)}
    for r, out in zip(rows, outputs):
        r["parity_max_abs"] = r["parity_mean_abs"] = None
        for key, other in (("parity", reference), ("vs_exact", by_name.get(exact_twin(r["variant"])))):
            if other is not None:
                diff = (out - other).abs()
                r[f"{key}_max_abs"], r[f"{key}_mean_abs"] = float(diff.max()), float(diff.mean())


def _variant_names(args, run_dtype: str) -> list:
    if args.variants:
        names = [n.strip() for n in args.variants.split(",") if n.strip()]
    else:
        names = ["reference", "optimized"]
        if run_dtype != "fp32":
            names.insert(1, "reference-same-dtype")
    suffix = ATTENTION_TWINS.get(getattr(args, "attention", None))
    if suffix:
        names = [m for n in names for m in ((n,) if n.endswith(suffix) else (n, n + suffix))]
    if getattr(args, "linear", None) == "fp8":
        names = [m for n in names for m in ((n, n + FP8) if n + FP8 in VARIANTS else (n,))]
    return names


def exact_twin(name: str) -> str | None:
    """The variant an approximate twin is compared with: its name without the last twin suffix."""
    return next((name[:-len(t)] for t in TWINS if name.endswith(t)), None)


def variant_ops(name: str) -> str:
    """The FastOptions.ops of a variant ('auto' unless it names one)."""
    return VARIANTS[name].get("options", {}).get("ops", "auto")


def _history(result: dict) -> None:
    try:
        from ..profiling import history
        for r in result["rows"]:
            history.append(history.make_record(
                "bench", label=f"sampler/{r['variant']}" + (f"+decode-{r['decode']}" if "decode" in r else ""),
                settings={k: result[k] for k in ("model", "model_kind", "shape", "frames", "height", "width",
                                                  "device")} | {"dtype": r["dtype"], "path": r["path"]},
                timings={"total_s": r["steady_s"], "first_s": r["first_s"], "frames_per_s": r["video_fps"],
                         "tflops_per_s": r["tflops_per_s"], "mfu": r["mfu"]}
                | {k: r[k] for k in ("decode_s", "end_to_end_s", "video_fps_with_decode", "first_frame_s") if k in r},
                peak_memory_bytes=int(r["peak_memory"].get("cuda_max_allocated_mb", 0) * 2 ** 20) or None))
    except Exception:  # noqa: BLE001 - the history is a bonus, never a failure
        pass


def run(args) -> int:
    from ..model import flops as fl
    from ..app.jobs.handle import default_device
    device = torch.device(args.device) if args.device else default_device()
    kind = args.model_kind
    shape = args.shape or "tiny"
    run_dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    names = _variant_names(args, run_dtype)
    refused = [n for n in names if n.endswith(FP8) and n not in VARIANTS and n[:-len(FP8)] in VARIANTS]
    if refused:
        raise UsageError(f"--variants {refused[0]}: the reference path has no fp8 linear mode (it keeps every layer "
                         f"exact); fp8 twins exist for the optimized variants (e.g. optimized{FP8})")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise UsageError(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if getattr(args, "linear", None) == "fp8" and not any(n.endswith(FP8) for n in names):
        raise UsageError(f"--linear fp8 adds an fp8 twin to each optimized variant, and --variants "
                         f"{args.variants} has none (the reference path keeps every layer exact): add optimized to "
                         f"--variants, or leave out --linear")
    from ..kernels.candidates import mode_problem
    for n in names:             # an ops mode that cannot run on the device: refused before any model is built
        problem = mode_problem(variant_ops(n), device) if VARIANTS[n]["path"] == "optimized" else None
        if problem:
            raise UsageError(f"--variants {n}: {problem}; leave {n} out")
    if args.vae and args.decode == "none":      # bad --decode values are refused by the parser's choices
        raise UsageError("--vae gives weights for a decoder: add --decode wan (a Wan 2.1 VAE file) or --decode tiny "
                         "(a taew2_1 file)")
    from . import sampler_setup as setup
    setup.check_options(args, device, names, VARIANTS)      # shape, --weights, --memory-cap-gb: before any work
    frames, height, width = run_geometry(args, kind, shape)
    peak, peak_src = fl.peak_tflops(device, args.peak_tflops)
    from ..app.progress import Progress
    from ..app.jobs.handle import parse_dtype
    progress = Progress("bench sampler")
    progress(f"{len(names)} variant(s) ({', '.join(names)}), {1 + max(1, args.repeat)} runs each (1 warm-up), "
             f"{frames} frames at {width}x{height} on {device}")
    _check_host_fit(args, device, kind, shape, frames, height, width)                 # CPU: the estimate first
    memory = setup.prepare_memory(args, device, kind, shape, frames, height, width)    # the cap, then the plan
    info = {**memory["memory"], "parity_off": setup.parity_off(args)}
    if memory["refused"]:
        progress(memory["refused"])
        if args.json:
            print(to_json({"device": str(device), "shape": shape, "error": "does not fit",
                              "message": memory["refused"], **info, "rows": []}, indent=2))
        else:
            print(f"bench sampler: {memory['refused']}")
        return 1
    if args.decode != "none":
        progress(f"building the {args.decode} decoder" + (f" from {args.vae}" if args.vae else " (random weights)"))
    decoder = build_bench_decoder(args, device, parse_dtype(run_dtype), shape)
    progress(f"loading {args.checkpoint}" if args.checkpoint else f"building the random {shape} {kind} model")
    run_kwargs = setup.sampler_kwargs(shape if not args.checkpoint else "1.3b", memory["kv_window"])
    if shape in setup.ON_DEVICE_SHAPES and not args.checkpoint:    # drawn on the device in the run dtype, once
        cfg = setup.shape_config(kind, shape)
        models = _Models(None, device, swap=memory["swap"], sampler_kwargs=run_kwargs,
                         build=lambda dt: setup.device_model(cfg, device, dt, args.seed, args.weights, memory["swap"]))
    else:
        models = _Models(_base_model(args, kind, shape), device, swap=memory["swap"], sampler_kwargs=run_kwargs)
    timed, failed = [], []
    from ..memory.oom import is_oom
    for k, n in enumerate(names):
        try:
            timed.append(_time_variant(n, args, models, kind, run_dtype, frames, height, width, peak, decoder,
                                       lambda text, k=k: progress(f"[{k + 1}/{len(names)}] {text}")))
            timed[-1][0]["weights"] = getattr(args, "weights", "bf16")
            timed[-1][0]["model_bytes"] = setup.model_bytes(models.model)
        except Exception as exc:  # noqa: BLE001 - out of memory becomes the row's answer; anything else is raised
            if not is_oom(exc):
                raise
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            progress(f"[{k + 1}/{len(names)}] {n}: out of memory ({detail[:160]})")
            failed.append({"variant": n, "error": "out of memory", "detail": detail[:300]})
            models.drop()
    rows, outputs = [r for r, _o in timed], [o for _r, o in timed]
    reference = next((o for r, o in timed if r["variant"] == "reference"), None)
    if reference is None and rows and not (getattr(args, "no_parity", False) or info["parity_off"]):
        # parity needs the reference latents: one untimed reference run
        progress("one untimed float32 reference run for the parity columns (--no-parity skips it)")
        v = VARIANTS["reference"]
        model = models.get(torch.float32, v["precision"], v["attention"])
        inp = _inputs(model, kind, args.shape, frames, height, width, args.seed, models.sampler_kwargs)
        reference = _sample(model, kind, inp, v, args.seed, None).float().cpu()
    _differences(rows, outputs, reference)
    models.drop()
    base = rows[0]["steady_s"] if rows else None
    same = {r["dtype"]: r["steady_s"] for r in rows if r["path"] == "reference"
            and r["attention"] not in ATTENTION_TWINS}
    for r in rows:
        r["first_chunk_ms"] = r["chunk_ms"][0] if r.get("chunk_ms") else None
        r["speedup_vs_first"] = round(base / r["steady_s"], 3) if r["steady_s"] else None
        ref = same.get(r["dtype"])
        r["speedup_vs_reference_same_dtype"] = round(ref / r["steady_s"], 3) if ref and r["steady_s"] else None
    result = {"device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
              else cpu_name(), "threads": torch.get_num_threads(), "model": args.checkpoint or f"random {shape}", "model_kind": kind, "shape": shape,
              "frames": frames, "height": height, "width": width, "peak_tflops": peak, "peak_source": peak_src,
              "torch": torch.__version__, "decode": args.decode, "vae": args.vae, **info, "rows": rows}
    _history(result)
    result["rows"] = rows + failed          # a variant that ran out of memory: its row says so
    if args.json:
        print(to_json(result))
        return 0 if rows else 1
    print(f"sampler bench on {result['device_name']} ({device}), {kind} {result['model']}, {frames} frames "
          f"{width}x{height}; peak {peak if peak else 'n/a'} TFLOP/s ({peak_src})"
          + (f"; each chunk decoded by {args.decode} ({args.vae or 'random weights'})" if decoder is not None else ""))
    plan = info.get("plan")
    if info.get("memory_cap_gb") is not None or getattr(args, "weights", "bf16") != "bf16" or (plan and plan["blocks_to_swap"]):
        print(f"weights {getattr(args, 'weights', 'bf16')}; memory cap {info.get('memory_cap_gb') or 'none'}" + (
            f"; VRAM plan: {plan['blocks_to_swap']} of {plan['blocks_total']} blocks swapped, KV window "
            f"{plan['kv_window']}, estimated peak {plan['estimated_peak_gb']} GiB of {plan['budget_gb']} GiB "
            f"({plan['reasons'].get('blocks_to_swap', '')})" if plan else ""))
    for r in failed:
        print(f"{r['variant']}: out of memory ({r['detail']})")
    if not rows:
        return 1
    cols = ["variant", "dtype", "ops", "first_s", "steady_s", "chunk_ms_mean", "video_fps", "tflop", "mfu",
            "speedup_vs_first", "speedup_vs_reference_same_dtype", "parity_max_abs", "parity_mean_abs",
            "ops_per_step", "host_syncs", "kv_kb_per_chunk"]
    if decoder is not None:
        cols += ["decode_s", "end_to_end_s", "video_fps_with_decode", "first_frame_s", "decode_share",
                 "decoder_peak_mb"]
    if any(r["linear"] != "exact" for r in rows):
        cols += ["linear_ran", "linear_path"]
    if any("vs_exact_max_abs" in r for r in rows):
        cols.append("vs_exact_max_abs")
    shown = [dict(r, parity_max_abs=_sci(r["parity_max_abs"]), parity_mean_abs=_sci(r["parity_mean_abs"]),
                  vs_exact_max_abs=_sci(r.get("vs_exact_max_abs")),
                  kv_kb_per_chunk=round(max(r["kv_bytes_per_chunk"]) / 1024, 1)) for r in rows]
    print_columns(cols, [[r[c] for c in cols] for r in shown])
    return 0


def _sci(value) -> str | None:
    return None if value is None else f"{value:.2e}"
