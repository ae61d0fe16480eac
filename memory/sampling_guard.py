"""The out-of-memory policy of causal sampling: a chunk guard for ``SamplingHooks(chunk_guard=...)``.

On an out-of-memory error inside a chunk the guard swaps more blocks to the host (``block_swap``) and redoes the chunk
(the loop rewinds the noise generator, so the result does not change); the resident block count that worked is
remembered for this machine under the DiT limit key the VRAM plan reads. When even every block swapped does not
fit, the run stops with a message that says what would.
"""
from __future__ import annotations

import logging

import torch

from ..cache import open_cache
from .block_swap import active_swap, run_with_swap_fallback
from .estimate import Workload
from .limits import dit_limit_key
from .oom import NoFitError
from .plan import make_plan
from .system import detect_system
from .weights import weights_from_module

log = logging.getLogger("wan_accel")
OOM_RETRY_MODES = ("auto", "on", "off")


def _no_fit_message(model, exc, shape, frames_per_block) -> str:
    """The NoFitError text plus what the VRAM plan says would fit."""
    msg = str(exc)
    try:
        b, f, _, h, w = shape
        plan = make_plan(weights_from_module(model), Workload(w * 8, h * 8, 4 * (f - 1) + 1, batch=b,
                                                                frames_per_block=frames_per_block),
                         detect_system(model.device))
        advice = plan.reasons.get("fits") or ""
        kv = "global" if plan.kv_window < 0 else f"{plan.kv_window} latent frames"
        msg += (f" What would fit on this GPU: {plan.blocks_to_swap} of {plan.blocks_total} blocks swapped with a "
                f"KV window of {kv}" + (f"; {advice}" if advice else "") + ".")
    except Exception as plan_exc:  # noqa: BLE001 - the advice is a bonus; the error itself must get through
        log.debug("wan_accel: no VRAM plan for the error message: %s", plan_exc)
    return msg


def sampling_limit_key(model, shape) -> str:
    """The learned-limit key of this model and video size (the one ``plan`` reads: limits.dit_limit_key), from the
    model's config and the dtype it computes in (not the dtype its weights were stored in)."""
    b, f, _, h, w = shape
    dtype = getattr(model, "compute_dtype", None) or next(model.parameters()).dtype
    config = getattr(model, "config", None) or weights_from_module(model).config
    return dit_limit_key(config, dtype, w * 8, h * 8, 4 * (f - 1) + 1, batch=b)


def oom_guard(model, shape, frames_per_block: int, *, mode: str = "auto", cache=None, swap_model=None,
              learn: bool = True):
    """A chunk guard for a run of latents ``shape`` (B, F, C, H, W), or None when ``mode`` ('auto': CUDA only,
    'on', 'off') leaves out-of-memory errors alone. ``swap_model``: the module whose blocks the retries swap (the
    owner of the weights ``model`` runs, e.g. the source of a borrowed model; default ``model``). ``learn``: False
    neither starts from nor records a learned resident-block limit (weights another program holds and places)."""
    if mode not in OOM_RETRY_MODES:
        raise ValueError(f"oom_retry must be one of {OOM_RETRY_MODES}, got {mode!r}")
    if mode == "off" or (mode == "auto" and torch.device(model.device).type != "cuda"):
        return None
    key = sampling_limit_key(model, shape) if learn else None
    cache = open_cache(cache)
    target = model if swap_model is None else swap_model

    def guard(attempt, on_oom):
        swap = active_swap(target)
        settings = getattr(swap, "settings", None) if swap is not None else None
        try:
            return run_with_swap_fallback(target, attempt, key=key, settings=settings, cache=cache,
                                          device=model.device, on_oom=lambda _resident: on_oom())
        except NoFitError as exc:
            raise NoFitError(_no_fit_message(model, exc, shape, frames_per_block), key=exc.key,
                             size=exc.size) from None

    return guard
