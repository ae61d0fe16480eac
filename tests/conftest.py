"""Shared test setup: every test gets its own limit cache file, never the user's."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))      # test helpers (kv_reference, ...)


@pytest.fixture(autouse=True)
def _isolated_limit_cache(tmp_path, monkeypatch):
    path = tmp_path / "wan_accel_cache" / "limits.json"
    monkeypatch.setenv("WAN_ACCEL_CACHE", str(path))
    return path


@pytest.fixture
def cache_path(_isolated_limit_cache) -> Path:
    return _isolated_limit_cache
