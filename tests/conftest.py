"""Shared test setup: every test gets its own limit cache file, never the user's."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))      # test helpers (kv_reference, ...)


def _real_comfyui_defaults() -> None:
    """Point tests/e2e (and the native bench / self-test tests) at the ComfyUI that tools/setup_comfyui.sh set up,
    unless COMFYUI_DIR / COMFYUI_VENV already name one or WAN_ACCEL_E2E=0. Done here, before any test module reads
    the variables at import."""
    import os

    if os.environ.get("WAN_ACCEL_E2E") == "0":
        for name in ("COMFYUI_DIR", "COMFYUI_VENV"):
            os.environ.pop(name, None)
        return
    home = Path(os.environ.get("WAN_ACCEL_E2E_HOME")
                or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "wan-accel-e2e")
    if os.environ.get("COMFYUI_DIR"):
        return
    if not (home / "ready").is_file():
        if os.environ.get("CI") == "true":       # CI runs tests/e2e, never skips them: the set-up must have run
            raise pytest.UsageError(f"CI=true but no ComfyUI is set up in {home}: run tools/setup_comfyui.sh first "
                                    f"(or set COMFYUI_DIR and COMFYUI_VENV, or WAN_ACCEL_E2E=0)")
        return
    os.environ["COMFYUI_DIR"] = str(home / "ComfyUI")
    os.environ["COMFYUI_VENV"] = str(home / "venv")
    frontends = sorted(str(p) for p in home.glob("frontend-*/comfyui_frontend_package/static") if p.is_dir())
    if frontends and "WAN_ACCEL_E2E_FRONTENDS" not in os.environ:
        os.environ["WAN_ACCEL_E2E_FRONTENDS"] = os.pathsep.join(frontends)


def pytest_configure(config):
    _real_comfyui_defaults()          # before any test module is collected (they read the variables at import)


@pytest.fixture(autouse=True)
def _isolated_limit_cache(tmp_path, monkeypatch):
    path = tmp_path / "wan_accel_cache" / "limits.json"
    monkeypatch.setenv("WAN_ACCEL_CACHE", str(path))
    return path


@pytest.fixture(autouse=True)
def _no_memory_caps(monkeypatch):
    """Each test starts without the memory variables (a run's cap, set by ``apply_vram_cap`` in one test, would
    shrink every later plan), and whatever a test sets is undone after it."""
    for name in ("WAN_ACCEL_VRAM_CAP_GB", "WAN_ACCEL_MEMORY_LIMIT_GB"):
        monkeypatch.setenv(name, "1")       # recorded as it was, so the teardown restores it (absent included)
        monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def _fresh_cache_warnings():
    """Each test starts like a new process: the limit cache's warn-once registry is empty."""
    from wan_accel.cache import safety

    safety._WARNED.clear()
    yield
    safety._WARNED.clear()


@pytest.fixture
def cache_path(_isolated_limit_cache) -> Path:
    return _isolated_limit_cache


_SYSTEM_PREFIXES = ("/dev/", "/etc/", "/usr/", "/bin/", "/sbin/", "/lib/", "/lib64/", "/boot/", "/proc/", "/sys/")


@pytest.fixture(autouse=True)
def _never_touch_system_folders(monkeypatch):
    """A safety net for the machine running the tests: renaming, replacing or creating a file in a system folder
    is refused (PermissionError) and fails the test, so a broken fix can never damage /dev/null or /etc."""
    import os

    attempts: list[str] = []

    def _system(path) -> bool:
        try:
            p = os.path.abspath(os.fsdecode(path))
        except (TypeError, ValueError):
            return False
        return p.startswith(_SYSTEM_PREFIXES)

    def guard(name, real):
        def call(src, dst, *a, **k):
            for p in (src, dst):
                if _system(p):
                    attempts.append(f"{name}({src!r}, {dst!r})")
                    raise PermissionError(13, "refused by the test safety net", os.fsdecode(p))
            return real(src, dst, *a, **k)
        return call

    real_open = os.open

    def guarded_open(path, flags, *a, **k):
        if flags & os.O_CREAT and isinstance(path, (str, bytes, os.PathLike)) and _system(path):
            p = os.fsdecode(path)
            if not os.path.exists(p):
                attempts.append(f"os.open({p!r}, O_CREAT)")
                raise PermissionError(13, "refused by the test safety net", p)
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "replace", guard("os.replace", os.replace))
    monkeypatch.setattr(os, "rename", guard("os.rename", os.rename))
    monkeypatch.setattr(os, "open", guarded_open)
    yield attempts
    assert not attempts, f"the test tried to change a system folder: {attempts}"


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` need a CUDA GPU: skipped without one (CI), run by ``python -m wan_accel selftest``."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (python -m wan_accel selftest runs it on a GPU)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
