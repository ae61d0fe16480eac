"""Which implementation runs each op (kernels/candidates.py, kernels/registry.py) on this machine, and why.

For the doctor's probe shape (device, dtype, head size): every candidate of LayerNorm+modulate, RMSNorm+RoPE and
exact attention ('auto') with its availability and its verdict, and the one the operator store chooses (the fastest
verified one; a candidate whose verdict failed is switched off alone).
"""
from __future__ import annotations

from ...cache.autotune import Autotuner
from ...kernels import candidates as op_candidates, registry
from ...model import attention as attn, cached_attention  # noqa: F401 - their op registry families
from .core import Doctor
from .probes import _op_args, _qkv, candidate_feature


def _failed(doctor: Doctor, feature: str, probe: bool) -> bool:
    """Whether ``feature``'s verdict here failed (probed now where ``probe``, else as stored)."""
    if feature not in doctor.catalogue or doctor.unavailable(feature)[0]:
        return False
    value = doctor.check(feature) if probe else doctor.stored(feature)
    return value is not None and value.get("status") != "passed"


def switched_off(doctor: Doctor, probe: bool = True) -> tuple:
    """'op:candidate' names switched off by a failed verdict here (the pack's kernels and comfy-kitchen's)."""
    return tuple(f"{op}:{name}" for op, cands in op_candidates.CANDIDATES.items() for name, cand in cands.items()
                 if cand.group != "torch" and _failed(doctor, f"kernel.{op}" if cand.group == "pack"
                                                      else candidate_feature(op, name), probe))


def implementations(doctor: Doctor, mode: str = "auto", probe: bool = True) -> list[dict]:
    """One row per op: {'op', 'uses', 'why', 'candidates': {name: why not or 'available'}}; exact attention under
    'auto' last (a candidate whose verdict failed here, FlashAttention 3 / 2 or the pack's kernel, left out)."""
    off, tuner, ctx = switched_off(doctor, probe), Autotuner(doctor.cache), doctor.context
    rows = []
    for op in op_candidates.OPS:
        args = _op_args(op, ctx)
        listing = {c.name: why or "available" for c, why in op_candidates.listing(op, ctx.device, mode, off, ctx.dtype)}
        uses, why = op_candidates.choose(op, args, mode, off, tuner=tuner, benchmark=probe)
        rows.append({"op": op, "uses": uses, "why": why, "candidates": listing, "shape": _shape(args)})
    off = tuple(feature.split(".", 1)[1] for feature in attn.SWITCHABLE if _failed(doctor, feature, probe))
    q, k, v = _qkv(ctx)
    listing = {c.name: why or "available" for c, why in attn.auto_listing(ctx.device, ctx.dtype, ctx.head_dim, off)}
    uses, why = attn.choose_auto(q, k, v, off, tuner=tuner, benchmark=probe)
    return rows + [{"op": "attention", "uses": uses, "why": why, "candidates": listing, "shape": _shape((q, k))}]


def registry_report(device, dtype, head_dim: int) -> dict:
    """Every op registry family (``kernels/registry.py``) here: its candidates, each chosen, usable or rejected with
    the reason (``python -m wan_accel doctor --ops``)."""
    families = [registry.explain(f, device, dtype, head_dim) for f in registry.list_families()]
    return {"device": str(device), "dtype": str(dtype).replace("torch.", ""), "head_dim": head_dim,
            "families": families}


def registry_text(found: dict) -> str:
    lines = [f"op registry on {found['device']} ({found['dtype']}, head size {found['head_dim']}):"]
    for fam in found["families"]:
        lines.append(f"{fam['family']} ({fam['summary']}): {fam['chosen']}")
        lines += [f"  {c['status']:<8} {name}: {c['reason']}" for name, c in fam["candidates"].items()]
    return "\n".join(lines)


def _shape(args) -> str:
    """The shapes a choice was made for, in words (the store decides per shape: a run's own shapes may differ)."""
    import torch
    return " / ".join("x".join(str(d) for d in a.shape) for a in args if isinstance(a, torch.Tensor))


def implementation_text(rows: list[dict]) -> str:
    lines = ["which implementation runs each op at the doctor's shape (the operator store chooses again at each run's "
             "own shapes; python -m wan_accel bench kernels: side by side):"]
    for row in rows:
        at = f" at {row['shape']}" if row.get("shape") else ""
        lines.append(f"  {row['op']}{at}: {row['uses']} - {row['why']}")
    return "\n".join(lines)
