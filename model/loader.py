"""Checkpoint loading: safetensors only, config from the file (``checkpoint.py``), streamed one tensor at a time.

The model is built on the meta device and each tensor is read, cast and moved to its target device and
dtype on its own, so host RAM never holds a second full copy. Each self-attention's q, k and v are loaded straight
into the slices of one concatenated buffer (``fused_qkv.py``: one GEMM for the optimized path, views for the rest),
so fusing never copies them again; on the CPU they are read from the file with plain reads, so none of their file
pages stays mapped beside the buffer: one copy of each weight. Pickle checkpoints (.pt/.pth/.ckpt) are never
opened here: convert them once with ``python -m wan_accel convert`` (``convert.py``).
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import torch
import torch.nn as nn

from ..cache.finite_flags import bad_flag, read_flags
from .checkpoint import (INPUT_SCALES, TORCH_DTYPES, WEIGHT_SCALES, CheckpointError, _list,
                         check_dtypes, check_quant_formats, keeps_fp8, metadata_quant_formats, model_class,
                         open_checkpoint, read_tensor_into)
from .dit import WanModel
from .finite import check_weights
from .fused_qkv import QKV_BIAS, QKV_WEIGHT
from .lora import check_lora, merge_lora, read_lora
from .quant import install_fp8_linears

_QKV = re.compile(r"^(blocks\.\d+\.self_attn)\.([qkv])\.(weight|bias)$")


def _set_param(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)


def _load_fused_qkv(model, f, ckpt, device, targets: dict, skip=frozenset()) -> set:
    """Load every self-attention's q/k/v (weight, and bias) into one [3*dim, ...] buffer per block; the three
    parameters become views of it. Returns the names loaded. ``skip``: attention modules left unfused (their
    layers are quantized: each dequantizes its own weight with its own scale)."""
    groups: dict = {}
    for name in ckpt.tensors:
        m = _QKV.match(name)
        if m and m.group(1) not in skip:
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
            if not read_tensor_into(ckpt.path, info, part):
                part.copy_(f.get_tensor(ckpt.names[parts[x]]).to(dtype=dt))
        sa = model.get_submodule(owner)
        for part, x in zip(buf.chunk(3), "qkv"):
            _set_param(model, parts[x], part)
        sa.register_buffer(QKV_WEIGHT if kind == "weight" else QKV_BIAS, buf, persistent=False)
        done.update(parts.values())
    return done


def _scale_shape(scale: torch.Tensor) -> tuple:
    """A weight scale as it multiplies the [out, in] weight: one value, or one per output row."""
    return () if scale.numel() == 1 else (scale.numel(), 1)


def _read_scales(f, ckpt, device) -> tuple[dict, dict]:
    """({layer: (weight scale, input scale or None)} as float32 on ``device``, {weight name: the scale in the file it
    is multiplied by}: what a non-finite weight most likely comes from). Each scale is checked: a floating tensor of
    one value (or one per output row of the weight), finite and positive. The layers' quantization formats (the
    file's metadata and each layer's ``comfy_quant`` entry) must be fp8. Errors name the tensor in the file."""
    from ..cache.safety import loads_json
    formats = metadata_quant_formats(ckpt.metadata)     # checked when the file was opened (its name in errors)
    out, values, hints = {}, [], {}
    for layer, side in (ckpt.quant or {}).items():
        where = f"{ckpt.path.name}: quantization tensor"
        if "comfy_quant" in side:
            src = ckpt.names[f"{layer}.comfy_quant"]
            try:
                conf = loads_json(bytes(f.get_tensor(src).to(torch.uint8).flatten().tolist()).decode("utf-8"))
            except (ValueError, UnicodeDecodeError, RecursionError):       # not JSON, or nested thousands deep
                raise CheckpointError(f"{where} {src!r} is not the JSON of a layer format; the file is damaged") \
                    from None
            formats[layer] = conf.get("format") if isinstance(conf, dict) else None
        weight = ckpt.tensors[f"{layer}.weight"]       # there: checked when the file was opened (check_quant_side)
        got = []
        for kinds, rows in ((WEIGHT_SCALES, weight.shape[0]), (INPUT_SCALES, None)):    # rows: one scale per row
            kind = next((k for k in kinds if k in side), None)
            if kind is None:
                got.append(None)
                continue
            src, info = ckpt.names[f"{layer}.{kind}"], side[kind]
            if rows is not None:
                hints[f"{layer}.weight"] = (f"multiplied by its scale {src!r}: a scale too large for the weight, or "
                                            f"bytes that encode NaN/inf")
            if info.dtype not in ("F32", "F16", "BF16", "F64") or \
                    not (math.prod(info.shape) == 1 or tuple(info.shape) in ((rows,), (rows, 1))):
                raise CheckpointError(f"{where} {src!r} is {info.dtype} {list(info.shape)}; a scale is one float "
                                      f"value" + (f" or one per output row ([{rows}] or [{rows}, 1])"
                                                  if rows is not None else "") + "; the file is damaged")
            value = f.get_tensor(src).to(device=device, dtype=torch.float32)
            values.append((f"{where} {src!r}", value))
            got.append(value)
        if got != [None, None]:
            out[layer] = tuple(got)
    read = read_flags([f for _, v in values for f in (bad_flag(v), ~(v > 0).all())])    # one host sync
    for i, (name, _) in enumerate(values):
        if read[2 * i] or read[2 * i + 1]:
            raise CheckpointError(f"{name} holds {'non-finite' if read[2 * i] else 'zero or negative'} values; a "
                                  f"scale must be finite and positive. The file is damaged: download or convert it "
                                  f"again")
    check_quant_formats(formats)
    return out, hints


def load_wan_checkpoint(path, device="cpu", dtype=torch.float32, precision=None, config=None,
                        num_heads=None, attention="auto", lora=None, lora_strength: float = 1.0) -> WanModel:
    """Load a Wan DiT from a .safetensors file. precision: 'float32' | 'wan21' | 'self_forcing'
    (default: 'float32' for float32, else 'self_forcing'). config: WanConfig/dict to use instead of inferring.
    lora: a LoRA .safetensors file merged into the weights at load (``lora.py``), scaled by lora_strength."""
    from safetensors import safe_open
    precision = precision or ("float32" if dtype == torch.float32 else "self_forcing")
    lora_layers = None if lora is None else read_lora(lora)     # a bad LoRA file fails before the checkpoint is read
    ckpt = open_checkpoint(path, config, num_heads)             # the header is read once, validated against the model
    check_dtypes({n: t.dtype for n, t in ckpt.tensors.items()})
    config, names = ckpt.config, ckpt.names
    with torch.device("meta"):
        model = model_class(config)(config)
    fp8 = {n: getattr(torch, TORCH_DTYPES[t.dtype]) for n, t in ckpt.tensors.items()
           if keeps_fp8(n, t.dtype, t.shape)}
    quantized = install_fp8_linears(model, fp8)        # these layers keep their fp8 weight (model/quant.py)
    model.set_precision(precision, dtype)
    targets = {n: p.dtype for n, p in model.named_parameters()}
    if lora_layers is not None:             # a LoRA that does not fit fails before any weight is read
        check_lora(model, lora_layers, Path(lora).name, lora_strength)
    with safe_open(str(path), framework="pt", device="cpu") as f:
        scales, hints = _read_scales(f, ckpt, device)
        skip = {n.rpartition(".")[0] for n in quantized}
        fused = _load_fused_qkv(model, f, ckpt, device, targets, skip)
        for name, info in ckpt.tensors.items():
            if name in fused:
                continue
            t, layer = f.get_tensor(names[name]), name[:-len(".weight")]
            if layer in quantized:
                _set_param(model, name, t.to(device=device))
                continue
            if name.endswith(".weight") and layer in scales:        # a scaled weight kept in the run's dtype
                t = t.float() * scales[layer][0].to(t.device).reshape(_scale_shape(scales[layer][0]))
            _set_param(model, name, t.to(device=device, dtype=targets[name]))
        for layer in quantized:
            weight_scale, input_scale = scales.get(layer, (None, None))
            _set_param(model, f"{layer}.scale_weight", torch.ones((), device=device) if weight_scale is None
                       else weight_scale.reshape(_scale_shape(weight_scale)))
            if input_scale is not None:
                _set_param(model, f"{layer}.scale_input", input_scale.reshape(()))
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise CheckpointError(f"parameters left unloaded: {_list(left)}")
    check_weights(model, Path(path).name, hints)      # loaded and dequantized: every value finite
    if lora is not None:
        merge_lora(model, lora, lora_strength, layers=lora_layers)     # checks the layers it changed
    model.set_precision(precision, dtype).set_attention_backend(attention)
    return model.eval().requires_grad_(False)

