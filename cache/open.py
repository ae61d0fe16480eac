"""``open_cache``: the limit cache a feature should use, never an error (learning is an optimisation)."""
from __future__ import annotations

import logging

from .store import LimitCache

log = logging.getLogger("wan_accel")


def open_cache(cache=None, without: str = "learned limits will not be remembered"):
    """``cache`` itself, or the default LimitCache; None when the cache cannot be opened (never fatal: one warning
    that ends with ``without``, what the feature does without it)."""
    if cache is not None:
        return cache
    try:
        return LimitCache()
    except Exception as exc:  # noqa: BLE001 - learning is an optimisation, never a failure
        log.warning("wan_accel: limit cache unavailable (%s); %s", exc, without)
        return None
