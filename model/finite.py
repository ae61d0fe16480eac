"""No silent NaN video: the checks that every number a run is made of is finite, each at the place it is made.

* ``check_weights(model, source)``: once, after a model's weights are made (loaded, fp8 scales applied, a LoRA
  merged): every parameter finite, an fp8 layer's weight as it is dequantized when called (``weight * scale`` in
  the run's dtype), so fp8 bytes that encode NaN/inf and a finite scale too large for the weights are caught.
  ``NonFiniteError`` names the tensor and the input it most likely comes from (``hints``: a tensor name's likely
  source, e.g. its scale's name in the file).
* ``check_conditioning(tensor, what, fix)``: a text embedding where it enters (the text encoder's answer, a
  CONDITIONING input, a file of embeddings).
* ``check_output(latents, ...)``: the latents of a sampling run, once when it ends (never inside the chunk loop:
  one host sync per run), before they are written or shown.

Each check reads the values once on their device and syncs once (one flag per tensor, read together: the pack's
one finite check, ``cache/finite_flags.py``); the messages are built only when something is wrong.
"""
from __future__ import annotations

import torch

from ..cache.finite_flags import bad_flag as _bad_flag, counts as _counts, first_bad, read_flags as _read_flags
from .quant import is_quantized

ROWS_PER_PASS = 4096         # rows of an fp8 weight dequantized at a time (bounded temporary memory)


class NonFiniteError(ValueError):
    """A tensor a run is made of holds NaN or infinite values; the message names it and what to fix."""


def _dequantized_rows(layer, dtype):
    """The dequantized weight of an fp8 layer in blocks of rows, as its call computes it in ``dtype``."""
    w, scale = layer.weight, layer.scale_weight.float()
    rows = w.shape[0]
    for i in range(0, rows, ROWS_PER_PASS):
        s = scale if scale.numel() == 1 else scale.reshape(-1, 1)[i:i + ROWS_PER_PASS]
        yield (w[i:i + ROWS_PER_PASS].float() * s).to(dtype)


def _what(t: torch.Tensor) -> str:
    return f"non-finite values ({_counts(t)})"


def check_weights(model: torch.nn.Module, source: str, hints: dict | None = None) -> None:
    """Every weight of ``model`` finite, fp8 layers as dequantized in the run's dtype; NonFiniteError naming the
    first bad tensor, how many values are bad, and (``hints`` {parameter name: likely input}) where it comes from.
    One pass over the weights and one host sync."""
    dtype = getattr(model, "compute_dtype", torch.float32)       # the run's dtype
    dtype = dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32
    names, flags, skip = [], [], set()
    with torch.no_grad():
        for prefix, mod in model.named_modules():
            if not is_quantized(mod):
                continue
            name = f"{prefix}.weight" if prefix else "weight"
            skip.update({name, f"{prefix}.scale_weight", f"{prefix}.scale_input"})
            if mod.weight.is_meta:
                continue
            bad = torch.zeros((), dtype=torch.bool, device=mod.weight.device)
            for part in _dequantized_rows(mod, dtype):
                bad |= _bad_flag(part)
            names.append((name, mod))
            flags.append(bad)
        for name, p in model.named_parameters():
            if name in skip or p.is_meta or not p.is_floating_point():
                continue
            names.append((name, None))
            flags.append(_bad_flag(p.detach()))
    if not flags:
        return
    found = [i for i, b in enumerate(_read_flags(flags)) if b]
    if not found:
        return
    name, layer = names[found[0]]
    more = f" (and {len(found) - 1} more tensor(s))" if len(found) > 1 else ""
    hint = (hints or {}).get(name)
    if layer is not None:
        raw, scale = layer.weight.float(), layer.scale_weight.float()
        if bool(_bad_flag(raw)):
            why = f"its fp8 bytes encode NaN or inf ({_counts(raw)}); the file is damaged: download or convert it again"
        else:
            big = float(raw.abs().max()) * float(scale.abs().max())
            why = (f"its fp8 values times its scale (up to {float(scale.max()):.3g}) reach {big:.3g}, beyond "
                   f"{str(dtype).replace('torch.', '')}'s range: the scale is wrong for this weight; the file is "
                   f"damaged: download or convert it again")
        raise NonFiniteError(f"{source}: the fp8 weight {name!r} dequantizes to NaN or infinite values{more}: "
                             f"{why}{f' ({hint})' if hint else ''}. Nothing was sampled")
    p = dict(model.named_parameters())[name]
    cast = (p.dtype == torch.float16 and not bool(torch.isnan(p).any())
            and "; values beyond float16's range became inf: load it in bf16 or fp32" or "")
    raise NonFiniteError(f"{source}: weight {name!r} holds {_what(p)}{more}"
                         f"{f' ({hint})' if hint else ''}{cast}. A NaN weight gives a NaN video: "
                         f"{'fix that input' if hint else 'the file is damaged: download or convert it again'}. "
                         f"Nothing was sampled")


def check_conditioning(t, what: str, fix: str = "encode the prompt again, or use another text encoder") -> None:
    """NonFiniteError when a run's input ``t`` (a text embedding, the initial noise; a tensor: anything else passes)
    holds NaN or inf."""
    if isinstance(t, torch.Tensor) and t.is_floating_point() and bool(_bad_flag(t)):
        raise NonFiniteError(f"{what} holds {_what(t)} (it would give a NaN video); {fix}")


def context_flags(contexts) -> list:
    """(tensor, on-device 'not finite' flag) of each conditioning tensor (shared ones once); no host sync: the flags
    are read later together with others (``check_output(pending=...)``)."""
    seen, flags = set(), []
    for t in contexts:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and id(t) not in seen:
            seen.add(id(t))
            flags.append((t, _bad_flag(t)))
    return flags


def output_problem(latents: torch.Tensor, bad: bool | None = None) -> str | None:
    """Why the sampled latents [B, F, ...] are not a video (None: every value finite); one host sync (none when
    ``bad``, the flag already read, is given)."""
    if not isinstance(latents, torch.Tensor) or not latents.is_floating_point() or latents.numel() == 0:
        return None
    if not (bool(_bad_flag(latents)) if bad is None else bad):
        return None
    first = first_bad(latents, 1) if latents.dim() >= 3 else 0
    return f"{_what(latents)}, from latent frame {first} on"


def largest_weight(model) -> tuple:
    """(name, largest magnitude) of the model's weights, fp8 layers as dequantized (the error path only)."""
    best = ("", 0.0)
    with torch.no_grad():
        for prefix, mod in model.named_modules():
            if is_quantized(mod) and not mod.weight.is_meta:
                top = max(float(p.abs().max()) for p in _dequantized_rows(mod, torch.float32))
                if top > best[1]:
                    best = (f"{prefix}.weight", top)
        for name, p in model.named_parameters():
            if p.is_floating_point() and not p.is_meta and p.numel() and p.element_size() > 1:
                top = float(p.detach().abs().max())
                if top > best[1]:
                    best = (name, top)
    return best


LARGE_WEIGHT = 1e4          # trained weights stay far below this; a weight above it is the likely overflow


def check_output(latents: torch.Tensor, what: str = "the sampled latents", dtype=None, contexts=(),
                 model=None, pending: list = ()) -> None:
    """NonFiniteError when the run's latents hold NaN or inf: the weights and the conditioning were checked where
    they entered, so a value overflowed while sampling; the message says what most likely did (the largest weight
    of ``model`` when it is far from a trained one's, conditioning of huge values, float16). ``pending``: the
    conditioning flags of ``context_flags``, read in the same host sync (a broken conditioning is named first)."""
    out_flag = _bad_flag(latents) if isinstance(latents, torch.Tensor) and latents.is_floating_point() and \
        latents.numel() else None
    flags = [f for _, f in pending] + ([out_flag] if out_flag is not None else [])
    bad = _read_flags(flags) if flags else []
    for (t, _), b in zip(pending, bad):           # a broken conditioning is named first
        if b:
            check_conditioning(t, "the text conditioning", "the text encoder's output (or the embeddings given) "
                                                           "is broken: encode the prompt again, or use another text "
                                                           "encoder")
    problem = output_problem(latents, bad[-1] if out_flag is not None else None)
    if problem is None:
        return
    likely = []
    if model is not None:
        try:
            name, top = largest_weight(model)
        except Exception:  # noqa: BLE001 - weights of another implementation (a quantized tensor type): no hint
            name, top = "", 0.0
        if top > LARGE_WEIGHT:
            likely.append(f"the weight {name!r}, whose values reach {top:.3g} (trained weights stay far below "
                          f"{LARGE_WEIGHT:g}): its fp8 scale or the LoRA merged into it is wrong; load another "
                          f"file or lower the LoRA strength")
    largest = 0.0
    for t in contexts:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
            largest = max(largest, float(t.detach().abs().max()))
    if largest > 1e4:
        likely.append(f"the text conditioning (its largest value is {largest:.3g}; a text encoder's output is "
                      f"near 1): encode the prompt with the model's own text encoder")
    if dtype == torch.float16:
        likely.append("float16, whose range is too small for this run: use bf16 or fp32")
    if not likely:
        likely.append("weights too large to compute with (a LoRA strength too high, an fp8 scale that does not "
                      "belong to its weight): lower the LoRA strength or load another file")
    raise NonFiniteError(f"{what} hold {problem}: a value overflowed while sampling; most likely "
                         f"{'; or '.join(likely)}. Nothing was kept of this run")


__all__ = ["NonFiniteError", "check_weights", "check_conditioning", "context_flags", "check_output",
           "output_problem", "largest_weight"]
