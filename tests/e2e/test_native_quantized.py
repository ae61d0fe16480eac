"""ComfyUI's quantized Wan weights (MXFP8 / NVFP4 QuantizedTensor, comfy-kitchen's eager backend on a CPU) through
the Wan Accel AR Sampler, with ComfyUI's Python (skipped unless COMFYUI_DIR and COMFYUI_VENV are set).

``native_quantized_check.py`` loads a tiny causal Wan whose block linear weights are quantized, samples it with both
paths of the pack's sampler, and samples a MODEL loaded from the dequantized weights. On a CPU the quantized layers
dequantize their weight and run a float32 GEMM, so the two must agree to float32 rounding; the weights must still be
quantized afterwards (the engine never fused, cast or replaced them) and q/k/v must have run unfused."""
from __future__ import annotations

import pytest
import torch

from e2e.test_native_vs_core import COMFY_DIR, COMFY_VENV, _run

pytestmark = pytest.mark.skipif(not (COMFY_DIR and COMFY_VENV),
                                reason="set COMFYUI_DIR and COMFYUI_VENV to run ComfyUI's quantized layers")
F32_EPS = torch.finfo(torch.float32).eps


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_quantized_native_model_samples_like_its_dequantized_copy(tmp_path, fmt):
    res = _run(tmp_path, "native_quantized_check.py", fmt)
    assert res["model"] == "WAN21_CausalAR" and res["finite"], res
    assert res["quantized_layers_before"] == res["quantized_layers_after"] == res["expected_layers"], res
    # the same dequantized weights through the same ops; the optimized path on the plain copy fuses q/k/v (one
    # GEMM instead of three), which reorders float32 sums: a few ulps per layer, well under 2^-16 relative
    for path, diff in res["rel_diff_vs_dequantized"].items():
        assert diff <= 512 * F32_EPS, (path, res)
    assert all("quantized" in (why or "") for why in res["fused_qkv_off"].values()), res
    assert res["fingerprint"][0] == res["fingerprint"][1], res
