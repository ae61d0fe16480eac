"""Small output helpers shared by every command: aligned tables and JSON."""
from __future__ import annotations

import json

from ..cache import json_out


def print_json(obj) -> None:
    """``obj`` on stdout as strict JSON (the pack's one JSON writer: ``cache/json_out.py``)."""
    json_out.print_json(obj, sort_keys=True)


def format_table(rows: list[dict], columns: list[str], headers: list[str] | None = None,
                 max_width: int = 60) -> str:
    """Render rows (dicts) as a plain aligned text table; long cells are shortened with '...'."""
    headers = headers or columns

    def cell(v) -> str:
        s = v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str) if isinstance(v, (dict, list)) else str(v)
        return s if len(s) <= max_width else s[: max_width - 3] + "..."

    body = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(h)] + [len(b[i]) for b in body]) for i, h in enumerate(headers)]
    line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()  # noqa: E731
    out = [line(headers), line(["-" * w for w in widths])] + [line(b) for b in body]
    return "\n".join(out)

