"""Learned memory limits: their keys in the limit cache (namespace ``memory``) and safe readers/writers.

Values are ``{"size": n, "failed": m, "unit": "...", "ooms": k}``: ``size`` worked after an out-of-memory error
at ``failed``. The cache scopes every entry by the machine's fingerprint, so keys carry no GPU name.
"""
from __future__ import annotations

import logging

from ..cache import open_cache  # noqa: F401  (re-exported)

NAMESPACE = "memory"
log = logging.getLogger("wan_accel")


def dit_limit_key(signature: str, width: int, height: int, frames: int, mode: str = "causal", batch: int = 1) -> str:
    """Key of the learned DiT limit (``size`` = resident blocks that worked)."""
    return f"dit/{signature}/{mode}/{width}x{height}x{frames}/b{batch}"


def vae_limit_key(kind: str, batch: int, latent_h: int, latent_w: int) -> str:
    """Key of the learned VAE decode limit (``size`` = latent frames per chunk that worked)."""
    return f"vae_decode/{kind}/b{batch}/{latent_h}x{latent_w}"


def read_limit(cache, key: str) -> dict | None:
    if cache is None:
        return None
    try:
        value = cache.get(NAMESPACE, key)
    except Exception as exc:  # noqa: BLE001
        log.warning("wan_accel: could not read memory limit %s (%s)", key, exc)
        return None
    return value if isinstance(value, dict) else None


def learned_size(cache, key: str) -> int | None:
    value = read_limit(cache, key)
    size = value.get("size") if value else None
    return int(size) if isinstance(size, (int, float)) and not isinstance(size, bool) and size >= 0 else None


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
