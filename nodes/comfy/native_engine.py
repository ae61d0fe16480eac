"""The pack's causal engine on ComfyUI's own Wan MODEL: the sampler function behind the Wan Accel AR Sampler.

ComfyUI loads a causal checkpoint through ``UNETLoader`` as ``WAN21_CausalAR`` (or, without the ``causal_ar``
metadata, as a plain ``WAN21``); its diffusion model uses the official attribute names, and its layers
(``comfy.ops``) cast stored fp8 weights and apply LoRA patches when they are called. ``model.borrowed`` builds the
engine's model over those very layers (no second copy of a weight; the device and offload are ComfyUI's), the
app floor's prepare step (``app/prepare.py``: the doctor's verdicts, compile, fast options) readies the run, and
``sample_causal`` runs the one chunk loop over it. ComfyUI calls ``sample_wan_accel`` as a ``KSAMPLER`` function
from ``SamplerCustomAdvanced``: the latent arrives noised by the sigma-0 scaling in the model's latent space
[B, C, T, H, W]; the text comes from the guider's positive conditioning; re-noising draws come from a generator
seeded with the NOISE input's seed (or from recorded draws, ``RECORDED_NOISE_KEY``); ``ARVideoI2V``'s start
image is written into the KV cache before the first block, as core does. On cores with the Comfy Compiler the
whole run (prepare and loop) is outside core's memory graph (``comfy_core.outside_memory_graph``). The engine
calls ComfyUI's layers, never its attention: q, k and v come from the borrowed ``q``/``k``/``v``/``norm_*`` layers, so
core's attention contract (plain tensors up to 0.39, ``AttentionTensorContainer`` and ``preferred_attention`` from
0.40) does not reach it; the layers are called as ``layer(x)``, which every core's ``comfy.ops`` honours.
"""
from __future__ import annotations

import functools
import logging
import weakref

import torch

from ...memory.block_swap import active_swap, ensure_block_swap
from ...memory.offload import COMFY_FULL, PACK, memory_manager
from ...memory.sampling_guard import oom_guard
from ...model.attention import explain_backend
from ...model.borrowed import borrow_wan_model, borrowed_config
from ...app.prepare import RunInputs, RunSpec, prepare
from ...sampling.request import SamplingHooks
from ...sampling.scheduler import schedule_from_sigmas
from .comfy_core import outside_memory_graph, progress_and_interrupt, wrapper_types

log = logging.getLogger("wan_accel")

SUPPORTED_MODELS = ("WAN21_CausalAR", "WAN21")
RECORDED_NOISE_KEY = "wan_accel_recorded_noise"   # transformer_options entry: {"extra_noise.block{b}.step{k}": t}
_ENGINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # ComfyUI diffusion model -> engine model


def check_native_model(base) -> None:
    """Clear error unless ``base`` (a ComfyUI BaseModel) is a Wan 2.1 text-to-video model this sampler runs."""
    name = type(base).__name__
    dm = getattr(base, "diffusion_model", None)
    model_type = getattr(dm, "model_type", None)
    if name not in SUPPORTED_MODELS or model_type != "t2v":
        raise ValueError(
            f"Wan Accel AR Sampler got a {name} model ({type(dm).__name__}, model_type={model_type!r}); it runs Wan "
            f"2.1 text-to-video models: a causal checkpoint loaded with Load Diffusion Model (WAN21_CausalAR, or "
            f"WAN21 for Self-Forcing / CausVid weights without the causal_ar metadata). Use core's samplers for "
            f"other models.")


def run_dtype(base) -> torch.dtype:
    """The dtype the engine computes in for ComfyUI's ``base`` (its inference dtype; float32 for others)."""
    dtype = base.get_dtype_inference() if hasattr(base, "get_dtype_inference") else base.get_dtype()
    return dtype if dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float32


NATIVE_NAMES = {"frames": "length", "height": "height", "width": "width",
                "kv_window": "kv_window", "frames_per_block": "frames_per_block", "sink": "sink"}


def native_spec(guider, options: dict, x, sigmas, seed, frames_per_block, kv_window, sink, **fields) -> tuple:
    """(the run's ``RunSpec``, its prompt inputs), every input checked before a tensor of the run is made: the model
    kind, a 64-bit seed, the sigmas, the prompt schedule's cache mode, the ``RunSpec`` fields (``fields``: path,
    oom_retry, linear...) and the memory estimate (``app.validate.check_fits``). ValueError naming the input."""
    from ...app.validate import MAX_SEED, check_fits, check_int
    base = guider.inner_model
    check_native_model(base)
    seed = check_int("noise_seed", seed, 0, MAX_SEED)
    multiplier = float(getattr(getattr(base, "model_sampling", None), "multiplier", 1000.0))
    sigma_values = tuple(sigmas.tolist()) if isinstance(sigmas, torch.Tensor) else tuple(sigmas)   # one read
    prompts, kv_window = schedule_cache(positive_schedule(guider), frames_per_block, kv_window, sink)
    spec = RunSpec(schedule=_schedule(sigma_values, int(round(multiplier))), frames_per_block=frames_per_block,
                   kv_window=kv_window, sink=sink, seed=seed, partial_last_block=True,
                   compile=native_compile_settings(guider, options), swap=None,    # the engine's blocks: ComfyUI's
                   recache=prompts.pop("recache", "switch"), **fields)
    dm = base.diffusion_model
    b, _, t, h, w = x.shape
    check_fits(borrowed_config(dm, num_heads=dm.num_heads, text_len=dm.text_len).to_dict(), 4 * (int(t) - 1) + 1,
               8 * int(h), 8 * int(w), device=x.device, dtype=str(run_dtype(base)), frames_per_block=frames_per_block,
               kv_window=spec.kv_window, batch=int(b), names=NATIVE_NAMES)
    return spec, prompts


def native_inputs(guider, options: dict, x, prompts: dict) -> RunInputs:
    """The run's inputs: the guider's positive text, the noised latent as [B, F, C, H, W], recorded re-noising
    draws where given (else the spec's seed draws them), ``ARVideoI2V``'s start image in the model's space."""
    base, device = guider.inner_model, x.device
    recorded = options.get(RECORDED_NOISE_KEY)
    prefix = options.get("ar_config", {}).get("initial_latent")
    if prefix is not None:
        prefix = base.process_latent_in(prefix).to(device=device, dtype=torch.float32).movedim(1, 2)
    return RunInputs(context=positive_context(guider).to(device), noise=x.movedim(1, 2).float(), prefix=prefix,
                     noise_provider=None if recorded is None else _recorded_noise_provider(recorded), **prompts)


def declared_attention(dm) -> str | None:
    """The attention method a checkpoint declares for core 0.40+ (``ComfyAttention.config['attention']`` on the
    blocks' attention modules, e.g. 'comfy_kitchen_int8'), or None. The engine runs its own attention (the
    sampler's ``attention`` input); the console says so once per model."""
    for block in getattr(dm, "blocks", ()):
        for attn in (getattr(block, "self_attn", None), getattr(block, "cross_attn", None)):
            config = getattr(getattr(attn, "comfy_attention", None), "config", None)
            if isinstance(config, dict) and config.get("attention"):
                return str(config["attention"])
    return None


def engine_for(base, device):
    """The engine model over ``base.diffusion_model``'s layers in ``run_dtype`` (built once per diffusion model,
    kept weakly; the model checked by ``native_spec``)."""
    dm, dtype = base.diffusion_model, run_dtype(base)
    engine = _ENGINES.get(dm)
    if engine is None:
        engine = borrow_wan_model(dm, dtype, device, num_heads=dm.num_heads, text_len=dm.text_len)
        _ENGINES[dm] = engine
        declared = declared_attention(dm)
        if declared:
            log.info("wan_accel: native sampler: this checkpoint declares attention %r for ComfyUI's own sampling; "
                     "the Wan Accel AR Sampler runs its attention input instead (int8 there: attention=int8)",
                     declared)
    return engine.set_run(dtype, device)


def positive_context(guider) -> torch.Tensor:
    """The text embedding [B, L, C] of the guider's positive conditioning (cfg must be 1: distilled models)."""
    conds = getattr(guider, "conds", None) or {}
    cfg = float(getattr(guider, "cfg", 1.0))
    if cfg != 1.0 and conds.get("negative"):
        raise ValueError(f"Wan Accel AR Sampler runs few-step distilled causal models without CFG; got cfg={cfg}. "
                         f"Use a Basic Guider (or cfg 1).")
    for cond in conds.get("positive") or []:
        c = cond.get("model_conds", {}).get("c_crossattn")
        if c is not None:
            return c.cond
    raise ValueError("Wan Accel AR Sampler needs a positive text conditioning (CLIP Text Encode with umt5-xxl) "
                     "in the guider")


def positive_schedule(guider) -> dict:
    """The prompt-switch arguments of ``sample_causal`` when the guider's positive conditioning comes from Wan Accel
    Prompt Schedule ({} otherwise): the schedule, its texts' embeddings and the re-cache mode."""
    from ..prompt_nodes import SCHEDULE_KEY
    for cond in (getattr(guider, "conds", None) or {}).get("positive") or []:
        found = cond.get(SCHEDULE_KEY) if isinstance(cond, dict) else None
        if found is not None:
            return {"prompt_schedule": found["schedule"], "prompt_embeddings": dict(found["embeddings"]),
                    "recache": found.get("recache", "switch"), "vae": found.get("vae")}
    return {}


def schedule_cache(prompts: dict, frames_per_block: int, kv_window: int, sink: int = 0) -> tuple:
    """(the sampler's prompt arguments, its kv_window) once the schedule's cache mode is mapped
    (``model_nodes.krea_cache``: recache krea becomes Krea's recompute policy and its window)."""
    from ..model_nodes import krea_cache
    prompts = dict(prompts)
    vae = prompts.pop("vae", None)
    if not prompts:
        return prompts, kv_window
    cache = krea_cache(prompts["recache"], frames_per_block, kv_window, vae, sink=sink)
    return {**prompts, **cache.sampler_kwargs()}, cache.kv_window


def native_compile_settings(guider, transformer_options: dict):
    """The compile settings Apply Compile (native Wan) put on this MODEL (its APPLY_MODEL wrapper carries its
    handle), or None. The engine compiles its own blocks with them: it calls the layers, not ComfyUI's blocks."""
    from .comfy_compile import COMFY_KEY
    apply_type = wrapper_types()["apply_model"]
    sources = [getattr(getattr(guider, "model_patcher", None), "wrappers", None) or {},
               transformer_options.get("wrappers", {}) or {}]
    for wrappers in sources:
        for fn in wrappers.get(apply_type, {}).get(COMFY_KEY, []):
            handle = getattr(fn, "handle", None)
            if handle is not None:
                return handle.settings
    return None


def _recorded_noise_provider(recorded: dict):
    def provide(ci, k, shape, dtype, device):
        key = f"extra_noise.block{ci}.step{k}"
        if key not in recorded:
            raise ValueError(f"the recorded noise has no {key}: it was recorded for another schedule or length")
        return recorded[key].reshape(shape).to(device=device, dtype=dtype)
    return provide


@functools.lru_cache(maxsize=32)
def _schedule(sigma_values: tuple, num_train_timesteps: int):
    """The Schedule of a sigma list (host floats), resolved once per list: its checks and float32 tables are host
    work, kept out of every later run."""
    return schedule_from_sigmas(list(sigma_values), num_train_timesteps=num_train_timesteps)


def _qkv_fusion(engine, swapped: bool) -> str | None:
    """Why the run keeps q/k/v as three GEMMs (None: one GEMM over a concatenated buffer of the layers' own
    weights); said on the console when it changes."""
    why = "Wan Block Swap streams the weights between calls" if swapped else engine.qkv_fusion_blocker()
    if why != engine.__dict__.get("qkv_fusion_off"):
        if why:
            log.info("wan_accel: native sampler: fused q/k/v off (%s)", why)
        engine.__dict__["qkv_fusion_off"] = why
    return why


def _guard(engine, dm, shape, frames_per_block: int, mode: str):
    """The pack's one out-of-memory retry (memory/sampling_guard.oom_guard) for the native model: it swaps the
    blocks of ComfyUI's diffusion model, and learns no limit (ComfyUI places these weights). A retry also drops
    the fused q/k/v buffers, so swapped weights leave no copy on the device."""
    guard = oom_guard(engine, shape, frames_per_block, mode=mode, swap_model=dm, learn=False)
    if guard is None:
        return None

    def chunk_guard(attempt, on_oom):
        def dropping():
            engine.unfuse_qkv()
            on_oom()
        return guard(attempt, dropping)
    return chunk_guard


def _memory_manager(guider):
    """Who manages the memory of ComfyUI's model (memory/offload.py): when ComfyUI loaded it partially or dynamic
    VRAM holds it, the out-of-memory retry does not swap its blocks (ComfyUI moves those weights itself)."""
    manager = memory_manager(getattr(guider, "model_patcher", None))
    if manager.who == PACK:        # no patcher to read: ComfyUI's model as loaded, the retry may swap
        manager = manager._replace(who=COMFY_FULL)
    if not manager.swap_allowed:
        manager.log_once(guider.inner_model)
    return manager


def _progress(callback, sigmas, step_callback=None):
    _, interrupt = progress_and_interrupt()
    steps = len(sigmas) - 1

    def on_step(ci, k, num_chunks, num_steps, x0):
        if step_callback is not None:
            step_callback(ci, k, num_chunks, num_steps, x0)
        if interrupt is not None:
            interrupt()
        if callback is not None:
            done = ci * num_steps + k
            scaled = done * steps // max(1, num_chunks * num_steps)
            x0c = x0.movedim(1, 2)
            callback({"x": x0c, "i": scaled, "sigma": sigmas[k], "sigma_hat": sigmas[k], "denoised": x0c})
    return on_step


def sample_wan_accel(model, x, sigmas, extra_args=None, callback=None, disable=None, frames_per_block: int = 3,
                     kv_window: int = -1, sink: int = 0, path: str = "auto", cuda_graphs: bool = True,
                     oom_retry: str = "auto", step_callback=None, report: dict | None = None, attention: str = "auto",
                     linear: str = "exact", **_):
    """KSAMPLER function: chunk-autoregressive sampling of x [B, C, T, H, W] over ``sigmas``. A frame count that is
    not whole blocks ends with a shorter block, as core's sampler. The sigmas are read from the device once.
    ``oom_retry`` ('auto': CUDA only, 'on', 'off'): on out of memory in a block, swap more of ComfyUI's blocks to
    the host and redo the block. ``step_callback(chunk, step, chunks, steps, x0)`` (profiling) and ``report``
    (a dict: what the run did, with ``fused_qkv_off``, why q/k/v ran as three GEMMs, the optimized path's
    ``attention``, and ``switched_off``, the doctor's verdicts applied: {feature: why}) are for tools.
    ``attention``: the backend request of model/attention.py ('auto', 'sdpa', 'int8', ...), on both paths.
    ``linear``: 'exact' or 'fp8' (the optimized path's fp8 linear layers, as ``generate --linear``; the reference
    path refuses it). The one ``prepare`` call prepares the run (path, verdicts, compile, options, checks, generator);
    before it the sampler makes 9 calls: ``native_spec`` (every input checked before the engine is built),
    ``engine_for``, ``explain_backend`` (an approximate attention mode said in the console, on either path),
    ``active_swap``, ``_qkv_fusion``, ``_memory_manager``, ``native_inputs``, ``_guard``, ``_progress``.
    """
    extra_args = extra_args or {}
    if x.ndim != 5:
        raise ValueError(f"Wan Accel AR Sampler needs a video latent [B, C, T, H, W]; got shape {tuple(x.shape)}. "
                         f"Use Empty AR Video Latent or Empty Hunyuan Latent Video.")
    guider = model.inner_model
    options = extra_args.get("model_options", {}).get("transformer_options", {})
    spec, prompts = native_spec(guider, options, x, sigmas, extra_args.get("seed", 0) or 0, frames_per_block,
                                kv_window, sink, path=path, oom_retry=oom_retry, linear=linear)
    dm = guider.inner_model.diffusion_model
    engine = engine_for(guider.inner_model, x.device).set_attention_backend(attention)   # the reference path too
    used, why = explain_backend(attention, x.device, engine.compute_dtype, engine.config.head_dim)
    if used in ("int8", "fp8"):             # an approximate mode, on either path: said once in the console
        log.info("wan_accel: native sampler: attention %s", why)
    swap_before = active_swap(dm)           # Wan Block Swap streams weights between calls
    fused_off = _qkv_fusion(engine, swap_before is not None)
    manager = _memory_manager(guider)
    spec = spec.replace(cuda_graphs="auto" if cuda_graphs and swap_before is None else "off",
                        fused_qkv=fused_off is None, oom_retry=oom_retry if manager.swap_allowed else "off")
    inputs = native_inputs(guider, options, x, prompts)
    guard = _guard(engine, dm, tuple(inputs.noise.shape), spec.frames_per_block, spec.oom_retry)
    run = {} if report is None else report
    hooks = SamplingHooks(callback=_progress(callback, sigmas, step_callback), chunk_guard=guard, report=run)
    try:                                    # the doctor's verdicts, compile and fast options: the one prepare step
        with outside_memory_graph():        # the pack's loop, allocations and CUDA graphs: never in core's graph
            out = prepare(engine, spec, inputs, hooks).latents()
    finally:
        engine.unfuse_qkv()                 # ComfyUI may move or patch its weights before the next run
        if swap_before is None and active_swap(dm) is not None:
            ensure_block_swap(dm, None)     # a retry's swap: ComfyUI's model is not left patched
    run["fused_qkv_off"] = fused_off
    run.setdefault("attention", used)       # the optimized path's runner names it first
    if run["switched_off"]:                 # the report names the verdicts applied; the console says them once
        log.info("wan_accel: native sampler: the doctor switched off %s", ", ".join(sorted(run["switched_off"])))
    return out.movedim(1, 2).to(dtype=x.dtype, device=x.device)
