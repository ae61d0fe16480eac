"""The op registry: every op family's implementations ("candidates") as data, one walk, one override, one verdict.

A family (``register``) lists its candidates in priority order, each with its needs as data (device types, dtypes,
minimum compute capability, head sizes, another family's candidate it runs on) and an optional probe
``problem(device, dtype, head_dim)`` for the rest. ``walk``: the first usable one and why each other is rejected
(``explain`` / ``list_families``: ``python -m wan_accel doctor --ops``). A ``timed`` family's usable candidates are
then verified and timed per call shape through the operator store (``kernels/candidates.pick``). One override,
``use`` (the ops string's ``family=candidate`` pairs, ``parse_ops``); one speed verdict, ``speed``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from ..cache.autotune import get_autotuner
from ._common import dtype_name

MODES = ("auto", "pack", "kitchen", "torch")
SWITCHED_OFF = "switched off: it failed its self-check on this machine (python -m wan_accel doctor)"
DEFAULT_HEAD_DIM = 128
SPEED_DEVICES = ("cuda",)          # where a timing says something about speed (a CPU runs torch versions)


def capability(device) -> tuple:
    """(major, minor) of a CUDA device (a torch.device or its index; no index: the current one)."""
    index = getattr(device, "index", device)
    return tuple(torch.cuda.get_device_capability(torch.cuda.current_device() if index is None else index))


@dataclass(frozen=True)
class Candidate:
    family: str
    name: str
    group: str                        # the ops mode that selects it: 'pack' | 'kitchen' | 'torch' | 'flash' | ...
    fn: Callable | None = None        # same signature as the family's reference (None: dispatched by name)
    problem: Callable | None = None   # problem(device, dtype, head_dim) -> why it cannot run, or None
    summary: str = ""
    devices: tuple = ()               # device types it runs on (empty: any)
    dtypes: tuple = ()                # dtypes of the calls it takes (empty: any)
    capability: tuple = ()            # minimum CUDA compute capability
    head_dims: tuple = ()             # head sizes it takes (empty: any)
    needs: tuple = ()                 # (family, candidate) it runs on: rejected with that one's reason
    manual: bool = False              # taken only by an override (another numerics: never the walk's pick)

    def rejected(self, device, dtype=None, head_dim=None) -> str | None:
        """Why this candidate cannot take a call on ``device`` in ``dtype`` with ``head_dim``, or None (the probe
        judges a call of unknown dtype or head size as Wan's: bf16, head size 128)."""
        device = torch.device(device)
        if self.devices and device.type not in self.devices:
            kinds = " or ".join(d.upper() if d == "cuda" else d for d in self.devices)
            return f"needs a {kinds} device, not {device.type}"
        if self.dtypes and dtype is not None and dtype not in self.dtypes:
            return f"takes {'/'.join(dtype_name(d) for d in self.dtypes)}, not {dtype_name(dtype)}"
        if self.head_dims and head_dim is not None and head_dim not in self.head_dims:
            return f"takes head sizes {', '.join(map(str, self.head_dims))}, not {head_dim}"
        if self.capability and device.type == "cuda":
            cap = capability(device)
            if cap < self.capability:
                return f"needs SM {self.capability[0]}.{self.capability[1]}+, this GPU is SM {cap[0]}.{cap[1]}"
        if self.needs:
            why = candidate(*self.needs).rejected(device, dtype, head_dim)
            if why:
                return f"{'.'.join(self.needs)}: {why}"
        if self.problem is None:
            return None
        return self.problem(device, torch.bfloat16 if dtype is None else dtype, head_dim or DEFAULT_HEAD_DIM)


@dataclass(frozen=True)
class Family:
    name: str
    summary: str
    candidates: dict                  # name -> Candidate, in priority order
    timed: bool = False               # the operator store verifies and times the usable ones per call shape


FAMILIES: dict[str, Family] = {}


def register(name: str, summary: str, candidates, timed: bool = False) -> dict:
    """Register family ``name`` (its candidates in priority order); its {name: Candidate}, the registry's own."""
    FAMILIES[name] = Family(name, summary, {c.name: c for c in candidates}, timed)
    return FAMILIES[name].candidates


def pack_family(name: str, summary: str, problem: Callable, **needs) -> dict:
    """Register the common family of one of the pack's Triton kernels ('pack': ``problem`` and ``needs``, the
    constraints) and its torch version ('torch')."""
    return register(name, summary, [Candidate(name, "pack", "pack", problem=problem, summary="the pack's Triton kernel",
                                              **needs), Candidate(name, "torch", "torch", summary="torch ops")])


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown op family {name!r}; families: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]


def candidate(family_name: str, name: str) -> Candidate:
    cands = family(family_name).candidates
    if name not in cands:
        raise ValueError(f"op family {family_name!r} has no candidate {name!r}; its candidates: {', '.join(cands)}")
    return cands[name]


def list_families() -> list[str]:
    return sorted(FAMILIES)


# ----------------------------------------------------------------------------- the one override
_OVERRIDES: list[dict] = []       # the active ``use`` layers, innermost last (only ``use`` changes it)


def override(family_name: str) -> str | None:
    """The candidate an active ``use`` asks ``family_name`` to take, or None."""
    return next((layer[family_name] for layer in reversed(_OVERRIDES) if family_name in layer), None)


def use(overrides: dict | None):
    """``with use({"attention.fp8": "fa3-torch"}):`` every choice of those families takes that candidate (where it
    runs); None or {} changes nothing. An unknown family or candidate is a ValueError (at once) naming the known
    ones."""
    return _using({f: candidate(f, c).name for f, c in (overrides or {}).items() if c is not None})


@contextlib.contextmanager
def _using(layer: dict):
    _OVERRIDES.append(layer)
    try:
        yield layer
    finally:
        _OVERRIDES.remove(layer)


def parse_ops(ops) -> tuple[str, dict]:
    """(mode, {family: candidate}) of an ops string: at most one mode (``MODES``; it applies to LayerNorm+modulate
    and RMSNorm+RoPE, as before) and any ``family=candidate`` pairs, comma-separated; ValueError naming the fix."""
    if not isinstance(ops, str):
        raise ValueError(f"ops must be one of {MODES} or 'family=candidate' pairs, got {ops!r}")
    modes, pairs = [], {}
    for item in (p.strip() for p in ops.split(",")):
        if "=" in item:
            fam, cand = (s.strip() for s in item.split("=", 1))
            try:
                pairs[fam] = candidate(fam, cand).name
            except ValueError as exc:
                raise ValueError(f"ops {ops!r}: {exc}") from None
        elif item in MODES:
            modes.append(item)
        else:
            raise ValueError(f"ops must be one of {MODES} or 'family=candidate' pairs (families: "
                             f"{', '.join(list_families())}), got {item!r}")
    if len(modes) > 1:
        raise ValueError(f"ops {ops!r} names more than one mode ({', '.join(modes)}): keep one")
    return (modes[0] if modes else "auto"), pairs


# ----------------------------------------------------------------------------- the walk
def _forced(family_name: str, among) -> str | None:
    forced = override(family_name)
    return forced if among is None or forced in among else None


def walk(family_name: str, device, dtype=None, head_dim=None, off=(), among=None) -> tuple[str | None, dict]:
    """(the first usable candidate, {candidate: why it is rejected, or None where usable}) of a family on ``device``
    for calls in ``dtype`` with ``head_dim``; ``off``: candidates switched off here, ``among``: the only ones
    allowed. An override (``use``, of a candidate among them) rejects every other; None only where it cannot run."""
    forced = _forced(family_name, among)
    chosen, reasons = None, {}
    for cand in family(family_name).candidates.values():
        if among is not None and cand.name not in among:
            why = f"not among {', '.join(among)}"
        elif cand.name in off:
            why = SWITCHED_OFF
        elif forced is not None and cand.name != forced:
            why = f"not the override ({family_name}={forced})"
        elif cand.manual and forced is None:
            why = f"only by an override ({family_name}={cand.name}): another numerics"
        else:
            why = cand.rejected(device, dtype, head_dim)
        reasons[cand.name] = why
        chosen = chosen or (cand.name if why is None else None)
    return chosen, reasons


def choice(family_name: str, device, dtype=None, head_dim=None, **kw) -> tuple[str, str]:
    """(candidate, why in words) the walk takes; ValueError where an override asks for one that cannot run here."""
    chosen, reasons = walk(family_name, device, dtype, head_dim, **kw)
    forced = _forced(family_name, kw.get("among"))
    if chosen is None:
        raise ValueError(f"{family_name}={forced} cannot run here: {reasons.get(forced)}")
    cand = FAMILIES[family_name].candidates[chosen]
    skipped = [f"{n}: {why}" for n, why in reasons.items() if why and n != chosen and forced is None
               and not FAMILIES[family_name].candidates[n].manual]
    note = "chosen by override" if forced else "; ".join(skipped)
    return chosen, f"{cand.summary or chosen}" + (f" ({note})" if note else "")


def explain(family_name: str, device, dtype=None, head_dim=None) -> dict:
    """The doctor's row of a family: {'family', 'summary', 'chosen', 'candidates': {name: {'summary', 'status',
    'reason'}}}; a timed family's usable candidates are all 'usable' (the operator store picks among them)."""
    fam = family(family_name)
    chosen, reasons = walk(family_name, device, dtype, head_dim)
    rows = {}
    for name, why in reasons.items():
        status = "rejected" if why else "chosen" if name == chosen and not fam.timed else "usable"
        rows[name] = {"summary": fam.candidates[name].summary, "status": status,
                      "reason": why or ("the operator store verifies and times the usable ones per call shape"
                                        if fam.timed else "first usable in priority order")}
    return {"family": family_name, "summary": fam.summary, "timed": fam.timed,
            "chosen": "operator store" if fam.timed else chosen, "candidates": rows}


# ----------------------------------------------------------------------------- the one speed verdict
def speed(kernel: str, key: str, mode: str, run_mode, run_exact, make, device, tuner=None) -> tuple[bool | None, str]:
    """(slower, why) of an opt-in ``mode`` against its exact path on ``make()``'s inputs, timed through the operator
    store (``Autotuner.slower_than_exact``: verdict kept per GPU fingerprint, ``kernel`` and ``key``; a second
    process times nothing). None where no speed can be judged: not a GPU, a compile trace or a capture running."""
    device = torch.device(device)
    if device.type not in SPEED_DEVICES or torch.compiler.is_compiling() or (
            device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return None, f"speed not judged on {device.type}"
    return (tuner or get_autotuner()).slower_than_exact(kernel, key, mode, run_mode, run_exact, make=make)
