"""The timed families of the op registry (``kernels/registry.py``): every usable candidate verified against its
torch reference, and the fastest verified one chosen.

* ``layernorm_modulate(x, shift, scale, eps)``: the pack's Triton kernel (``pack``), comfy-kitchen's ``adaln`` per
  backend (``kitchen.cuda``, ``kitchen.triton``, ``kitchen.eager``) and plain torch (``torch``);
* ``rmsnorm_rope(x, weight, cos, sin, num_heads, eps)``: the pack's fused Triton kernel, the pack's full-width
  RMSNorm followed by comfy-kitchen's ``apply_rope1`` per backend, plain torch.

The choice goes through the operator store (``cache/autotune.py``): kernel ``ops.<op>``, key the call's shapes and
dtypes, one "config" ``{"impl": name}`` per candidate, on the cache's GPU fingerprint. Each candidate is checked on
seeded inputs of the call's shapes against the reference (tolerance from the dtype's resolution) before it is timed
(with the store's pluggable timer); a candidate whose numbers are wrong is recorded as failed and never used again
on that fingerprint, alone. A second process with the same store measures nothing. ``pick`` is generic: exact
attention (``model/attention.py``) runs its candidates through it with its own reference, key and tolerance.
Modes (``FastOptions.ops``): ``auto``, ``pack``, ``kitchen``, ``torch``; plain torch stays the last resort.
"""
from __future__ import annotations

import hashlib
import logging
from typing import Callable

import torch

from ..cache import autotune
from . import _common, flash_attention, kitchen, norm_modulate, qk_norm_rope, registry
from .norm_modulate import layernorm_modulate, layernorm_modulate_reference
from .qk_norm_rope import rmsnorm_rope, rmsnorm_rope_reference

log = logging.getLogger("wan_accel.kernels")

OPS = ("layernorm_modulate", "rmsnorm_rope")
MODES = registry.MODES
Candidate = registry.Candidate
KERNEL_PREFIX = "ops."
# How candidates are timed (the operator store's default timer on a GPU: GPU time per call from CUDA-graph
# replays, cache/autotune.graph_timer). It is part of each op's store name together with the source of the pack's
# own candidate, so a choice made with another timing, or against an older pack kernel, is measured again.
TIMING = autotune.TIMING
_PACK_MODULES = {"layernorm_modulate": norm_modulate, "rmsnorm_rope": qk_norm_rope, "attention": flash_attention}
VERIFY_ULPS = 8       # tolerance in units of the dtype's resolution at the reference's magnitude


class CandidateMismatch(ValueError):
    """A candidate's result differs from the torch reference beyond the dtype's tolerance."""


def _kitchen(op: str, func: str, backend: str, summary: str) -> Candidate:
    call = (lambda x, shift, scale, eps=1e-6: kitchen.adaln(x, shift, scale, eps, backend)) if func == "adaln" else \
        (lambda x, w, cos, sin, heads, eps=1e-6: kitchen.norm_rope(x, w, cos, sin, heads, eps, backend))
    return Candidate(op, f"kitchen.{backend}", "kitchen", call,
                     lambda d, dt=None, hd=None: kitchen.backend_problem(backend, func, d) or (
                         kitchen.dtype_problem(backend, func, dt) if dt is not None else None),
                     f"{summary} ({backend} backend)")


REFERENCES = {"layernorm_modulate": layernorm_modulate_reference, "rmsnorm_rope": rmsnorm_rope_reference}
CANDIDATES: dict[str, dict[str, Candidate]] = {
    op: registry.register(op, summary, [
        Candidate(op, "pack", "pack", pack, _common.triton_problem, f"the pack's fused Triton kernel{detail}"),
        *(_kitchen(op, func, b, words) for b in kitchen.BACKENDS),
        Candidate(op, "torch", "torch", REFERENCES[op], None, "plain torch (the reference)")], timed=True)
    for op, summary, pack, detail, func, words in (
        ("layernorm_modulate", "LayerNorm + modulate", layernorm_modulate, "", "adaln", "comfy-kitchen adaln"),
        ("rmsnorm_rope", "RMSNorm + RoPE of q/k", rmsnorm_rope, " (RMSNorm over the width + RoPE)", "apply_rope1",
         "full-width RMSNorm + comfy-kitchen apply_rope1"))}


def store_kernel(op: str) -> str:
    """The operator-store kernel name of ``op``'s choice: ``ops.<op>@<version>``, the version a hash of the timing
    method and of the pack's own candidate's source."""
    name = _STORE_NAMES.get(op)
    if name is None:
        module = _PACK_MODULES.get(op)
        name = _common.kernel_name(KERNEL_PREFIX + op, module) if module is not None else KERNEL_PREFIX + op
        version = hashlib.sha256(f"{TIMING}|{name}".encode()).hexdigest()[:8]
        name = _STORE_NAMES[op] = f"{KERNEL_PREFIX}{op}@{version}"
    return name


_STORE_NAMES: dict[str, str] = {}


def mode_problem(ops: str, device) -> str | None:
    """Why an ops string cannot run on ``device`` (no candidate of its mode's group is available; an override's
    candidate cannot run here), or None."""
    mode, pairs = registry.parse_ops(ops)
    reasons = []
    for fam, name in pairs.items():
        why = registry.candidate(fam, name).rejected(device)
        if why:
            reasons.append(f"{fam}={name}: {why}")
    for op in OPS if mode in ("pack", "kitchen") else ():
        found = {c.name: c.rejected(device) for c in CANDIDATES[op].values() if c.group == mode}
        if all(found.values()):
            reasons.append(f"{op}: " + "; ".join(f"{n}: {r}" for n, r in found.items()))
    if not reasons:
        return None
    hint = kitchen.INSTALL_HINT if mode == "kitchen" else "run on a CUDA GPU with triton installed"
    return f"ops={ops!r} cannot run here ({' | '.join(reasons)}); {hint}, or use ops='auto'"


def listing(op: str, device, mode: str = "auto", off: tuple = (), dtype=None) -> list[tuple[Candidate, str | None]]:
    """(candidate, why it is not used or None) for every candidate of ``op`` in this mode on ``device`` (and for
    calls in ``dtype`` where given: a backend is only called with the dtypes it declares)."""
    among = None if mode == "auto" else [n for n, c in CANDIDATES[op].items() if c.group in (mode, "torch")]
    _, reasons = registry.walk(op, device, dtype, off=[o.split(":", 1)[1] for o in off if o.startswith(op + ":")
                                                       and not o.endswith(":torch")], among=among)
    return [(CANDIDATES[op][n], f"not in ops={mode!r}" if why and why.startswith("not among") else why)
            for n, why in reasons.items()]


# ----------------------------------------------------------------------------- shapes and verification
def _desc(t) -> str:
    if isinstance(t, torch.Tensor):
        return "x".join(str(s) for s in t.shape) + ":" + _common.dtype_name(t)
    return repr(t)


def call_key(op: str, args: tuple) -> str:
    """The store key of a call: every argument's shape and dtype (numbers as they are) and the device type."""
    dev = next(a.device.type for a in args if isinstance(a, torch.Tensor))
    return f"{dev}|" + "|".join(_desc(a) for a in args)


def sample_like(op: str, args: tuple) -> tuple:
    """Seeded inputs with the shapes, dtypes and device of ``args`` (modulation and weights near their real scale)."""
    gen = torch.Generator().manual_seed(1234)
    out = []
    for i, a in enumerate(args):
        if not isinstance(a, torch.Tensor):
            out.append(a)
            continue
        r = torch.randn(*a.shape, generator=gen)
        if op == "layernorm_modulate" and i in (1, 2):
            r = 0.1 * r
        elif op == "rmsnorm_rope" and i == 1:
            r = 1.0 + 0.1 * r
        elif op == "rmsnorm_rope" and i in (2, 3):      # cos/sin of seeded angles
            ang = torch.rand(*a.shape, generator=gen) * 6.283
            r = ang.cos() if i == 2 else ang.sin()
        out.append(r.to(device=a.device, dtype=a.dtype))
    return tuple(out)


def tolerance(dtype: torch.dtype, magnitude: float, ulps: int = VERIFY_ULPS) -> float:
    return ulps * torch.finfo(dtype).eps * max(1.0, float(magnitude))


def verify(cand: Candidate, args: tuple, reference: Callable | None = None, ulps: int = VERIFY_ULPS) -> float:
    """Max difference of ``cand`` against the reference (``REFERENCES[op]`` unless given) on ``args``;
    CandidateMismatch beyond ``ulps`` units of the dtype's resolution."""
    with torch.no_grad():
        ref = (reference or REFERENCES[cand.family])(*args)
        out = cand.fn(*args)
    if tuple(out.shape) != tuple(ref.shape):
        raise CandidateMismatch(f"{cand.family} {cand.name}: wrong shape {tuple(out.shape)}, expected {tuple(ref.shape)}")
    diff = float((out.float() - ref.float()).abs().nan_to_num(nan=float("inf")).max()) if ref.numel() else 0.0
    tol = tolerance(ref.dtype, float(ref.float().abs().max()) if ref.numel() else 0.0, ulps)
    if not diff <= tol:
        raise CandidateMismatch(f"{cand.family} {cand.name}: wrong numbers, max difference {diff:.3g} against the torch "
                                f"reference exceeds {tol:.3g} ({_common.dtype_name(ref)})")
    return diff


# ----------------------------------------------------------------------------- the choice
_CHOSEN: dict[tuple, str] = {}


def choose(op: str, args: tuple, mode: str = "auto", off: tuple = (), tuner=None,
           benchmark: bool = True) -> tuple[str, str]:
    """(candidate name, why) for a call of ``op`` with ``args``: the fastest verified candidate recorded in the
    operator store for these shapes, measuring (verify, then time) only the candidates it does not know yet."""
    first = next(a for a in args if isinstance(a, torch.Tensor))
    rows = listing(op, first.device, mode, off, first.dtype)
    usable = [c for c, why in rows if why is None]
    if mode in ("pack", "kitchen") and any(c.group == mode for c in usable):
        usable = [c for c in usable if c.group == mode]       # forced: torch only when none of them is left
    skipped = [f"{c.name}: {why}" for c, why in rows if why is not None and c.group != "torch"]
    if [c.group for c in usable] == ["torch"]:
        return "torch", f"plain torch, the only implementation left ({'; '.join(skipped) or 'no other'})"
    best, why = pick(op, usable, skipped, args, tuner=tuner, benchmark=benchmark)
    if best is None:
        return "torch", "no other implementation verified here (see the operator store); plain torch"
    return best, why


def pick(op: str, usable: list, skipped: list, args: tuple, *, key: str | None = None,
         reference: Callable | None = None, sample: tuple | None = None, ulps: int = VERIFY_ULPS, tuner=None,
         benchmark: bool = True) -> tuple[str | None, str]:
    """The generic choice among ``usable`` candidates of any op (kernel ``ops.<op>`` in the operator store, under
    ``key``, default ``call_key``): each verified against ``reference`` (default ``REFERENCES[op]``) on ``sample``
    (default seeded inputs like ``args``) within ``ulps``, then timed; (fastest verified name, why), or (None, why)
    when none is verified (or nothing is known yet and measuring is not allowed)."""
    from ..cache.autotune import get_autotuner

    tuner = tuner or get_autotuner()
    key = key or call_key(op, args)
    sample = sample if sample is not None else sample_like(op, args)
    checked: set = set()
    by_name = {c.name: c for c in usable}
    made: list = []

    def reference_once(*a):         # every candidate is checked against one reference output (made at most once)
        if not made:
            made.append((reference or REFERENCES[op])(*a))
        return made[0]

    def run(cfg: dict):
        cand = by_name[cfg["impl"]]
        if cand.name not in checked:
            verify(cand, sample, reference_once, ulps)
            checked.add(cand.name)
            return None
        with torch.no_grad():
            return cand.fn(*sample)

    configs = tuple({"impl": c.name} for c in usable)
    best = tuner.tune(store_kernel(op), key, configs, run, benchmark=benchmark)
    entry = tuner.entry(store_kernel(op), key) or {}
    failed = [f"{cfg_id.split('=', 1)[-1]}: {f.get('error', {}).get('message', '')[:160]}"
              for cfg_id, f in (entry.get("failed") or {}).items()]
    if best is None:
        return None, f"none verified yet{'; failed its check: ' + '; '.join(failed) if failed else ''}"
    timings = entry.get("timings") or {}
    times = ", ".join(f"{n} {timings[f'impl={n}']:.3g} ms" for n in by_name if f"impl={n}" in timings)
    why = f"fastest verified ({times})"
    if failed:
        why += f"; failed its check: {'; '.join(failed)}"
    if skipped:
        why += f"; not available: {'; '.join(skipped)}"
    return best["impl"], why


# ----------------------------------------------------------------------------- one opaque op per op
# The store may choose an implementation torch.compile cannot trace (comfy-kitchen's CUDA ``adaln`` hands its
# tensor over by ``__dlpack__``, which a FakeTensor cannot do; any extension op may do the same). Inside a compile
# trace every op therefore runs as one registered custom op, ``torch.ops.wan_accel.ops_<op>``: the trace sees a
# single node whose fake implementation is the op's torch reference (shapes and dtypes only), and the real call
# makes (or reuses) the store's choice eagerly. Only ``ops='torch'`` is traced into, so Inductor can fuse it.
_SEP = "\n"


def _sig_lnmod(fn):
    def f(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, mode: str,
          off: str) -> torch.Tensor:
        return fn(x, shift, scale, eps, mode, off)
    return f


def _sig_rope(fn):
    def f(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
          eps: float, mode: str, off: str) -> torch.Tensor:
        return fn(x, weight, cos, sin, num_heads, eps, mode, off)
    return f


def _opaque(op: str, sig):
    """``op``'s custom op: the real call makes the store's choice eagerly, the fake is the torch reference."""
    def impl(*a):
        *args, mode, off = a
        return _run_eager(op, mode, tuple(x for x in off.split(_SEP) if x), *args)

    def fake(*a):
        return REFERENCES[op](*a[:-2]).contiguous()
    return _common.register_op(f"ops_{op}", sig(impl), sig(fake))


OPAQUE: dict = {op: _opaque(op, sig) for op, sig in (("layernorm_modulate", _sig_lnmod), ("rmsnorm_rope", _sig_rope))}


def _coerce(op: str, args: tuple) -> tuple:
    """The numbers of a call as the custom op's schema types them (Python int / float)."""
    if op == "rmsnorm_rope":
        x, w, cos, sin, heads, eps = args
        return x, w, cos, sin, int(heads), float(eps)
    x, shift, scale, *rest = args
    return (x, shift, scale, float(rest[0]) if rest else 1e-6)


def run(op: str, mode: str, off: tuple, *args):
    """Call ``op`` with the implementation chosen for these shapes (chosen once per process and shape); inside a
    compile trace through the op's opaque custom op (see above)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if _common.needs_autograd(*tensors):
        return REFERENCES[op](*args)
    if _common.is_compiling():
        if mode == "torch":
            return REFERENCES[op](*args)
        opaque = OPAQUE.get(op)
        if opaque is not None:
            return opaque(*_coerce(op, args), mode, _SEP.join(off))
    return _run_eager(op, mode, off, *args)


def _run_eager(op: str, mode: str, off: tuple, *args):
    key = (op, mode, off, registry.override(op), call_key(op, args))
    name = _CHOSEN.get(key)
    if name is None:
        measuring = not (_common.is_compiling() or any(_common.capturing(a) for a in args
                                                       if isinstance(a, torch.Tensor)))
        name, why = choose(op, args, mode, off, benchmark=measuring)
        if measuring:
            _CHOSEN[key] = name
            log.info("wan_accel: %s uses %s (%s)", op, name, why)
    return CANDIDATES[op][name].fn(*args)
