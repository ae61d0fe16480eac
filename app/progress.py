"""What a long command is doing now, one line at a time on stderr: the stage, the variant, the chunk, what is being
timed, and the seconds since the command started. stdout keeps the command's result (its table or JSON) as it is,
so ``--json > out.json`` still gives one JSON document while the terminal shows the progress.

``WAN_ACCEL_QUIET=1`` silences these lines (errors and warnings are still printed). ``format_table``: the aligned
text table of every command and of the doctor."""
from __future__ import annotations

import json
import os
import sys
import time

QUIET_ENV = "WAN_ACCEL_QUIET"


def quiet() -> bool:
    return os.environ.get(QUIET_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


class Progress:
    """``progress = Progress("bench sampler"); progress("optimized: timed run 1/2")`` prints
    ``bench sampler [  3.2 s]: optimized: timed run 1/2`` on stderr (at call time: a redirected stderr is honoured)."""

    def __init__(self, command: str, enabled: bool = True):
        self.command, self.enabled, self.t0 = command, enabled, time.perf_counter()

    def __call__(self, what: str) -> None:
        if not self.enabled or quiet():
            return
        print(f"{self.command} [{time.perf_counter() - self.t0:6.1f} s]: {what}", file=sys.stderr, flush=True)


def format_table(rows: list[dict], columns: list[str], headers: list[str] | None = None,
                 max_width: int = 60) -> str:
    """Render rows (dicts) as a plain aligned text table; long cells are shortened with '...'."""
    headers = headers or columns

    def cell(v) -> str:
        if isinstance(v, (dict, list)):
            s = json.dumps(v, sort_keys=True, default=str)
        else:
            s = v if isinstance(v, str) else str(v)
        return s if len(s) <= max_width else s[: max_width - 3] + "..."

    body = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(h)] + [len(b[i]) for b in body]) for i, h in enumerate(headers)]
    line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()  # noqa: E731
    out = [line(headers), line(["-" * w for w in widths])] + [line(b) for b in body]
    return "\n".join(out)
