"""The one finite check of tensors: whether any number of tensors hold NaN or inf, read with one host sync per
device they are on.

Every tensor the pack writes or reports goes through it: video frames (``video_file.VideoFile``), converted
checkpoints (``model/convert.py``), the weights and latents of a run and the checks built on them
(``model/finite.py``), decoders' weights (``vae/weights.py``), reference fixtures (``app/jobs/reference.py``).

* ``bad_flag(t)``: a 0-d bool tensor on ``t``'s device, True when ``t`` holds a value that is not finite (no sync);
* ``read_flags(flags)``: their values, one host sync per device;
* ``non_finite(named)``: the names of the tensors of ``named`` ({name: tensor} or (name, tensor) pairs) that hold
  NaN or inf, in their order (one host sync per device; tensors that are not floating point are finite);
* ``counts(t)``: '3 NaN, 1 infinite of 4,096' and ``first_bad(t, dim)``: the first index along ``dim`` that holds
  one (for a message, once something is wrong).
"""
from __future__ import annotations

import torch


def bad_flag(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor on ``t``'s device: True when ``t`` holds a value that is not finite (no host sync)."""
    return ~torch.isfinite(t).all()


def read_flags(flags: list) -> list:
    """The values of 0-d bool tensors, read with one host sync per device they are on."""
    out = [False] * len(flags)
    by_device: dict = {}
    for i, f in enumerate(flags):
        by_device.setdefault(f.device, []).append(i)
    for idx in by_device.values():
        for i, v in zip(idx, torch.stack([flags[i] for i in idx]).tolist()):
            out[i] = bool(v)
    return out


def non_finite(named) -> list:
    """Names of the floating-point tensors of ``named`` that hold NaN or inf (see the module doc)."""
    items = list(named.items() if isinstance(named, dict) else named)
    checked = [(n, t) for n, t in items if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()
               and not t.is_meta]
    if not checked:
        return []
    with torch.no_grad():
        flags = [bad_flag(t.detach()) for _, t in checked]
    return [n for (n, _), bad in zip(checked, read_flags(flags)) if bad]


def counts(t: torch.Tensor) -> str:
    """How many values of ``t`` are NaN and infinite, of how many."""
    v = t.detach().float()
    nan, inf = int(torch.isnan(v).sum()), int(torch.isinf(v).sum())
    return ", ".join(p for p in (f"{nan:,} NaN" if nan else "", f"{inf:,} infinite" if inf else "") if p) + \
        f" of {v.numel():,}"


def first_bad(t: torch.Tensor, dim: int = 0) -> int:
    """The first index along ``dim`` of ``t`` whose slice holds NaN or inf (0 when none)."""
    bad = (~torch.isfinite(t.detach().float())).movedim(dim, 0).flatten(1).any(1).nonzero()
    return int(bad[0, 0]) if bad.numel() else 0


__all__ = ["bad_flag", "read_flags", "non_finite", "counts", "first_bad"]
