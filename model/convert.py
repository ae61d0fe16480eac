"""Convert Self-Forcing / CausVid training checkpoints (.pt) to safetensors.

The .pt file is read with torch.load(weights_only=True), which refuses arbitrary pickled objects.
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch

from ..cache.finite_flags import counts, non_finite
from .checkpoint import (METADATA_KEY, OVERRIDABLE, CheckpointError, canonical_names, core_causal_metadata,
                         expected_shapes, infer_config, validate_keys)


def _load_pt(src: Path):
    if not src.is_file():
        raise CheckpointError(f"checkpoint not found: {src}")
    try:
        try:
            return torch.load(str(src), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            # legacy (non-zip) files cannot be memory-mapped
            return torch.load(str(src), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        detail = next((ln.strip() for ln in str(exc).splitlines() if "Unsupported global" in ln), "")
        raise CheckpointError(f"{src.name} holds objects other than tensors and plain containers; it was not "
                              f"loaded (weights_only=True refuses arbitrary pickled code). {detail}") from exc
    except Exception as exc:  # noqa: BLE001 - garbage bytes fail the unpickler in any way (KeyError, struct.error...)
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__).split(". ")[0]
        if not isinstance(exc, (RuntimeError, EOFError, ValueError, OSError)):
            first = f"unreadable pickle data: {type(exc).__name__} {first}"
        raise CheckpointError(f"{src.name} is not a readable PyTorch checkpoint ({first}); it may be damaged or "
                              f"incomplete: download or save it again") from exc


def lora_state_dict(src) -> dict:
    """The LoRA tensors of a training checkpoint (LongLive's ``lora.pt``: its ``generator_lora`` entry, or a plain
    state dict), read with weights_only=True."""
    obj = _load_pt(Path(src))
    if isinstance(obj, dict) and isinstance(obj.get("generator_lora"), dict):
        obj = obj["generator_lora"]
    if not isinstance(obj, dict):
        raise CheckpointError(f"{Path(src).name} holds a {type(obj).__name__}, not a LoRA state dict")
    return _named_tensors(obj, Path(src).name, "a LoRA state dict")


def _named_tensors(state: dict, source: str, what: str) -> dict:
    """``state`` when it maps tensor names (text) to values; CheckpointError naming the file otherwise (a dict
    with integer or other keys is not a state dict)."""
    bad = next((k for k in state if not isinstance(k, str)), None)
    if bad is not None:
        raise CheckpointError(f"{source}: the key {bad!r} ({type(bad).__name__}) is not a tensor name; {what} maps "
                              f"names such as 'blocks.0.self_attn.q.weight' to tensors, so this file is not one")
    return state


def pick_state_dict(obj, ema: bool = False) -> tuple[dict, str]:
    """The generator weights of a training checkpoint: 'generator_ema' with ema, else 'generator';
    a plain state dict is used as is."""
    if not isinstance(obj, dict):
        raise CheckpointError(f"expected a dict in the checkpoint, found {type(obj).__name__}")
    if ema:
        if "generator_ema" not in obj:
            raise CheckpointError(f"--ema given but the checkpoint has no 'generator_ema' (top-level keys: "
                                  f"{sorted(map(str, obj))[:10]})")
        if not isinstance(obj["generator_ema"], dict):
            raise CheckpointError(f"'generator_ema' holds a {type(obj['generator_ema']).__name__}, not weights")
        return _named_tensors(obj["generator_ema"], "'generator_ema'", "a state dict"), "generator_ema"
    for key in ("generator", "generator_ema", "state_dict", "model"):
        if isinstance(obj.get(key), dict):
            return _named_tensors(obj[key], f"'{key}'", "a state dict"), key
    if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return _named_tensors(obj, "the checkpoint", "a state dict"), "(top level)"
    raise CheckpointError(f"no weights found: expected a 'generator' / 'generator_ema' entry or a plain "
                          f"state dict (top-level keys: {sorted(map(str, obj))[:10]})")


def convert_pt_to_safetensors(src, dst, ema: bool = False, num_heads: int | None = None,
                              config: dict | None = None) -> dict:
    """Convert; returns a summary dict (source entry, number of tensors, config). The config written to the
    metadata (``checkpoint.METADATA_KEY``) is inferred from the shapes; ``config`` may add what shapes cannot show
    (``num_heads``, a rolling window: ``local_attn_size`` / ``sink_size``, ``text_len``, ...). ComfyUI's ``config``
    entry (``checkpoint.core_causal_metadata``) is written too, so core loads the file as ``WAN21_CausalAR``. A
    weight holding NaN or inf is refused (CheckpointError naming it) and nothing is written."""
    from safetensors.torch import save_file
    src, dst = Path(src), Path(dst)
    if dst.suffix.lower() != ".safetensors":
        raise CheckpointError(f"output must be a .safetensors file, got {dst.name}")
    try:
        state, entry = pick_state_dict(_load_pt(src), ema)
    except CheckpointError as exc:
        raise CheckpointError(exc if str(exc).startswith(src.name) else f"{src.name}: {exc}") from None
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    names = canonical_names(tensors)
    shapes = {n: tuple(tensors[src_name].shape) for n, src_name in names.items()}
    extra = dict(config or {})
    unknown = set(extra) - set(OVERRIDABLE) - {"num_heads"}
    if unknown:
        raise CheckpointError(f"convert: config keys {sorted(unknown)} are read from the tensor shapes and cannot "
                              f"be set; settable: {sorted(set(OVERRIDABLE) | {'num_heads'})}")
    config = infer_config(shapes, num_heads=num_heads, overrides=extra)
    validate_keys(expected_shapes(config), shapes, src.name)
    out = {n: tensors[src_name].contiguous() for n, src_name in names.items()}
    bad = non_finite(out)                       # every weight written is finite (one pass, one host sync)
    if bad:
        src_name = names[bad[0]]
        more = f" (and {len(bad) - 1} more tensor(s))" if len(bad) > 1 else ""
        other = "the non-EMA weights" if ema else "--ema"
        raise CheckpointError(f"{src.name}: the weight {src_name!r} in '{entry}' holds values that are not "
                              f"numbers ({counts(out[bad[0]])}){more}; every loader refuses such a file, so nothing "
                              f"was written: convert another checkpoint (an earlier save, or {other})")
    meta = {METADATA_KEY: json.dumps(config.to_dict()), "wan_accel.source": f"{src.name}:{entry}",
            **core_causal_metadata(config)}     # ComfyUI's Load Diffusion Model reads it as WAN21_CausalAR
    from ..cache.owned_files import write_with
    write_with(dst, lambda tmp: save_file(out, tmp, metadata=meta), option="DST", purpose="the converted checkpoint")
    return {"source": str(src), "entry": entry, "tensors": len(out), "output": str(dst),
            "config": config.to_dict()}
