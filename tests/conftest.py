"""Shared test setup: every test gets its own limit cache file, never the user's."""
from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(autouse=True)
def _isolated_limit_cache(tmp_path, monkeypatch):
    path = tmp_path / "wan_accel_cache" / "limits.json"
    monkeypatch.setenv("WAN_ACCEL_CACHE", str(path))
    return path


@pytest.fixture
def cache_path(_isolated_limit_cache) -> Path:
    return _isolated_limit_cache
