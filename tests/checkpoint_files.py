"""The tests' checkpoint writer: a model's state dict as safetensors with its config in the metadata key
``checkpoint.METADATA_KEY``, as ``python -m wan_accel convert`` writes it."""
from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from wan_accel.cache.owned_files import write_with
from wan_accel.model.checkpoint import METADATA_KEY


def save_wan_checkpoint(model, path, extra_metadata: dict | None = None) -> Path:
    """Write a model's state dict as safetensors with its config in the metadata."""
    meta = {METADATA_KEY: json.dumps(model.config.to_dict())}
    meta.update(extra_metadata or {})
    tensors = {n: t.detach().contiguous() for n, t in model.state_dict().items()}
    return write_with(path, lambda tmp: save_file(tensors, tmp, metadata=meta), purpose="the checkpoint")
