"""Checkpoint loading: safetensors only, config from the file (``checkpoint.py``), streamed one tensor at a time.

The model is built on the meta device and each tensor is read, cast and moved to its target device and
dtype on its own, so host RAM never holds a second full copy. Each self-attention's q, k and v are loaded straight
into the slices of one concatenated buffer (``fused_qkv.py``: one GEMM for the optimized path, views for the rest),
so fusing never copies them again; on the CPU they are read from the file with plain reads, so none of their file
pages stays mapped beside the buffer: one copy of each weight. Pickle checkpoints (.pt/.pth/.ckpt) are never
opened here: convert them once with ``python -m wan_accel convert`` (``convert.py``).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.nn as nn

from .checkpoint import (METADATA_KEY, CheckpointError, _list, check_dtypes, model_class, open_checkpoint,
                         read_tensor_into)
from .dit import WanModel
from .fused_qkv import QKV_BIAS, QKV_WEIGHT

_QKV = re.compile(r"^(blocks\.\d+\.self_attn)\.([qkv])\.(weight|bias)$")


def _set_param(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)


def resolve_checkpoint(path, config=None, num_heads=None):
    """The checkpoint (header, names, settled config) of a safetensors file, validated against the model."""
    ckpt = open_checkpoint(path, config, num_heads)
    check_dtypes({n: t.dtype for n, t in ckpt.tensors.items()})
    return ckpt


def _load_fused_qkv(model, f, path, ckpt, names: dict, device, targets: dict) -> set:
    """Load every self-attention's q/k/v (weight, and bias) into one [3*dim, ...] buffer per block; the three
    parameters become views of it. Returns the names loaded."""
    groups: dict = {}
    for name in names:
        m = _QKV.match(name)
        if m:
            groups.setdefault((m.group(1), m.group(3)), {})[m.group(2)] = name
    done = set()
    for (owner, kind), parts in groups.items():
        if set(parts) != {"q", "k", "v"}:
            continue
        infos = [ckpt.tensors[parts[x]] for x in "qkv"]
        dt = targets[parts["q"]]
        if len({i.shape for i in infos}) != 1 or len({targets[parts[x]] for x in "qkv"}) != 1:
            continue
        buf = torch.empty((3 * infos[0].shape[0],) + tuple(infos[0].shape[1:]), device=device, dtype=dt)
        for part, info, x in zip(buf.chunk(3), infos, "qkv"):
            if not read_tensor_into(path, info, part):
                part.copy_(f.get_tensor(names[parts[x]]).to(dtype=dt))
        sa = model.get_submodule(owner)
        for part, x in zip(buf.chunk(3), "qkv"):
            _set_param(model, parts[x], part)
        sa.register_buffer(QKV_WEIGHT if kind == "weight" else QKV_BIAS, buf, persistent=False)
        done.update(parts.values())
    return done


def load_wan_checkpoint(path, device="cpu", dtype=torch.float32, precision=None, config=None,
                        num_heads=None, attention="auto") -> WanModel:
    """Load a Wan DiT from a .safetensors file. precision: 'float32' | 'wan21' | 'self_forcing'
    (default: 'float32' for float32, else 'self_forcing'). config: WanConfig/dict to use instead of inferring."""
    from safetensors import safe_open
    precision = precision or ("float32" if dtype == torch.float32 else "self_forcing")
    ckpt = resolve_checkpoint(path, config, num_heads)          # the header is read once
    config, names = ckpt.config, ckpt.names
    with torch.device("meta"):
        model = model_class(config)(config)
    model.set_precision(precision, dtype)
    targets = {n: p.dtype for n, p in model.named_parameters()}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        fused = _load_fused_qkv(model, f, path, ckpt, names, device, targets)
        for name, src in names.items():
            if name not in fused:
                _set_param(model, name, f.get_tensor(src).to(device=device, dtype=targets[name]))
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
    from ..cache.owned_files import write_with
    return write_with(path, lambda tmp: save_file(tensors, tmp, metadata=meta), purpose="the checkpoint")
