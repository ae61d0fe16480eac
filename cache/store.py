"""The limit cache: one JSON file shared by every feature of the pack (its shape and per-entry checks: entries.py).

Layout on disk (schema 1)::

    {"kind": "wan_accel.limit_cache", "schema": 1,
     "fingerprints": {fid: {gpu, capability, ...}},
     "namespaces": {namespace: {fid: {key: {"value": {...}, "created": t, "updated": t,
                                             "last_used": t, "hits": n}}}}}

Writers take a cross-process file lock, re-read the file, apply their change (so another process's entries are
never dropped), write a temporary file in the same folder, fsync it and ``os.replace`` it over the old one.
Readers never lock: a replace is atomic, so they see either the old or the new file. A file that cannot be
parsed or has the wrong shape is moved aside as ``<name>.corrupt-<time>`` with one warning, and only when it is
the cache's own regular file (cache/safety.py): a device, a folder, a symlink, a file in a system folder or a
file that is not a limit cache is left untouched, and the cache runs empty and in memory for that process.

A cache that cannot be written (permissions, a read-only disk, a refused place) never stops a feature: it warns
once, naming the file and the reason, and keeps the change in memory. Only the explicit maintenance actions
(``clear``, ``prune_stale``) raise :class:`CacheUnavailableError`, whose message says where and why.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import socket
import stat
import sys
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Callable

from filelock import FileLock, Timeout

from .entries import (NAMESPACE_RE, _SHAPES_GEN, CacheFormatError, Lenient, _check_json_value, _empty, _refuse_constant,
                      _validate, finite_number, loads_lenient, shape_problem)
from .owned_files import OwnedFileError, read_regular, replace_file
from .fingerprint import SOFTWARE_FIELDS, fingerprint as _fingerprint, fingerprint_id as _fingerprint_id
from .paths import default_cache_path
from .safety import (CacheUnavailableError, check_writable_place, describe_os_error, file_kind, loads_json,
                     quarantine_refusal, warn_once, write_problem)

DEFAULT_MAX_ENTRIES = 4096  # per namespace, over all fingerprints
LOCK_TIMEOUT_S = 120.0
LOCK_NOTICE_S = 1.0       # a lock still held after this long is announced (who holds it), then waited for
SET_ASIDE_SUFFIX = ".set-aside.json"
SET_ASIDE_KIND = "wan_accel.limit_cache.set_aside"
MAX_SET_ASIDE = 1000      # the side file keeps the newest items
SET_ASIDE_BYTES = 32 << 20   # ... within this size (written so; a larger file is not read, only reported)
KNOWN_NAMESPACES = ("operator", "compile", "memory", "sampler", "doctor")

def _unseen(old: list[dict], more: list[dict]) -> list[dict]:
    """The set-aside items of ``more`` that are not in ``old`` (nor repeated), in their order."""
    def ident(item: dict) -> str:
        return json.dumps([item.get("namespace"), item.get("fingerprint"), item.get("key"), item.get("entry"),
                           item.get("reason")], sort_keys=True, default=str)
    seen = {ident(i) for i in old}
    return [i for i in more if ident(i) not in seen and not seen.add(ident(i))]


def count_entries(n: int) -> str:
    """'1 entry', '2 entries', '0 entries'."""
    return "1 entry" if n == 1 else f"{n} entries"


def _atomic_write(path: Path, blob: bytes, durable: bool = True) -> None:
    """Write ``blob`` to the cache's own file ``path`` with the pack's one whole-file writer
    (``owned_files.replace_file``: a temporary ``.<name>.*.tmp`` in the same folder, fsync when ``durable``,
    os.replace); a link, pipe, device or folder in the way is refused."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise CacheUnavailableError(f"{path} is not a regular file; the limit cache writes only its own files")
    replace_file(path, lambda tmp: Path(tmp).write_bytes(blob), durable=durable, suffix=".tmp")


_LIVE: "weakref.WeakSet[LimitCache]" = weakref.WeakSet()
_HOST = socket.gethostname()


class LimitCache:
    """JSON-backed, cross-process-safe store of measured limits, scoped by the machine's fingerprint.

    ``get`` sees only entries measured on the current fingerprint (GPU, driver, CUDA, torch, triton).
    ``put``/``update``/``clear`` are durable when they return.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, max_entries: int = DEFAULT_MAX_ENTRIES,
                 fingerprint: dict | None = None):
        self.path = Path(path).expanduser() if path is not None else default_cache_path()
        self.max_entries = int(max_entries)
        self._fp = dict(fingerprint) if fingerprint is not None else None
        self._file_lock = FileLock(str(self.path) + ".lock", timeout=LOCK_TIMEOUT_S)
        self._thread_lock = threading.RLock()
        self._data: dict | None = None
        self._stamp = None
        self._pending_hits: dict[tuple[str, str, str], list] = {}
        self._refused: str | None = None        # why the file on disk may not be replaced (not the cache's own)
        self._write_error: str | None = None    # why the last write could not reach the disk
        self._unsaved: dict | None = None       # this process's view while writes fail (kept in memory)
        self.quarantined: list[dict] = []       # files this instance moved aside: path, moved_to, reason, time
        self._aside_now: list[dict] = []        # entries of the file last read that were set aside
        self._aside_unsaved: list[dict] = []    # set-aside items the side file could not take
        self.set_aside_announced = False        # this instance warned about newly set-aside entries
        _LIVE.add(self)

    # ---------------------------------------------------------------- identity
    @property
    def directory(self) -> Path:
        """The folder of the cache file; sibling files (history, compile artifacts) live here."""
        return self.path.parent

    @property
    def fingerprint(self) -> dict:
        if self._fp is None:
            self._fp = _fingerprint()
        return self._fp

    @property
    def fingerprint_id(self) -> str:
        return _fingerprint_id(self.fingerprint)

    def __repr__(self) -> str:
        return f"LimitCache({str(self.path)!r})"

    # ---------------------------------------------------------------- reading
    def _stat_stamp(self):
        try:
            st = os.stat(self.path)
        except OSError:  # absent, or a folder part that is not a folder
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size, _SHAPES_GEN[0])  # a newly registered shape re-reads

    def _parse_file(self) -> dict:
        """Parse the file; raise CacheFormatError on any damage, FileNotFoundError when absent, OwnedFileError when
        it is not a regular file (a device, a pipe or a folder is never read: a pipe would block)."""
        raw = read_regular(self.path)
        try:
            hooks = Lenient()
            data = loads_lenient(raw.decode("utf-8-sig"), hooks)   # a BOM an editor added is not damage
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:   # nested too deeply is one (safety.loads_json)
            raise CacheFormatError(f"not valid JSON ({exc})") from None
        data, aside = _validate(data, finite=not hooks.unusable)
        self._aside_now = aside
        if aside:
            self._keep_set_aside(aside)
        return data

    def _quarantine(self, reason: str, refusal: str | None = None) -> None:
        refusal = refusal or quarantine_refusal(self.path)
        if refusal is not None:
            hint = "" if "WAN_ACCEL_CACHE" in refusal else "; set WAN_ACCEL_CACHE to a folder of your own"
            self._refused = f"{self.path} is not a usable limit cache ({reason}) and was left untouched: {refusal}{hint}"
            warn_once(self.path, "refused", f"wan_accel limit cache: {self._refused}. Using an empty cache in "
                                            f"memory.")
            return
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while target.exists():
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
            n += 1
        try:
            os.replace(self.path, target)
        except FileNotFoundError:
            return
        except OSError as exc:
            warnings.warn(f"wan_accel limit cache {self.path} is damaged ({reason}) and could not be moved aside "
                          f"({exc}); using an empty cache", RuntimeWarning, stacklevel=4)
            return
        self.quarantined.append({"path": str(self.path), "moved_to": str(target), "reason": reason,
                                 "time": time.time()})
        warnings.warn(f"wan_accel limit cache {self.path} was damaged ({reason}); moved it to {target} and "
                      f"started an empty cache", RuntimeWarning, stacklevel=4)

    # ---------------------------------------------------------------- set-aside entries
    @property
    def set_aside_path(self) -> Path:
        """The side file that keeps entries set aside from the cache (``limits.json.set-aside.json``)."""
        return Path(str(self.path) + SET_ASIDE_SUFFIX)

    def _read_set_aside(self) -> tuple[list[dict] | None, str | None]:
        """(the items in the side file ([] when absent), None), or (None, why) when it exists but cannot be read as
        one. At most ``SET_ASIDE_BYTES`` are ever read."""
        p = self.set_aside_path
        try:
            st = os.lstat(p)
        except (FileNotFoundError, NotADirectoryError):
            return [], None
        except OSError as exc:
            return None, f"it cannot be inspected ({exc.strerror or exc})"
        if not stat.S_ISREG(st.st_mode):
            return None, f"it is {file_kind(st.st_mode)}, not a file"
        if st.st_size > SET_ASIDE_BYTES:
            return None, (f"it is {st.st_size} bytes, larger than any set-aside file the pack writes "
                          f"({SET_ASIDE_BYTES >> 20} MiB); it was not read")
        try:
            raw = read_regular(p, SET_ASIDE_BYTES + 1)
            if len(raw) > SET_ASIDE_BYTES:
                return None, f"it is larger than {SET_ASIDE_BYTES >> 20} MiB; it was not read"
            data = loads_json(raw.decode("utf-8"), parse_constant=_refuse_constant)
        except (OSError, UnicodeDecodeError, ValueError) as exc:    # nested too deeply: a ValueError of loads_json
            why = getattr(exc, "strerror", None) or str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
            return None, f"it is damaged ({why})"
        items = data.get("items") if isinstance(data, dict) and data.get("kind") == SET_ASIDE_KIND else None
        if not isinstance(items, list):
            return None, "it is not a set-aside file of the cache (no 'kind' and 'items' of one)"
        return [i for i in items if isinstance(i, dict)], None

    def set_aside_problem(self) -> str | None:
        """Why the set-aside file cannot be read (damaged, too large, not a file), with what to do; None when it
        reads (or is absent)."""
        why = self._read_set_aside()[1]
        if why is None:
            return None
        return (f"the set-aside file {self.set_aside_path} cannot be read: {why}. It only keeps "
                f"entries set aside for you to read (never used); move it away or delete it when you no longer "
                f"need it, and new ones are kept in a new file")

    def _keep_set_aside(self, found: list[dict]) -> None:
        """Add newly set-aside items to the side file (atomic); kept in memory, with one warning, when the side
        file cannot be written."""
        pending = self._aside_unsaved + found
        try:
            check_writable_place(self.path)
            refusal = quarantine_refusal(self.path)
            if refusal is not None:
                raise CacheUnavailableError(f"the cache file is not the pack's own ({refusal})")
            old = self._read_set_aside()[0]
            if old is None:
                raise CacheUnavailableError(f"{self.set_aside_path} exists but is not a set-aside file of the cache")
            new = _unseen(old, pending)
            if new:
                items = (old + new)[-MAX_SET_ASIDE:]
                while True:                  # within the size the reader reads: the oldest items go first
                    blob = json.dumps({"kind": SET_ASIDE_KIND, "cache": str(self.path), "items": items}, indent=1,
                                      sort_keys=True, allow_nan=False).encode("utf-8")
                    if len(blob) <= SET_ASIDE_BYTES or len(items) <= 1:
                        break
                    items = items[len(items) // 2:]
                _atomic_write(self.set_aside_path, blob)
                if warn_once(self.path, f"set-aside:{len(old) + len(new)}",
                             f"wan_accel limit cache {self.path}: {count_entries(len(new))} could not be used and "
                             f"{'was' if len(new) == 1 else 'were'} set aside to {self.set_aside_path} "
                             f"({new[0]['reason']}{'; ...' if len(new) > 1 else ''}); every other entry is in "
                             f"use (read them with `python -m wan_accel cache set-aside`)"):
                    self.set_aside_announced = True
            self._aside_unsaved = []
        except (OSError, ValueError) as exc:
            self._aside_unsaved = pending[-MAX_SET_ASIDE:]
            warn_once(self.path, "set-aside-write", f"wan_accel limit cache {self.path}: "
                                                    f"{count_entries(len(found))} could not be used and "
                                                    f"{'was' if len(found) == 1 else 'were'} set aside, but the side "
                                                    f"file could not be written ({exc}); they are kept in memory")

    def set_aside(self) -> list[dict]:
        """Entries set aside from the cache (this file's and earlier ones'), oldest first: each item has
        ``namespace``, ``fingerprint``, ``key``, ``entry`` (the raw entry; unusable numbers as their text),
        ``reason`` and ``time``. They are never used; the user may read them and delete the side file."""
        self._snapshot()
        items = self._read_set_aside()[0] or []
        return items + _unseen(items, self._aside_unsaved + self._aside_now)

    def notices(self) -> list[str]:
        """What the user should know about the cache file itself: a damaged file moved aside (by this or an
        earlier process), a file refused, a cache that could not be written. Empty when all is well."""
        self._snapshot()
        out = []
        if self._refused:
            out.append(self._refused)
        problem = self._write_error or write_problem(self.path)
        if problem and not any(problem in o for o in out):
            out.append(problem)
        reasons = {Path(q["moved_to"]).name: q["reason"] for q in self.quarantined}
        problem = self.set_aside_problem()
        if problem:
            out.append(problem)
        aside = self.set_aside()
        if aside:
            out.append(f"{count_entries(len(aside))} of the cache could not be used and "
                       f"{'is' if len(aside) == 1 else 'are'} set aside in {self.set_aside_path} (read them with "
                       f"`python -m wan_accel cache set-aside`; delete the file when you no longer need them)")
        try:        # damaged cache files moved aside beside the cache (limits.json.corrupt-<time>), newest first
            moved = [p for p in self.path.parent.glob(f"{self.path.name}.corrupt-*") if p.is_file()]
            moved.sort(key=lambda p: (p.stat().st_mtime, p.name), reverse=True)
        except OSError:
            moved = []
        for p in moved:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(p.stat().st_mtime)) if p.exists() else "?"
            why = f" ({reasons[p.name]})" if p.name in reasons else ""
            out.append(f"a damaged cache file was moved aside to {p.name}{why} on {when}, and the cache started "
                       f"empty; delete {p} when you no longer need it")
        return out

    def _load(self, stamp=None) -> dict:
        """Read the file and keep it as the current data. ``stamp``: the file's stamp seen before reading, by a
        reader without the lock (a damaged file goes to :meth:`_recover`); None: a fresh read while holding the
        file lock (damaged files are quarantined, the stamp is taken after)."""
        try:
            data = self._parse_file()
        except FileNotFoundError:
            data = _empty()
        except CacheFormatError as exc:
            if stamp is not None:
                return self._recover(str(exc), stamp)
            self._quarantine(str(exc))
            data = _empty()
        except (OSError, OwnedFileError) as exc:
            warn_once(self.path, "read", f"wan_accel limit cache {self.path} cannot be read "
                                         f"({describe_os_error(exc)}); using an empty cache")
            data = _empty()
        self._data, self._stamp = data, self._stat_stamp() if stamp is None else stamp
        return data

    def _recover(self, reason: str, stamp) -> dict:
        """A reader found a damaged file: move it aside under the lock when it is the cache's own file in a place
        the cache may write; otherwise leave it untouched (one warning) and run empty in memory."""
        try:
            check_writable_place(self.path)
            refusal = quarantine_refusal(self.path)
        except CacheUnavailableError as exc:
            refusal = str(exc)
        if refusal is None:
            try:
                with self._locked():
                    return self._load()
            except Timeout:
                return _empty()
            except OSError as exc:
                refusal = f"its folder cannot be written ({describe_os_error(exc)})"
        self._quarantine(reason, refusal)
        self._data, self._stamp = _empty(), stamp
        return self._data

    def _snapshot(self) -> dict:
        """The current file contents for reading (reloaded only when the file changed)."""
        with self._thread_lock:
            if self._unsaved is not None:
                return self._unsaved
            stamp = self._stat_stamp()
            if self._data is not None and stamp == self._stamp:
                return self._data
            if stamp is None:
                self._data, self._stamp = _empty(), None
                return self._data
            return self._load(stamp)

    def get(self, namespace: str, key: str) -> dict | None:
        """The value stored for ``key`` on this fingerprint, or None. Counts a hit."""
        fid = self.fingerprint_id
        entry = self._snapshot()["namespaces"].get(namespace, {}).get(fid, {}).get(str(key))
        if entry is None:
            return None
        with self._thread_lock:
            pending = self._pending_hits.setdefault((namespace, fid, str(key)), [0, 0.0])
            pending[0] += 1
            pending[1] = time.time()
        return copy.deepcopy(entry["value"])

    def entries(self, namespace: str | None = None, all_fingerprints: bool = False) -> list[dict]:
        """Rows (namespace, key, value, fingerprint, created, updated, last_used, hits), sorted."""
        data = self._snapshot()
        fid_now = self.fingerprint_id
        rows = []
        for ns, by_fp in sorted(data["namespaces"].items()):
            if namespace is not None and ns != namespace:
                continue
            for fid, entries in sorted(by_fp.items()):
                if not all_fingerprints and fid != fid_now:
                    continue
                for key, entry in sorted(entries.items()):
                    pending = self._pending_hits.get((ns, fid, key), (0, 0.0))
                    rows.append({
                        "namespace": ns, "key": key, "value": copy.deepcopy(entry["value"]), "fingerprint": fid,
                        "created": entry.get("created", 0.0), "updated": entry.get("updated", 0.0),
                        "last_used": max(entry.get("last_used", 0.0), pending[1]),
                        "hits": int(entry.get("hits", 0)) + pending[0],
                    })
        return rows

    # ---------------------------------------------------------------- the cross-process lock
    @property
    def lock_owner_path(self) -> Path:
        """Beside the lock file: who holds the lock (PID, command, since when); the lock file itself may be
        truncated by a waiting process, so it carries nothing."""
        return Path(str(self.path) + ".lock.owner")

    def lock_holder(self) -> str:
        """'PID 123 (python -m wan_accel bench ...), holding it for 5 s' from the owner file, or a phrase saying
        the holder is unknown."""
        try:
            owner = json.loads(read_regular(self.lock_owner_path).decode("utf-8"), parse_constant=_refuse_constant)
            pid, command, since = int(owner["pid"]), str(owner.get("command", "?"))[:200], owner.get("since")
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return "another process (it did not record itself)"
        held = f", holding it for {time.time() - since:.0f} s" if finite_number(since) else ""
        host = owner.get("host")
        where = f" on {host}" if isinstance(host, str) and host and host != _HOST else ""
        return f"PID {pid}{where} ({command}){held}"

    def _record_owner(self) -> None:
        blob = json.dumps({"pid": os.getpid(), "command": " ".join([sys.executable.rsplit(os.sep, 1)[-1]]
                                                                     + sys.argv)[:300],
                           "host": _HOST, "since": time.time()}).encode("utf-8")
        try:
            _atomic_write(self.lock_owner_path, blob, durable=False)
        except OSError:
            pass  # the owner note is a courtesy to waiting processes

    def _clear_owner(self) -> None:
        try:
            owner = json.loads(read_regular(self.lock_owner_path).decode("utf-8"))
            if isinstance(owner, dict) and owner.get("pid") == os.getpid():
                self.lock_owner_path.unlink()
        except (OSError, ValueError):
            pass

    @contextlib.contextmanager
    def _locked(self):
        """Hold the cross-process lock. A lock another process holds is announced once, naming that process,
        after LOCK_NOTICE_S; the wait goes on up to LOCK_TIMEOUT_S in all (then filelock's Timeout)."""
        lock, total = self._file_lock, float(LOCK_TIMEOUT_S)
        outer = not lock.is_locked
        started = time.monotonic()
        try:
            lock.acquire(timeout=min(LOCK_NOTICE_S, total))
        except Timeout:
            warnings.warn(f"wan_accel: waiting for the limit cache lock {lock.lock_file}: it is held by "
                          f"{self.lock_holder()}; waiting up to {total:g} s", RuntimeWarning, stacklevel=4)
            lock.acquire(timeout=max(0.0, total - (time.monotonic() - started)))
        try:
            if outer:
                self._record_owner()
            yield
        finally:
            if outer:
                self._clear_owner()
            lock.release()

    # ---------------------------------------------------------------- writing
    def _write(self, data: dict) -> None:
        blob = json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("utf-8")
        _atomic_write(self.path, blob)

    def _settle(self, data: dict) -> None:
        """Fold the pending hit counters into ``data``, evict the least recently used entries beyond
        ``max_entries`` per namespace and drop the namespaces and fingerprints left without entries."""
        for (ns, fid, key), (count, last) in self._pending_hits.items():
            entry = data["namespaces"].get(ns, {}).get(fid, {}).get(key)
            if entry is not None:
                entry["hits"] = int(entry.get("hits", 0)) + count
                entry["last_used"] = max(entry.get("last_used", 0.0), last)
        self._pending_hits.clear()
        for ns, by_fp in data["namespaces"].items():
            rows = [(e.get("last_used", 0.0), e.get("updated", 0.0), fid, key)
                    for fid, entries in by_fp.items() for key, e in entries.items()]
            excess = len(rows) - self.max_entries
            if excess <= 0:
                continue
            for _, _, fid, key in sorted(rows)[:excess]:
                del by_fp[fid][key]
        for ns in list(data["namespaces"]):
            by_fp = data["namespaces"][ns]
            for fid in [f for f, e in by_fp.items() if not e]:
                del by_fp[fid]
            if not by_fp:
                del data["namespaces"][ns]
        used = {fid for by_fp in data["namespaces"].values() for fid in by_fp}
        for fid in [f for f in data["fingerprints"] if f not in used]:
            del data["fingerprints"][fid]

    def _mutate(self, change: Callable[[dict], object], strict: bool = False):
        """Apply ``change`` under the cross-process lock and write the file. When the file cannot be written:
        ``strict`` raises CacheUnavailableError; otherwise one warning, and the change is kept in memory."""
        with self._thread_lock:
            applied = None
            try:
                check_writable_place(self.path)
                self._snapshot()  # a file that is not the cache's is refused here, before a lock file is made
                if self._refused:
                    raise CacheUnavailableError(self._refused)
                self.path.parent.mkdir(parents=True, exist_ok=True)  # the lock file lives there too
                with self._locked():
                    data = self._load()
                    if self._refused:
                        raise CacheUnavailableError(self._refused)
                    self._merge_unsaved(data)
                    result = change(data)
                    applied = (data, result)
                    self._settle(data)
                    self._write(data)
                    self._data, self._stamp = data, self._stat_stamp()
                    self._write_error, self._unsaved = None, None
                    return result
            except Timeout:
                raise TimeoutError(f"could not lock the limit cache {self.path} within {LOCK_TIMEOUT_S:g} s; "
                                   f"{self.lock_holder()} holds {self._file_lock.lock_file}") from None
            except CacheUnavailableError as exc:
                error = exc
            except OSError as exc:
                where = exc.filename or self.path.parent
                error = CacheUnavailableError(f"the limit cache {self.path} cannot be written: {where}: "
                                              f"{describe_os_error(exc)}; set WAN_ACCEL_CACHE to a writable folder")
            self._write_error = str(error)
            if strict:
                raise error
            warn_once(self.path, "write", f"wan_accel: {error}. Continuing without saving to the cache (results "
                                          f"are kept in memory for this run).")
            if applied is not None:
                data, result = applied
            else:
                base = self._unsaved if self._unsaved is not None else self._data
                data = copy.deepcopy(base) if base is not None else _empty()
                result = change(data)
            self._settle(data)
            self._unsaved = data
            return result

    def _merge_unsaved(self, data: dict) -> None:
        """Entries this process kept in memory while the file could not be written join the fresh data."""
        if self._unsaved is None:
            return
        data["fingerprints"].update(copy.deepcopy(self._unsaved["fingerprints"]))
        for ns, by_fp in self._unsaved["namespaces"].items():
            for fid, entries in by_fp.items():
                data["namespaces"].setdefault(ns, {}).setdefault(fid, {}).update(copy.deepcopy(entries))

    @property
    def writable_problem(self) -> str | None:
        """Why the cache cannot be written here (without trying a write), or None."""
        try:
            check_writable_place(self.path)
        except CacheUnavailableError as exc:
            return str(exc)
        self._snapshot()
        return self._refused

    @staticmethod
    def _check_names(namespace: str, key) -> str:
        if not isinstance(namespace, str) or not NAMESPACE_RE.match(namespace):
            raise ValueError(f"namespace {namespace!r} must be 1-64 letters, digits, '_', '.' or '-'")
        if not isinstance(key, str) or not key:
            raise ValueError(f"key must be a non-empty string, got {key!r}")
        return key

    def _store(self, data: dict, namespace: str, key: str, value: dict | None) -> dict | None:
        fid = self.fingerprint_id
        entries = data["namespaces"].setdefault(namespace, {}).setdefault(fid, {})
        if value is None:
            entries.pop(key, None)
            return None
        if not isinstance(value, dict):
            raise TypeError(f"limit cache values must be dicts, got {type(value).__name__}")
        _check_json_value(value, f"{namespace}/{key}")
        reason = shape_problem(namespace, value)
        if reason:
            raise ValueError(f"{namespace}/{key}: {reason}; not stored in the limit cache")
        now = time.time()
        old = entries.get(key)
        entries[key] = {
            "value": copy.deepcopy(value),
            "created": old["created"] if old else now,
            "updated": now,
            "last_used": now,
            "hits": old.get("hits", 0) if old else 0,
        }
        data["fingerprints"][fid] = dict(self.fingerprint)
        return copy.deepcopy(value)

    def put(self, namespace: str, key: str, value: dict) -> None:
        """Store ``value`` under ``key`` for this fingerprint; durable on return."""
        key = self._check_names(namespace, key)
        self._mutate(lambda data: self._store(data, namespace, key, value))   # _store checks the value

    def update(self, namespace: str, key: str, fn: Callable[[dict | None], dict | None]) -> dict | None:
        """Read-modify-write under the cross-process lock: ``fn(old or None) -> new`` (None deletes)."""
        key = self._check_names(namespace, key)
        fid = self.fingerprint_id

        def change(data):
            old = data["namespaces"].get(namespace, {}).get(fid, {}).get(key)
            new = fn(copy.deepcopy(old["value"]) if old else None)
            return self._store(data, namespace, key, new)

        return self._mutate(change)

    def clear(self, namespace: str | None = None) -> int:
        """Remove every entry (of every fingerprint) in ``namespace``, or everything; returns the count."""
        if namespace is not None:
            self._check_names(namespace, "-")

        def change(data):
            names = [namespace] if namespace is not None else list(data["namespaces"])
            removed = 0
            for ns in names:
                removed += sum(len(e) for e in data["namespaces"].pop(ns, {}).values())
            return removed

        return int(self._mutate(change, strict=True))

    def prune_stale(self) -> int:
        """Remove entries measured with other software (driver, CUDA, torch, triton) than the current one:
        they can never be read again. Entries of other GPUs with the same software are kept."""
        now = {k: self.fingerprint.get(k) for k in SOFTWARE_FIELDS}

        def change(data):
            stale = {fid for fid, fp in data["fingerprints"].items()
                     if {k: fp.get(k) for k in SOFTWARE_FIELDS} != now}
            known = set(data["fingerprints"])
            removed = 0
            for by_fp in data["namespaces"].values():
                for fid in list(by_fp):
                    if fid in stale or fid not in known:
                        removed += len(by_fp.pop(fid))
            return removed

        return int(self._mutate(change, strict=True))

    def flush(self) -> None:
        """Write pending hit counters (they are otherwise written with the next change or at exit)."""
        if self._pending_hits and self.path.exists():
            self._mutate(lambda data: None)
