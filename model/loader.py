"""Checkpoint loading: safetensors only, config from the file (``checkpoint.py``), streamed one tensor at a time.

The model is built on the meta device and each tensor is read, cast and moved to its target device and
dtype on its own, so host RAM never holds a second full copy. Pickle checkpoints (.pt/.pth/.ckpt) are
never opened here: convert them once with ``python -m wan_accel convert`` (``convert.py``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn

from .checkpoint import (METADATA_KEY, CheckpointError, _list, check_dtypes, model_class, open_checkpoint)
from .dit import WanModel


def _set_param(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)


def resolve_config(path, config=None, num_heads=None):
    """(config, {official name: file name}) for a safetensors checkpoint, validated against the model."""
    ckpt = open_checkpoint(path, config, num_heads)
    check_dtypes({n: t.dtype for n, t in ckpt.tensors.items()})
    return ckpt.config, ckpt.names


def load_wan_checkpoint(path, device="cpu", dtype=torch.float32, precision=None, config=None,
                        num_heads=None, attention="auto") -> WanModel:
    """Load a Wan DiT from a .safetensors file. precision: 'float32' | 'wan21' | 'self_forcing'
    (default: 'float32' for float32, else 'self_forcing'). config: WanConfig/dict to use instead of inferring."""
    from safetensors import safe_open
    precision = precision or ("float32" if dtype == torch.float32 else "self_forcing")
    config, names = resolve_config(path, config, num_heads)
    with torch.device("meta"):
        model = model_class(config)(config)
    model.set_precision(precision, dtype)
    targets = {n: p.dtype for n, p in model.named_parameters()}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for name, src in names.items():
            tensor = f.get_tensor(src).to(device=device, dtype=targets[name])
            _set_param(model, name, tensor)
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise CheckpointError(f"parameters left unloaded: {_list(left)}")
    model.set_precision(precision, dtype).set_attention_backend(attention)
    return model.eval().requires_grad_(False)


def save_wan_checkpoint(model: WanModel, path, extra_metadata: dict | None = None) -> Path:
    """Write a model's state dict as safetensors with its config in the metadata."""
    from safetensors.torch import save_file
    meta = {METADATA_KEY: json.dumps(model.config.to_dict())}
    meta.update(extra_metadata or {})
    tensors = {n: t.detach().contiguous() for n, t in model.state_dict().items()}
    save_file(tensors, str(path), metadata=meta)
    return Path(path)
