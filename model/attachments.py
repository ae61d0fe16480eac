"""What the policy floors attach to a model, read here so that sampling never imports them.

``memory/block_swap.py`` hangs its ``BlockSwap`` on the model's block list, ``compile/apply.py`` its compile handle
on the model, and the optimized sampler its runner; this module names those attributes and reads them (duck-typed),
so the floors below memory/ and compile/ learn what was done to a model without importing the code that did it.
"""
from __future__ import annotations

import hashlib
import json

import torch.nn as nn

SWAP_ATTR = "_wan_accel_block_swap"        # on model.blocks: the active BlockSwap (units keyed by block index)
COMPILE_ATTR = "_wan_accel_compile"        # on the model: the CompileHandle (settings, end_warmup())
RUNNER_ATTR = "_wan_accel_fast"            # on the model: the optimized sampler's runner (static buffers, graphs)
SEQ_PARALLEL_ATTR = "_wan_accel_seq_parallel"  # on the model: its sequence-parallel group (model/seq_parallel.py)


def block_list(model) -> nn.ModuleList | None:
    if isinstance(model, nn.ModuleList):
        return model
    blocks = getattr(model, "blocks", None)
    return blocks if isinstance(blocks, nn.ModuleList) else None


def block_swap_of(model):
    """The model's active block swap, or None."""
    blocks = block_list(model)
    return getattr(blocks, SWAP_ATTR, None) if blocks is not None else None


def swapped_blocks(model) -> set:
    """Indices of the blocks whose weights a block swap moves between calls."""
    swap = block_swap_of(model)
    return {k for k in getattr(swap, "units", {}) if isinstance(k, int)} if swap is not None else set()


def seq_parallel_of(model):
    """The model's sequence-parallel group (``model/seq_parallel.SeqParallel``), or None: one rank."""
    return model.__dict__.get(SEQ_PARALLEL_ATTR) if hasattr(model, "__dict__") else None


def compile_handle_of(model):
    """The compile handle the pack's compile put on the model, or None."""
    return model.__dict__.get(COMPILE_ATTR) if hasattr(model, "__dict__") else None


def compiled_mode(model) -> str | None:
    """'default', 'reduce-overhead', ... for an Inductor compile, the backend name otherwise; None: not compiled."""
    handle = compile_handle_of(model)
    if handle is None:
        return None
    s = handle.settings
    return s.mode if s.backend == "inductor" else s.backend


def end_compile_warmup(model) -> bool:
    """Tell a compiled model its warm-up run is complete (switches its recompile stance); False if not compiled."""
    handle = compile_handle_of(model)
    if handle is None:
        return False
    handle.end_warmup()
    return True


def model_signature(model) -> str:
    """Stable name of a model's structure: class, block count, parameter names/shapes/dtypes/device type."""
    h = hashlib.sha256(type(model).__qualname__.encode())
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        try:
            h.update(json.dumps(to_dict(), sort_keys=True, default=str).encode())
        except Exception:  # noqa: BLE001 - the parameter list below still identifies the model
            pass
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.device.type};".encode())
    blocks = getattr(model, "blocks", None)
    n = len(blocks) if blocks is not None and hasattr(blocks, "__len__") else 0
    return f"{type(model).__name__}-{n}b-{h.hexdigest()[:12]}"
