"""The doctor's table (command, node, web panel) and its bug-report file.

A row per feature: available, verified, difference, speed against the fallback, why it is off and what to
install or change. The report holds the machine fingerprint, the rows, library versions and the last errors:
nothing beyond what ``doctor`` prints (no paths, user or host names; the table prints the versions too).
"""
from __future__ import annotations

import time

from ...cache.owned_files import write_json
from ..progress import format_table
from .core import Doctor, library_version
from .ops import implementation_text, implementations
from .versions import STACK, known_breaks, stack_text, versions

COLUMNS = ["feature", "available", "verified", "difference", "speed", "why_off", "fix"]
HEADERS = ["feature", "available", "verified", "difference", "speed vs fallback", "why off", "to turn it on"]


def _ms(v) -> str:
    return "-" if v is None else f"{v:.3f} ms"


def _speed(value: dict) -> str:
    f, b = value.get("feature_ms"), value.get("fallback_ms")
    if f is None or b is None:
        return "-"
    ratio = f"speed-up x{b / f:.2f}" if f > 0 else "-"
    shape = f" at {value['shape']}" if value.get("shape") else ""
    judged = (f" (judged{shape})" if value.get("speed_judged", True) else
              f" (timed{shape}; not judged: speed is decided at the run's shapes)")
    return f"{_ms(f)} vs {_ms(b)} ({ratio}){judged}"


def _difference(value: dict) -> str:
    d, t = value.get("difference"), value.get("tolerance")
    if d is None:
        return "-"
    return f"{d:.2g} (tol {t:.2g})" if t is not None else f"{d:.2g}"


def feature_row(doctor: Doctor, name: str, probe: bool = True, recheck: bool = False) -> dict:
    """One row of the table; ``probe=False`` only reads recorded verdicts (the web panel's listing)."""
    feature = doctor.catalogue.get(name)
    reason, hint = doctor.unavailable(name)
    row = {"feature": name, "summary": feature.summary if feature else "", "available": reason is None,
           "verified": "-", "status": "unavailable" if reason else "not checked", "difference": "-", "speed": "-",
           "why_off": reason or "", "fix": hint, "library": library_version(feature) if feature else "none",
           "verdict": None}
    if reason is not None:
        return row
    value = doctor.check(name, recheck=recheck) if probe else doctor.stored(name)
    if value is None:
        row["verified"] = "not checked yet" if not probe else "not checked (a capture or compile is running)"
        return row
    status = value["status"]
    row.update(status=status, verified=status, difference=_difference(value), speed=_speed(value),
               verdict=value)
    if status != "passed":
        row["why_off"] = value.get("error") or status
        row["fix"] = (f"switched off here ({feature.switches_off}); update the driver / torch / "
                      f"{'the library' if feature.library else 'the pack'} and re-check")
    elif value.get("note"):
        row["fix"] = value["note"]
    return row


def doctor_rows(doctor: Doctor, names=None, probe: bool = True, recheck: bool = False) -> list[dict]:
    return [feature_row(doctor, n, probe=probe, recheck=recheck) for n in (names or list(doctor.catalogue))]


def machine_line(doctor: Doctor) -> str:
    fp = doctor.cache.fingerprint
    ctx = doctor.context
    mem = int(fp.get("total_memory") or 0)
    gib = f", {mem / 2**30:.0f} GiB" if mem else ""
    return (f"machine: {fp.get('gpu')} ({fp.get('device')}, capability {fp.get('capability')}{gib}), driver "
            f"{fp.get('driver')}, CUDA {fp.get('cuda')}, torch {fp.get('torch')}, triton {fp.get('triton')}; "
            f"probes: {str(ctx.dtype).replace('torch.', '')}, head size {ctx.head_dim}, {ctx.tokens} tokens")


def format_rows(rows: list[dict], max_width: int = 70) -> str:
    def cell(v):
        return ("yes" if v else "no") if isinstance(v, bool) else v
    return format_table([{c: cell(r.get(c, "")) for c in COLUMNS} for r in rows], COLUMNS, HEADERS, max_width)


def doctor_text(doctor: Doctor, rows: list[dict]) -> str:
    off = [r["feature"] for r in rows if r["status"] in ("failed", "slower")]
    tail = (f"switched off on this machine: {', '.join(off)}" if off else
            "no feature is switched off on this machine")
    soft = ", ".join(f"{k} {v}" for k, v in versions().items() if k not in STACK)    # the stack: its own line
    ops = implementation_text(implementations(doctor))
    return f"{machine_line(doctor)}\nversions: {soft}\n{stack_text()}\n\n{format_rows(rows)}\n\n{tail}\n\n{ops}"


def report(doctor: Doctor, rows: list[dict]) -> dict:
    """The bug-report content: fingerprint, verdict rows, versions, the last errors (no paths, no user names)."""
    errors = [{"feature": r["feature"], "error": r["verdict"].get("error"), "checked": r["verdict"].get("checked")}
              for r in rows if r.get("verdict") and r["verdict"].get("error")]
    errors.sort(key=lambda e: -(e["checked"] or 0))
    ctx = doctor.context
    return {"kind": "wan_accel.doctor_report", "schema": 1, "written": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                                    time.gmtime()),
            "fingerprint": dict(doctor.cache.fingerprint), "fingerprint_id": doctor.cache.fingerprint_id,
            "probe": {"device": ctx.device.type, "dtype": str(ctx.dtype).replace("torch.", ""),
                      "head_dim": ctx.head_dim, "heads": ctx.heads, "tokens": ctx.tokens},
            "versions": versions(), "known_breaks": known_breaks(), "features": [{k: r[k] for k in COLUMNS + ["status", "library", "verdict"]}
                                                 for r in rows],
            "last_errors": errors[:20]}


REPORT_PURPOSE = "the doctor's bug report"


def write_report(path, doctor: Doctor, rows: list[dict], option: str = "") -> dict:
    """The bug report written to ``path`` through the pack's one writer (cache/owned_files.py): never over the
    limit cache or its side files, a link, a pipe, a device or a folder (OwnedFileError naming ``option``)."""
    data = report(doctor, rows)
    write_json(path, data, option=option, purpose=REPORT_PURPOSE, cache_path=getattr(doctor.cache, "path", None))
    return data
