"""Small output helpers shared by every command: aligned tables and JSON."""
from __future__ import annotations

from ..app.progress import format_table  # noqa: F401 - re-exported: the commands' tables
from ..cache import json_out


def print_json(obj) -> None:
    """``obj`` on stdout as strict JSON (the pack's one JSON writer: ``cache/json_out.py``)."""
    json_out.print_json(obj, sort_keys=True)
