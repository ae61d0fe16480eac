"""fp8 linear layers for the pack's loader: the weight stays in float8 (1 byte per element), dequantized when called.

A checkpoint stores a quantized linear layer as its float8 weight (``float8_e4m3fn`` or ``float8_e5m2``) and,
optionally, a float32 scale beside it; the real weight is ``weight.float() * scale``. The key names of the scale
follow ComfyUI's conventions (``model/checkpoint.py`` reads them): ``<layer>.scale_weight`` / ``.scale_input``
(scaled fp8 files) or ``<layer>.weight_scale`` / ``.input_scale`` (its per-layer quantization format
``float8_e4m3fn`` / ``float8_e5m2``). A plain fp8 file has no scale (1).

``FP8Linear`` holds the float8 weight and the scale as parameters (so ``model.to``, block swap and the
cross-attention cache move them like any other weight) and computes:

* on a GPU with fp8 matmuls (SM 8.9+), when the layer has a static input scale, an e4m3 weight with one scale and
  sizes that are multiples of 16: one scaled matmul of the input quantized with that scale, through
  comfy-kitchen's ``scaled_mm_v2`` when comfy-kitchen is installed (``kernels/kitchen.py``), else
  ``torch._scaled_mm``;
* elsewhere (a CPU included, where an fp8 matmul would only lose the activations' precision):
  ``F.linear(x, (weight.float() * scale).to(x.dtype), bias)``, the same numbers as loading the dequantized copy
  in the run's dtype.

``fp8_matmul_path(layer, x)`` says which of the three runs for a call, and why (``FP8_PATHS``); a scaled matmul
that raises falls back to the next one.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels import fp8_linear, kitchen, registry

FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
SCALE_PARAMS = ("scale_weight", "scale_input")
FP8_PATHS = ("kitchen", "torch", "dequantize")     # fastest first
_FOUND: dict = {}                                   # looked up once: comfy-kitchen's scaled matmul


def is_fp8(dtype) -> bool:
    return dtype in FP8_DTYPES


class FP8Linear(nn.Linear):
    """A linear layer whose weight is stored in float8 with a per-tensor (or per-output-row) float32 scale."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=torch.float8_e4m3fn):
        super().__init__(in_features, out_features, bias=bias, device=device)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype),
                                   requires_grad=False)
        self.scale_weight = nn.Parameter(torch.ones((), device=device), requires_grad=False)
        self.register_parameter("scale_input", None)

    def dequantized(self, dtype=torch.float32) -> torch.Tensor:
        return (self.weight.float() * self.scale_weight.float()).to(dtype)

    def _scaled_mm(self, x: torch.Tensor, path: str):
        """The fp8 matmul of ``path`` ('kitchen' | 'torch'), or None when it raises (the next path runs)."""
        s_in, w = self.scale_input, self.weight
        rows = x.reshape(-1, self.in_features)
        q = quantize_input(rows, s_in)
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        bias = None if self.bias is None else self.bias.to(out_dtype)
        mm = kitchen_scaled_mm() if path == "kitchen" else torch_scaled_mm
        try:
            out = mm(q, w.t(), s_in.float().reshape(()), self.scale_weight.float().reshape(()), bias, out_dtype)
        except (RuntimeError, TypeError, ValueError, NotImplementedError, AttributeError):
            return None
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        path = fp8_matmul_path(self, x)[0]
        for fast in FP8_PATHS[FP8_PATHS.index(path):-1]:
            out = self._scaled_mm(x, fast)
            if out is not None:
                return out
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized(x.dtype), bias)


def quantize_input(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Activations in float8 e4m3 with a static per-tensor scale (clamped to the format's range)."""
    finfo = torch.finfo(torch.float8_e4m3fn)
    return (rows.float() / scale.float()).clamp(finfo.min, finfo.max).to(torch.float8_e4m3fn)


def torch_scaled_mm(q, w_t, scale_a, scale_b, bias, out_dtype) -> torch.Tensor:
    """``torch._scaled_mm`` of e4m3 ``q`` [M, K] and ``w_t`` [K, N] with per-tensor scales."""
    out = torch._scaled_mm(q, w_t, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)
    return out[0] if isinstance(out, tuple) else out


def kitchen_scaled_mm():
    """comfy-kitchen's fp8 scaled matmul (``comfy_kitchen.scaled_mm_v2.scaled_mm_v2``: input, weight, scale_a,
    scale_b, bias, out_dtype), or None when comfy-kitchen is absent or does not offer it."""
    if "kitchen" not in _FOUND:
        fn = getattr(kitchen.submodule("scaled_mm_v2"), "scaled_mm_v2", None)
        _FOUND["kitchen"] = fn if callable(fn) else None
    return _FOUND["kitchen"]


def fp8_mm_device_problem(device) -> str | None:
    """Why fp8 tensor-core matmuls do not run on ``device`` (None: they do): the op registry's 'linear.fp8'."""
    why = registry.walk(fp8_linear.FAMILY, device)[1]["scaled_mm"]
    return f"fp8 matmuls {why} (the weight is dequantized)" if why else None


def fp8_matmul_path(layer: "FP8Linear", x: torch.Tensor) -> tuple[str, str]:
    """(path, why) of the matmul an ``FP8Linear`` call runs: 'kitchen' (comfy-kitchen's scaled matmul),
    'torch' (``torch._scaled_mm``) or 'dequantize' (the weight dequantized to the input's dtype)."""
    if layer.scale_input is None:
        return "dequantize", "the layer has no static input scale"
    if layer.weight.dtype != torch.float8_e4m3fn:
        return "dequantize", f"the weight is {layer.weight.dtype} (scaled matmuls take float8_e4m3fn)"
    if layer.scale_weight.numel() != 1:
        return "dequantize", "the weight scale is per row (scaled matmuls take one per tensor)"
    if layer.in_features % 16 or layer.out_features % 16:
        return "dequantize", f"{layer.in_features}x{layer.out_features} is not a multiple of 16"
    problem = fp8_mm_device_problem(x.device)
    if problem:
        return "dequantize", problem
    if kitchen_scaled_mm() is not None:
        return "kitchen", f"comfy-kitchen {kitchen.version()} scaled_mm_v2"
    if hasattr(torch, "_scaled_mm"):
        return "torch", "torch._scaled_mm (comfy-kitchen is not installed)"
    return "dequantize", f"torch {torch.__version__} has no _scaled_mm"


def is_quantized(layer) -> bool:
    """The layer dequantizes its stored weight when called (one GEMM over its raw weight would be wrong)."""
    return isinstance(layer, FP8Linear)


def quantized_param_names(model: nn.Module) -> set:
    """Names of the parameters of quantized layers that keep their stored dtype (weight, scales)."""
    out = set()
    for prefix, mod in model.named_modules():
        if is_quantized(mod):
            out.update(f"{prefix}.{n}" if prefix else n for n in ("weight",) + SCALE_PARAMS)
    return out


def install_fp8_linears(model: nn.Module, weights: dict) -> set:
    """Replace each linear layer whose weight name is in ``weights`` ({'blocks.0.ffn.0.weight': float8 dtype}) by
    an ``FP8Linear`` of that storage dtype. Returns the names of the layers replaced."""
    done = set()
    for name, dtype in weights.items():
        owner = name[:-len(".weight")]
        parent, _, leaf = owner.rpartition(".")
        layer = model.get_submodule(owner)
        if not isinstance(layer, nn.Linear) or is_quantized(layer):
            continue
        fp8 = FP8Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                        device=layer.weight.device, dtype=dtype)        # its weights still to be loaded
        setattr(model.get_submodule(parent) if parent else model, leaf, fp8)
        done.add(owner)
    return done
