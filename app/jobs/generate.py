"""The `generate` job: load a model, sample latents, write latents.safetensors, a preview and report.json. The run
is prepared by the one prepare step (``app/prepare.py``) every face uses."""
from __future__ import annotations

import os
import re
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ...cache.json_out import to_json, walk_json
from ...cache.owned_files import check_target, write_text, write_with
from ...profiling.runner import peak_memory_mb, sync_device
from ...sampling.request import SamplingHooks
from ...sampling.sampler import path_for_linear
from ..prepare import RunInputs, RunSpec, prepare_model, sample_video
from ..ranks.parallel import enable_parallel, parallel_report

TINY_DEFAULTS = {"frames": 33, "height": 128, "width": 128}
MODEL_DEFAULTS = {"frames": 81, "height": 480, "width": 832}


def load_text_embeds(path, text_dim: int, key: str | None = None, text_len: int | None = None) -> torch.Tensor:
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
    if text_len is not None:
        from ...model.dit import check_text_tokens
        check_text_tokens(t.shape[1], text_len, f"{path}: the text embedding")
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
    return {t: load_text_embeds(text_embeds, cfg.text_dim, key=t, text_len=cfg.text_len) for t in schedule.texts()}


@dataclass
class JobOptions:
    """The options both generate jobs take (text-to-video: ``GenerateOptions``; Matrix-Game-2: ``mg2.MG2Options``)."""
    out_dir: str = "wan_accel_out"
    checkpoint: str | None = None        # .safetensors; None = built-in tiny model
    seed: int = 0
    steps: str | None = None             # step list override, e.g. "1000,750,500,250"
    shift: float | None = None           # timestep shift override
    device: str | None = None            # default: cuda if available else cpu
    dtype: str | None = None             # bf16 / fp16 / fp32; default fp32 on cpu, bf16 on cuda
    precision: str = "self_forcing"
    attention: str = "auto"
    skip_last_refresh: bool = False
    num_heads: int | None = None         # for checkpoints whose dim is not a multiple of 128
    preview: bool = True
    out_option: str = "out_dir"          # how out_dir is named in messages (the command line: --out)

    def device_dtype(self) -> tuple:
        """(the run's torch device, its dtype name), each default filled in."""
        from .handle import default_device
        device = torch.device(self.device) if self.device else default_device()
        return device, self.dtype or ("bf16" if device.type == "cuda" else "fp32")


@dataclass
class GenerateOptions(JobOptions):
    text_embeds: str | None = None       # .safetensors with the prompt's umt5 embedding
    frames: int | None = None            # video frames (4k+1)
    height: int | None = None
    width: int | None = None
    preset: str = "self_forcing"
    warp: bool | None = None
    frames_per_block: int = 3
    kv_window: int = -1
    sink: int = 0
    lora: str | None = None              # a LoRA .safetensors merged into the weights at load (model/lora.py)
    lora_strength: float = 1.0
    sampler: str = "auto"                # auto (optimized on CUDA) | optimized | reference
    cuda_graphs: str = "auto"            # auto | off (optimized path)
    fused_kernels: bool = True           # optimized path
    ops: str = "auto"                    # optimized path: auto | pack | kitchen | torch (kernels/candidates.py)
    compile: bool = False                # regional torch.compile of the blocks (optimized path)
    prompt_schedule: str | None = None   # the text of a prompt schedule (sampling/prompts.py); None: one prompt
    recache: str = "switch"              # switch (LongLive KV re-cache at a prompt switch) | none | krea (recompute)
    keep_slower: bool = False            # keep int8 attention / fp8 linear where measured slower than exact (optimized)
    linear: str = "exact"                # exact | fp8 (opt-in, approximate; optimized path: 'auto' becomes 'optimized')
    decode: str | None = None            # wan | tiny | none: a video decoded as the chunks are made (app/jobs/video.py);
    vae: str | None = None               # None: the vae file's decoder, else none. vae: that decoder's .safetensors


class ChunkTimer:
    """Per-chunk wall time of a sampling run (device-synchronised), logged as it goes; call it as ``on_chunk``.
    ``stop()``: the whole run's seconds since ``start()``."""

    def __init__(self, device, log, progress=None):
        self.device, self.log, self.progress = device, log, progress
        self.seconds: list[float] = []
        self._mark = 0.0

    def start(self) -> None:
        sync_device(self.device)
        self._mark = self._began = time.perf_counter()

    def stop(self) -> float:
        sync_device(self.device)
        return time.perf_counter() - self._began

    def __call__(self, ci: int, n: int) -> None:
        sync_device(self.device)
        now = time.perf_counter()
        self.seconds.append(now - self._mark)
        self._mark = now
        self.log(f"chunk {ci + 1}/{n}: {self.seconds[-1]:.3f} s")
        if self.progress is not None:
            self.progress(ci, n)


def _resolve(opts: GenerateOptions):
    device, dtype = opts.device_dtype()
    defaults = MODEL_DEFAULTS if opts.checkpoint else TINY_DEFAULTS
    pick = lambda value, key: defaults[key] if value is None else value  # noqa: E731 - 0 is an error, not "default"
    frames, height, width = pick(opts.frames, "frames"), pick(opts.height, "height"), pick(opts.width, "width")
    return device, dtype, frames, height, width


def run_generate(opts: GenerateOptions, progress=None, log=print, parallel=None) -> dict:
    """Run the job; progress(chunk, step, num_chunks, num_steps) per step. Returns the report dict.
    parallel: this rank's ``SeqParallel`` (``app/ranks/parallel.py``) to sample sequence-parallel; rank 0 writes the files."""
    from .handle import load_model_handle
    from ...sampling.scheduler import resolve_schedule
    device, dtype, frames, height, width = _resolve(opts)
    path, path_note = path_for_linear(opts.sampler, opts.linear)      # the run rules, said before any work
    opts = replace(opts, sampler=path)
    video = None                         # --decode: each chunk decoded and written as it is made (app/jobs/video.py)
    if _writes(parallel):
        check_outputs(opts.out_dir, opts.out_option)
        from .video import open_generate_video
        video = open_generate_video(opts.decode, opts.vae, opts.checkpoint, opts.out_dir, device, dtype, opts.seed,
                                    option=opts.out_option, log=log)
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
        context = load_text_embeds(opts.text_embeds, cfg.text_dim, text_len=cfg.text_len)
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

    def on_step(ci, k, nc, ns, _x0):
        if progress is not None:
            progress(ci, k, nc, ns)

    from ...profiling.session import maybe_profile
    from ..doctor.gate import features_summary, fused_kernels_ran
    from ...cache import warmup
    one_time = warmup.snapshot()
    spec = RunSpec.for_handle(handle, path=opts.sampler, cuda_graphs=opts.cuda_graphs,
                              fused_kernels=opts.fused_kernels, ops=opts.ops, keep_slower=opts.keep_slower,
                              linear=opts.linear, schedule=schedule, frames_per_block=opts.frames_per_block,
                              kv_window=opts.kv_window, sink=opts.sink, skip_last_refresh=opts.skip_last_refresh,
                              seed=opts.seed, oom_retry="off" if parallel is not None else "auto",
                              recache=prompts.pop("recache", "switch"))
    setup = prepare_model(model, spec, log=log, notes=notes)        # the doctor's verdicts, swap, compile, options
    fast_options, record = setup.options, setup.record
    sampler_report: dict = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timer.start()
    hooks = SamplingHooks(callback=on_step, on_chunk=timer, report=sampler_report, on_chunk_latents=video)
    latents = maybe_profile(handle, sample_video, model, spec, RunInputs(context=context, **prompts), width, height,
                            frames, setup=setup, hooks=hooks)
    sample_s = timer.stop()
    video_path = video.close() if video is not None else None     # its frames checked before anything is written
    files = _write_outputs(latents, opts, parallel)
    if video_path is not None:
        files["video"] = video_path
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
    report = job_report(handle, device, dtype, asdict(opts) | {"frames": frames, "height": height, "width": width},
                        {"preset": schedule.name, "timesteps": schedule.timesteps, "shift": schedule.shift},
                        latents.shape, (load_s, sample_s, timer.seconds), files, notes, sampler_report)
    report["features"] = features
    if video is not None:
        report["video"] = video.report()
    if parallel is not None:
        report["parallel"] = parallel_report(model, parallel, latents.shape, opts.kv_window, opts.sink,
                                             len(timer.seconds))
    if _write_report(report, opts, parallel):
        _append_history(report, frames)
    return report


def job_report(handle, device, dtype: str, settings: dict, schedule: dict, latent_shape, seconds: tuple,
               files: dict, notes: list, sampler_report: dict) -> dict:
    """The report both generate jobs write (each adds its own fields): the handle's model, the run's device and
    dtype, ``settings``, ``schedule``, the latents' shape, ``seconds`` (loading, sampling, each chunk), the files,
    notes and ``sampler_report``."""
    load_s, sample_s, chunk_s = seconds
    return {
        "model": handle.source, "tiny_random_model": handle.is_tiny, "config": handle.config.to_dict(),
        "device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": dtype, "precision": handle.precision, "attention": handle.attention,
        "settings": settings, "schedule": schedule,
        "latent_shape": list(latent_shape), "load_seconds": load_s, "sample_seconds": sample_s,
        "chunk_seconds": chunk_s, "peak_memory": peak_memory_mb(device), "files": files, "notes": notes,
        "torch": torch.__version__, "sampler": _jsonable(sampler_report),
    }


def _jsonable(value):
    """``value`` with its dict keys, and every value that JSON does not hold, written as their text."""
    return walk_json(value, lambda v: v if isinstance(v, (str, int, float, bool)) or v is None else str(v), str)


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

    from ...vae.latents import to_vae_latents
    from .preview import latents_to_rgb, save_animation
    out = Path(opts.out_dir)
    lat = latents.detach().float().cpu().contiguous()
    meta = {"layout.latents": "[B, F, C, H, W] model space", "layout.vae_latents": "[B, C, F, H, W] VAE space",
            "seed": str(opts.seed), "preset": opts.preset}
    tensors = {"latents": lat, "vae_latents": to_vae_latents(lat)}
    write_with(out / "latents.safetensors", lambda tmp: save_file(tensors, tmp, metadata=meta),
               option=opts.out_option, purpose="the latents")
    files = {"latents": str(out / "latents.safetensors")}
    if opts.preview:
        files["preview"] = str(save_animation(latents_to_rgb(lat)[0], out / "preview.webp",
                                                               option=opts.out_option))
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
    write_text(path, to_json(report), option=opts.out_option, purpose="the run's report")
    report["files"]["report"] = str(path)
    return True
