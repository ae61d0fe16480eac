"""The doctor's vocabulary: a feature, its probe, the probe's shape, and the registry of features.

Kept apart from ``app/doctor/core.py`` (which runs and remembers the checks) so the probes (``app/doctor/probes.py``)
can register themselves without an import circle.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


class NotAvailable(Exception):
    """The feature cannot run here: ``reason`` says why, ``hint`` what to install or change (may be empty)."""

    def __init__(self, reason: str, hint: str = ""):
        super().__init__(reason)
        self.reason, self.hint = reason, hint


@dataclass
class Probe:
    """What a feature's check runs: ``feature()`` and ``fallback()`` return tensors to compare in ``dtype``."""
    feature: Callable[[], torch.Tensor]
    fallback: Callable[[], torch.Tensor]
    dtype: torch.dtype
    judge_speed: bool | None = None      # True only for a probe at the run's own shapes; otherwise the timing
    #                                      is shown, not judged (speed is decided at the call's shapes)
    note: str = ""
    ulps: int = 8                        # tolerance in units of the dtype's resolution at the output's magnitude
    #                                      (more for whole-chunk probes: many ops, two steps)
    bound: Callable[[], torch.Tensor] | None = None   # a per-element error bound (a feature that changes the
    #                                      numerics by design, e.g. int8 attention) instead of ``ulps``: the
    #                                      difference is then reported in units of the bound (pass: <= 1)


@dataclass(frozen=True)
class ProbeContext:
    """The shape of the real call: device, dtype, head size and heads; ``tokens`` per probe (a few hundred)."""
    device: torch.device
    dtype: torch.dtype
    head_dim: int = 128
    heads: int = 2
    tokens: int = 256
    with_compile: bool = False           # probe torch.compile on a CPU (tens of seconds with Inductor)
    compile_backend: str | None = None   # None: inductor; 'eager' checks the mechanism quickly


@dataclass(frozen=True)
class Feature:
    name: str                            # 'attention.fa2', 'kernel.gated_residual', 'fused_qkv', ...
    summary: str
    check: Callable[[ProbeContext], Probe]   # raises NotAvailable when the feature cannot run here
    library: tuple = ()                  # distributions whose version is part of the verdict ('flash-attn', ...)
    switches_off: str = ""               # what a failed verdict turns off, in words
    requires: Callable[[ProbeContext], None] | None = None   # cheap availability test (raises NotAvailable);
    #                                                          None: ``check`` itself is cheap until it probes
    sources: Callable[[], tuple] | None = None   # the code the probe exercises (modules, functions, kernel names
    #                                              ``name@sourcehash``): part of the verdict, with ``check``


FEATURES: dict[str, Feature] = {}


def register_feature(feature: Feature) -> Feature:
    """Add (or replace) a feature; its probe runs the first time the feature is used on a machine."""
    FEATURES[feature.name] = feature
    return feature


@dataclass(frozen=True)
class OutsideProbe:
    """A probe that a higher floor registers (it needs what ``app/`` may not import, e.g. ComfyUI)."""
    check: Callable[[ProbeContext], Probe]       # raises NotAvailable when it cannot run here
    requires: Callable[[ProbeContext], None] | None = None
    sources: Callable[[], tuple] | None = None


PROBES: dict[str, OutsideProbe] = {}


def register_probe(name: str, check: Callable[[ProbeContext], Probe], requires=None, sources=None) -> OutsideProbe:
    """Register the probe of feature ``name`` from outside ``app/`` (the native MODEL path registers itself when
    the nodes package is imported); until then the feature says what it needs instead."""
    probe = OutsideProbe(check, requires, sources)
    PROBES[name] = probe
    return probe
