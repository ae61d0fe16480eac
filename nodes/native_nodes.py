"""Nodes for ComfyUI's own causal Wan MODEL: the Wan Accel AR Sampler (a SAMPLER for SamplerCustomAdvanced, a
drop-in for core's SamplerARVideo), the released causal schedules as SIGMAS, and a recorded run's inputs (noise,
re-noising draws, text) to replay an official output."""
from __future__ import annotations

from .comfy import Node, check_choice, node_mappings
from .comfy.comfy_core import core
from .model_nodes import LINEAR_CHOICES, LINEAR_TOOLTIP, widget_schedule    # torch-free: the sampler nodes' widgets

# the sampling modules import torch: they load when a node's inputs are listed or it runs, not at import

CATEGORY = "wan_accel/native"


class WanAccelARSampler:
    DESCRIPTION = ("The pack's causal engine as a SAMPLER for SamplerCustomAdvanced, on the MODEL of Load Diffusion "
                   "Model (WAN21_CausalAR, or WAN21 with Self-Forcing / CausVid weights): a drop-in for Sampler AR "
                   "Video. Uses the weights as ComfyUI holds them (fp8, LoRA, offload); adds a rolling KV window with "
                   "sink frames and the optimized path (static buffers, CUDA graphs).")
    CATEGORY = CATEGORY
    FUNCTION = "get_sampler"
    RETURN_TYPES = ("SAMPLER",)

    @classmethod
    def INPUT_TYPES(cls):
        from ..model.attention import BACKENDS
        from ..sampling.sampler import PATHS
        return {"required": {
            "frames_per_block": ("INT", {"default": 3, "min": 1, "max": 64, "tooltip":
                                 "Latent frames per autoregressive block (3 for Self-Forcing / CausVid, 1 for "
                                 "frame-wise models); a frame count that is not whole blocks ends with a shorter block, as core."}),
            "kv_window": ("INT", {"default": -1, "min": -1, "max": 1024, "tooltip":
                          "Rolling KV cache window in latent frames; -1 keeps every frame (global cache, as core)."}),
            "sink": ("INT", {"default": 0, "min": 0, "max": 1024, "tooltip":
                     "First latent frames always kept in a rolling window (0 with the global cache)."}),
            "path": (list(PATHS), {"default": "auto", "tooltip":
                     "auto: optimized on CUDA, reference elsewhere. optimized: static buffers and CUDA graphs (same "
                     "results within rounding). reference: one plain model call per step."}),
            "cuda_graphs": ("BOOLEAN", {"default": True, "tooltip":
                            "Replay CUDA graphs on the optimized path (off: plain launches, for debugging)."}),
        }, "optional": {
            "attention": (list(BACKENDS), {"default": "auto", "tooltip":
                          "auto: FlashAttention 3 / 2 where installed and supported, else torch SDPA (exact). "
                          "int8 (opt-in): SageAttention-style int8 Q/K (comfy-kitchen's kernel on CUDA, the "
                          "pack's torch version elsewhere), close to exact but not equal (docs/sampler.md: Fidelity). fp8 "
                          "(opt-in): keys and values smoothed, Q/K in int8, V and P in fp8 (the pack's kernel on "
                          "GPUs of SM 8.9+), within a stated error of exact."}),
            "linear": (LINEAR_CHOICES, {"default": "exact", "tooltip": LINEAR_TOOLTIP}),
        }}

    def get_sampler(self, frames_per_block=3, kv_window=-1, sink=0, path="auto", cuda_graphs=True, attention="auto",
                    linear="exact"):
        from ..model.attention import BACKENDS
        from ..app.validate import check_window
        from ..sampling.sampler import PATHS, path_for_linear
        from .comfy.native_engine import sample_wan_accel
        check_choice("path", path, PATHS)
        check_choice("attention", attention, BACKENDS)
        check_choice("linear", linear, LINEAR_CHOICES)
        path_for_linear(path, linear, names=("path", "linear"))     # the CLI's one rule, in the node's words
        check_window(frames_per_block, kv_window, sink)     # the one window check: kv_window 0 is refused here
        options = {"frames_per_block": int(frames_per_block), "kv_window": int(kv_window), "sink": int(sink),
                   "path": path, "cuda_graphs": bool(cuda_graphs), "attention": attention, "linear": linear}
        return (core("comfy.samplers.KSAMPLER")(sample_wan_accel, extra_options=options),)


def causal_sigmas(preset: str, steps: str = "1000,750,500,250", shift: float = 5.0, warp: bool = True):
    """The step list of a released causal schedule (or a custom one) as a float32 SIGMAS tensor ending in 0."""
    import torch

    return torch.tensor(widget_schedule(preset, steps, shift, warp).sigmas(), dtype=torch.float32)


class WanCausalSigmas:
    DESCRIPTION = ("SIGMAS of the released causal Wan schedules for SamplerCustomAdvanced: Self-Forcing (steps "
                   "1000,750,500,250 warped, shift 5), CausVid (1000,757,522, shift 8) or a custom list and shift.")
    CATEGORY = CATEGORY
    FUNCTION = "get_sigmas"
    RETURN_TYPES = ("SIGMAS",)

    @classmethod
    def INPUT_TYPES(cls):
        from ..sampling.scheduler import PRESET_NAMES
        return {"required": {
            "preset": (list(PRESET_NAMES), {"default": "self_forcing", "tooltip":
                       "self_forcing: 4 warped steps, shift 5. causvid: [1000, 757, 522], shift 8. custom: the "
                       "steps, shift and warp below."}),
            "steps": ("STRING", {"default": "1000,750,500,250", "tooltip":
                      "custom only: timesteps in [0, 1000], comma separated, highest first."}),
            "shift": ("FLOAT", {"default": 5.0, "min": 0.1, "max": 100.0, "step": 0.1, "tooltip":
                      "custom only: the timestep shift of the flow-matching schedule."}),
            "warp": ("BOOLEAN", {"default": True, "tooltip":
                     "custom only: map each step through the shifted schedule (Self-Forcing's warp); off: use "
                     "the steps as timesteps (CausVid)."}),
        }}

    def get_sigmas(self, preset="self_forcing", steps="1000,750,500,250", shift=5.0, warp=True):
        return (causal_sigmas(preset, steps, shift, warp),)


class WanRecordedRun(Node):
    DESCRIPTION = ("Replay a recorded causal run (e.g. an official implementation's output, saved as safetensors in "
                   "ComfyUI's input folder with initial_noise [B, F, C, H, W], context [B, L, C] and "
                   "extra_noise.block{b}.step{k}): gives its noise, its text conditioning, an empty latent of its "
                   "size, and the MODEL carrying its re-noising draws for the Wan Accel AR Sampler.")
    CATEGORY = CATEGORY
    FUNCTION = "load"
    RETURN_TYPES = ("MODEL", "NOISE", "CONDITIONING", "LATENT")
    RETURN_NAMES = ("model", "noise", "conditioning", "latent")

    INPUTS = {"required": {
        "model": ("MODEL", {"tooltip": "The causal Wan MODEL to sample (from Load Diffusion Model)."}),
        "file": ("STRING", {"default": "causal_io.safetensors", "tooltip":
                 "A .safetensors file in ComfyUI's input folder holding the recorded tensors."}),
    }}

    def load(self, model, file="causal_io.safetensors"):
        import torch
        from safetensors.torch import load_file
        from .comfy.comfy_files import input_file
        from .comfy.native_engine import RECORDED_NOISE_KEY
        path = input_file(file, input_name="file")   # only inside ComfyUI's input folder: no '..', no absolute path
        io = load_file(str(path))
        missing = [k for k in ("initial_noise", "context") if k not in io]
        if missing:
            raise ValueError(f"{file} has no {missing}: a recorded run holds initial_noise [B, F, C, H, W], context "
                             f"[B, L, C] and extra_noise.block<b>.step<k>")
        noise = io["initial_noise"].movedim(1, 2).float().contiguous()
        m = model.clone()
        options = m.model_options.setdefault("transformer_options", {})
        options[RECORDED_NOISE_KEY] = {k: v for k, v in io.items() if k.startswith("extra_noise.")}
        latent = {"samples": torch.zeros_like(noise)}
        return (m, _RecordedNoise(noise), [[io["context"].float(), {}]], latent)


class _RecordedNoise:
    """A NOISE whose draw is the recorded initial noise (the re-noising draws travel on the MODEL)."""

    seed = 0

    def __init__(self, noise):
        self.noise = noise

    def generate_noise(self, input_latent):
        want = tuple(input_latent["samples"].shape)
        if tuple(self.noise.shape) != want:
            raise ValueError(f"the recorded noise is {tuple(self.noise.shape)} but the latent is {want}")
        return self.noise.clone()


class WanTinyNativeModel(Node):
    DESCRIPTION = ("The built-in tiny random causal model as ComfyUI's own MODEL (loaded by core as WAN21_CausalAR, "
                   "as Load Diffusion Model would load a converted file) with a random prompt embedding of its "
                   "width: runs a native causal workflow with no model files, in seconds on a CPU. Noise-like "
                   "output is expected.")
    CATEGORY = CATEGORY
    FUNCTION = "load"
    RETURN_TYPES = ("MODEL", "CONDITIONING")
    RETURN_NAMES = ("model", "conditioning")

    INPUTS = {"required": {
        "seed": ("INT", {"default": 0, "min": 0, "max": 2 ** 31 - 1, "tooltip":
                 "Seed of the tiny model's random weights and of its random prompt embedding."}),
    }}

    def load(self, seed=0):
        import torch
        from ..model.tiny import TINY_CONFIG, tiny_causal_model
        patcher = core_causal_model(tiny_causal_model(seed=int(seed)))
        g = torch.Generator().manual_seed((int(seed) + 1) % 2 ** 64)
        context = torch.randn(1, TINY_CONFIG.text_len, TINY_CONFIG.text_dim, generator=g)
        return (patcher, [[context, {}]])


def core_causal_model(model, **model_options):
    """ComfyUI's own MODEL of the pack's tiny causal ``model``: its weights loaded by core (as WAN21_CausalAR, as
    Load Diffusion Model would load a converted file), with ``model_options`` (e.g. dtype)."""
    from ..model.checkpoint import core_causal_metadata
    load = core("comfy.sd.load_diffusion_model_state_dict")
    weights = {k: v.detach().to("cpu").clone() for k, v in model.state_dict().items()}
    patcher = load(weights, model_options=model_options, metadata=core_causal_metadata(model.config))
    if patcher is None:
        raise ValueError("this ComfyUI did not recognise the tiny causal Wan model; it needs ComfyUI 0.33 or "
                         "newer (WAN21_CausalAR)")
    return patcher


NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = node_mappings({
    "WanTinyNativeModel": (WanTinyNativeModel, "Wan Tiny Model (native MODEL)"),
    "WanAccelARSampler": (WanAccelARSampler, "Wan Accel AR Sampler (native MODEL)"),
    "WanCausalSigmas": (WanCausalSigmas, "Wan Causal Sigmas"),
    "WanRecordedRun": (WanRecordedRun, "Wan Recorded Run"),
})
