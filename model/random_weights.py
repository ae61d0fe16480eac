"""Random-weight models at full size, made where they run (benchmarks of the 14B shapes; no checkpoint needed).

``random_model(config, device, dtype, seed=..., weights='bf16' | 'fp8', host_blocks=N)`` builds the model on the
meta device, then draws every tensor on its own target device, in its own dtype, from its own generator seeded by
the run's seed and the tensor's name (``tiny.draw_weights``): a 14B model in bf16 (28 GB) never exists in float32 nor passes through host
RAM, and the values do not depend on the order tensors are made in. The last ``host_blocks`` blocks are drawn and
moved to the CPU as each is made (where block swap keeps them; the same values as without swap), so the device
holds the resident part and one tensor more.

``weights='fp8'``: every linear weight inside a block (``checkpoint.keeps_fp8``: what the loader keeps in 1 byte)
becomes the pack's ``FP8Linear`` (``model/quant.py``) holding e4m3 codes with one float32 scale per tensor
(``kernels/fp8_linear.quantize_tensor``), as a scaled fp8 checkpoint stores them: a 14B model's weights in ~15 GB.
``to_fp8_weights(model)`` does the same to a model whose weights exist (the tiny model on the CPU).

The spread of each tensor is the tiny model's (``tiny.shape_values``); the numbers are not a trained model's.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..kernels.fp8_linear import quantize_tensor
from .checkpoint import keeps_fp8, model_class
from .loader import _set_param
from .quant import install_fp8_linears, is_quantized
from .tiny import draw_weights

WEIGHT_KINDS = ("bf16", "fp8")      # 'bf16': the run's dtype (bf16 on a GPU); 'fp8': block linears in e4m3


def fp8_weight_names(model: nn.Module) -> list:
    """The block linear weights an fp8 checkpoint stores in 1 byte (the loader's rule, ``keeps_fp8``)."""
    return [n for n, p in model.named_parameters()
            if p.dim() == 2 and keeps_fp8(n, "F8_E4M3", tuple(p.shape)) and
            isinstance(model.get_submodule(n[:-len(".weight")]), nn.Linear)]


def random_model(config, device, dtype: torch.dtype, *, seed: int = 0, precision: str = "self_forcing",
                 weights: str = "bf16", host_blocks: int = 0) -> nn.Module:
    """A model of ``config`` with seeded random weights drawn on ``device`` in the run's ``dtype`` (see the module
    doc); ``host_blocks``: the last N blocks are moved to the CPU as they are made (for block swap)."""
    if weights not in WEIGHT_KINDS:
        raise ValueError(f"weights must be one of {WEIGHT_KINDS}, got {weights!r}")
    device = torch.device(device)
    with torch.device("meta"):
        model = model_class(config)(config)
    layers = len(model.blocks)
    if not 0 <= int(host_blocks) <= layers:
        raise ValueError(f"host_blocks must be between 0 and {layers}, got {host_blocks}")
    first_host = layers - int(host_blocks)
    if weights == "fp8":
        install_fp8_linears(model, {n: torch.float8_e4m3fn for n in fp8_weight_names(model)})
    model.set_precision(precision, dtype)
    quantized = {prefix for prefix, mod in model.named_modules() if is_quantized(mod)}

    def draw(name, shape, dt):
        return next(draw_weights({name: shape}, seed, device, dt, per_tensor=True))[1]

    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            parts = name.split(".")
            block = int(parts[1]) if parts[0] == "blocks" and len(parts) > 1 and parts[1].isdigit() else None
            where = torch.device("cpu") if block is not None and block >= first_host else device
            owner, _, leaf = name.rpartition(".")
            if owner in quantized and leaf != "bias":
                if leaf == "weight":        # drawn in the run's dtype, stored as e4m3 codes + one scale
                    codes, scale = quantize_tensor(draw(name, p.shape, dtype))
                    _set_param(model, name, codes.to(where))
                    _set_param(model, f"{owner}.scale_weight", scale.to(where))
                continue
            _set_param(model, name, draw(name, p.shape, p.dtype).to(device=where, dtype=p.dtype))
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"random_model left parameters unmade: {left[:4]}")
    return model.eval().requires_grad_(False)


def to_fp8_weights(model: nn.Module) -> nn.Module:
    """Store every block linear weight of ``model`` (in place) as an ``FP8Linear``: e4m3 codes of its current values
    with one float32 scale per tensor; biases kept. Returns the model."""
    names = fp8_weight_names(model)
    old = {n[:-len(".weight")]: model.get_submodule(n[:-len(".weight")]) for n in names}
    install_fp8_linears(model, {n: torch.float8_e4m3fn for n in names})
    with torch.no_grad():
        for owner, layer in old.items():
            new = model.get_submodule(owner)
            codes, scale = quantize_tensor(layer.weight)
            new.weight = nn.Parameter(codes, requires_grad=False)
            new.scale_weight = nn.Parameter(scale.to(layer.weight.device), requires_grad=False)
            if layer.bias is not None:
                new.bias = nn.Parameter(layer.bias.detach().clone(), requires_grad=False)
    return model
