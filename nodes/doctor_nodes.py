"""Node "Wan Doctor": every accelerated feature's verdict on this machine (the ``doctor`` command's table)."""
from __future__ import annotations

from .comfy import FreshNode, check_choice

FEATURE_CHOICES = ["all", "attention.sdpa", "attention.fa3", "attention.fa2", "attention.triton",
                   "attention.fa3_hub", "attention.fa3_xformers", "attention.int8", "attention.fp8", "linear.fp8",
                   "kernel.layernorm_modulate", "kernel.rmsnorm_rope", "kernel.gated_residual", "kernel.rms_norm",
                   "kernel.residual_norm", "kernel.ffn_gelu", "fused_qkv",
                   "cuda_graphs", "compile", "block_swap", "native_model"] + [
    f"op.{op}.kitchen.{backend}" for op in ("layernorm_modulate", "rmsnorm_rope")
    for backend in ("cuda", "triton", "eager")]
DTYPE_CHOICES = ["auto", "bf16", "fp16", "fp32"]


class WanAccelDoctor(FreshNode):   # always read the current verdicts
    DESCRIPTION = ("Checks each accelerated path of the pack (attention backends, fused Triton kernels, fused "
                   "q/k/v, CUDA graphs, compiled blocks, block swap, the native MODEL path) against its plain "
                   "fallback on this GPU, once, and shows the verdicts: a feature that failed or was slower is "
                   "switched off here. The same table as `python -m wan_accel doctor`.")
    CATEGORY = "wan_accel"
    FUNCTION = "run"
    OUTPUT_NODE = True
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("report",)

    INPUTS = {"required": {
        "feature": (FEATURE_CHOICES, {"default": "all", "tooltip": "Which feature to show (or re-check)."}),
        "recheck": ("BOOLEAN", {"default": False, "tooltip": "Probe again even where a verdict is recorded "
                                                             "(after a driver, torch or library update the "
                                                             "check runs again by itself)."}),
        "dtype": (DTYPE_CHOICES, {"default": "auto", "tooltip": "dtype of the probes: auto is bf16 on a GPU, "
                                                                "fp32 on a CPU; use your model's dtype."}),
        "with_compile": ("BOOLEAN", {"default": False, "tooltip": "Also probe torch.compile on a CPU (tens of "
                                                                  "seconds); on a GPU it is always probed."}),
    }}

    def run(self, feature="all", recheck=False, dtype="auto", with_compile=False):
        import torch

        from ..app.doctor.core import doctor_for
        from ..app.doctor.report import doctor_rows, doctor_text
        from ..app.jobs.handle import parse_dtype
        from .comfy import native_probe  # noqa: F401 - registers the native MODEL path's probe (torch: not at import)
        check_choice("feature", feature, FEATURE_CHOICES)
        check_choice("dtype", dtype, DTYPE_CHOICES)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        dt = None if dtype == "auto" else parse_dtype(dtype)
        doctor = doctor_for(device, dt, with_compile=bool(with_compile))
        rows = doctor_rows(doctor, None if feature == "all" else [feature], recheck=bool(recheck))
        text = doctor_text(doctor, rows)
        return {"ui": {"text": [text]}, "result": (text,)}


NODE_CLASS_MAPPINGS = {"WanAccelDoctor": WanAccelDoctor}
NODE_DISPLAY_NAME_MAPPINGS = {"WanAccelDoctor": "Wan Doctor"}
