"""Metrics history: one JSON line per generate / bench / profile run, beside the limit cache.

The file is ``LimitCache().directory / "history.jsonl"`` (``WAN_ACCEL_CACHE`` moves both). Appends are safe
across threads and processes: each record is ONE ``os.write`` of one complete line on an ``O_APPEND``
descriptor, under a file lock. Reading skips a corrupt line (a crash mid-write, a hand edit) with one warning.

Record fields (all optional except ``kind``; ``timestamp`` and ``fingerprint`` are filled in when missing)::

    kind               "generate" | "bench" | "profile"
    timestamp          unix seconds (float)
    fingerprint        cache.fingerprint_id() of the machine
    label              short free text (model name, bench name)
    settings           dict: what ran (resolution, frames, steps, compile preset, ...)
    timings            dict: total_s (wall seconds of the run), frames_per_s, steps_per_s, compile_s, ...
    peak_memory_bytes  int
    cache_hits         int or dict (limit-cache / compile-cache hits during the run)
"""
from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

from ..cache.json_out import null_json
from ..cache.owned_files import loads_json, read_regular

KINDS = ("generate", "bench", "profile")
FILE_NAME = "history.jsonl"
LOCK_TIMEOUT_S = 30.0


class HistoryWarning(UserWarning):
    """Issued once per read when corrupt lines were skipped, and when a line could not be appended."""


def history_path(path=None) -> Path:
    """``path`` when given, else ``history.jsonl`` in the limit cache's folder."""
    if path is not None:
        return Path(path).expanduser()
    from ..cache import LimitCache

    return LimitCache().directory / FILE_NAME


def make_record(kind: str, *, settings: dict | None = None, timings: dict | None = None,
                peak_memory_bytes: int | None = None, cache_hits=None, label: str = "", **extra) -> dict:
    """Build a record with the standard fields (see the module docstring); ``extra``: more fields."""
    rec = {"kind": kind, "label": label, "settings": dict(settings or {}), "timings": dict(timings or {}),
           "peak_memory_bytes": peak_memory_bytes, "cache_hits": cache_hits}
    rec.update(extra)
    return rec


def append(record: dict, path=None) -> dict:
    """Append one record (a JSON-serialisable dict) as one line; returns the record as written, or None when
    the line was dropped with one HistoryWarning naming the file (its lock timed out, or the file is not one the
    pack may append to: a symlink, a pipe, a folder; cache/owned_files.py).

    Fills ``timestamp`` and ``fingerprint`` when missing. Raises ValueError for an unknown ``kind`` and
    TypeError for values JSON cannot hold.
    """
    if not isinstance(record, dict):
        raise TypeError(f"a history record is a dict, got {type(record).__name__}")
    rec = dict(record)
    kind = rec.get("kind")
    if kind not in KINDS:
        raise ValueError(f"history record kind must be one of {', '.join(KINDS)}; got {kind!r}")
    rec.setdefault("timestamp", time.time())
    if rec.get("fingerprint") is None:
        try:
            from ..cache import fingerprint_id

            rec["fingerprint"] = fingerprint_id()
        except Exception:  # noqa: BLE001 - a record without fingerprint is still useful
            rec["fingerprint"] = None
    rec = null_json(rec, str)            # NaN/inf become None (they are not valid JSON), keys strings
    try:
        line = json.dumps(rec, sort_keys=True, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"history record is not JSON-serialisable: {exc}") from exc
    data = (line + "\n").encode("utf-8")
    p = history_path(path)
    if path is None:  # beside the limit cache: only where the cache itself may write
        from ..cache import LimitCache
        from ..cache.safety import CacheUnavailableError

        problem = LimitCache().writable_problem
        if problem:
            raise CacheUnavailableError(problem)
    from filelock import FileLock, Timeout

    from ..cache.owned_files import OwnedFileError, append_line, check_target

    lock = Path(str(p) + ".lock")
    try:
        check_target(lock, purpose="the metrics history's lock", allow=(FILE_NAME + ".lock",))   # the file: append_line
        p.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(lock), timeout=LOCK_TIMEOUT_S):
            append_line(p, data, purpose="the metrics history", allow=(FILE_NAME,))
    except OwnedFileError as exc:
        _dropped(p, str(exc))
        return None
    except Timeout:
        _dropped(p, f"its lock {lock} was held by another process for {LOCK_TIMEOUT_S:.0f} s")
        return None
    return rec


def _dropped(p: Path, why: str) -> None:
    warnings.warn(f"metrics history {p}: this run's line was dropped ({why})", HistoryWarning, stacklevel=3)


def read(path=None, kind: str | None = None, last: int | None = None) -> list[dict]:
    """All records, oldest first (optionally only ``kind``, only the ``last`` N). A missing file reads as
    empty; corrupt lines are skipped with ONE HistoryWarning that names them."""
    p = history_path(path)
    try:
        raw = read_regular(p)          # a pipe or device put there never blocks the read
    except FileNotFoundError:
        return []
    records, bad = [], []
    for n, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            rec = loads_json(line.decode("utf-8"))
            if not isinstance(rec, dict):
                raise ValueError("not an object")
        except (ValueError, UnicodeDecodeError):
            bad.append(n)
            continue
        if kind is None or rec.get("kind") == kind:
            records.append(rec)
    if bad:
        shown = ", ".join(map(str, bad[:10])) + (" ..." if len(bad) > 10 else "")
        warnings.warn(f"{p}: skipped {len(bad)} corrupt line(s) (line {shown})", HistoryWarning, stacklevel=2)
    if last is not None and last >= 0:
        records = records[-last:] if last else []
    return records
