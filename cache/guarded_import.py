"""The one door through which the pack imports a module it does not own and can run without (FlashAttention 3
builds, xformers, the kernel hub, ComfyUI's modules for ``bench native`` and the doctor's native probe).

An outside module may do anything while it is imported: raise, print, or call ``sys.exit`` (a ComfyUI module that
parses the command line, an FA3 build that checks its GPU). :func:`guarded_import` turns all of it, every
exception short of ``KeyboardInterrupt``, into an :class:`ImportProblem` that says which module failed and how
(the exception's type and message), and tells a module that is absent from one that is installed but broken, so
no message advises installing what is installed. Pure Python; imports nothing of the pack.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys


class ImportProblem(ImportError):
    """An outside module that did not import: ``module``, ``installed`` (found on the path, but failed) and
    ``reason`` (the failure in one line)."""

    def __init__(self, module: str, installed: bool, reason: str):
        self.module, self.installed, self.reason = module, installed, reason
        super().__init__(f"{module} is installed but does not import ({reason})" if installed
                         else f"{module} is not installed ({reason})")


def first_line(exc: BaseException) -> str:
    """``Type: the first line of its message`` of an exception, at most 300 characters (an OOM, an import that
    failed or called ``sys.exit``)."""
    if isinstance(exc, SystemExit):
        return f"SystemExit: it called sys.exit({exc.code!r}) while being imported"
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else '(no message)'}"[:300]


def installed(module: str) -> bool:
    """Whether ``module`` is found on the path, without running it (a parent package may run, guarded)."""
    try:
        return importlib.util.find_spec(module) is not None
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - a parent package that fails to import: present, and broken
        return True


def guarded_import(module: str, package: str | None = None):
    """The module ``module`` (relative to ``package`` when it starts with a dot), imported once; ImportProblem
    for anything it raised while being imported (``SystemExit`` included; ``KeyboardInterrupt`` goes through)."""
    try:
        return importlib.import_module(module, package)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - an outside module may exit or raise anything while imported
        name = importlib.util.resolve_name(module, package) if module.startswith(".") else module
        absent = isinstance(exc, ModuleNotFoundError) and exc.name is not None and \
            (name == exc.name or name.startswith(exc.name + "."))
        if absent:
            raise ImportProblem(exc.name, False, first_line(exc)) from None
        sys.modules.pop(name, None)          # a half-run module is not left behind as if it had imported
        raise ImportProblem(_failed_part(name), True, first_line(exc)) from None


def _failed_part(name: str) -> str:
    """The package of ``name`` whose import failed: the first of ``a``, ``a.b``, ``a.b.c`` that is not imported
    (Python imports the parents first and drops a module that raised)."""
    parts = name.split(".")
    return next((p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if p not in sys.modules), name)


def try_import(module: str, package: str | None = None) -> tuple:
    """(module, None) or (None, the ImportProblem): :func:`guarded_import` for callers that go on without it."""
    try:
        return guarded_import(module, package), None
    except ImportProblem as problem:
        return None, problem
