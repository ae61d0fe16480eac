"""The pack's causal engine on ComfyUI's own Wan MODEL: the sampler function behind the Wan Accel AR Sampler.

ComfyUI loads a causal checkpoint through ``UNETLoader`` as ``WAN21_CausalAR`` (or, without the ``causal_ar``
metadata, as a plain ``WAN21``); its diffusion model uses the official attribute names, and its layers
(``comfy.ops``) cast stored fp8 weights and apply LoRA patches when they are called. ``model.borrowed`` builds the
engine's model over those very layers (no second copy of a weight; the device and offload are ComfyUI's), and
``sample_causal`` runs the one chunk loop over it. ComfyUI calls ``sample_wan_accel`` as a ``KSAMPLER`` function
from ``SamplerCustomAdvanced``: the latent arrives noised by the sigma-0 scaling in the model's latent space
[B, C, T, H, W]; the text comes from the guider's positive conditioning; re-noising draws come from a generator
seeded with the NOISE input's seed (or from recorded draws, ``RECORDED_NOISE_KEY``); ``ARVideoI2V``'s start
image is written into the KV cache before the first block, as core does.
"""
from __future__ import annotations

import weakref

import torch

from ..memory.block_swap import active_swap
from ..model.borrowed import borrow_wan_model
from ..sampling.runner import FastOptions
from ..sampling.sampler import PATHS, generator_noise, sample_causal
from ..sampling.scheduler import schedule_from_sigmas

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


def engine_for(base, device, dtype=None):
    """The engine model over ``base.diffusion_model``'s layers (built once per diffusion model, kept weakly)."""
    check_native_model(base)
    dm = base.diffusion_model
    if dtype is None:
        dtype = base.get_dtype_inference() if hasattr(base, "get_dtype_inference") else base.get_dtype()
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        dtype = torch.float32
    engine = _ENGINES.get(dm)
    if engine is None:
        engine = borrow_wan_model(dm, dtype, device, num_heads=dm.num_heads, text_len=dm.text_len)
        _ENGINES[dm] = engine
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


def native_compile_settings(guider, transformer_options: dict):
    """The compile settings Apply Compile (native Wan) put on this MODEL (its APPLY_MODEL wrapper carries its
    handle), or None. The engine compiles its own blocks with them: it calls the layers, not ComfyUI's blocks."""
    from .comfy_compile import COMFY_KEY, _comfy_wrapper_types
    apply_type = _comfy_wrapper_types()[0]
    sources = [getattr(getattr(guider, "model_patcher", None), "wrappers", None) or {},
               transformer_options.get("wrappers", {}) or {}]
    for wrappers in sources:
        for fn in wrappers.get(apply_type, {}).get(COMFY_KEY, []):
            handle = getattr(fn, "handle", None)
            if handle is not None:
                return handle.settings
    return None


def _apply_compile(engine, settings, path: str, device) -> None:
    from ..app.jobs.generate import compile_for_sampling
    from ..compile import uncompile_model
    from ..sampling.sampler import resolve_path
    if settings is not None and resolve_path(path, device, model=engine)[0] == "optimized":
        compile_for_sampling(engine, settings)
    else:
        uncompile_model(engine)          # the reference path runs eager, as the pack's own sampler node


def _recorded_noise_provider(recorded: dict):
    def provide(ci, k, shape, dtype, device):
        key = f"extra_noise.block{ci}.step{k}"
        if key not in recorded:
            raise ValueError(f"the recorded noise has no {key}: it was recorded for another schedule or length")
        return recorded[key].reshape(shape).to(device=device, dtype=dtype)
    return provide


def _progress(callback, sigmas, num_chunks_hint):
    from ._comfy import progress_and_interrupt
    _, interrupt = progress_and_interrupt()
    steps = len(sigmas) - 1

    def on_step(ci, k, num_chunks, num_steps, x0):
        if interrupt is not None:
            interrupt()
        if callback is not None:
            done = ci * num_steps + k
            scaled = done * steps // max(1, num_chunks * num_steps)
            x0c = x0.movedim(1, 2)
            callback({"x": x0c, "i": scaled, "sigma": sigmas[k], "sigma_hat": sigmas[k], "denoised": x0c})
    return on_step


def sample_wan_accel(model, x, sigmas, extra_args=None, callback=None, disable=None, frames_per_block: int = 3,
                     kv_window: int = -1, sink: int = 0, path: str = "auto", cuda_graphs: bool = True, **_):
    """KSAMPLER function: chunk-autoregressive sampling of x [B, C, T, H, W] over ``sigmas``."""
    extra_args = extra_args or {}
    if x.ndim != 5:
        raise ValueError(f"Wan Accel AR Sampler needs a video latent [B, C, T, H, W]; got shape {tuple(x.shape)}. "
                         f"Use Empty AR Video Latent or Empty Hunyuan Latent Video.")
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    guider = model.inner_model
    base = guider.inner_model
    device = x.device
    engine = engine_for(base, device)
    options = extra_args.get("model_options", {}).get("transformer_options", {})
    multiplier = float(getattr(getattr(base, "model_sampling", None), "multiplier", 1000.0))
    schedule = schedule_from_sigmas(sigmas, num_train_timesteps=int(round(multiplier)))
    context = positive_context(guider).to(device)
    seed = int(extra_args.get("seed", 0) or 0)
    gen = torch.Generator(device=device).manual_seed(seed)
    recorded = options.get(RECORDED_NOISE_KEY)
    provider = _recorded_noise_provider(recorded) if recorded is not None else generator_noise(gen)
    prefix = options.get("ar_config", {}).get("initial_latent")
    if prefix is not None:
        prefix = base.process_latent_in(prefix).to(device=device, dtype=torch.float32).movedim(1, 2)
    noise = x.movedim(1, 2).float()
    _apply_compile(engine, native_compile_settings(guider, options), path, device)
    swapped = active_swap(base.diffusion_model) is not None      # Wan Block Swap streams weights between calls
    fast = FastOptions(fused_qkv=False, cuda_graphs="auto" if cuda_graphs and not swapped else "off")
    out = sample_causal(engine, context, noise, schedule, int(frames_per_block), generator=gen,
                        noise_provider=provider, kv_window=int(kv_window), sink=int(sink),
                        callback=_progress(callback, sigmas, None), path=path, fast_options=fast, prefix=prefix)
    return out.movedim(1, 2).to(dtype=x.dtype, device=x.device)
