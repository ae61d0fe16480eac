"""Tolerances derived from the dtype a test compares, never from one machine's run: a comparison of float16 or
bfloat16 values allows at least one step of that dtype at the values' magnitude, because two correct computations
(another CPU's vector width, another summation order) may round a value to neighbouring representable numbers.

* ``step(dtype, magnitude=1.0)``: ``torch.finfo(dtype).eps * |magnitude|``, an upper bound of the spacing of
  ``dtype``'s numbers at that magnitude (the spacing at ``x`` is at most ``eps * |x|``; never below the spacing of
  the smallest normal number). ``magnitude`` may be a number or a tensor: a tensor gives a tensor of steps, one per
  element (an element-wise tolerance), ``ulps`` steps each.
"""
from __future__ import annotations

import torch


def step(dtype: torch.dtype, magnitude=1.0, ulps: float = 1.0):
    """``ulps`` steps of ``dtype`` at ``magnitude`` (a number, or a tensor for a tolerance per element)."""
    info = torch.finfo(dtype)
    if isinstance(magnitude, torch.Tensor):
        return ulps * info.eps * magnitude.detach().abs().double().clamp_min(info.tiny)
    return ulps * info.eps * max(abs(float(magnitude)), info.tiny)


def within(got: torch.Tensor, want: torch.Tensor, atol) -> bool:
    """Every element of ``got`` within ``atol`` (a number or a tensor of ``want``'s shape) of ``want``."""
    return bool(((got.double() - want.double()).abs() <= atol).all())
