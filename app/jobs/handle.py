"""The model handle passed between nodes (CAUSALWAN_MODEL) and the one place that resolves load settings."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import logging

import torch

TINY_NAME = "(built-in tiny model)"
TINY_MG2_NAME = "(built-in tiny Matrix-Game-2 model)"    # universal action layout (4 keys + mouse)
TINY_NAMES = (TINY_NAME, TINY_MG2_NAME)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


log = logging.getLogger("wan_accel")


def parse_dtype(name) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {name!r}")
    return DTYPES[name]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class ModelHandle:
    """A loaded model plus the settings it was loaded with; compile settings and the VRAM plan are stored
    for the stages that use them."""
    model: Any
    source: str
    dtype: torch.dtype
    precision: str
    attention: str = "auto"
    compile_settings: Any = None
    plan: Any = None
    extra: dict = field(default_factory=dict)
    lora: str | None = None              # the LoRA file merged into the weights at load, and its strength
    lora_strength: float = 1.0

    @property
    def config(self):
        return self.model.config

    @property
    def is_tiny(self) -> bool:
        return self.source in TINY_NAMES

    @property
    def device(self) -> torch.device:
        return self.model.device


def load_model_handle(checkpoint=None, dtype="bf16", precision="self_forcing", attention="auto", device=None,
                      compile_settings=None, plan=None, num_heads=None, seed: int = 0, lora=None,
                      lora_strength: float = 1.0) -> ModelHandle:
    """Load a checkpoint (a .safetensors path) or, for None / TINY_NAME, build the tiny random model (TINY_MG2_NAME:
    the tiny Matrix-Game-2 model). lora: a LoRA .safetensors file merged into the weights at load
    (``model/lora.py``), scaled by lora_strength; the handle records both (a handle is never shared between two
    LoRA settings: each load merges its own)."""
    from ...model.loader import load_wan_checkpoint
    from ...model.tiny import tiny_causal_model
    device = torch.device(device) if device is not None else default_device()
    dtype_reason = ""
    if dtype == "auto":                     # bf16 with bf16 tensor cores, fp16 on older GPUs, fp32 on the CPU
        from ...memory.system import auto_dtype, detect_system
        dtype, dtype_reason = auto_dtype(detect_system(device))
        log.info("wan_accel: dtype auto -> %s (%s)", dtype, dtype_reason)
    torch_dtype = parse_dtype(dtype)
    if compile_settings is not None:        # a clear error now, not at the first sampling run
        from ...compile.settings import coerce_settings
        compile_settings = coerce_settings(compile_settings)
    if torch_dtype == torch.float32 or precision == "float32":
        torch_dtype, precision = torch.float32, "float32"
    lora = None if lora in (None, "") else str(lora)
    if lora is not None:
        from ...model.lora import check_strength
        lora_strength = check_strength(lora_strength)
    if checkpoint in (None, "", TINY_NAME):
        model = tiny_causal_model(seed, device, torch_dtype, precision).set_attention_backend(attention)
        source = TINY_NAME
    elif checkpoint == TINY_MG2_NAME:
        from ...model.mg2_model import tiny_mg2_model
        model = tiny_mg2_model(seed, device, torch_dtype, precision).set_attention_backend(attention)
        source = TINY_MG2_NAME
    else:
        swap = _planned_swap(plan) if device.type == "cuda" else None
        # A plan that swaps blocks: load on the CPU and move only the resident part to the GPU, so a model larger
        # than the free VRAM never has to fit there whole.
        model = load_wan_checkpoint(checkpoint, device="cpu" if swap else device, dtype=torch_dtype,
                                    precision=precision, num_heads=num_heads, attention=attention, lora=lora,
                                    lora_strength=lora_strength)
        if swap:
            from ...memory.block_swap import apply_block_swap

            apply_block_swap(model, swap, device=device)
        source = str(checkpoint)
    if lora is not None and source in TINY_NAMES:
        from ...model.lora import merge_lora
        merge_lora(model, lora, lora_strength)
    return ModelHandle(model, source, torch_dtype, precision, attention, compile_settings, plan,
                       extra={"dtype_reason": dtype_reason} if dtype_reason else {}, lora=lora,
                       lora_strength=float(lora_strength))


def _planned_swap(plan):
    """The block-swap settings a VRAM plan asks for, or None when it keeps every block resident."""
    if plan is None:
        return None
    swap = plan.swap_settings() if hasattr(plan, "swap_settings") else None
    if swap is None and isinstance(plan, dict) and plan.get("blocks_to_swap"):
        from ...memory.block_swap import SwapSettings

        swap = SwapSettings(int(plan["blocks_to_swap"]), int(plan.get("prefetch", 1)),
                            bool(plan.get("offload_embeddings", False)))
    return swap if swap is not None and swap.blocks_to_swap > 0 else None
