"""The Wan Accel AR Sampler on a ComfyUI causal Wan MODEL whose block linear weights are ComfyUI quantized tensors.

Run with ComfyUI's Python, cwd = ComfyUI, the pack importable as ``wan_accel``; argument: a format ('mxfp8' or
'nvfp4'). Random tiny weights; each block linear weight is quantized with comfy-kitchen (``QuantizedTensor.from_float``,
eager backend on a CPU) and written as ComfyUI's loader reads it (``weight``, ``weight_scale``, ``weight_scale_2``,
``comfy_quant``); ``load_diffusion_model_state_dict`` builds the model with its quantized ops. Both samplers (the
pack's, both paths) runs on that MODEL and on one loaded from the dequantized weights; prints JSON: the relative
difference of the latents, how many
layers hold quantized weights before and after, why q/k/v ran unfused, and the weight fingerprint.
"""
from __future__ import annotations

import json
import re
import sys

import torch
from comfy.cli_args import args

args.cpu = True
import comfy.model_management  # noqa: E402
import comfy.samplers  # noqa: E402
import comfy.sd  # noqa: E402
from comfy.quant_ops import QuantizedTensor  # noqa: E402
from comfy_extras.nodes_custom_sampler import Guider_Basic  # noqa: E402

from wan_accel.model.checkpoint import core_causal_metadata, expected_shapes  # noqa: E402
from wan_accel.model.config import WanConfig  # noqa: E402
from wan_accel.nodes.comfy.native_engine import engine_for, sample_wan_accel  # noqa: E402
from wan_accel.nodes.native_nodes import causal_sigmas  # noqa: E402
from wan_accel.sampling.continuation import weight_fingerprint  # noqa: E402

CONFIG = WanConfig(dim=64, ffn_dim=128, freq_dim=32, text_dim=48, text_len=16, num_heads=4, num_layers=2)
LAYOUTS = {"mxfp8": "TensorCoreMXFP8Layout", "nvfp4": "TensorCoreNVFP4Layout"}
LINEAR = re.compile(r"^blocks\.\d+\.(self_attn|cross_attn|ffn)\.[^.]+\.weight$")


def quantized_state_dict(fmt: str, seed: int = 0) -> tuple[dict, dict]:
    """(the quantized file's tensors, the dequantized copy in float32)."""
    g = torch.Generator().manual_seed(seed)
    sd, deq = {}, {}
    for name, shape in sorted(expected_shapes(CONFIG).items()):
        w = torch.randn(shape, generator=g)
        w = 0.1 * w if name.endswith("modulation") else 1.0 + 0.05 * w if "norm" in name else \
            0.02 * w if name.endswith("bias") else w / (w[0].numel() ** 0.5) if w.dim() > 1 else w
        if not LINEAR.match(name) or w.dim() != 2:
            sd[name] = deq[name] = w
            continue
        q = QuantizedTensor.from_float(w, LAYOUTS[fmt])
        deq[name] = q.dequantize().float()
        layer = name[:-len(".weight")]
        sd[name] = q._qdata
        if fmt == "mxfp8":
            sd[f"{layer}.weight_scale"] = q._params.scale.view(torch.uint8)
        else:
            sd[f"{layer}.weight_scale_2"] = q._params.scale
            sd[f"{layer}.weight_scale"] = q._params.block_scale.view(torch.uint8)
        sd[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps({"format": fmt}).encode()), dtype=torch.uint8)
    return sd, deq


def quantized_layers(dm) -> int:
    return sum(isinstance(getattr(m, "weight", None), QuantizedTensor) or
               isinstance(getattr(getattr(m, "weight", None), "data", None), QuantizedTensor)
               for m in dm.modules())


def _guider(sd, context):
    patcher = comfy.sd.load_diffusion_model_state_dict(sd, metadata=core_causal_metadata(CONFIG))
    comfy.model_management.load_models_gpu([patcher])
    guider = Guider_Basic(patcher)
    guider.set_conds([[context, {}]])
    return patcher, guider


def main(fmt: str) -> None:
    sd, deq = quantized_state_dict(fmt)
    g = torch.Generator().manual_seed(1)
    context = torch.randn(1, 10, CONFIG.text_dim, generator=g)
    patcher, guider = _guider(sd, context)
    dm = patcher.model.diffusion_model
    before = quantized_layers(dm)
    latent = torch.zeros(1, 16, 6, 8, 12)
    noise = torch.randn(latent.shape, generator=g)
    sigmas = causal_sigmas("self_forcing")

    def run(gd, path, report=None):
        opts = {"frames_per_block": 3, "path": path, "report": {} if report is None else report}
        return gd.sample(noise.clone(), latent.clone(), comfy.samplers.KSAMPLER(sample_wan_accel, extra_options=opts),
                         sigmas.clone(), seed=7, disable_pbar=True)

    reports = {"reference": {}, "optimized": {}}
    outs = {path: run(guider, path, reports[path]) for path in reports}
    _, plain = _guider(deq, context)
    core = run(plain, "reference")            # the same sampler on the dequantized copy, plain float32 layers
    engine = engine_for(patcher.model, torch.device("cpu"))
    print(json.dumps({
        "format": fmt, "model": type(patcher.model).__name__, "quantized_layers_before": before,
        "quantized_layers_after": quantized_layers(dm), "expected_layers": 10 * CONFIG.num_layers,
        "finite": all(bool(torch.isfinite(o).all()) for o in outs.values()),
        "scale": core.abs().max().item(),
        "rel_diff_vs_dequantized": {p: ((o - core).norm() / core.norm()).item() for p, o in outs.items()},
        "fused_qkv_off": {p: r.get("fused_qkv_off") for p, r in reports.items()},
        "fingerprint": [weight_fingerprint(engine), weight_fingerprint(engine)],
    }))


if __name__ == "__main__":
    main(sys.argv[1])
