"""Feature detection of the torch.compile APIs the pack uses (version drift lives here only)."""
from __future__ import annotations

import contextlib
import inspect
from functools import lru_cache

import torch


@lru_cache(maxsize=None)
def per_call_recompile_limit() -> bool:
    """torch.compile(recompile_limit=...) exists (scoped to one compiled region, no global change)."""
    try:
        return "recompile_limit" in inspect.signature(torch.compile).parameters
    except (TypeError, ValueError):
        return False


@lru_cache(maxsize=None)
def dynamo_limit_name() -> str | None:
    """Name of Dynamo's per-code recompile limit: "recompile_limit" (2.7+) or "cache_size_limit"."""
    import torch._dynamo.config as dc

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dc, name):
            return name
    return None


def stance(name: str):
    """Context manager setting Dynamo's stance for the enclosed calls (no-op where unsupported)."""
    if name == "default" or not hasattr(getattr(torch, "compiler", None), "set_stance"):
        return contextlib.nullcontext()
    return torch.compiler.set_stance(name)


def has_mega_cache() -> bool:
    c = getattr(torch, "compiler", None)
    return hasattr(c, "save_cache_artifacts") and hasattr(c, "load_cache_artifacts")


def graph_count() -> int | None:
    """Graphs compiled by Dynamo so far in this process (None when the counter is unavailable)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001
        return None


def cache_counters() -> dict:
    """Cache hit/miss counters of Inductor's FX graph cache and AOTAutograd's cache, as plain ints."""
    try:
        from torch._dynamo.utils import counters
    except Exception:  # noqa: BLE001
        return {}
    out = {}
    for group in ("inductor", "aot_autograd"):
        for name, value in counters.get(group, {}).items():
            if "cache" in name:
                out[f"{group}.{name}"] = int(value)
    out["dynamo.unique_graphs"] = int(counters["stats"].get("unique_graphs", 0))
    return out


def cache_info_counts(info) -> dict:
    """{kind: count} from a Mega-Cache CacheInfo (field names drifted between releases)."""
    if info is None:
        return {}
    arts = getattr(info, "artifacts", None)
    if isinstance(arts, dict):
        return {str(k): len(v) for k, v in arts.items()}
    out = {}
    for name in dir(info):
        if name.endswith("_artifacts") and not name.startswith("_"):
            try:
                out[name[: -len("_artifacts")]] = len(getattr(info, name))
            except TypeError:
                pass
    return out
