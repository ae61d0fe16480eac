"""The one place where a command's exception becomes one ``error: ...`` line and an exit code.

The pack's own errors (CheckpointError, HeaderError, ActionScriptError, ... all ValueError), missing or
unreadable files, a damaged safetensors file and an unusable limit cache are the user's to fix: exit 2. Errors
of the run itself (out of memory with nothing left to try, a failed explain subprocess, a lock held too long):
exit 1. Anything else is a bug of the pack: one line naming it, exit 1, and the traceback only when
``WAN_ACCEL_DEBUG=1`` is set.
"""
from __future__ import annotations

import errno
import sys
import warnings
from contextlib import contextmanager

from ..profiling.child import DEBUG_ENV, debug

USAGE_EXIT, RUN_EXIT = 2, 1


def _one_line(text: str) -> str:
    lines = [ln.rstrip() for ln in str(text).strip().splitlines() if ln.strip()]
    return "\n  ".join(lines) if lines else ""


_FILE_ERRORS = {FileNotFoundError: "not found", IsADirectoryError: "is a folder, not a file",
                NotADirectoryError: "a part of the path is not a folder", PermissionError: "permission denied"}


_PATH_ERRNOS = (errno.ENAMETOOLONG, errno.ELOOP)


def describe(exc: BaseException) -> tuple[str, int]:
    """(message, exit code) of an exception raised by a command."""
    from safetensors import SafetensorError

    from ..cache.safety import CacheUnavailableError

    if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)):
        what = _FILE_ERRORS.get(type(exc)) or exc.strerror or type(exc).__name__
        return (f"{exc.filename}: {what}" if exc.filename is not None else _one_line(str(exc))), USAGE_EXIT
    if isinstance(exc, UnicodeError):
        return f"a file or value is not valid text ({exc})", USAGE_EXIT
    if isinstance(exc, (ValueError, CacheUnavailableError)):     # the cache's is an OSError, never a file's
        return _one_line(str(exc)), USAGE_EXIT
    if isinstance(exc, SafetensorError):
        return f"not a readable safetensors file ({_one_line(str(exc))})", USAGE_EXIT
    if isinstance(exc, (TimeoutError, RuntimeError)):
        return _one_line(str(exc)), RUN_EXIT
    if isinstance(exc, OSError) and exc.errno in _PATH_ERRNOS:     # a path nobody can open: the user's to fix
        return f"{exc.filename}: {exc.strerror or exc}; give a shorter path or one without a link loop", USAGE_EXIT
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror or exc}", RUN_EXIT
    return (f"internal error {type(exc).__name__}: {_one_line(str(exc))} (set {DEBUG_ENV}=1 to see the "
            f"traceback, and please report it)"), RUN_EXIT


def run_guarded(func, args) -> int:
    """Run ``func(args)``: its exit code, or one ``error:`` line on stderr and the code from :func:`describe`."""
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - this is the one place that turns errors into messages
        if debug():                                     # only 1/true/yes/on: WAN_ACCEL_DEBUG=false keeps it quiet
            raise
        message, code = describe(exc)
        print(f"error: {message}", file=sys.stderr)
        return code


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as one ``warning: ...`` line (no source line, no file position)."""
    print(f"warning: {_one_line(str(message))}", file=file or sys.stderr)


@contextmanager
def clean_warnings():
    """Warnings printed by :func:`show_warning` while a command runs."""
    saved = warnings.showwarning
    warnings.showwarning = show_warning
    try:
        yield
    finally:
        warnings.showwarning = saved


def announce_cache_problem(command: str) -> None:
    """Commands that save to the limit cache as they go: one warning up front when it cannot be written (where
    and why); the features that would fail later stay silent. Nothing is raised."""
    if command not in ("generate", "profile", "bench"):
        return
    try:
        from ..cache import default_cache_path
        from ..cache.safety import warn_once, write_problem

        path = default_cache_path()
        problem = write_problem(path)
        if problem:
            warn_once(path, "write", f"{problem}. Running without saving to the limit cache (measured limits, "
                                     f"compile caches and the metrics history are not kept)")
    except Exception:  # noqa: BLE001 - a check that cannot run must not stop the command
        pass
