"""``python -m wan_accel cache show|path|clear|prune-stale|set-aside``."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from ..cache import KNOWN_NAMESPACES, LimitCache, count_entries, default_cache_path
from ..cache.safety import CacheUnavailableError, write_problem
from ..app.validate import UsageError
from ..app.progress import format_table
from ..cache.json_out import print_json


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if t else "-"


def check_namespace(cache, namespace):
    """A namespace the pack uses or the file holds; else UsageError listing them."""
    if namespace is None:
        return None
    present = {r["namespace"] for r in cache.entries(None, all_fingerprints=True)}
    valid = sorted(set(KNOWN_NAMESPACES) | present)
    if namespace not in valid:
        raise UsageError(f"--namespace {namespace!r} is not a namespace of the limit cache; use one of "
                         f"{', '.join(valid)} (or leave --namespace out for all)")
    return namespace


def _print_notices(cache) -> list[str]:
    notes = cache.notices()
    warned = [Path(q["moved_to"]).name for q in cache.quarantined]  # this run's warning named them already
    if cache.set_aside_announced:
        warned.append(str(cache.set_aside_path))
    for note in notes:
        if not any(name in note for name in warned):
            print(f"warning: {note}", file=sys.stderr)
    return notes


def _show(args) -> int:
    cache = LimitCache()
    check_namespace(cache, args.namespace)
    rows = cache.entries(args.namespace, all_fingerprints=args.all)
    notes = _print_notices(cache)
    if args.json:
        print_json({"path": str(cache.path), "fingerprint": cache.fingerprint,
                    "fingerprint_id": cache.fingerprint_id, "entries": rows, "notices": notes,
                    "set_aside": {"path": str(cache.set_aside_path), "items": cache.set_aside()}}, sort_keys=True)
        return 0
    fp = cache.fingerprint
    print(f"limit cache: {cache.path}")
    print(f"this machine: {fp['gpu']} ({fp['device']}, capability {fp['capability']}), torch {fp['torch']}, "
          f"triton {fp['triton']}, CUDA {fp['cuda']}, driver {fp['driver']}  [{cache.fingerprint_id}]")
    if not rows:
        scope = f"namespace '{args.namespace}'" if args.namespace else "any namespace"
        print(f"no entries in {scope}" + ("" if args.all else " for this machine (use --all for every machine)"))
        return 0
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["namespace"]] = counts.get(r["namespace"], 0) + 1
    print("entries: " + ", ".join(f"{ns} {n}" for ns, n in sorted(counts.items())))
    table = [dict(r, updated=_when(r["updated"])) for r in rows]
    cols = ["namespace", "key", "hits", "updated", "value"] + (["fingerprint"] if args.all else [])
    print(format_table(table, cols))
    return 0


def _set_aside(args) -> int:
    cache = LimitCache()
    items = cache.set_aside()
    problem = cache.set_aside_problem()
    if problem:                 # a damaged or over-large side file is not "no entries"
        raise UsageError(problem)
    if args.json:
        print_json({"path": str(cache.set_aside_path), "count": len(items), "items": items}, sort_keys=True)
        return 0
    if not items:
        print(f"no entries set aside (they would be kept in {cache.set_aside_path})")
        return 0
    print(f"{count_entries(len(items))} set aside in {cache.set_aside_path} (never used; delete the file when "
          f"you no longer need them):")
    table = [{"namespace": i.get("namespace") or "-", "key": i.get("key") or "-",
              "fingerprint": i.get("fingerprint") or "-", "when": _when(i.get("time") or 0),
              "reason": i.get("reason"), "entry": i.get("entry")} for i in items]
    print(format_table(table, ["namespace", "key", "fingerprint", "when", "reason", "entry"]))
    return 0


def _path(args) -> int:
    print(default_cache_path())
    return 0


def _remove(args, prune: bool) -> int:
    """clear (one namespace or all) and prune-stale: the entries removed, counted."""
    cache = LimitCache()
    namespace = None if prune else check_namespace(cache, args.namespace)
    problem = write_problem(cache.path)     # a cache that cannot be written: the one error (no warning before it)
    if problem:
        raise CacheUnavailableError(problem)
    _print_notices(cache)
    n = cache.prune_stale() if prune else cache.clear(namespace)
    if args.json:
        print_json({"removed": n} if prune else {"removed": n, "namespace": namespace}, sort_keys=True)
    else:
        scope = f"namespace '{namespace}'" if namespace else "every namespace"
        print(f"removed {count_entries(n)} " + ("measured with other driver/CUDA/torch/triton versions" if prune
                                                 else f"from {scope}"))
    return 0


def register(sub) -> None:
    p = sub.add_parser("cache", help="inspect or clear the limit cache",
                       description="The limit cache: one JSON file of measured limits shared by every feature.")
    csub = p.add_subparsers(dest="cache_command", metavar="ACTION", required=True)

    s = csub.add_parser("show", help="list the entries measured on this machine")
    s.add_argument("--namespace", "-n", help="only this namespace (operator, compile, memory, sampler, ...)")
    s.add_argument("--all", action="store_true", help="include entries measured on other machines / software")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=_show)

    s = csub.add_parser("set-aside", help="list the entries set aside because they could not be used",
                        description="Entries of the cache that could not be used (a wrong type, a number that is "
                                    "not finite) are set aside alone into <cache>.set-aside.json; this lists them.")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=_set_aside)

    s = csub.add_parser("path", help="print where the cache file lives")
    s.set_defaults(func=_path)

    s = csub.add_parser("clear", help="remove entries (every machine's) from one namespace or all")
    s.add_argument("--namespace", "-n", help="only this namespace")
    s.add_argument("--json", action="store_true", help="print the number of removed entries as JSON")
    s.set_defaults(func=lambda args: _remove(args, prune=False))

    s = csub.add_parser("prune-stale", help="remove entries measured with other driver/CUDA/torch/triton versions")
    s.add_argument("--json", action="store_true", help="print the number of removed entries as JSON")
    s.set_defaults(func=lambda args: _remove(args, prune=True))
