"""The one writer of the pack's JSON output: what every command prints with ``--json`` and every JSON file it
writes (reports, summaries, bench results), so a strict reader (``jq``, ``JSON.parse``) reads all of it.

Python's ``json`` writes a NaN or an infinity as the bare words ``NaN`` / ``Infinity``, which JSON does not have:
a strict reader refuses the whole output for one such number. Here a number that is not finite is written as a
string instead, ``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` (what Python's ``float()`` and JavaScript's
``Number()`` read back), so the field keeps its name and says what it held; everything else is written as
``json.dumps`` would, and the result is always checked with ``allow_nan=False``.

* ``to_json(obj, indent=2, sort_keys=False, default=str)``: the text;
* ``print_json(obj, file=None, **kw)``: the text and a newline on stdout (or ``file``);
* ``finite_json(obj)``: ``obj`` with its non-finite numbers encoded (dicts, lists and tuples walked; no copy of
  anything else); ``null_json(obj, key=None)``: the same walk writing null instead (the metrics history, the web
  panel's answers); ``walk_json(obj, leaf, key=None)``: the walk under both, for the other cleaners (the limit
  cache's set-aside items write the number's text).
"""
from __future__ import annotations

import json
import math
import sys

NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def _encode(x: float) -> str:
    return NON_FINITE[repr(float(x)).lower()]


def walk_json(obj, leaf, key=None):
    """``obj`` with its dicts, lists and tuples copied (tuples as lists, dict keys through ``key`` when given) and
    every other value in them replaced by ``leaf(value)``: the one walk of the pack's JSON cleaners."""
    if isinstance(obj, dict):
        return {k if key is None else key(k): walk_json(v, leaf, key) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [walk_json(v, leaf, key) for v in obj]
    return leaf(obj)


def non_finite_as(value, replacement):
    """``replacement(value)`` for a float that is not finite, else ``value`` itself (a leaf of :func:`walk_json`)."""
    return replacement(value) if isinstance(value, float) and not math.isfinite(value) else value


def finite_json(obj):
    """``obj`` with every float that is not finite written as its string (see the module doc)."""
    return walk_json(obj, lambda v: non_finite_as(v, _encode))


def null_json(obj, key=None):
    """``obj`` with every float that is not finite replaced by None (null); dict keys through ``key`` when given."""
    return walk_json(obj, lambda v: non_finite_as(v, lambda _v: None), key)


def to_json(obj, *, indent: int | None = 2, sort_keys: bool = False, default=str, separators=None) -> str:
    """``obj`` as strict JSON text (non-finite numbers as strings; ``default``: how other objects are written)."""
    def other(o):
        return finite_json(default(o)) if default is not None else o
    return json.dumps(finite_json(obj), indent=indent, sort_keys=sort_keys, default=other if default else None,
                      separators=separators, allow_nan=False)


def print_json(obj, file=None, **kw) -> None:
    """``to_json(obj, **kw)`` and a newline on ``file`` (stdout)."""
    (file or sys.stdout).write(to_json(obj, **kw) + "\n")


__all__ = ["finite_json", "null_json", "walk_json", "non_finite_as", "to_json", "print_json"]
