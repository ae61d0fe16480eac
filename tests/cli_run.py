"""The command line driven from a test: ``run_cli`` runs ``python -m wan_accel ARGV`` in this process (what
``__main__`` runs, without paying a new interpreter and a fresh torch import for every case), and ``refused``
checks the answer to a usage error."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

WORLD_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")   # set by a launcher, not by a test


def run_cli(*argv) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the command line given ``argv`` (each one turned into a string)."""
    from wan_accel.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:          # argparse's own refusals
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def run_cli_in(folder, *argv, env: dict | None = None) -> tuple[int, str, str]:
    """``run_cli`` as a fresh ``python -m wan_accel`` started in ``folder`` would run: relative paths land there,
    the limit cache is ``folder/cache``, no launcher's world variable is set but those of ``env`` (a value of
    None unsets the variable); the working folder and the variables are restored afterwards."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        mp.setenv("WAN_ACCEL_CACHE", str(Path(folder) / "cache"))
        for k in WORLD_VARS:
            mp.delenv(k, raising=False)
        for k, v in (env or {}).items():
            if v is None:
                mp.delenv(k, raising=False)
            else:
                mp.setenv(k, v)
        return run_cli(*argv)


def refused(result, *words, longest: int | None = None) -> str:
    """The ``(code, out, err)`` of a command that exits 2 with one ``error:`` line holding every word, and no
    traceback nor internal error; ``longest``: the line is shorter than that (a long input is never echoed
    whole). The line is returned."""
    code, out, err = result
    assert code == 2, (code, out, err)
    assert "Traceback" not in err and "internal error" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    for w in words:
        assert w in lines[0], lines[0]
    if longest is not None:
        assert len(lines[0]) < longest, lines[0][:300]
    return lines[0]


TRACEBACK = "Traceback (most recent call last)"


def failure_report(result, tail: int = 3000) -> str:
    """What a failed command said that explains it, for an assertion's message: its exit code; every traceback
    and ``error:`` line of stderr in full, wherever it stands in a long output (a tail alone can cut it); then the
    tails of stdout and stderr. ``result``: a CompletedProcess, ``(code, stdout, stderr)``, or the TimeoutExpired
    of a command that did not finish (with what it printed until then)."""
    import subprocess

    def text(value) -> str:
        return value.decode("utf-8", "replace") if isinstance(value, bytes) else (value or "")
    if isinstance(result, subprocess.TimeoutExpired):
        head, out, err = f"did not finish within {result.timeout:g} s (killed)", text(result.output), \
            text(result.stderr)
    elif isinstance(result, subprocess.CompletedProcess):
        head, out, err = f"exit {result.returncode}", text(result.stdout), text(result.stderr)
    else:
        code, out, err = result
        head, out, err = f"exit {code}", text(out), text(err)
    parts = [head]
    start = err.find(TRACEBACK)
    while start >= 0:                       # each traceback up to the line that names the exception
        lines = err[start:].splitlines()
        end = next((i for i, ln in enumerate(lines[1:], 1) if ln and not ln.startswith(" ")), len(lines) - 1)
        parts.append("--- traceback on stderr:\n" + "\n".join(lines[:end + 1])[-4000:])
        start = err.find(TRACEBACK, start + 1)
        if len(parts) > 4:
            break
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    if errors:
        parts.append("--- error lines:\n" + "\n".join(errors[-5:]))
    parts.append(f"--- stdout (last {tail // 2} characters):\n{out[-(tail // 2):]}")
    parts.append(f"--- stderr (last {tail} characters):\n{err[-tail:]}")
    return "\n".join(parts)
