"""The one writer of every file the pack writes: reports, histories, previews, latents, saved sessions, traces.

A target is written only when it is a regular file (or absent) outside the system folders, and not one of the
limit cache's own files (the cache file, its lock, its ``corrupt-*`` and ``set-aside`` copies, its temporary
files, the history and compile folders beside it) unless writing that file is the caller's purpose. A symbolic
link, a pipe, a device, a socket or a folder is refused before anything is opened, with a message that names the
option and what to do, so nothing outside the folders the pack owns is ever changed and nothing blocks on a pipe.

Whole files go through a temporary file in the same folder, fsync and ``os.replace``: a write that fails midway
leaves the previous file intact. Appends open with ``O_NOFOLLOW | O_NONBLOCK`` and write only to a regular file.
"""
from __future__ import annotations

import os
import re
import stat
import tempfile
import time
from pathlib import Path
from typing import Callable

from .json_out import to_json
from .paths import default_cache_path
from .safety import file_kind, loads_json, system_folder  # noqa: F401 - loads_json: the files' JSON reader

# Side files of the limit cache, by name beside the cache file (see cache/paths.py and cache/store.py).
SIDE_FILE_NAMES = ("history.jsonl", "history.jsonl.lock")
SIDE_FOLDERS = ("inductor", "compile_artifacts")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


_UMASK = os.umask(0)                      # read (by setting it) and put back at once
os.umask(_UMASK)
_NEW_FILE_MODE = 0o666 & ~_UMASK          # what open() would give a new file


class OwnedFileError(ValueError):
    """A file the pack was asked to write is not one it may write; the message names the option and the fix."""


def _prefix(option: str, path) -> str:
    return f"{option}: {path}" if option else f"{path}"


def _real(path: Path) -> str:
    """Absolute path with the folder part's links resolved and the last part kept as named."""
    try:
        return os.path.join(os.path.realpath(str(path.parent)), path.name)
    except (OSError, ValueError):
        return os.path.normpath(os.path.abspath(str(path)))


def cache_file_role(path, cache_path=None) -> str | None:
    """Which of the limit cache's own files ``path`` is ('the limit cache file', 'its lock file', ...), else None.

    ``cache_path``: the cache file (default: ``$WAN_ACCEL_CACHE`` or the default place)."""
    path = Path(path).expanduser()
    cache = Path(cache_path).expanduser() if cache_path is not None else default_cache_path()
    name, real = cache.name, _real(path)
    folder = os.path.dirname(_real(cache))
    if real == _real(cache):
        return "the limit cache file"
    try:
        if os.path.exists(path) and os.path.exists(cache) and os.path.samefile(path, cache):
            return "the limit cache file (another name of it)"
    except OSError:
        pass
    for sub in SIDE_FOLDERS:
        root = os.path.join(folder, sub)
        if real == root or real.startswith(root + os.sep):
            return f"a file of the limit cache's {sub}/ folder"
    if os.path.dirname(real) != folder:
        return None
    base = os.path.basename(real)
    if base == name + ".lock":
        return "the limit cache's lock file"
    if base == name + ".set-aside.json":
        return "the limit cache's set-aside file"
    if base.startswith(name + ".corrupt-"):
        return "a damaged limit cache moved aside (kept for you to inspect)"
    if base.startswith("." + name + ".") and base.endswith(".tmp"):
        return "a temporary file of the limit cache"
    if base in SIDE_FILE_NAMES:
        return "the metrics history beside the limit cache"
    return None


def check_target(path, *, option: str = "", purpose: str = "the output", cache_path=None,
                 allow: tuple = ()) -> Path:
    """``path`` as a Path when the pack may write ``purpose`` there; else OwnedFileError naming ``option``.
    ``cache_path``: a limit cache file in use besides the default one (``$WAN_ACCEL_CACHE`` or its default place).

    Allowed: an absent name, or an existing regular file, in a folder (or a folder still to be created) outside
    the system folders, that is not one of the limit cache's files (but for a side file whose name is in
    ``allow``: writing that very file is the caller's purpose, e.g. the metrics history). Never opens anything,
    so a pipe cannot block."""
    if path is None or str(path).strip() == "":
        raise OwnedFileError(f"{option or purpose} is empty: give a file name for {purpose}")
    p = Path(str(path)).expanduser()
    where = _prefix(option, p)
    root = system_folder(p)
    if root is not None:
        raise OwnedFileError(f"{where} is in the system folder {root}; write {purpose} to a folder of your own")
    for folder in [p.parent, *p.parent.parents]:
        try:
            st = os.stat(folder)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as exc:
            raise OwnedFileError(f"{where}: the folder {folder} cannot be used ({exc.strerror or exc})") from None
        if not stat.S_ISDIR(st.st_mode):
            raise OwnedFileError(f"{where}: {folder} is {file_kind(st.st_mode)} where a folder is needed; choose "
                                 f"another place for {purpose}")
        if not os.access(folder, os.W_OK | os.X_OK):   # the file (or the folders still to make) cannot be made there
            raise OwnedFileError(f"{where}: the folder {folder} is not writable (permission denied or a read-only "
                                 f"disk); choose a folder you may write for {purpose}")
        break
    try:
        st = os.lstat(p)
    except (FileNotFoundError, NotADirectoryError):
        st = None
    except OSError as exc:
        raise OwnedFileError(f"{where} cannot be inspected ({exc.strerror or exc}); choose another file") from None
    if st is not None:
        if stat.S_ISLNK(st.st_mode):
            raise OwnedFileError(f"{where} is a symbolic link; {purpose} is written only to a regular file, never "
                                 f"through a link: remove the link or choose another file")
        if not stat.S_ISREG(st.st_mode):
            raise OwnedFileError(f"{where} is {file_kind(st.st_mode)}; {purpose} is written only to a regular "
                                 f"file: choose another file")
    caches = [None] if cache_path is None else [cache_path, None]   # the given cache and the default one
    role = next((r for r in (cache_file_role(p, c) for c in caches) if r is not None), None)
    if role is not None and p.name not in allow:
        raise OwnedFileError(f"{where} is {role}; writing {purpose} there would destroy it: choose another file")
    return p


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(str(folder), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


TMP_MARK = "wan_accel"            # temporaries are named .<name>.wan_accel-<pid>-<random>.tmp...: the pack's own
_TMP_NAME = re.compile(r"^\..+\.wan_accel-(\d+)-[A-Za-z0-9_]+\.tmp")
STALE_TMP_SECONDS = 24 * 3600      # a temporary this old is stale even if its pid now names another process
QUIET_TMP_SECONDS = 60             # ... and one of a gone process is removed once untouched this long (a writer
                                   # in another pid namespace keeps its file's mtime fresh while it writes)
LOCK_GRACE_SECONDS = 2.0           # a writer takes its temporary's lock this soon after making it
_HELD: dict = {}                   # temporary path -> the descriptor holding its lock while this process writes it


def _hold(tmp: str, fd: int) -> None:
    """Keep ``fd`` open with an exclusive ``flock`` on the temporary ``tmp`` for as long as this process writes it:
    the lock (kept by the kernel, in every pid namespace, dropped when the process dies however it dies) is how a
    later run tells a live writer from a killed one. Where locks are not supported the descriptor is closed."""
    try:
        import fcntl
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (ImportError, OSError):
        os.close(fd)
        return
    _HELD[tmp] = fd


def release(tmp: str, remove: bool = False) -> None:
    """The temporary ``tmp`` was renamed (or, with ``remove``, is removed now: a write that failed or was given
    up): its lock is let go."""
    if remove:
        try:
            os.unlink(tmp)
        except OSError:
            pass
    fd = _HELD.pop(str(tmp), None)
    if fd is not None:
        os.close(fd)


def _writer_alive(path: str) -> bool | None:
    """Whether a process holds the lock of the temporary ``path`` (True), none does (False: its writer ended, or
    was killed), or this cannot be told here (None: no locks on this system or file system)."""
    try:
        import fcntl
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC)
    except (ImportError, OSError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError, OverflowError, ValueError):
        return True                 # another user's process, or not knowable: kept
    return True


def remove_stale_temporaries(folder) -> None:
    """Remove the temporary files of this writer left in ``folder`` by a process that was killed while writing
    (each write does, before making its own). Those are regular files of this user named
    ``.<name>.wan_accel-<pid>-<random>.tmp...`` whose lock no process holds (every writer locks its temporary while
    it exists: :func:`new_temporary`) and whose pid is gone, or that nothing wrote for a minute; where locks cannot
    be asked, those whose process is gone and that nothing wrote for a minute; and any a day old. Nothing else
    matches: a user's file is never among them."""
    now = time.time()
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        m = _TMP_NAME.match(entry.name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            continue
        age = now - st.st_mtime
        if age > STALE_TMP_SECONDS:
            stale = True
        else:
            alive = _writer_alive(entry.path) if age > LOCK_GRACE_SECONDS else True
            gone = not _pid_alive(int(m.group(1)))
            if alive is None:
                stale = gone and age > QUIET_TMP_SECONDS
            else:                    # unlocked: its writer ended; a live pid is another process that took its number
                stale = not alive and (gone or age > QUIET_TMP_SECONDS)
        if stale:
            try:
                os.unlink(entry.path)
            except OSError:
                pass


def replace_file(path: Path, write: Callable[[str], object], *, durable: bool = True, suffix: str | None = None,
                 before_rename: Callable[[], object] | None = None, tmp: str | None = None) -> Path:
    """The mechanism under every whole-file write of the pack (this module's writers and the limit cache's own
    file): ``write(tmp_name)`` fills a temporary file in the same folder (named ``.<name>.wan_accel-<pid>-*<suffix>``;
    by default ``.tmp`` plus the target's extension, for libraries that pick a format from it; temporaries that a
    killed process left there are removed first: :func:`remove_stale_temporaries`), which is fsynced (when
    ``durable``), given the target's mode, checked by ``before_rename()`` and moved over ``path``; then the folder
    is fsynced. ``tmp``: a temporary of :func:`new_temporary` already filled (a video written over a long time),
    used instead of a new one. A failure leaves the previous file as it was and no temporary file behind."""
    p = Path(path)
    tmp = new_temporary(p, suffix) if tmp is None else tmp
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OwnedFileError(f"{p}: the temporary file {tmp} was replaced by something else while "
                                     f"writing; nothing was written")
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        try:
            old = os.lstat(p)
            mode = stat.S_IMODE(old.st_mode) if stat.S_ISREG(old.st_mode) else _NEW_FILE_MODE
        except OSError:
            mode = _NEW_FILE_MODE
        os.chmod(tmp, mode)
        if before_rename is not None:
            before_rename()
        os.replace(tmp, p)
    except BaseException:
        release(tmp, remove=True)
        raise
    finally:
        release(tmp)
    if durable:
        _fsync_folder(p.parent)
    return p


def new_temporary(path, suffix: str | None = None) -> str:
    """A new empty temporary file beside ``path`` (its folder made), named as this writer's own
    (``.<name>.wan_accel-<pid>-*<suffix>``, by default ``.tmp`` plus the target's extension), after removing the
    temporaries a killed process left there. A file filled over a long time (a video written as its frames are
    decoded) is filled here and handed to :func:`write_with` at the end (its ``tmp``).
    The temporary stays locked (:func:`_hold`) until :func:`release`, so a later run knows it is being written."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(p.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.{TMP_MARK}-{os.getpid()}-",
                               suffix=f".tmp{p.suffix}" if suffix is None else suffix, dir=str(p.parent))
    _hold(tmp, fd)
    return tmp


def write_with(path, write: Callable[[str], object], *, option: str = "", purpose: str = "the output",
               cache_path=None, allow: tuple = (), tmp: str | None = None) -> Path:
    """Write ``path`` atomically (:func:`replace_file`, ``tmp`` as there) after :func:`check_target`, which runs
    again just before the rename: ``write(tmp_name)`` fills the temporary file (for libraries that write to a file
    name: safetensors, PIL, PyAV). A failure leaves the previous file as it was. Returns the path."""
    def check():
        return check_target(path, option=option, purpose=purpose, cache_path=cache_path, allow=allow)
    return replace_file(check(), write, before_rename=check, tmp=tmp)


def write_text(path, text: str, **kw) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (see :func:`write_with`; keywords as :func:`check_target`)."""
    data = text.encode("utf-8")
    return write_with(path, lambda tmp: Path(tmp).write_bytes(data), **kw)


def write_json(path, obj, **kw) -> Path:
    """``obj`` as strict JSON (``json_out.to_json``: non-finite numbers as strings; indented, keys sorted, a final
    newline), written atomically."""
    return write_text(path, to_json(obj, sort_keys=True) + "\n", **kw)


def read_regular(path, limit: int | None = None, refuse: Callable[[os.stat_result], object] | None = None) -> bytes:
    """The bytes of ``path`` when it is a regular file (at most ``limit``); opened without blocking, so a pipe or
    a device put where the pack keeps a file can never hang a read. FileNotFoundError when absent; OSError
    :class:`OwnedFileError` (a ValueError: the user's to fix) when it is not a regular file. ``refuse(st)``: the
    caller's own check instead (raising for a file not to read), given the file's stat before it is opened and the
    opened descriptor's after."""
    def not_regular(st: os.stat_result) -> None:
        if not stat.S_ISREG(st.st_mode):
            raise OwnedFileError(f"{path} is {file_kind(st.st_mode)}; the pack reads only a regular file there: "
                                 f"remove it (the pack makes the file again)")
    refuse = refuse or not_regular
    refuse(os.stat(path))                           # refused before it is opened: opening a device can act or stall
    fd = os.open(path, os.O_RDONLY | _NONBLOCK | _CLOEXEC)
    try:
        refuse(os.fstat(fd))
        with os.fdopen(os.dup(fd), "rb") as fh:
            return fh.read() if limit is None else fh.read(limit)
    finally:
        os.close(fd)


def _last_byte(fd: int, size: int) -> bytes:
    if hasattr(os, "pread"):
        return os.pread(fd, 1, size - 1)
    os.lseek(fd, size - 1, os.SEEK_SET)
    return os.read(fd, 1)


def append_line(path, line, *, option: str = "", purpose: str = "the line", allow: tuple = ()) -> Path:
    """Append one line (str or bytes; a newline is added when missing) as ONE write on an ``O_APPEND``
    descriptor opened without following a link, to a regular file with no other names. A last line left torn
    by a crash is ended first, so the new line stands alone. Returns the path."""
    p = check_target(path, option=option, purpose=purpose, allow=allow)
    data = line.encode("utf-8") if isinstance(line, str) else bytes(line)
    if not data.endswith(b"\n"):
        data += b"\n"
    p.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(p, os.O_RDWR | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _NONBLOCK | _CLOEXEC, 0o666)
    except OSError:
        if _NOFOLLOW and os.path.islink(p):
            raise OwnedFileError(f"{_prefix(option, p)} is a symbolic link; {purpose} is appended only to a "
                                 f"regular file: remove the link") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OwnedFileError(f"{_prefix(option, p)} is {file_kind(st.st_mode)}; {purpose} is appended only to "
                                 f"a regular file: choose another file")
        if st.st_nlink > 1:
            raise OwnedFileError(f"{_prefix(option, p)} has other hard links (another name of a file elsewhere); "
                                 f"{purpose} is appended only to a file of its own")
        if st.st_size and _last_byte(fd, st.st_size) != b"\n":
            data = b"\n" + data
        written = os.write(fd, data)
        if written != len(data):
            raise OSError(f"short write to {p}: {written} of {len(data)} bytes")
        os.fsync(fd)
    finally:
        os.close(fd)
    return p


__all__ = ["OwnedFileError", "check_target", "cache_file_role", "replace_file", "write_with", "write_text", "write_json",
           "append_line", "read_regular"]
