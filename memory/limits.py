"""Learned memory limits: their keys in the limit cache (namespace ``memory``) and safe readers/writers.

Values are ``{"size": n, "failed": m, "unit": "...", "ooms": k}``: ``size`` worked after an out-of-memory error
at ``failed``. The cache scopes every entry by the machine's fingerprint, so keys carry no GPU name.
"""
from __future__ import annotations

import logging

from ..cache.entries import finite_number
from ..kernels._common import dtype_name

NAMESPACE = "memory"
log = logging.getLogger("wan_accel")


def model_identity(config) -> str:
    """Architecture of a model, the same however its weights are stored: ``wan-t2v-d1536-f8960-l30``.
    ``config``: a WanConfig, its dict, or anything with those attributes (a loaded model's ``config``, a plan's
    ``ModelWeights.config`` read from the checkpoint header)."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    return f"wan-{get('model_type', 't2v')}-d{int(get('dim', 0))}-f{int(get('ffn_dim', 0))}-l{int(get('num_layers', 0))}"


def dit_limit_key(config, compute_dtype, width: int, height: int, frames: int, mode: str = "causal",
                  batch: int = 1) -> str:
    """Key of the learned DiT limit (``size`` = resident blocks that worked): the model's architecture
    (``model_identity``) and the dtype it computes in, never the dtype its file stores. The sampling guard writes
    it from the running model (its config and compute dtype), the plan reads it from the checkpoint's config and
    the dtype it plans, so an fp32 file run in bf16 finds the limit a bf16 file learned, and the other way round."""
    return f"dit/{model_identity(config)}-{dtype_name(compute_dtype)}/{mode}/{width}x{height}x{frames}/b{batch}"


VAE_KINDS = {16: "wan2.1", 48: "wan2.2"}


def vae_kind(latent_channels: int, vae=None) -> str:
    """The VAE a latent belongs to, from its channels: 16 -> 'wan2.1', 48 -> 'wan2.2'; another VAE is named by its
    class and channels. Used by the decode node (writer) and the plan (reader, from the DiT's latent channels)."""
    channels = int(latent_channels)
    if channels in VAE_KINDS:
        return VAE_KINDS[channels]
    inner = getattr(vae, "first_stage_model", vae)
    return f"{type(inner).__name__ if inner is not None else 'vae'}-c{channels}"


def vae_limit_key(kind: str, batch: int, latent_h: int, latent_w: int) -> str:
    """Key of the learned VAE decode limit (``size`` = latent frames per chunk that worked); ``kind``: vae_kind."""
    return f"vae_decode/{kind}/b{batch}/{latent_h}x{latent_w}"


def learned_size(cache, key: str) -> int | None:
    if cache is None:
        return None
    try:
        value = cache.get(NAMESPACE, key)
    except Exception as exc:  # noqa: BLE001
        log.warning("wan_accel: could not read memory limit %s (%s)", key, exc)
        return None
    size = value.get("size") if isinstance(value, dict) else None
    return int(size) if finite_number(size) and size >= 0 else None


def record_size(cache, key: str, size: int, *, failed: int | None = None, unit: str = "") -> None:
    """Remember that ``size`` worked (after an OOM at ``failed``). Durable when it returns."""
    if cache is None:
        return

    def change(old):
        ooms = int((old or {}).get("ooms", 0)) + (1 if failed is not None else 0)
        return {"size": int(size), "failed": None if failed is None else int(failed), "unit": unit, "ooms": ooms}

    try:
        cache.update(NAMESPACE, key, change)
    except Exception as exc:  # noqa: BLE001
        log.warning("wan_accel: could not record memory limit %s=%s (%s)", key, size, exc)
