"""fp8 linear layers for the pack's loader: the weight stays in float8 (1 byte per element), dequantized when called.

A checkpoint stores a quantized linear layer as its float8 weight (``float8_e4m3fn`` or ``float8_e5m2``) and,
optionally, a float32 scale beside it; the real weight is ``weight.float() * scale``. The key names of the scale
follow ComfyUI's conventions (``model/checkpoint.py`` reads them): ``<layer>.scale_weight`` / ``.scale_input``
(scaled fp8 files) or ``<layer>.weight_scale`` / ``.input_scale`` (its per-layer quantization format
``float8_e4m3fn`` / ``float8_e5m2``). A plain fp8 file has no scale (1).

``FP8Linear`` holds the float8 weight and the scale as parameters (so ``model.to``, block swap and the
cross-attention cache move them like any other weight) and computes:

* on a GPU with fp8 matmuls (SM 8.9+), when the layer has a static input scale and an e4m3 weight: one scaled
  matmul (``torch._scaled_mm``) of the input quantized with that scale;
* elsewhere: ``F.linear(x, (weight.float() * scale).to(x.dtype), bias)``, the same numbers as loading the
  dequantized copy in the run's dtype.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
SCALE_PARAMS = ("scale_weight", "scale_input")


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

    @classmethod
    def like(cls, layer: nn.Linear, dtype) -> "FP8Linear":
        """An FP8Linear of ``layer``'s size on its device (weights still to be loaded)."""
        return cls(layer.in_features, layer.out_features, bias=layer.bias is not None, device=layer.weight.device,
                   dtype=dtype)

    def dequantized(self, dtype=torch.float32) -> torch.Tensor:
        return (self.weight.float() * self.scale_weight.float()).to(dtype)

    def _scaled_mm(self, x: torch.Tensor):
        """The fp8 tensor-core matmul, or None where it does not apply (then the layer dequantizes)."""
        s_in, w = self.scale_input, self.weight
        if s_in is None or not x.is_cuda or w.dtype != torch.float8_e4m3fn or self.scale_weight.numel() != 1 \
                or not hasattr(torch, "_scaled_mm") or torch.cuda.get_device_capability(x.device) < (8, 9) \
                or self.in_features % 16 or self.out_features % 16:
            return None
        rows = x.reshape(-1, self.in_features)
        finfo = torch.finfo(torch.float8_e4m3fn)
        q = (rows.float() / s_in.float()).clamp(finfo.min, finfo.max).to(torch.float8_e4m3fn)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        try:
            out = torch._scaled_mm(q, w.t(), scale_a=s_in.float().reshape(()), scale_b=self.scale_weight.float()
                                   .reshape(()), bias=None if bias is None else bias.to(out_dtype),
                                   out_dtype=out_dtype)
        except (RuntimeError, TypeError):
            return None
        out = out[0] if isinstance(out, tuple) else out
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._scaled_mm(x) if self.scale_input is not None else None
        if out is not None:
            return out
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized(x.dtype), bias)


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
        setattr(model.get_submodule(parent) if parent else model, leaf, FP8Linear.like(layer, dtype))
        done.add(owner)
    return done
