"""The limit cache file's shape: strict reading entry by entry, the per-namespace shapes, set-aside items.

The file as a whole is a limit cache or not (:class:`CacheFormatError`: not an object, wrong kind or schema,
'fingerprints'/'namespaces' not objects); below that, each entry is judged alone (:func:`entry_problem`: the
common fields, no non-finite number anywhere, its namespace's registered shape) and a bad one is set aside with its
reason while every valid entry stays in use. ``loads_lenient`` reads NaN/Infinity/1e999 as markers so the entries
holding them can be found; nothing non-finite is ever written back.
"""
from __future__ import annotations

import json
import math
import re
import time
from typing import Callable

from .json_out import non_finite_as, walk_json
from .safety import FILE_KIND, loads_json

SCHEMA_VERSION = 1
NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


class CacheFormatError(ValueError):
    """The file on disk is not a limit cache this version can read."""


# namespace -> check(value) for the entries of that namespace (see register_shape)
_SHAPES: dict[str, Callable[[dict], object]] = {}
_SHAPES_GEN = [0]   # bumped by register_shape: a cache read before re-validates


def register_shape(namespace: str, check: Callable[[dict], object]) -> None:
    """Register the shape of the values stored under ``namespace``.

    ``check(value)`` receives an entry's ``value`` (already known to be a JSON object holding only finite
    numbers) and either raises ``ValueError``/``TypeError`` with the reason, or returns a reason string when the
    value is unusable; it returns None (or anything falsy) when the value is fine. The store checks the common
    entry fields itself (``created``/``updated``/``last_used`` finite numbers, ``hits`` a non-negative integer,
    ``value`` an object). An entry whose value fails its namespace's check is set aside alone (kept in
    ``<cache>.set-aside.json`` with the reason) and never returned by ``get``; every other entry stays in use.
    Registering again replaces the previous check. Call it at import time of the module that writes the
    namespace (cache/ may not import upper floors, so the upper floor registers)."""
    if not isinstance(namespace, str) or not NAMESPACE_RE.match(namespace):
        raise ValueError(f"namespace {namespace!r} must be 1-64 letters, digits, '_', '.' or '-'")
    if not callable(check):
        raise TypeError(f"register_shape({namespace!r}, ...): check must be callable")
    _SHAPES[namespace] = check
    _SHAPES_GEN[0] += 1


def _empty() -> dict:
    return {"kind": FILE_KIND, "schema": SCHEMA_VERSION, "fingerprints": {}, "namespaces": {}}


def _check_json_value(value, where: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: non-finite float {value!r} cannot be stored in the limit cache; store None or a string")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: dict keys must be strings, got {type(k).__name__}")
            _check_json_value(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_json_value(v, f"{where}[{i}]")
    elif not (value is None or isinstance(value, (str, int, float, bool))):
        raise ValueError(f"{where}: {type(value).__name__} is not JSON-serialisable")


class _Unusable:
    """A number the strict format refuses (NaN, Infinity, 1e999, an integer too long to read), found by the
    lenient parse; ``text`` is how the file spelled it. An entry holding one is set aside."""
    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


class Lenient:
    """json.loads hooks that turn every number strict JSON refuses into an :class:`_Unusable` marker and count
    them, so a file without one (the usual case) is known to be finite without a second pass."""

    def __init__(self):
        self.unusable = 0

    def mark(self, text: str) -> _Unusable:
        self.unusable += 1
        return _Unusable(text[:40] + ("..." if len(text) > 40 else ""))

    def parse_float(self, text: str):
        value = float(text)
        return value if math.isfinite(value) else self.mark(text)   # 1e999 reads as inf

    def parse_int(self, text: str):
        try:
            return int(text)
        except ValueError:  # longer than Python reads by default
            return self.mark(text)


def loads_lenient(text: str, hooks: Lenient):
    """json.loads that reads NaN, Infinity, -Infinity, a number beyond float range (1e999) and an integer too
    long to read as :class:`_Unusable` markers, so the entries holding them can be found and set aside one by
    one; ``hooks.unusable`` counts them."""
    try:
        return loads_json(text, parse_constant=hooks.mark, parse_float=hooks.parse_float)
    except json.JSONDecodeError:
        raise
    except ValueError:  # an integer longer than Python reads by default: read again, marking it
        hooks.unusable = 0
        return loads_json(text, parse_constant=hooks.mark, parse_float=hooks.parse_float,
                          parse_int=hooks.parse_int)


def _unusable_in(value, where: str = "") -> str | None:
    """'non-finite number NaN at value.size' for the first unusable number inside ``value``, else None."""
    stack = [(value, where)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, _Unusable):
            return f"non-finite number {item.text} at {at or 'the top'}"
        if isinstance(item, float) and not math.isfinite(item):
            return f"non-finite number {item!r} at {at or 'the top'}"
        if isinstance(item, dict):
            stack.extend((v, f"{at}.{k}" if at else str(k)) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(item))
    return None


def _plain(value):
    """``value`` with unusable numbers written as their text, so it can be stored as strict JSON."""
    return walk_json(value, lambda v: v.text if isinstance(v, _Unusable) else non_finite_as(v, repr), str)


def finite_number(value) -> bool:
    """A finite int or float (not a bool): the one test of a stored number."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def entry_problem(namespace: str, entry, numbers_checked: bool = False) -> str | None:
    """Why a stored entry cannot be used (common fields, unusable numbers, its namespace's shape), else None.
    ``numbers_checked``: the caller knows the entry holds no unusable number."""
    if not isinstance(entry, dict):
        return f"the entry is a JSON {type(entry).__name__}, not an object"
    bad = None if numbers_checked else _unusable_in(entry)
    if bad:
        return bad
    if not isinstance(entry.get("value"), dict):
        return "'value' is missing or not an object"
    for field in ("created", "updated", "last_used"):
        v = entry.get(field, 0)
        if type(v) not in (int, float) or not (numbers_checked or math.isfinite(v)):
            return f"{field!r} is {v!r:.60}, not a number"
    hits = entry.get("hits", 0)
    if type(hits) is not int or hits < 0:
        return f"'hits' is {hits!r}, not a non-negative integer"
    return shape_problem(namespace, entry["value"])


def shape_problem(namespace: str, value: dict) -> str | None:
    """The reason the namespace's registered check (see register_shape) gives for ``value``, else None."""
    check = _SHAPES.get(namespace)
    if check is None:
        return None
    try:
        reason = check(value)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        return str(exc) or type(exc).__name__
    return str(reason) if reason else None


def _set_aside_item(namespace, fid, key, raw, reason: str) -> dict:
    try:
        raw = _plain(raw)
    except RecursionError:
        raw = "(nested too deeply to keep)"
    return {"namespace": namespace, "fingerprint": fid, "key": key, "entry": raw, "reason": reason,
            "time": time.time()}


def _validate(data, finite: bool) -> tuple[dict, list[dict]]:
    """Schema-current data and the items set aside from it; CacheFormatError when the file as a whole is not a
    limit cache (not an object, wrong kind or schema, 'fingerprints'/'namespaces' not objects). ``finite``: the
    lenient parse found no unusable number (``Lenient.unusable``), so no entry is searched for one.

    Damage below that level costs only the damaged part: an entry with wrong types or an unusable number, a
    fingerprint record that is not an object, a namespace or fingerprint group that is not an object is removed
    from use and returned as a set-aside item (namespace, fingerprint, key, the raw entry, the reason)."""
    if not isinstance(data, dict):
        raise CacheFormatError(f"top level is a JSON {type(data).__name__}, expected an object")
    if data.get("kind") != FILE_KIND:
        raise CacheFormatError(f"'kind' is {data.get('kind')!r}, expected {FILE_KIND!r}")
    version = data.get("schema")
    if not isinstance(version, int) or isinstance(version, bool):
        raise CacheFormatError(f"'schema' is {version!r}, expected an integer")
    if version > SCHEMA_VERSION:
        raise CacheFormatError(f"schema {version} is newer than this version of the pack understands ({SCHEMA_VERSION})")
    if version < SCHEMA_VERSION:    # schema 1 is the first: no older file was ever written
        raise CacheFormatError(f"schema {version} is too old to migrate (current {SCHEMA_VERSION})")
    fps, spaces = data.get("fingerprints"), data.get("namespaces")
    if not isinstance(fps, dict) or not isinstance(spaces, dict):
        raise CacheFormatError("'fingerprints' and 'namespaces' must be objects")
    aside: list[dict] = []
    for name in [k for k in data if k not in ("kind", "schema", "fingerprints", "namespaces")]:
        bad = None if finite else _unusable_in(data[name])
        if bad:
            aside.append(_set_aside_item(None, None, name, data.pop(name), f"top-level field {name!r}: {bad}"))
    for fid in list(fps):
        record = fps[fid]
        reason = (f"the fingerprint record is a JSON {type(record).__name__}, not an object"
                  if not isinstance(record, dict) else None if finite else _unusable_in(record))
        if reason:
            aside.append(_set_aside_item(None, fid, None, fps.pop(fid), f"fingerprint {fid}: {reason}"))
    for ns in list(spaces):
        by_fp = spaces[ns]
        if not isinstance(by_fp, dict):
            aside.append(_set_aside_item(ns, None, None, spaces.pop(ns),
                                         f"namespace {ns!r} is a JSON {type(by_fp).__name__}, not an object"))
            continue
        for fid in list(by_fp):
            entries = by_fp[fid]
            if not isinstance(entries, dict):
                aside.append(_set_aside_item(ns, fid, None, by_fp.pop(fid), f"the entries of fingerprint {fid} "
                                             f"are a JSON {type(entries).__name__}, not an object"))
                continue
            for key in list(entries):
                try:
                    reason = entry_problem(ns, entries[key], numbers_checked=finite)
                except RecursionError:
                    reason = "nested too deeply"
                if reason:
                    aside.append(_set_aside_item(ns, fid, key, entries.pop(key), reason))
    return data, aside


def _refuse_constant(text: str):
    raise ValueError(f"non-finite number {text}")
