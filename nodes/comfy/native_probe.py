"""The doctor's probe of the native MODEL path (registered where a doctor is made: the node, the command, the route).

A tiny causal Wan model is loaded by ComfyUI's own loader (``comfy.sd.load_diffusion_model_state_dict``, as
``WAN21_CausalAR``) and sampled by the Wan Accel AR Sampler's function (the node's KSAMPLER, ``sample_wan_accel``);
the fallback is the pack's own engine over a model holding the very same weights. Where ComfyUI does not import,
the feature says it needs ComfyUI. ``app/`` may not import ComfyUI or the nodes, hence the registration
(``app/doctor/vocabulary.register_probe``).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from ...app.doctor.vocabulary import NotAvailable, Probe, ProbeContext, register_probe
from . import native_engine
from .comfy_core import CoreMissing, core, in_comfyui, start_core


def _comfy():
    """ComfyUI's loader and model management, or NotAvailable('needs ComfyUI')."""
    try:
        # outside a ComfyUI server (the doctor command run with ComfyUI's Python) on a machine without CUDA, ComfyUI's
        # model management starts on the CPU, as `main.py --cpu` would
        mm = start_core("cuda" if torch.cuda.is_available() else "cpu")
        load = core("comfy.sd.load_diffusion_model_state_dict")
    except CoreMissing as exc:
        from ...app.doctor.probes import NATIVE_HINT
        why = "ComfyUI does not import here" if not in_comfyui() else str(exc)
        raise NotAvailable(f"needs ComfyUI ({why})", NATIVE_HINT) from None
    return load, mm


def requires(ctx: ProbeContext) -> None:
    _comfy()


def check(ctx: ProbeContext) -> Probe:
    """The probe: the AR Sampler on ComfyUI's MODEL against the pack's engine on the same weights."""
    from ...app.doctor.probes import CHUNK_SCHEDULE, CHUNK_ULPS, _probe_model
    from ...app.prepare import RunInputs, RunSpec, Setup, prepare
    from ...sampling.runner import FastOptions
    from ...sampling.scheduler import resolve_schedule
    from ..native_nodes import WanAccelARSampler, core_causal_model
    _load, mm = _comfy()
    ours = _probe_model(ctx)
    patcher = core_causal_model(ours, dtype=ctx.dtype)
    mm.load_models_gpu([patcher])
    base = patcher.model
    device = torch.device(getattr(patcher, "load_device", ctx.device))
    ours = ours.to(device)
    cfg = ours.config
    gen = torch.Generator().manual_seed(16)
    context = torch.randn(1, cfg.text_len, cfg.text_dim, generator=gen).to(device, ctx.dtype)
    noise = torch.randn(1, 3, cfg.in_dim, 16, 16, generator=gen).to(device)            # [B, F, C, H, W]
    schedule = resolve_schedule(**CHUNK_SCHEDULE)
    sigmas = torch.tensor(schedule.sigmas(), dtype=torch.float32)
    sampler = WanAccelARSampler().get_sampler(frames_per_block=3, path="auto", cuda_graphs=False)[0]
    guider = SimpleNamespace(inner_model=base, cfg=1.0, model_patcher=patcher,
                             conds={"positive": [{"model_conds": {"c_crossattn": SimpleNamespace(cond=context)}}]})
    model_k = SimpleNamespace(inner_model=guider)

    def feature():
        x = noise.movedim(1, 2).to(ctx.dtype)
        out = sampler.sampler_function(model_k, x, sigmas, extra_args={"seed": 7}, callback=None,
                                       **sampler.extra_options)
        return out.movedim(1, 2)

    def fallback():         # the engine on the same weights, the model kept as it is
        inputs = RunInputs(context=context, noise=noise.to(ctx.dtype).float())
        return prepare(ours, RunSpec(schedule=schedule, seed=7, doctor=False, oom_retry="off"), inputs,
                       setup=Setup("auto", FastOptions(fused_qkv=False, cuda_graphs="off"), [], {})).latents()
    return Probe(feature, fallback, ctx.dtype, judge_speed=False, ulps=CHUNK_ULPS,
                 note="speed not judged: the same engine runs on both sides")


def sources() -> tuple:
    from ...app.doctor.probes import _probe_model
    from ...model import borrowed
    from .. import native_nodes
    return (native_engine, native_nodes, borrowed, _probe_model)


def register() -> None:
    """Register this probe with the doctor (done when this module is imported)."""
    register_probe("native_model", check, requires=requires, sources=sources)


register()
