"""The limit cache touches only its own files, and an unwritable cache never stops a command or a feature."""
from __future__ import annotations

import json
import os
import stat
import warnings
from pathlib import Path

import pytest

from wan_accel.cache import LimitCache, default_cache_path
from wan_accel.cache.safety import (CacheUnavailableError, check_writable_place, quarantine_refusal,
                                    system_folder, write_problem)
from wan_accel.cli import main

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def _snapshot(path: Path):
    st = os.lstat(path)
    return (st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns)


def _within_seconds(fn, fifo=None, seconds=10.0):
    import threading

    done = threading.Event()
    thread = threading.Thread(target=lambda: (fn(), done.set()), daemon=True)
    thread.start()
    if not done.wait(seconds) and fifo is not None:
        with open(fifo, "wb"):  # let the blocked reader go
            pass
        thread.join(5)
        pytest.fail(f"reading the cache at {fifo} blocked")


# ------------------------------------------------------------------ quarantine refuses what is not the cache's
def test_device_is_never_quarantined():
    before = _snapshot(Path("/dev/null"))
    c = LimitCache("/dev/null")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert c.get("operator", "k") is None
        c.put("operator", "k", {"v": 1})          # kept in memory, never written over the device
    assert c.get("operator", "k") == {"v": 1}
    assert _snapshot(Path("/dev/null")) == before and stat.S_ISCHR(os.lstat("/dev/null").st_mode)
    assert not list(Path("/dev").glob("null.*"))
    text = " ".join(str(w.message) for w in rec)
    assert "/dev/null" in text and "system folder /dev" in text
    with pytest.raises(CacheUnavailableError, match="system folder /dev"):
        c.clear()


def test_env_var_naming_a_device_or_system_folder_changes_nothing(monkeypatch, capsys):
    monkeypatch.setenv("WAN_ACCEL_CACHE", "/dev/null")
    before = _snapshot(Path("/dev/null"))
    assert main(["cache", "show"]) == 0
    assert main(["cache", "clear"]) == 2
    err = capsys.readouterr().err
    assert "system folder /dev" in err and "WAN_ACCEL_CACHE" in err and "Traceback" not in err
    assert _snapshot(Path("/dev/null")) == before
    assert not list(Path("/dev").glob("null.*")) and not Path("/dev/limits.json").exists()


@pytest.mark.parametrize("kind", ["directory", "symlink", "foreign-json", "hardlink", "fifo"])
def test_foreign_files_are_left_untouched(tmp_path, kind):
    folder = tmp_path / "c"
    folder.mkdir()
    victim = tmp_path / "users_file.txt"
    victim.write_bytes(b"my notes, not JSON")
    if kind == "directory":
        path = folder / "limits.json"
        path.mkdir()
        (path / "keep").write_text("x")
    elif kind == "symlink":
        path = folder / "limits.json"
        path.symlink_to(victim)
    elif kind == "foreign-json":
        path = folder / "settings.json"       # a .json the user pointed the cache at: not the cache's name
        path.write_bytes(b"{broken user config")
        victim = path
    elif kind == "hardlink":
        path = folder / "limits.json"
        os.link(victim, path)
    else:
        path = folder / "limits.json"
        os.mkfifo(path)
    before = sorted((str(p), _snapshot(p)) for p in tmp_path.rglob("*"))
    victim_bytes = victim.read_bytes() if victim.is_file() else None
    c = LimitCache(path)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _within_seconds(lambda: c.get("memory", "k"), path if kind == "fifo" else None)  # a pipe never blocks
        assert c.get("memory", "k") is None
        c.put("memory", "k", {"v": 2})
    assert c.get("memory", "k") == {"v": 2}
    with pytest.raises(CacheUnavailableError):
        c.clear()
    after = sorted((str(p), _snapshot(p)) for p in tmp_path.rglob("*"))
    assert after == before                                      # nothing moved, created, changed
    if victim_bytes is not None:
        assert victim.read_bytes() == victim_bytes
    assert not list(folder.glob("*.corrupt-*"))
    assert any(str(path) in str(w.message) for w in rec)


def test_own_damaged_file_is_still_quarantined(cache_path):
    cache_path.parent.mkdir(parents=True)
    cache_path.write_bytes(b'{"fingerprints":{"x": tru')            # what a cut-off write of the cache looks like
    assert quarantine_refusal(cache_path) is None
    other = cache_path.with_name("my_cache.json")
    other.write_bytes(b'{"fingerprints":{"x": tru')
    assert quarantine_refusal(other) is None                        # its content proves it is a cache file
    other.write_bytes(b'{"theme": "dark"')
    assert "not a limit cache" in quarantine_refusal(other)


def test_system_folders():
    assert system_folder("/dev/null") == "/dev"
    assert system_folder("/etc/wan/limits.json") == "/etc"
    assert system_folder("/limits.json") == "/"
    assert system_folder("/usr/bin/x") == "/usr/bin"
    assert system_folder(Path.home() / ".cache" / "wan_accel" / "limits.json") is None
    with pytest.raises(CacheUnavailableError, match="system folder"):
        check_writable_place("/etc/limits.json")


def test_lock_file_symlink_is_refused(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    path = tmp_path / "c" / "limits.json"
    path.parent.mkdir()
    Path(str(path) + ".lock").symlink_to(victim)
    with pytest.warns(RuntimeWarning, match="lock file"):
        LimitCache(path).put("memory", "k", {"v": 1})
    assert victim.read_bytes() == b"precious" and not path.exists()


# ------------------------------------------------------------------ unwritable caches
def _deny_writes(monkeypatch):
    import tempfile

    def deny(*a, **k):
        raise PermissionError(13, "Permission denied", k.get("dir") or "cache folder")

    monkeypatch.setattr(tempfile, "mkstemp", deny)


def test_unwritable_cache_features_continue_with_one_warning(cache_path, monkeypatch):
    _deny_writes(monkeypatch)
    c = LimitCache(cache_path)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        c.put("memory", "a", {"v": 1})
        c.put("memory", "b", {"v": 2})
        c.update("memory", "a", lambda old: {"v": old["v"] + 1})
    assert c.get("memory", "a") == {"v": 2} and c.get("memory", "b") == {"v": 2}
    msgs = [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and str(cache_path) in msgs[0] and "ermission denied" in msgs[0]
    with pytest.raises(CacheUnavailableError, match="cannot be written"):
        c.clear()


@pytest.mark.parametrize("command", [["cache", "clear"], ["cache", "prune-stale"], ["cache", "clear", "-n", "memory"]])
def test_cache_commands_on_an_unwritable_cache_fail_cleanly(cache_path, monkeypatch, capsys, command):
    _deny_writes(monkeypatch)
    assert main(command) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(cache_path) in err and "Traceback" not in err


@pytest.mark.skipif(IS_ROOT, reason="permission bits do not bind root")
def test_read_only_cache_folder_real_permissions(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        monkeypatch.setenv("WAN_ACCEL_CACHE", str(folder))
        assert main(["cache", "clear"]) == 2
        assert "cannot be written" in capsys.readouterr().err
    finally:
        folder.chmod(0o700)


def test_inductor_folder_on_an_unwritable_cache_falls_back(tmp_path, monkeypatch):
    from wan_accel.compile.warm_start import ENV_INDUCTOR, ensure_inductor_cache_dir

    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.delenv(ENV_INDUCTOR, raising=False)
    cache = LimitCache(blocker / "limits.json")
    with pytest.warns(RuntimeWarning, match="Inductor"):
        folder, set_here = ensure_inductor_cache_dir(cache)
    assert not set_here and not os.environ.get(ENV_INDUCTOR, "").startswith(str(blocker))
    assert blocker.read_text().startswith("a file")


def test_generate_runs_on_an_unwritable_cache_with_one_warning(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "notafolder"
    blocker.write_text("x")
    monkeypatch.setenv("WAN_ACCEL_CACHE", str(blocker / "cache"))
    out = tmp_path / "out"
    assert main(["generate", "--out", str(out), "--frames", "9", "--height", "32", "--width", "32",
                 "--no-preview"]) == 0
    err = capsys.readouterr().err
    warnings_ = [ln for ln in err.splitlines() if ln.startswith("warning:")]
    assert len(warnings_) == 1 and str(blocker) in warnings_[0], err
    assert (out / "latents.safetensors").is_file() and blocker.read_text() == "x"


# ------------------------------------------------------------------ WAN_ACCEL_CACHE names a folder
def test_env_var_names_a_folder_even_before_it_exists(tmp_path, monkeypatch):
    target = tmp_path / "new" / "cachedir"
    monkeypatch.setenv("WAN_ACCEL_CACHE", str(target))
    assert default_cache_path() == target / "limits.json"
    from wan_accel.profiling import history

    LimitCache().put("memory", "k", {"v": 1})
    history.append(history.make_record("bench", label="x"))
    assert sorted(p.name for p in target.iterdir()) == ["history.jsonl", "history.jsonl.lock", "limits.json",
                                                        "limits.json.lock"]
    assert sorted(p.name for p in target.parent.iterdir()) == ["cachedir"]
    monkeypatch.setenv("WAN_ACCEL_CACHE", str(tmp_path / "x" / "mine.json"))
    assert default_cache_path() == tmp_path / "x" / "mine.json"


# ------------------------------------------------------------------ a reset is never silent
def test_quarantine_is_shown_in_the_cli_node_and_panel(cache_path, capsys):
    from wan_accel.nodes.cache_nodes import WanAccelLimitCache
    from wan_accel.server_routes import limits_payload

    cache_path.parent.mkdir(parents=True)
    cache_path.write_bytes(b"\x00garbage")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        LimitCache(cache_path).get("memory", "k")                  # an earlier process moved it aside
    moved = next(cache_path.parent.glob("limits.json.corrupt-*")).name
    assert main(["cache", "show"]) == 0
    assert moved in capsys.readouterr().err
    text = WanAccelLimitCache().run()["result"][0]
    assert "WARNING" in text and moved in text
    payload = limits_payload()
    assert any(moved in n for n in payload["notices"])
    assert main(["cache", "show", "--json"]) == 0
    assert any(moved in n for n in json.loads(capsys.readouterr().out)["notices"])
