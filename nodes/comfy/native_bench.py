"""The ComfyUI side of ``bench native`` (bench/native.py): ComfyUI's loader, core's SamplerARVideo node and
the Wan Accel AR Sampler node on one MODEL. Registered with the bench at import (``app/`` may not import ComfyUI
or the nodes); every ComfyUI import is made inside a function, so this module imports anywhere."""
from __future__ import annotations

import functools

import torch

from ...app.doctor.versions import NOT_FOUND, stack
from ...bench.native import _structure, register_comfy_side
from .comfy_core import CoreMissing, core, optional, start_core


class ComfySide:
    """What the bench asks of ComfyUI, each step as a user's workflow does it."""

    def unavailable(self, device: torch.device) -> str | None:
        """None where ComfyUI's loader, samplers and core's AR video nodes import, its model management started on
        ``device`` (on a CPU as ``main.py --cpu`` starts it, before model management is first imported); else why
        not."""
        try:
            mm = start_core(device.type)
            for name in ("comfy.samplers.KSAMPLER", "comfy.sd.load_diffusion_model",
                         "comfy_extras.nodes_ar_video.SamplerARVideo", "comfy_extras.nodes_custom_sampler.Guider_Basic"):
                core(name)
        except CoreMissing as exc:      # not ComfyUI, or a ComfyUI that lacks (or fails to import) what the bench uses
            return str(exc)
        got = torch.device(mm.get_torch_device())
        if got.type != device.type:
            raise RuntimeError(f"ComfyUI's model management runs on {got}, the bench was asked for {device} (it "
                               f"was imported before the bench could choose)")
        return None

    def versions(self) -> dict:
        """The ComfyUI stack the bench ran in (app/doctor/versions.py; None where a part is absent)."""
        return {k: (None if v == NOT_FOUND else v) for k, v in stack().items() if k not in ("torch", "triton")}

    def load(self, path, lora_path=None, strength: float = 1.0):
        """Load Diffusion Model (UNETLoader, weight dtype default), then LoraLoaderModelOnly when a LoRA is given."""
        patcher = core("comfy.sd.load_diffusion_model")(str(path))
        if lora_path is not None:
            lora = core("comfy.utils.load_torch_file")(str(lora_path), safe_load=True)
            patcher, _clip = core("comfy.sd.load_lora_for_models")(patcher, None, lora, float(strength), 0)
        return patcher

    def describe(self, patcher) -> dict:
        base = patcher.model
        quantized = sum(1 for m in base.diffusion_model.modules()
                        if type(getattr(m, "weight", None)).__name__ == "QuantizedTensor")
        return {"comfy_model": type(base).__name__, "comfy_diffusion_model": type(base.diffusion_model).__name__,
                "comfy_weight_dtype": str(base.get_dtype()).replace("torch.", ""),
                "comfy_manual_cast": str(getattr(base, "manual_cast_dtype", None)).replace("torch.", ""),
                "comfy_quantized_layers": quantized,
                "lora_patches": len(getattr(patcher, "patches", {}) or {})}

    def run_dtype(self, patcher) -> torch.dtype:
        from .native_engine import run_dtype
        return run_dtype(patcher.model)

    def core_sampler(self, frames_per_block: int):
        """Core's Sampler AR Video node's SAMPLER."""
        node = core("comfy_extras.nodes_ar_video.SamplerARVideo")
        return node.execute(num_frame_per_block=int(frames_per_block)).result[0]

    def native_sampler(self, frames_per_block: int, path: str):
        """The Wan Accel AR Sampler node's SAMPLER (its defaults: global cache, CUDA graphs)."""
        from ..native_nodes import WanAccelARSampler
        return WanAccelARSampler().get_sampler(frames_per_block=int(frames_per_block), path=path)[0]

    def guider(self, patcher, context):
        """Basic Guider (cfg 1, as the distilled causal models run) over the positive conditioning."""
        guider = core("comfy_extras.nodes_custom_sampler.Guider_Basic")(patcher)
        guider.set_conds([[context, {}]])
        return guider

    def sample(self, guider, sampler, inputs: dict, on_step, recorded: dict | None = None, counts=None):
        """SamplerCustomAdvanced's call; returns the sampler function's own output [B, C, T, H, W] (before the
        latent format's process_latent_out), float32 on the CPU. recorded: re-noising draws for the Wan Accel AR
        Sampler (its recorded-run input); counts: a DispatchCounts around the sampler function alone."""
        captured = {}
        inner = sampler.sampler_function

        @functools.wraps(inner)
        def sampler_function(*args, **kwargs):
            if counts is not None:
                if "frames_per_block" in sampler.extra_options:
                    kwargs["step_callback"] = counts.step_callback()
                with torch.no_grad(), counts:
                    out = inner(*args, **kwargs)
            else:
                out = inner(*args, **kwargs)
            captured["x"] = out
            return out
        wrapped = core("comfy.samplers.KSAMPLER")(sampler_function, extra_options=dict(sampler.extra_options),
                                          inpaint_options=dict(getattr(sampler, "inpaint_options", {}) or {}))
        if recorded is not None:
            from .native_engine import RECORDED_NOISE_KEY
            patcher = guider.model_patcher.clone()
            patcher.model_options.setdefault("transformer_options", {})[RECORDED_NOISE_KEY] = recorded
            guider = self.guider(patcher, inputs["context"])
        callback = None if on_step is None else (lambda step, x0, x, total: on_step())
        guider.sample(inputs["noise"].clone(), inputs["latent"].clone(), wrapped, inputs["sigmas"].clone(),
                      seed=inputs["seed"], disable_pbar=True, callback=callback)
        return captured["x"].float().cpu()

    def structure(self, guider, samplers: dict, inputs: dict) -> dict:
        """ops_per_step (one steady-state step: the last block's last step) and syncs_per_video of each sampler,
        from one untimed run under the dispatch counter (the sampler function alone, not the guider around it)."""
        from ...profiling.dispatch_counts import DispatchCounts
        out = {}
        for key, sampler in samplers.items():
            counts, marks = DispatchCounts(), []
            self.sample(guider, sampler, inputs, lambda c=counts, m=marks: m.append(c.snapshot()), counts=counts)
            step = counts.steady_step() if counts.steps else marks[-1] - marks[-2]
            out[key] = _structure(counts, step)
        return out

    def unload(self) -> None:
        """ComfyUI's models off the device (the own path's memory is then its own)."""
        mm = optional("comfy.model_management")
        if mm is None:
            return
        mm.unload_all_models()
        mm.soft_empty_cache()


register_comfy_side(ComfySide())
