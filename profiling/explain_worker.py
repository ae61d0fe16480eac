"""Worker: runs ``torch._dynamo.explain`` on a target in a fresh process and prints its JSON after RESULT_MARK.

Started through ``child_argv`` so it works whatever name the pack was imported under::

    child_argv("profiling.explain_worker:run", "pkg.module:factory", KWARGS_JSON, *SYS_PATH_DIRS)

The target is a factory (called with the kwargs JSON as keyword arguments) returning ``(fn, args)``,
``(fn, args, kwargs)`` or a dict with keys fn/args/kwargs (and optionally ``inference_mode: True``);
``fn(*args, **kwargs)`` is what gets explained. explain resets dynamo, which is
harmless here: this process holds nothing else. Imports nothing else from the pack by itself.
"""
from __future__ import annotations

import importlib
import json
import sys
import traceback

RESULT_MARK = "WAN_ACCEL_EXPLAIN_RESULT "


def _load(target: str):       # 'package.module:factory': explain_in_subprocess checked the colon already
    mod_name, attr = target.split(":", 1)
    obj = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _unpack(spec):
    if isinstance(spec, dict):
        return spec["fn"], tuple(spec.get("args", ())), dict(spec.get("kwargs", {}))
    if isinstance(spec, (tuple, list)) and len(spec) in (2, 3):
        return spec[0], tuple(spec[1]), (dict(spec[2]) if len(spec) == 3 else {})
    raise TypeError("the target factory must return (fn, args), (fn, args, kwargs) or {'fn', 'args', 'kwargs'}")


def _frame(fs) -> str:
    return f"{getattr(fs, 'filename', '?')}:{getattr(fs, 'lineno', '?')} in {getattr(fs, 'name', '?')}"


class TargetNotLoaded(Exception):
    """The target's module or factory cannot be loaded: the caller named something that is not there."""


def explain_target(target: str, kwargs: dict) -> dict:
    import torch

    try:
        factory = _load(target)
    except Exception as exc:  # noqa: BLE001 - whatever stops the import, the target is not usable
        raise TargetNotLoaded(f"{type(exc).__name__}: {exc}") from exc
    spec = factory(**kwargs)
    fn, args, call_kwargs = _unpack(spec)
    inference = isinstance(spec, dict) and bool(spec.get("inference_mode"))
    with torch.inference_mode(inference):
        out = torch._dynamo.explain(fn)(*args, **call_kwargs)
    breaks = []
    for br in getattr(out, "break_reasons", []) or []:
        stack = [_frame(fs) for fs in (getattr(br, "user_stack", None) or [])]
        breaks.append({"reason": str(getattr(br, "reason", br)), "location": stack[-1] if stack else "",
                       "user_stack": stack})
    ops = getattr(out, "ops_per_graph", None) or []
    return {"ok": True, "target": target, "torch_version": torch.__version__,
            "graph_count": int(getattr(out, "graph_count", 0)),
            "graph_break_count": int(getattr(out, "graph_break_count", len(breaks))),
            "op_count": int(getattr(out, "op_count", 0)),
            "ops_per_graph": [len(g) for g in ops], "break_reasons": breaks}


def run(target: str, kwargs: str = "{}", *sys_path: str) -> None:
    """Explain ``target`` with the ``kwargs`` JSON, ``sys_path`` folders first, and print the result after
    RESULT_MARK (on a line of its own, whatever the target printed)."""
    for entry in reversed(sys_path):
        sys.path.insert(0, entry)
    try:
        result = explain_target(target, json.loads(kwargs))
    except BaseException as exc:  # noqa: BLE001 - report any failure to the parent as data
        loading = isinstance(exc, TargetNotLoaded)
        result = {"ok": False, "target": target, "stage": "load" if loading else "run",
                  "error": str(exc) if loading else f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()[-4000:]}
    print("\n" + RESULT_MARK + json.dumps(result), flush=True)
