"""The `generate` job: load a model, sample latents, write latents.safetensors, a preview and report.json."""
from __future__ import annotations

import json
import os
import re
import resource
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ...cache.owned_files import check_target, write_text, write_with
from ..ranks.parallel import enable_parallel, parallel_report

VAE_TIME_STRIDE, VAE_SPACE_STRIDE = 4, 8
TINY_DEFAULTS = {"frames": 33, "height": 128, "width": 128}
MODEL_DEFAULTS = {"frames": 81, "height": 480, "width": 832}


def latent_frames(video_frames: int) -> int:
    """Video frames -> latent frames, (n - 1) / 4 + 1; clear error when n is not 4k + 1."""
    if video_frames < 1 or (video_frames - 1) % VAE_TIME_STRIDE:
        k = max(0, (video_frames - 1) // VAE_TIME_STRIDE)
        raise ValueError(f"{video_frames} video frames is not 4k+1 (the Wan VAE packs 4 frames per latent "
                         f"frame after the first); use {VAE_TIME_STRIDE * k + 1} or "
                         f"{VAE_TIME_STRIDE * (k + 1) + 1}")
    return (video_frames - 1) // VAE_TIME_STRIDE + 1


def latent_size(height: int, width: int, patch=(2, 2)) -> tuple[int, int]:
    """Pixel size -> latent size (/8); must be divisible by 8 * patch (16 for Wan 2.1)."""
    mh, mw = VAE_SPACE_STRIDE * patch[0], VAE_SPACE_STRIDE * patch[1]
    if height % mh or width % mw or height <= 0 or width <= 0:
        raise ValueError(f"width x height {width}x{height} must be positive multiples of {mw}x{mh}")
    return height // VAE_SPACE_STRIDE, width // VAE_SPACE_STRIDE


def load_text_embeds(path, text_dim: int, key: str | None = None) -> torch.Tensor:
    """A text embedding [L, text_dim] or [1, L, text_dim] from a safetensors file (key 'context' or the only
    tensor, or the tensor ``key``) -> [1, L, text_dim]."""
    from safetensors.torch import load_file
    tensors = load_file(str(path))
    if key is not None:
        t = tensors[key]
        path = f"{path} [{key!r}]"
    elif "context" in tensors:
        t = tensors["context"]
    elif len(tensors) == 1:
        t = next(iter(tensors.values()))
    else:
        raise ValueError(f"{path}: expected a tensor named 'context' (found {sorted(tensors)[:5]})")
    t = t[None] if t.dim() == 2 else t
    if t.dim() != 3 or t.shape[0] != 1 or t.shape[-1] != text_dim:
        raise ValueError(f"{path}: text embedding must be [L, {text_dim}] or [1, L, {text_dim}], got {tuple(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"{path}: text embedding must hold floating-point numbers (bf16/fp16/fp32), got {t.dtype}; "
                         f"write the umt5 encoder's output as it is")
    t = t.float()
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{path}: text embedding holds NaN or inf values (it would give a NaN video); encode the "
                         f"prompt again")
    return t


SCHEDULE_BYTES = 1 << 20           # a prompt schedule file larger than this is not one
_SCHEDULE_START = re.compile(r"^\s*[+-]?\d[^:\n]*:")     # a schedule's first line starts '<chunk>:'


def read_prompt_schedule(option: str, value) -> str:
    """The text of ``value``: the user's file (``validate.read_user_file``: a folder, a pipe, a device, a missing
    or over-large file each get their own message; nothing is changed), or ``value`` itself when it reads as a
    schedule (several lines, or a first line '<chunk>: <prompt>') and names no file. UsageError naming ``option``;
    text that is not UTF-8 is refused here, before any work."""
    from ..validate import UsageError, check_text, read_user_file, shown, user_text
    text = "" if value is None else str(value)
    if not text.strip():
        raise UsageError(f"{option} is empty: give a schedule file or its text, e.g. '0: a cat walks'")
    first = next((ln for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")), "")
    schedule_like = "\n" in text or _SCHEDULE_START.match(first) is not None
    if schedule_like:
        try:
            named = "\n" not in text and os.path.lexists(os.path.expanduser(text))
        except (OSError, ValueError):       # a name too long for a path, a NUL byte: the text itself
            named = False
        if not named:
            return check_text(option, text)
    try:
        data = read_user_file(option, text, what="a prompt schedule file", limit=SCHEDULE_BYTES)
    except UsageError as exc:
        if "no such file" in str(exc) and not schedule_like:
            raise UsageError(f"{option} {shown(text)}: no such file, and not a schedule text (its lines are "
                             f"'<chunk>: <prompt>', starting with a chunk number, e.g. '0: a cat walks'); check "
                             f"the path") from None
        raise
    return check_text(option, user_text(option, data, text))


def check_prompt_schedule(option: str, text: str, latent_frames: int, frames_per_block: int):
    """The parsed schedule, checked against the run's chunks; UsageError ``option: <the schedule's reason>``."""
    from ...sampling.prompts import PromptSchedule
    from ...sampling.sampler import chunk_plan
    from ..validate import UsageError
    try:
        return PromptSchedule.parse(text).validate(len(chunk_plan(latent_frames, frames_per_block)))
    except ValueError as exc:
        raise UsageError(f"{option}: {exc}") from None


def schedule_embeddings(schedule, handle, text_embeds) -> dict:
    """{text: raw context [1, L, text_dim]} for every text of ``schedule``: the tiny model's stand-in encoder, or
    the tensors of ``text_embeds`` named by the texts."""
    cfg = handle.model.config
    if text_embeds is None:
        if not handle.is_tiny:
            raise ValueError("a prompt schedule on a checkpoint needs text_embeds: one umt5 embedding per prompt "
                             "text, each named by its text")
        from ...model.tiny import tiny_text_embedding
        return {t: tiny_text_embedding(t, cfg.text_len, cfg.text_dim) for t in schedule.texts()}
    from safetensors import safe_open
    with safe_open(str(text_embeds), framework="pt", device="cpu") as f:
        names = set(f.keys())
    missing = [t for t in schedule.texts() if t not in names]
    if missing:
        raise ValueError(f"{text_embeds}: no embedding named {missing[0]!r}; write one tensor per prompt text of the "
                         f"schedule, named by the text (found {sorted(names)[:5]})")
    return {t: load_text_embeds(text_embeds, cfg.text_dim, key=t) for t in schedule.texts()}


def sample_latents(model, context, width: int, height: int, num_frames: int, seed: int = 0,
                   schedule="self_forcing", frames_per_block: int = 3, kv_window: int = -1, sink: int = 0,
                   skip_last_refresh: bool = False, callback=None, on_chunk=None, batch: int = 1,
                   path: str = "auto", fast_options=None, report: dict | None = None,
                   oom_retry: str = "auto", on_chunk_latents=None, **prompts) -> torch.Tensor:
    """Pixel-space request (width, height, video frames) -> model-space latents [B, F, 16, H/8, W/8].
    Validates the geometry (4k+1 frames, multiples of 16, whole blocks) before any work.
    path / fast_options / report: see ``sampling.sampler.sample_causal`` (optimized path by default on CUDA).
    oom_retry: 'auto' (CUDA) | 'on' | 'off': on out-of-memory in a chunk, swap more blocks and redo it
    (``memory.sampling_guard``). on_chunk_latents: each chunk's latents before its refresh pass (a streaming
    decode). prompts: prompt_schedule / prompt_embeddings / recache of ``sample_causal``."""
    from ...memory.sampling_guard import oom_guard
    from ...sampling.sampler import generate_latents
    lf, lh, lw = _latent_geometry(model, width, height, num_frames, frames_per_block, kv_window, sink, batch)
    guard = oom_guard(model, (batch, lf, model.config.out_dim, lh, lw), frames_per_block, mode=oom_retry)
    return generate_latents(model, context, lf, lh, lw, seed=seed, batch=batch, schedule=schedule,
                            frames_per_block=frames_per_block, kv_window=kv_window, sink=sink,
                            skip_last_refresh=skip_last_refresh, callback=callback, on_chunk=on_chunk,
                            path=path, fast_options=fast_options, report=report, chunk_guard=guard,
                            on_chunk_latents=on_chunk_latents, **prompts)


def _latent_geometry(model, width: int, height: int, num_frames: int, frames_per_block: int, kv_window: int = -1,
                     sink: int = 0, batch: int = 1) -> tuple:
    """(latent frames, latent height, latent width), after the one geometry check of every entry point (4k+1
    frames, multiples of 16, whole blocks, window and sink; its advice passes it) and the memory estimate of the
    run on the model's device (``validate.check_fits``: refused before any tensor is made). The command line and
    the nodes check both earlier with their own input names; repeating them here costs one memory query."""
    from ...model.attachments import seq_parallel_of
    from ..validate import check_fits, check_geometry
    names = {"frames": "num_frames"}
    check_geometry(num_frames, height, width, frames_per_block, kv_window, sink, names=names)
    sp = seq_parallel_of(model)
    check_fits(model.config.to_dict(), num_frames, height, width, device=model.device,
               dtype=str(model.compute_dtype), frames_per_block=frames_per_block, kv_window=kv_window,
               batch=batch, names=names, world=sp.world if sp is not None else 1)
    lf = latent_frames(num_frames)
    lh, lw = latent_size(height, width, model.config.patch_size[1:])
    return lf, lh, lw


def sample_latents_with_state(model, context, width: int, height: int, num_frames: int, seed: int = 0,
                              schedule="self_forcing", frames_per_block: int = 3, kv_window: int = -1,
                              sink: int = 0, state=None, keep_state: bool = True, state_device="cpu",
                              oom_retry: str = "auto", **kwargs):
    """``sample_latents`` that can continue a video: ``num_frames`` is the video length to reach (4k+1 video
    frames); with ``state`` (a ``SamplerState``) only the frames after it are sampled, exactly as one long run
    would have. Returns (latents of the new frames [B, n, 16, H/8, W/8], the state after them or None when
    ``keep_state`` is off; kept on ``state_device``, the CPU by default, between prompts)."""
    from ...memory.sampling_guard import oom_guard
    from ...sampling.continuation import sample_continuable
    batch = int(kwargs.pop("batch", 1))
    lf, lh, lw = _latent_geometry(model, width, height, num_frames, frames_per_block, kv_window, sink, batch)
    guard = oom_guard(model, (batch, lf, model.config.out_dim, lh, lw), frames_per_block, mode=oom_retry)
    return sample_continuable(model, context, lf, lh, lw, seed=seed, batch=batch, schedule=schedule,
                              frames_per_block=frames_per_block, kv_window=kv_window, sink=sink, state=state,
                              keep_state=keep_state, state_device=state_device, chunk_guard=guard, **kwargs)


def sampler_setup(handle, path: str = "auto", cuda_graphs: str = "auto", fused_kernels: bool = True,
                  log=None, doctor: bool = True, notes: list | None = None, record: dict | None = None,
                  ops: str = "auto", keep_slower: bool = False, linear: str = "exact"):
    """FastOptions for a handle, with its block swap / VRAM plan and its compile settings applied to the model.

    The swap carried by the handle (or its plan's) is (re)applied on CUDA, or removed when the handle has none;
    the handle's compile settings compile the blocks (scope 'blocks': the optimized path calls them directly) unless
    they already are; a reference run removes a regional compile left by an optimized run (it runs eager).

    doctor: each accelerated feature the run is about to use is checked on this machine first (once; the verdict
    is remembered in the limit cache, ``app/doctor/core.py``); one that failed or was slower is switched off and a
    line saying so goes to ``log`` and to ``notes`` (a failed fallback too); ``record`` (``gate.new_record()``)
    receives {feature: why} of both. ops: which implementation runs the normalization ops (``FastOptions.ops``);
    linear: 'exact' or the opt-in 'fp8' (``FastOptions.linear``)."""
    from ..doctor.gate import gate_compile, gate_options, gate_swap
    from ...memory.block_swap import ensure_block_swap, handle_swap_settings
    from .handle import _planned_swap
    from ...sampling.runner import FastOptions
    from ...sampling.sampler import PATHS, resolve_path
    if path not in PATHS:
        raise ValueError(f"sampler must be one of {PATHS}, got {path!r}")
    model = handle.model
    settings = handle_swap_settings(handle)
    plan = getattr(handle, "plan", None)
    if settings is None and plan is not None:
        settings = _planned_swap(plan)
    lines = notes if notes is not None else []
    if doctor and model.device.type == "cuda":
        settings = gate_swap(model, settings, log_fn=log, lines=lines, record=record)
    if model.device.type == "cuda" or settings is None:
        ensure_block_swap(model, settings, device=model.device)
    optimized = resolve_path(path, model.device, model=model)[0] != "reference"
    if not optimized:
        from ...compile import uncompile_model
        if uncompile_model(model) and log is not None:
            log("reference sampler: removed the regional compile of an earlier optimized run")
    else:
        compile_settings = getattr(handle, "compile_settings", None)
        if doctor and compile_settings is not None:
            compile_settings = gate_compile(model, compile_settings, log_fn=log, lines=lines, record=record)
            if compile_settings is None:
                from ...compile import uncompile_model
                uncompile_model(model)
        compile_for_sampling(model, compile_settings, log=log)
    options = FastOptions(cuda_graphs=cuda_graphs, fused_kernels=bool(fused_kernels), ops=ops,
                          keep_slower=bool(keep_slower), linear=linear)
    if doctor and optimized:
        options, switched = gate_options(model, options, log_fn=log, record=record)
        lines.extend(switched)
    return options


def compile_for_sampling(model, settings, log=None) -> str | None:
    """Regional compile of the blocks for the optimized sampler (None settings: nothing); returns the mode."""
    if settings is None:
        return None
    from ...compile import uncompile_model
    from ...compile.apply import compile_handle, compile_model
    from ...compile.presets import graph_safe_settings
    from ...compile.settings import coerce_settings
    s = coerce_settings(settings)
    if s.scope != "blocks":
        if log is not None:
            log("compile scope set to 'blocks' (the optimized path calls the blocks directly)")
        s = s.replace(scope="blocks")
    safe, note = graph_safe_settings(s)         # the sampler's own CUDA graphs stay in charge of capture
    if note and log is not None:
        log(note)
    if safe is None:
        uncompile_model(model)
        return s.backend
    handle = compile_handle(model)
    if handle is None or handle.settings != safe:
        compile_model(model, safe)
    return safe.mode if safe.backend == "inductor" else safe.backend


@dataclass
class GenerateOptions:
    out_dir: str = "wan_accel_out"
    checkpoint: str | None = None        # .safetensors; None = built-in tiny model
    text_embeds: str | None = None       # .safetensors with the prompt's umt5 embedding
    frames: int | None = None            # video frames (4k+1)
    height: int | None = None
    width: int | None = None
    seed: int = 0
    preset: str = "self_forcing"
    steps: str | None = None             # custom step list, e.g. "1000,750,500,250"
    shift: float | None = None
    warp: bool | None = None
    device: str | None = None            # default: cuda if available else cpu
    dtype: str | None = None             # bf16 / fp16 / fp32; default fp32 on cpu, bf16 on cuda
    precision: str = "self_forcing"
    attention: str = "auto"
    frames_per_block: int = 3
    kv_window: int = -1
    sink: int = 0
    skip_last_refresh: bool = False
    num_heads: int | None = None
    lora: str | None = None              # a LoRA .safetensors merged into the weights at load (model/lora.py)
    lora_strength: float = 1.0
    preview: bool = True
    sampler: str = "auto"                # auto (optimized on CUDA) | optimized | reference
    cuda_graphs: str = "auto"            # auto | off (optimized path)
    fused_kernels: bool = True           # optimized path
    ops: str = "auto"                    # optimized path: auto | pack | kitchen | torch (kernels/candidates.py)
    compile: bool = False                # regional torch.compile of the blocks (optimized path)
    prompt_schedule: str | None = None   # the text of a prompt schedule (sampling/prompts.py); None: one prompt
    recache: str = "switch"              # switch (LongLive KV re-cache at a prompt switch) | none | krea (recompute)
    keep_slower: bool = False            # keep int8 attention / fp8 linear where measured slower than exact (optimized)
    linear: str = "exact"                # exact | fp8 (opt-in, approximate; optimized path: 'auto' becomes 'optimized')


def _peak_memory(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"cuda_max_allocated_mb": torch.cuda.max_memory_allocated(device) / 2**20,
                "cuda_max_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"host_max_rss_mb": rss / (2**20 if sys.platform == "darwin" else 2**10)}


class ChunkTimer:
    """Per-chunk wall time of a sampling run (device-synchronised), logged as it goes; call it as ``on_chunk``."""

    def __init__(self, device, log, progress=None):
        self.device, self.log, self.progress = device, log, progress
        self.seconds: list[float] = []
        self._mark = 0.0

    def start(self) -> float:
        _sync(self.device)
        self._mark = time.perf_counter()
        return self._mark

    def __call__(self, ci: int, n: int) -> None:
        _sync(self.device)
        now = time.perf_counter()
        self.seconds.append(now - self._mark)
        self._mark = now
        self.log(f"chunk {ci + 1}/{n}: {self.seconds[-1]:.3f} s")
        if self.progress is not None:
            self.progress(ci, n)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _resolve(opts: GenerateOptions):
    from .handle import default_device
    device = torch.device(opts.device) if opts.device else default_device()
    dtype = opts.dtype or ("bf16" if device.type == "cuda" else "fp32")
    defaults = MODEL_DEFAULTS if opts.checkpoint else TINY_DEFAULTS
    pick = lambda value, key: defaults[key] if value is None else value  # noqa: E731 - 0 is an error, not "default"
    frames, height, width = pick(opts.frames, "frames"), pick(opts.height, "height"), pick(opts.width, "width")
    return device, dtype, frames, height, width


FP8_PATH_NOTE = "linear fp8: the optimized sampler path runs (the only one with fp8 linear layers)"


def optimized_for_fp8(opts):
    """(opts, note): the fp8 linear mode lives on the optimized path, so sampler 'auto' means 'optimized' with it;
    an explicit 'reference' is refused (ValueError naming the fix)."""
    if getattr(opts, "linear", "exact") == "exact":
        return opts, None
    if opts.sampler == "reference":
        raise ValueError("linear fp8 runs on the optimized sampler path only; use sampler optimized (or auto), or "
                         "linear exact")
    if opts.sampler == "auto":
        return replace(opts, sampler="optimized"), FP8_PATH_NOTE
    return opts, None


def run_generate(opts: GenerateOptions, progress=None, log=print, parallel=None) -> dict:
    """Run the job; progress(chunk, step, num_chunks, num_steps) per step. Returns the report dict.
    parallel: this rank's ``SeqParallel`` (``app/ranks/parallel.py``) to sample sequence-parallel; rank 0 writes the files."""
    from .handle import load_model_handle
    from ...sampling.scheduler import resolve_schedule
    device, dtype, frames, height, width = _resolve(opts)
    opts, path_note = optimized_for_fp8(opts)
    if _writes(parallel):
        check_outputs(opts.out_dir)
    t0 = time.perf_counter()
    compile_settings = None
    if opts.compile:
        from ...compile import CompileSettings
        compile_settings = CompileSettings()
    handle = load_model_handle(opts.checkpoint, dtype, opts.precision, opts.attention, device,
                               num_heads=opts.num_heads, compile_settings=compile_settings, lora=opts.lora,
                               lora_strength=opts.lora_strength)
    model, notes = handle.model, [path_note] if path_note else []
    if path_note:
        log(path_note)
    enable_parallel(model, parallel)
    if handle.is_tiny:
        log("using the built-in tiny random model (deterministic random weights; output is not a real video)")
        notes.append("tiny random model")
    load_s = time.perf_counter() - t0
    cfg = model.config
    if opts.text_embeds and opts.prompt_schedule is None:
        context = load_text_embeds(opts.text_embeds, cfg.text_dim)
    else:
        context = torch.zeros(1, 0, cfg.text_dim)
        if not handle.is_tiny:
            notes.append("no --text-embeds given: zero text context")
    schedule = resolve_schedule(opts.preset, opts.steps, opts.shift, opts.warp)
    prompts = {}
    if opts.prompt_schedule is not None:
        from ...sampling.prompts import PromptSchedule
        plan = PromptSchedule.parse(opts.prompt_schedule)
        prompts = {"prompt_schedule": plan, "prompt_embeddings": schedule_embeddings(plan, handle, opts.text_embeds),
                   "recache": opts.recache}
        context = None
    from ...sampling.krea import cache_setup
    cache = cache_setup(opts.recache, opts.frames_per_block, opts.kv_window,     # no VAE here: identity re-encode
                        sink=opts.sink, preset=opts.preset)
    if cache.cache_policy is not None:
        prompts.update(cache.sampler_kwargs())
        opts = replace(opts, kv_window=cache.kv_window)
    if cache.note:
        log(cache.note)
        notes.append(cache.note)
    timer = ChunkTimer(device, log)
    chunk_seconds, on_chunk = timer.seconds, timer

    def on_step(ci, k, nc, ns, _x0):
        if progress is not None:
            progress(ci, k, nc, ns)

    from ...profiling.session import maybe_profile
    from ..doctor.gate import features_summary, fused_kernels_ran, new_record
    record = new_record()
    from ...cache import warmup
    one_time = warmup.snapshot()
    fast_options = sampler_setup(handle, opts.sampler, opts.cuda_graphs, opts.fused_kernels, log=log, notes=notes,
                                 record=record, ops=opts.ops, keep_slower=opts.keep_slower, linear=opts.linear)
    sampler_report: dict = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    t_start = timer.start()
    latents = maybe_profile(handle, sample_latents, model, context, width, height, frames, opts.seed, schedule,
                            opts.frames_per_block, opts.kv_window, opts.sink, opts.skip_last_refresh,
                            callback=on_step, on_chunk=on_chunk, path=opts.sampler, fast_options=fast_options,
                            report=sampler_report, oom_retry="off" if parallel is not None else "auto", **prompts)
    _sync(device)
    sample_s = time.perf_counter() - t_start
    files = _write_outputs(latents, opts, parallel)
    features = features_summary(model, fast_options, sampler_report, record)
    sampler_report["one_time_s"] = warmup.since(one_time)   # doctor probes, autotuning, plans, capture, compile
    if warmup.line(sampler_report["one_time_s"]):
        log(warmup.line(sampler_report["one_time_s"]))
    from ...compile.apply import compile_handle
    compiled = compile_handle(model)
    if compiled is not None:       # what ran: compiled blocks, or eager ones where compiling failed (and why)
        sampler_report["compile"] = {"ran": "eager" if compiled.failed else "compiled", "failed": compiled.failed,
                                     "graphs_compiled": compiled.compiles}
        if compiled.failed:
            notes.append(f"compile failed, the blocks ran eagerly: {compiled.failed}")
    if "fused_kernels" in sampler_report:     # true only when every fused kernel that applies here ran
        sampler_report["fused_kernels"] = fused_kernels_ran(features, model.device, model.compute_dtype)
    report = {
        "model": handle.source, "tiny_random_model": handle.is_tiny, "config": cfg.to_dict(),
        "device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": dtype, "precision": handle.precision, "attention": opts.attention,
        "settings": asdict(opts) | {"frames": frames, "height": height, "width": width},
        "schedule": {"preset": schedule.name, "timesteps": schedule.timesteps, "shift": schedule.shift},
        "latent_shape": list(latents.shape), "load_seconds": load_s, "sample_seconds": sample_s,
        "chunk_seconds": chunk_seconds, "peak_memory": _peak_memory(device), "files": files, "notes": notes,
        "torch": torch.__version__, "sampler": _jsonable(sampler_report), "features": features,
    }
    if parallel is not None:
        report["parallel"] = parallel_report(model, parallel, latents.shape, opts.kv_window, opts.sink,
                                             len(chunk_seconds))
    if _write_report(report, opts, parallel):
        _append_history(report, frames)
    return report


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value if isinstance(value, (str, int, float, bool)) or value is None else str(value)


def _append_history(report: dict, frames: int) -> None:
    """One 'generate' record in the metrics history (never fails the job)."""
    try:
        from ...profiling import history
        mem = report["peak_memory"]
        peak = mem.get("cuda_max_allocated_mb")
        s = report["settings"]
        history.append(history.make_record(
            "generate", label=str(report["model"]),
            settings={k: s.get(k) for k in ("frames", "height", "width", "preset", "seed", "kv_window", "sampler",
                                             "cuda_graphs", "fused_kernels", "compile")}
            | {"device": report["device"], "dtype": report["dtype"], "precision": report["precision"],
               "path": report["sampler"].get("path")},
            timings={"total_s": report["sample_seconds"], "load_s": report["load_seconds"],
                     "frames_per_s": frames / report["sample_seconds"] if report["sample_seconds"] else None},
            peak_memory_bytes=int(peak * 2 ** 20) if peak else None))
    except Exception:  # noqa: BLE001 - the history is a bonus
        pass


def _writes(parallel) -> bool:
    """Whether this process writes the run's files (always, but for ranks other than 0 of a parallel run)."""
    return parallel is None or parallel.rank == 0


def _write_outputs(latents, opts, parallel=None) -> dict:
    """latents.safetensors (model and VAE space) and the animated preview in ``opts.out_dir`` (created); {} where
    another rank writes. latents [B, F, C, H, W]."""
    if not _writes(parallel):
        return {}
    from safetensors.torch import save_file

    from .preview import latents_to_rgb, save_animation, to_vae_latents
    out = Path(opts.out_dir)
    lat = latents.detach().float().cpu().contiguous()
    meta = {"layout.latents": "[B, F, C, H, W] model space", "layout.vae_latents": "[B, C, F, H, W] VAE space",
            "seed": str(opts.seed), "preset": opts.preset}
    tensors = {"latents": lat, "vae_latents": to_vae_latents(lat)}
    write_with(out / "latents.safetensors", lambda tmp: save_file(tensors, tmp, metadata=meta),
               option=OUT_OPTION, purpose="the latents")
    files = {"latents": str(out / "latents.safetensors")}
    if opts.preview:
        files["preview"] = str(save_animation(latents_to_rgb(lat)[0], out / "preview.webp", option=OUT_OPTION))
    return files


OUT_OPTION = "out_dir"      # how the output folder is named in messages (the command line says --out)
OUTPUT_FILES = ("latents.safetensors", "preview.webp", "preview.gif", "report.json")


def check_outputs(out_dir, option: str = OUT_OPTION) -> Path:
    """Every file a run writes into ``out_dir``, checked before any work (cache/owned_files.py): a name that is
    a link, a pipe, a folder or a limit cache file is refused (OwnedFileError naming ``option`` and the file)."""
    out = Path(str(out_dir)).expanduser()
    for name in OUTPUT_FILES:
        check_target(out / name, option=option, purpose=f"the run's {name}")
    return out


def _write_report(report: dict, opts, parallel=None) -> bool:
    """report.json beside the outputs (then its path joins ``report['files']``); False where another rank writes."""
    if not _writes(parallel):
        return False
    path = Path(opts.out_dir) / "report.json"
    write_text(path, json.dumps(report, indent=2), option=OUT_OPTION, purpose="the run's report")
    report["files"]["report"] = str(path)
    return True
