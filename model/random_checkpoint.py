"""Random Wan checkpoints in the layouts ComfyUI loads (``bench native``, bench/native.py; the DiT's tensors are
``tiny.draw_weights`` of ``checkpoint.expected_shapes``): ComfyUI's scaled fp8 layout (current and legacy); one
random LoRA in the keys ComfyUI maps on a WAN model; and the safetensors writer. The metadata that makes core load a file as
``WAN21_CausalAR`` is ``checkpoint.core_causal_metadata``."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..cache.owned_files import write_with
from ..kernels.fp8_linear import quantize_tensor
from .tiny import draw_weights

# the block linear weights ComfyUI's fp8_scaled Wan files store in fp8 (and a Wan LoRA adapts)
BLOCK_LINEAR = re.compile(r"^blocks\.\d+\.((self_attn|cross_attn)\.(q|k|v|o)|ffn\.(0|2))\.weight$")


def fp8_scaled(weights: dict, legacy: bool = False, device=None) -> tuple:
    """(tensors, metadata) of ComfyUI's scaled fp8 layout: each block linear weight as float8 e4m3fn divided by a
    float32 per-tensor scale (absmax / 448), the scale beside it. Current layout: ``<layer>.weight_scale`` and the
    ``_quantization_metadata`` header (``{"format_version": "1.0", "layers": {layer: {"format":
    "float8_e4m3fn"}}}``); legacy: ``<layer>.scale_weight`` and an empty float8 ``scaled_fp8`` marker tensor.
    ``device``: where each tensor is converted (a GPU: fast at full size); the results stay where the weights are."""
    out, layers = {}, {}
    for name, w in weights.items():
        if not BLOCK_LINEAR.match(name):
            out[name] = w
            continue
        layer = name[:-len(".weight")]
        codes, scale = quantize_tensor(w.to(device or w.device).float())     # the loader's own per-tensor rule
        out[name] = codes.to(w.device)
        out[f"{layer}.scale_weight" if legacy else f"{layer}.weight_scale"] = scale.to(w.device)
        layers[layer] = {"format": "float8_e4m3fn"}
    meta = {}
    if legacy:
        out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn, device=next(iter(weights.values())).device)
    else:
        meta["_quantization_metadata"] = json.dumps({"format_version": "1.0", "layers": layers})
    return out, meta


def random_lora(weights: dict, rank: int, seed: int) -> dict:
    """One LoRA on every block linear in the keys ComfyUI maps on a WAN model (``diffusion_model.<layer>.lora_A /
    lora_B .weight``, ``<layer>.alpha`` = rank, so the scale is 1), bf16 (``tiny.draw_weights``, seed + 7); its
    update about a quarter of the weight's spread."""
    shapes = {}
    for name, w in weights.items():
        if BLOCK_LINEAR.match(name):
            layer = f"diffusion_model.{name[:-len('.weight')]}"
            shapes[f"{layer}.lora_A.weight"], shapes[f"{layer}.lora_B.weight"] = (rank, w.shape[1]), (w.shape[0], rank)
    out = {}
    for name, t in draw_weights(shapes, int(seed) + 7, dtype=torch.bfloat16):
        out[name] = 0.25 * t if name.endswith("lora_B.weight") else t
        if name.endswith("lora_B.weight"):
            out[name[:-len("lora_B.weight")] + "alpha"] = torch.tensor(float(rank))
    return out


def write_file(path: Path, tensors: dict, metadata: dict) -> float:
    """Write tensors (moved to the CPU) as safetensors, atomically (a stopped run leaves no truncated file that a
    later run would reuse); returns the file's size in MiB."""
    from safetensors.torch import save_file
    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    write_with(path, lambda tmp: save_file(cpu, tmp, metadata=metadata), option="--workdir",
               purpose="a random checkpoint")
    return round(path.stat().st_size / 2 ** 20, 2)
