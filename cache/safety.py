"""What the limit cache may touch on disk: only its own files, in a folder that is not a system folder.

The cache moves a damaged file aside, creates a lock file and temporary files, and removes temporary files a
killed writer left behind. Each of those goes through :func:`check_writable_place` or :func:`quarantine_refusal`
first, so a cache path that points at a device, a folder, a symlink, somebody else's file or a system folder
is refused with a clear reason and left untouched.
"""
from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

from .paths import FILE_NAME

FILE_KIND = "wan_accel.limit_cache"
# The cache writes sorted keys without spaces, so every file it wrote starts like this.
_OWN_PREFIXES = (b'{"fingerprints":', b'{"kind":"wan_accel.limit_cache"')
# Folders (and everything below them) the cache never writes to, and folders it never writes directly into.
_POSIX_SYSTEM = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/sbin", "/sys",
                 "/usr/bin", "/usr/sbin", "/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/libexec", "/usr/include",
                 "/usr/share", "/var/run", "/var/log", "/var/spool", "/run/lock", "/System", "/private/etc")
_POSIX_SYSTEM_PARENTS = ("/", "/usr", "/usr/local", "/var", "/run", "/home", "/Users", "/private")


class JSONTooDeepError(json.JSONDecodeError):
    """JSON nested deeper than Python's parser can follow (``[[[[...`` from a damaged or hostile file)."""

    def __init__(self):
        ValueError.__init__(self, "nested too deeply to be a file of the pack")
        self.msg, self.doc, self.pos, self.lineno, self.colno = str(self), "", 0, 1, 1


def loads_json(text, **hooks):
    """``json.loads`` for text read from a file or a header somebody else wrote: JSON nested too deeply raises
    :class:`JSONTooDeepError` (a ``json.JSONDecodeError``, so every ``except ValueError`` reader reports the file
    as damaged) instead of a RecursionError that no reader expects."""
    try:
        return json.loads(text, **hooks)
    except RecursionError:
        raise JSONTooDeepError() from None


class CacheUnavailableError(OSError):
    """The limit cache cannot be written where it is configured; the message says where and why."""


_WARNED: set[tuple[str, str]] = set()   # (cache path, topic) already warned about in this process


def warn_once(path, topic: str, message: str, stacklevel: int = 3) -> bool:
    """One RuntimeWarning per (cache path, topic) and process; True when it was issued now. Every feature that
    fails to write beside the cache uses topic 'write', so an unwritable cache gives one warning in all."""
    import warnings

    key = (str(path), topic)
    if key in _WARNED:
        return False
    _WARNED.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)
    return True


def write_problem(path) -> str | None:
    """Why the cache file ``path`` (or its folder) cannot be written, found without writing; None when it can."""
    path = Path(path)
    try:
        check_writable_place(path)
    except CacheUnavailableError as exc:
        return str(exc)
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"the limit cache {path} cannot be written: {folder}: permission denied (or a read-only disk)"
    if path.exists() and not os.access(path, os.W_OK):
        return f"the limit cache {path} cannot be written: the file is read-only"
    return None


def system_folder(path) -> str | None:
    """The system folder ``path`` is in (or is), else None. Symlinks in the folder part are resolved."""
    try:
        p = Path(os.path.normpath(os.path.abspath(str(path))))
    except (OSError, ValueError):
        p = Path(path)
    candidates = {str(p)}
    try:
        candidates.add(os.path.join(os.path.realpath(str(p.parent)), p.name))
    except (OSError, ValueError):
        pass
    for c in candidates:
        if sys.platform == "win32":
            windir = os.environ.get("SystemRoot", r"C:\Windows").lower()
            low = c.lower()
            for root in (windir, os.environ.get("ProgramFiles", r"C:\Program Files").lower()):
                if low == root or low.startswith(root.rstrip("\\") + "\\"):
                    return root
            continue
        for root in _POSIX_SYSTEM:
            if c == root or c.startswith(root + "/"):
                return root
        parent = os.path.dirname(c)
        if parent in _POSIX_SYSTEM_PARENTS:
            return parent
    return None


def file_kind(mode: int) -> str:
    """What a path that is not a regular file is, for a message (``st_mode`` of its ``stat``): the one wording of
    the limit cache, the pack's own files and the user's input files."""
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a pipe (FIFO)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _looks_like_own_content(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            head = fh.read(1 << 20)
    except OSError:
        return False
    if head.lstrip().startswith(_OWN_PREFIXES):
        return True
    try:
        data = loads_json(head.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return False
    return isinstance(data, dict) and data.get("kind") == FILE_KIND


def quarantine_refusal(path) -> str | None:
    """Why the file at ``path`` must not be moved aside, or None when it is the cache's own file.

    Own file: a regular file (not a symlink, a single hard link) outside the system folders, that is named like
    the cache file (``limits.json``) or whose content proves it was written by the cache."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "it does not exist"
    except OSError as exc:
        return f"it cannot be inspected ({exc.strerror or exc})"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link (the file it points to is not the cache's)"
    if not stat.S_ISREG(st.st_mode):
        return f"it is {file_kind(st.st_mode)}, not a cache file"
    root = system_folder(path)
    if root is not None:
        return f"it is in the system folder {root}"
    if st.st_nlink > 1:
        return "it has other hard links (another name of somebody else's file)"
    if path.name != FILE_NAME and not _looks_like_own_content(path):
        return f"it is not named {FILE_NAME} and its content is not a limit cache"
    return None


def check_writable_place(path) -> None:
    """Raise CacheUnavailableError when the cache file ``path`` (and its lock and temporary files) must not be
    written: a system folder, a folder part that is not a directory, a cache path or lock file that is not the
    cache's own regular file."""
    path = Path(path)
    root = system_folder(path)
    if root is not None:
        raise CacheUnavailableError(f"the limit cache {path} is in the system folder {root}; set WAN_ACCEL_CACHE "
                                    f"to a folder of your own")
    for p in [path.parent, *path.parent.parents]:
        try:
            st = os.stat(p)
        except (FileNotFoundError, NotADirectoryError):  # absent, or below a file: the next level up says which
            continue
        except OSError as exc:
            raise CacheUnavailableError(f"the limit cache folder {p} cannot be inspected ({exc.strerror or exc})")
        if not stat.S_ISDIR(st.st_mode):
            raise CacheUnavailableError(f"the limit cache {path} cannot be written: {p} is {file_kind(st.st_mode)} "
                                        f"where a folder is needed")
        break
    for p, what in ((path, "the cache file"), (Path(str(path) + ".lock"), "its lock file")):
        try:
            st = os.lstat(p)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as exc:
            raise CacheUnavailableError(f"{what} {p} cannot be inspected ({exc.strerror or exc})")
        if not stat.S_ISREG(st.st_mode):
            kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else file_kind(st.st_mode)
            raise CacheUnavailableError(f"{what} {p} is {kind}; the limit cache writes only its own regular files")


def describe_os_error(exc: OSError | ValueError) -> str:
    """'permission denied' style text of an OSError (without the repeated path), or a refusal's message."""
    text = getattr(exc, "strerror", None) or str(exc)
    return text[:1].lower() + text[1:] if text else type(exc).__name__
