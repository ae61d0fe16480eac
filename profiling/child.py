"""A function of this pack in a fresh Python interpreter, and how a worker's failure reads in this one.

``child_argv("bench.compile:_child")`` is the command line of a new interpreter that loads this pack from its
folder under the name this process imported it by (``wan_accel`` when installed, editable or not; a ComfyUI
``custom_nodes`` folder of any name), then calls ``module.function(*args)`` with the given string arguments. It
needs no PYTHONPATH and works whatever the folder is called.

``worker_message(summary, details)``: a worker's failure is one line (which worker, the exception type and
message); its traceback is added only when ``WAN_ACCEL_DEBUG=1`` is set.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

DEBUG_ENV = "WAN_ACCEL_DEBUG"
# Not resolved: the pack may sit behind a link whose name is the import name.
PACKAGE_ROOT = Path(os.path.abspath(__file__)).parent.parent

# Run with: root, package name, "module:function", arguments...
BOOT = ("import importlib, importlib.util, os, sys\n"
        "root, name, target = sys.argv[1:4]\n"
        "args = sys.argv[4:]\n"
        "del sys.argv[1:]\n"
        "spec = importlib.util.spec_from_file_location(name, os.path.join(root, '__init__.py'),\n"
        "                                              submodule_search_locations=[root])\n"
        "pack = importlib.util.module_from_spec(spec); sys.modules[name] = pack; spec.loader.exec_module(pack)\n"
        "module, function = target.split(':')\n"
        "getattr(importlib.import_module(name + '.' + module), function)(*args)\n")


def pack_name() -> str:
    """The name this pack was imported under (``wan_accel``, or a ComfyUI custom_nodes folder name)."""
    return __name__.rsplit(".", 2)[0] if __name__.count(".") >= 2 else PACKAGE_ROOT.name


def child_argv(target: str, *args) -> list:
    """The command line that runs ``target`` ('module.path:function', relative to the pack) with ``args`` (as
    strings) in a new interpreter."""
    module, sep, function = target.partition(":")
    if not sep or not module or not function:
        raise ValueError(f"target must look like 'module.path:function', got {target!r}")
    return [sys.executable, "-c", BOOT, str(PACKAGE_ROOT), pack_name(), target, *(str(a) for a in args)]


def run_for_json(argv: list, *, mark: str, what: str, error: type = RuntimeError, env=None, timeout: float = 600.0):
    """The JSON that the child ``argv`` (``child_argv``; its output captured) printed after ``mark`` on a line of its
    stdout. ``error`` where it printed none: ``what``, its exit code and its last error line (the end of its output
    only with ``WAN_ACCEL_DEBUG=1``); TimeoutExpired after ``timeout`` seconds (the child killed)."""
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    for line in proc.stdout.splitlines():
        _, found, data = line.partition(mark)
        if found:
            return json.loads(data)
    tail = ((proc.stdout or "") + (proc.stderr or ""))[-4000:]
    raise error(worker_message(f"{what} (exit code {proc.returncode}): {last_error(proc.stderr)}", tail))


DEBUG_TRUE = ("1", "true", "yes", "on", "y", "t")


def debug() -> bool:
    """Whether ``WAN_ACCEL_DEBUG`` asks for whole tracebacks: only a truthy value (1, true, yes, on; any case)
    does; false, off, no, 0, empty or anything else does not. The one reading of the variable."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() in DEBUG_TRUE


def one_line(exc: BaseException | str) -> str:
    """``Type: message`` of an exception (or a text) on one line."""
    text = f"{type(exc).__name__}: {exc}" if isinstance(exc, BaseException) else str(exc)
    return " ".join(text.split())


def last_error(output: str) -> str:
    """The failure a child printed: the last line of its output that is not indented (after a traceback, its
    ``Type: message`` line)."""
    lines = [ln.strip() for ln in (output or "").splitlines() if ln.strip() and not ln.startswith((" ", "\t"))]
    return lines[-1] if lines else "no output"


def worker_message(summary: str, details: str | None = None) -> str:
    """A worker's failure for the user: ``summary`` on one line, then ``details`` (its traceback, the end of its
    output) only when ``WAN_ACCEL_DEBUG=1``."""
    line = one_line(summary)
    if details and details.strip() and debug():
        return f"{line}\n{details.rstrip()}"
    return line
