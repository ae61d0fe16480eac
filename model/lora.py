"""LoRA adapters merged into a loaded Wan DiT at load time (safetensors only).

LongLive v1.0 ships its generator LoRA as the peft state dict of the wrapped model (``lora.pt``, key
``generator_lora``): keys ``base_model.model.blocks.{i}.<layer>.lora_A.weight`` [rank, in] and ``.lora_B.weight``
[out, rank] on every Linear of every attention block, with no alpha in the file (its config sets alpha = rank, so
the scale is 1). The same file layouts ComfyUI reads are accepted too: ``diffusion_model.``/``model.``/no prefix,
``lora_A``/``lora_B`` or ``lora_down``/``lora_up``, peft's ``.default`` adapter name, and an optional ``<layer>.alpha``
scalar. Each pair is merged as ``W += strength * (alpha / rank) * B @ A`` in float32 and cast back to the weight's
dtype, in place (fused q/k/v buffers stay one buffer).

ComfyUI's ``LoraLoaderModelOnly`` maps ``diffusion_model.<layer>`` keys on a WAN model, not peft's
``base_model.model.`` ones: ``to_comfy`` writes a copy under those names with the alpha recorded.
"""
from __future__ import annotations

import math
import re
from functools import partial
from pathlib import Path

import torch

from ..cache.finite_flags import bad_flag, read_flags
from .checkpoint import CheckpointError, check_path, read_header, strip_prefix

LORA_PREFIXES = ("base_model.model.", "model.diffusion_model.", "diffusion_model.", "transformer.", "model.")
_KEY = re.compile(r"^(?P<layer>.+?)\.(?P<part>lora_A|lora_B|lora_down|lora_up)(?:\.default)?(?:\.weight)?$")
_ALPHA = re.compile(r"^(?P<layer>.+?)\.alpha$")
_DOWN = {"lora_A": "down", "lora_down": "down", "lora_B": "up", "lora_up": "up"}
LORA_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_layer_name = partial(strip_prefix, prefixes=LORA_PREFIXES)     # a key's layer, without its wrapper prefix


class LoraError(CheckpointError):
    """A LoRA file that cannot be merged into the model; the message names the key and the fix."""


def read_lora(path) -> dict:
    """{layer: {"down": A [r, in], "up": B [out, r], "alpha": float | None, "keys": (file keys)}} of a LoRA file."""
    path = check_path(path)
    infos, _ = read_header(path)
    if not infos:
        raise LoraError(f"LoRA file {path.name} holds no tensors")
    from safetensors import safe_open
    with safe_open(str(path), framework="pt", device="cpu") as f:
        return parse_lora(path.name, list(infos), f.get_tensor)


def parse_lora(name: str, keys, get_tensor) -> dict:
    """``read_lora``'s answer for the tensors ``get_tensor(key)`` of ``keys`` (a file named ``name``)."""
    path = Path(name)
    layers: dict = {}
    for key in keys:
        m, a = _KEY.match(key), _ALPHA.match(key)
        if m is None and a is None:
            raise LoraError(f"LoRA file {path.name}: key {key!r} is not a LoRA weight (expected "
                            f"<layer>.lora_A.weight / <layer>.lora_B.weight, lora_down / lora_up, or "
                            f"<layer>.alpha); remove it or convert the file")
        t = get_tensor(key)
        if not isinstance(t, torch.Tensor):
            raise LoraError(f"LoRA file {path.name}: key {key!r} holds a {type(t).__name__}, not a tensor; the file "
                            f"is not a LoRA state dict")
        if t.dtype not in LORA_DTYPES:
            raise LoraError(f"LoRA file {path.name}: key {key!r} is stored as {str(t.dtype).replace('torch.', '')}; "
                            f"LoRA matrices are read as float32, bfloat16 or float16 (an fp8 or integer LoRA is "
                            f"not merged): use the LoRA as it was released, or save it in one of those dtypes")
        if bool(bad_flag(t)):
            raise LoraError(f"LoRA file {path.name}: key {key!r} is not a finite tensor (it holds NaN or infinite "
                            f"values); the file is damaged")
        entry = layers.setdefault(_layer_name((m or a).group("layer")), {"keys": []})
        entry["keys"].append(key)
        if a is not None:
            if t.numel() != 1:
                raise LoraError(f"LoRA file {path.name}: key {key!r} must be one number (the alpha), "
                                f"got shape {list(t.shape)}")
            entry["alpha"] = float(t.reshape(()))
            if not entry["alpha"] > 0:
                raise LoraError(f"LoRA file {path.name}: key {key!r} sets alpha {entry['alpha']:g}; an alpha must "
                                f"be a number > 0 (the update is scaled by alpha / rank; 0 or a negative alpha is "
                                f"no LoRA or an inverted one): fix the file; the LoRA strength scales or inverts it")
        else:
            slot = _DOWN[m.group("part")]
            if slot in entry:
                raise LoraError(f"LoRA file {path.name}: key {key!r} repeats the {slot} matrix of layer "
                                f"{_layer_name(m.group('layer'))!r} (two adapters in one file?)")
            entry[slot] = t
    for layer, e in layers.items():
        missing = [s for s in ("down", "up") if s not in e]
        if missing:
            raise LoraError(f"LoRA file {path.name}: layer {layer!r} ({', '.join(e['keys'])}) has no "
                            f"{'lora_A (down)' if 'down' in missing else 'lora_B (up)'} matrix; the file is "
                            f"incomplete")
        if e["down"].dim() != 2 or e["up"].dim() != 2 or e["down"].shape[0] != e["up"].shape[1]:
            raise LoraError(f"LoRA file {path.name}: layer {layer!r} has lora_A {list(e['down'].shape)} and "
                            f"lora_B {list(e['up'].shape)}; expected [rank, in] and [out, rank]")
        if e["down"].shape[0] == 0:
            raise LoraError(f"LoRA file {path.name}: layer {layer!r} has rank 0 (lora_A {list(e['down'].shape)}, "
                            f"lora_B {list(e['up'].shape)}): it holds no update; the file is empty or damaged")
        e.setdefault("alpha", None)
    return layers


def check_strength(strength) -> float:
    """The LoRA strength as a float; LoraError when it is not a finite number."""
    try:
        value = float(strength)
    except (TypeError, ValueError):
        raise LoraError(f"LoRA strength must be a number, got {strength!r}") from None
    if not math.isfinite(value):
        raise LoraError(f"LoRA strength must be a finite number, got {strength}")
    return value


def check_lora(model: torch.nn.Module, layers: dict, name: str, strength: float = 1.0) -> list:
    """[(parameter, layer entry, scale)] merging ``layers`` (``read_lora``) into ``model``; LoraError naming the
    key and the fix when one does not fit. Only names, shapes and dtypes are read, so a model still on the meta
    device (before its weights are loaded) is checked too."""
    strength = check_strength(strength)
    params = dict(model.named_parameters())
    plan = []
    for layer, e in layers.items():
        target = params.get(f"{layer}.weight")
        if target is None:
            raise LoraError(f"LoRA file {name}: key {e['keys'][0]!r} targets {layer + '.weight'!r}, which the "
                            f"model does not have; use a LoRA trained for this model")
        want = (e["up"].shape[0], e["down"].shape[1])
        if target.dim() != 2 or tuple(target.shape) != want:
            raise LoraError(f"LoRA file {name}: key {e['keys'][0]!r} makes a {list(want)} update but "
                            f"{layer + '.weight'!r} is {list(target.shape)}; use a LoRA trained for this model")
        if not target.is_floating_point() or target.element_size() < 2:
            raise LoraError(f"LoRA file {name}: {layer + '.weight'!r} is stored as {target.dtype}; a LoRA is merged "
                            f"into float32/bfloat16/float16 weights only: load the checkpoint without fp8")
        rank = e["down"].shape[0]
        a = e["alpha"] if e["alpha"] is not None else float(rank)
        plan.append((target, e, strength * a / rank))
    return plan


def merge_lora(model: torch.nn.Module, path, strength: float = 1.0, layers: dict | None = None) -> int:
    """Merge the LoRA file into the model's Linear weights; returns the number of layers changed. A file without
    an alpha takes alpha = rank, as LongLive v1.0 configures it. layers: the file already read
    (``read_lora(path)``), so it is not read twice."""
    strength = check_strength(strength)
    layers = read_lora(path) if layers is None else layers
    plan = check_lora(model, layers, Path(path).name, strength)
    flags = []
    with torch.no_grad():
        for target, e, scale in plan:            # checked first, so a bad file changes nothing
            delta = e["up"].to(target.device, torch.float32) @ e["down"].to(target.device, torch.float32)
            target.copy_((target.float() + scale * delta).to(target.dtype))
            flags.append(bad_flag(target))
    if flags:                                    # one host sync: every merged weight still finite
        bad = [i for i, b in enumerate(read_flags(flags)) if b]
        if bad:
            target, e, scale = plan[bad[0]]
            layer = _layer_name(_KEY.match(e["keys"][0]).group("layer")) if _KEY.match(e["keys"][0]) else e["keys"][0]
            raise LoraError(f"LoRA file {Path(path).name}: merging it at strength {strength:g} (scale "
                            f"{scale:.3g} per layer) makes {layer + '.weight'!r} NaN or infinite in "
                            f"{str(target.dtype).replace('torch.', '')}"
                            f"{f' (and {len(bad) - 1} more layer(s))' if len(bad) > 1 else ''}: its update is too "
                            f"large for the weight; lower the LoRA strength or use another LoRA file. The model "
                            f"was not loaded")
    return len(plan)


def to_comfy(src, dst, alpha: float | None = None, tensors: dict | None = None) -> int:
    """Write the LoRA under the names ComfyUI maps on a WAN model (``diffusion_model.<layer>.lora_A.weight`` ...),
    with ``<layer>.alpha`` set (the file's, else ``alpha``, else the rank). ``tensors``: the LoRA's tensors already
    read (from a released ``.pt`` by the convert command), else ``src`` is read as safetensors. Returns the number
    of layers."""
    from safetensors.torch import save_file
    from ..cache.owned_files import write_with
    if tensors is not None:
        if not tensors or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()):
            raise LoraError(f"{Path(src).name}: no LoRA tensors found (expected a 'generator_lora' entry or a plain "
                            f"state dict of lora_A / lora_B tensors)")
        layers = parse_lora(Path(src).name, list(tensors), tensors.__getitem__)
    else:
        layers = read_lora(src)
    out = {}
    for layer, e in layers.items():
        rank = e["down"].shape[0]
        a = e["alpha"] if e["alpha"] is not None else (float(alpha) if alpha is not None else float(rank))
        out[f"diffusion_model.{layer}.lora_A.weight"] = e["down"].contiguous()
        out[f"diffusion_model.{layer}.lora_B.weight"] = e["up"].contiguous()
        out[f"diffusion_model.{layer}.alpha"] = torch.tensor(a, dtype=torch.float32)
    write_with(dst, lambda tmp: save_file(out, tmp), purpose="the converted LoRA")
    return len(layers)


__all__ = ["LoraError", "read_lora", "parse_lora", "merge_lora", "check_lora", "check_strength", "to_comfy", "LORA_PREFIXES"]
