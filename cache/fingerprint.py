"""Where a limit was measured: the hardware and software that make a limit valid.

Everything here is computed lazily (CUDA is never initialised at import) and memoised per process and device.
"""
from __future__ import annotations

import hashlib
import json
import platform
from functools import lru_cache
from importlib import metadata

FINGERPRINT_FIELDS = ("device", "gpu", "capability", "total_memory", "driver", "cuda", "torch", "triton")
# Fields that describe software: an entry whose software no longer matches can never be read again.
SOFTWARE_FIELDS = ("driver", "cuda", "torch", "triton")


def package_version(name: str) -> str:
    """The installed version of the distribution ``name`` (from its metadata), or 'none' where it is absent."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "none"


def cpu_name() -> str:
    """The CPU model (from /proc/cpuinfo where available)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _driver_version(torch) -> str:
    getter = getattr(torch._C, "_cuda_getDriverVersion", None)
    if getter is None:
        return "unknown"
    try:
        v = int(getter())
    except Exception:  # noqa: BLE001 - any driver query failure just means "unknown"
        return "unknown"
    return f"{v // 1000}.{(v % 1000) // 10}"


@lru_cache(maxsize=None)
def _compute(device_index: int | None) -> tuple:
    import torch  # lazy: importing the pack must not import torch

    base = {
        "torch": torch.__version__,
        "triton": package_version("triton"),
    }
    if device_index is not None and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device_index)
        hip = getattr(torch.version, "hip", None)
        info = {
            "device": "cuda",
            "gpu": props.name,
            "capability": f"{props.major}.{props.minor}",
            "total_memory": int(props.total_memory),
            "driver": _driver_version(torch),
            "cuda": str(hip or torch.version.cuda),
        }
    else:
        info = {
            "device": "cpu",
            "gpu": cpu_name(),
            "capability": platform.machine(),
            "total_memory": 0,
            "driver": "none",
            "cuda": "none",
        }
    info.update(base)
    return tuple((k, info[k]) for k in FINGERPRINT_FIELDS)


def fingerprint(device=None) -> dict:
    """The fingerprint of ``device`` (a ``torch.device`` or its name, or None for the current device / CPU)."""
    import torch  # lazy: importing the pack must not import torch

    dev = "" if device is None else str(device)
    if dev.startswith("cpu"):
        index = None
    elif ":" in dev:
        index = int(dev.split(":", 1)[1])
    else:
        index = torch.cuda.current_device() if torch.cuda.is_available() else None
    return dict(_compute(index))


def fingerprint_id(fp: dict | None = None) -> str:
    """A short, stable identifier of a fingerprint (hex of a hash over its canonical JSON)."""
    fp = fingerprint() if fp is None else fp
    blob = json.dumps({k: fp.get(k) for k in FINGERPRINT_FIELDS}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
