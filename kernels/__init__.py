"""The pack's fused Triton kernels, each beside its torch reference.

Public functions pick Triton for CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``) and torch
otherwise (always torch when autograd needs to track the inputs); inside torch.compile each call is one opaque op
``torch.ops.wan_accel.<name>``. Configs are tuned through the operator store (``cache/autotune.py``) within the
tile caps of the active compile preset (``use_kernel_caps``).
"""
from ._common import DEFAULT_CAPS, current_caps, use_kernel_caps, use_triton
from . import int8_attention, kv_quant, vae_norm  # noqa: F401 - their op registry families (kernels/registry.py)
from .residual import gated_residual, gated_residual_reference
from .norm_modulate import layernorm_modulate, layernorm_modulate_reference
from .qk_norm_rope import rmsnorm_rope, rmsnorm_rope_reference
from .residual_layernorm import residual_norm, residual_norm_reference

__all__ = [
    "layernorm_modulate", "layernorm_modulate_reference",
    "rmsnorm_rope", "rmsnorm_rope_reference",
    "gated_residual", "gated_residual_reference",
    "residual_norm", "residual_norm_reference",
    "use_kernel_caps", "current_caps", "DEFAULT_CAPS", "use_triton",
]
