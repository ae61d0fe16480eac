"""Warm start: Inductor's on-disk caches beside the limit cache, plus Mega-Cache artifacts indexed in it.

- Unless the user set ``TORCHINDUCTOR_CACHE_DIR``, it is pointed at ``<limit cache folder>/inductor`` (Triton's
  cache of Inductor kernels follows it), so compiled graphs survive temp-folder cleaners and are found by the
  next process.
- After a compile, ``torch.compiler.save_cache_artifacts()`` (torch 2.7+) is written to
  ``<limit cache folder>/compile_artifacts/<hash>.bin`` and indexed in the limit cache (``compile`` namespace,
  key = model signature + settings hash); before the next compile of the same model and settings the file is
  loaded with ``load_cache_artifacts`` (which pre-fills Inductor's caches even when its folder was wiped).
"""
from __future__ import annotations

import hashlib
import logging
import os
import stat
import time
from pathlib import Path

import torch

from ..cache.owned_files import replace_file
from ..cache.safety import CacheUnavailableError, warn_once
from . import compat

log = logging.getLogger("wan_accel.compile")

NAMESPACE = "compile"
ARTIFACT_DIR = "compile_artifacts"
INDUCTOR_DIR = "inductor"
ENV_INDUCTOR = "TORCHINDUCTOR_CACHE_DIR"

_LOADED: set[str] = set()  # artifact keys loaded in this process


def _torch_default_cache_dir() -> str | None:
    """Inductor's own default folder (torch writes it into the environment when Dynamo is imported)."""
    for module in ("torch._inductor.runtime.cache_dir_utils", "torch._inductor.runtime.runtime_utils"):
        try:
            mod = __import__(module, fromlist=["default_cache_dir"])
            return os.path.abspath(mod.default_cache_dir())
        except Exception:  # noqa: BLE001 - moved or absent in this torch
            continue
    return None


def ensure_inductor_cache_dir(cache) -> tuple[str, bool]:
    """Point TORCHINDUCTOR_CACHE_DIR beside the limit cache unless the user chose a folder.

    Torch itself fills the variable with its default folder when Dynamo is imported, so a value equal to that
    default counts as "not set by the user". Returns (directory, set_here). The variable is process-wide.
    """
    current = os.environ.get(ENV_INDUCTOR)
    if current and os.path.abspath(current) != _torch_default_cache_dir():
        return current, False
    target = Path(cache.directory) / INDUCTOR_DIR
    try:
        problem = getattr(cache, "writable_problem", None)
        if problem:
            raise CacheUnavailableError(problem)
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # an unwritable cache folder: Inductor keeps its own default folder
        warn_once(cache.path, "write", f"wan_accel: cannot keep Inductor's caches in {target} "
                                       f"({exc.strerror or exc}); compiling with Inductor's default cache folder "
                                       f"(no warm start across restarts)")
        return current or (_torch_default_cache_dir() or ""), False
    os.environ[ENV_INDUCTOR] = str(target)
    return str(target), True


class WarmStart:
    """Save/load the Mega-Cache artifacts of one (model signature, settings) pair."""

    def __init__(self, cache, key: str):
        self.cache = cache
        self.key = key
        digest = hashlib.sha256(key.encode()).hexdigest()[:24]
        self.path = Path(cache.directory) / ARTIFACT_DIR / f"{digest}.bin"
        self.saves = 0

    def load(self) -> dict:
        """Load the saved artifacts once per process; returns {kind: count} ({} when nothing was loaded)."""
        if self.key in _LOADED or not compat.has_mega_cache():
            return {}
        _LOADED.add(self.key)
        entry = self.cache.get(NAMESPACE, self.key)
        if not entry:
            return {}
        path = self.path.with_name(entry.get("file", self.path.name))
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
            try:                       # only the regular file the pack wrote: never a link, a pipe or a device
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return {}
                with os.fdopen(os.dup(fd), "rb") as fh:
                    blob = fh.read()
            finally:
                os.close(fd)
        except OSError:
            return {}
        try:
            info = torch.compiler.load_cache_artifacts(blob)
        except Exception as exc:  # noqa: BLE001 - a stale or foreign artifact only costs a cold compile
            log.warning("wan_accel: could not load compile artifacts %s (%s); compiling from scratch", path, exc)
            return {}
        counts = compat.cache_info_counts(info)
        log.info("wan_accel: loaded compile artifacts %s: %s", path.name, counts)
        return counts

    def save(self) -> dict:
        """Write this process's compile artifacts beside the limit cache and index them; {} if none."""
        if not compat.has_mega_cache():
            return {}
        try:
            result = torch.compiler.save_cache_artifacts()
        except Exception as exc:  # noqa: BLE001 - saving is an optimisation only
            log.warning("wan_accel: could not save compile artifacts (%s)", exc)
            return {}
        if not result:
            return {}
        blob, info = result
        counts = compat.cache_info_counts(info)
        try:
            problem = getattr(self.cache, "writable_problem", None)
            if problem:
                raise CacheUnavailableError(problem)
            # the one whole-file writer: a fresh temporary file, then a rename
            replace_file(self.path, lambda tmp: Path(tmp).write_bytes(blob))
            self.cache.put(NAMESPACE, self.key, {
                "file": self.path.name, "bytes": len(blob), "saved": time.time(), "artifacts": counts,
                "torch": torch.__version__,
            })
        except Exception as exc:  # noqa: BLE001
            log.warning("wan_accel: could not write compile artifacts to %s (%s)", self.path, exc)
            return {}
        self.saves += 1
        return counts
