"""Metrics history: atomic appends across processes, corrupt lines, the report table and the PNG plot."""
from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import wan_accel
from wan_accel.cli import main
from wan_accel.profiling import history
from wan_accel.profiling.history_view import PlotUnavailable, plot_history, speed_metric, table_rows

# The folder the package was imported from (kept unresolved: it may be a link named wan_accel).
PACKAGE_PARENT = str(Path(wan_accel.__file__).parent.parent)

# Lines (20 KB) larger than a write buffer: a writer without one-write-per-line atomicity interleaves.
WRITER = """
import sys
from wan_accel.profiling.history import append
path, worker, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for i in range(count):
    append({"kind": "bench", "fingerprint": "test", "label": f"w{worker}",
            "settings": {"worker": worker, "i": i, "pad": "x" * 20000},
            "timings": {"total_s": 0.5 + i}}, path=path)
"""


def _record(i, **kw):
    rec = {"kind": "generate", "fingerprint": "fp", "label": f"run{i}", "settings": {"frames": 21 + i},
           "timings": {"total_s": 10.0 - i, "frames_per_s": 2.0 + i}, "peak_memory_bytes": (i + 1) * 2**30,
           "cache_hits": i}
    rec.update(kw)
    return rec


def test_append_then_read_round_trip(tmp_path):
    path = tmp_path / "h.jsonl"
    written = history.append(_record(0), path=path)
    assert isinstance(written["timestamp"], float) and written["fingerprint"] == "fp"
    history.append(_record(1, kind="profile", timings={"total_s": float("nan")}), path=path)
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(line) for line in lines)
    recs = history.read(path)
    assert [r["label"] for r in recs] == ["run0", "run1"]
    assert recs[1]["timings"]["total_s"] is None  # NaN is not JSON: stored as null
    assert [r["label"] for r in history.read(path, kind="profile")] == ["run1"]
    assert [r["label"] for r in history.read(path, last=1)] == ["run1"]


def test_default_location_follows_the_limit_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("WAN_ACCEL_CACHE", str(tmp_path / "elsewhere" / "limits.json"))
    assert history.history_path() == tmp_path / "elsewhere" / "history.jsonl"
    history.append(_record(0, fingerprint=None))
    rec = history.read()[0]
    assert (tmp_path / "elsewhere" / "history.jsonl").exists()
    assert isinstance(rec["fingerprint"], str) and len(rec["fingerprint"]) == 16  # filled from the cache


def test_bad_records_are_refused(tmp_path):
    with pytest.raises(ValueError, match="kind must be one of"):
        history.append({"kind": "other"}, path=tmp_path / "h.jsonl")
    with pytest.raises(TypeError, match="not JSON-serialisable"):
        history.append({"kind": "bench", "fingerprint": "x", "settings": {"obj": object()}}, path=tmp_path / "h.jsonl")
    assert not (tmp_path / "h.jsonl").exists() or history.read(tmp_path / "h.jsonl") == []


def test_concurrent_appends_from_several_processes(tmp_path):
    path = tmp_path / "shared" / "history.jsonl"
    workers, count = 4, 40
    env = {"PYTHONPATH": PACKAGE_PARENT, "PATH": "", "WAN_ACCEL_CACHE": str(tmp_path / "c")}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(w), str(count)], env=env,
                              stderr=subprocess.PIPE) for w in range(workers)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()[-2000:]
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b""  # ends with a newline
    records = [json.loads(line) for line in lines[:-1]]  # every line is valid JSON
    assert len(records) == workers * count
    seen = {(r["settings"]["worker"], r["settings"]["i"]) for r in records}
    assert seen == {(w, i) for w in range(workers) for i in range(count)}
    for w in range(workers):  # each writer's lines stay in its own order
        own = [r["settings"]["i"] for r in records if r["settings"]["worker"] == w]
        assert own == list(range(count))


def test_corrupt_lines_are_skipped_with_one_warning(tmp_path):
    path = tmp_path / "h.jsonl"
    history.append(_record(0), path=path)
    with open(path, "ab") as fh:
        fh.write(b"{not json at all\n")
        fh.write(b"[1, 2]\n")                                 # valid JSON, but not a record
        fh.write(b'{"kind": "bench", "timings": {"total_')   # torn write, no newline
    with pytest.warns(history.HistoryWarning, match=r"skipped 3 corrupt line\(s\) \(line 2, 3, 4\)") as rec:
        recs = history.read(path)
    assert len([w for w in rec if issubclass(w.category, history.HistoryWarning)]) == 1
    assert [r["label"] for r in recs] == ["run0"]
    # the next append starts on a fresh line, so the torn line does not swallow it
    history.append(_record(1), path=path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", history.HistoryWarning)
        assert [r["label"] for r in history.read(path)] == ["run0", "run1"]


def test_report_command_prints_table_and_json(tmp_path, capsys):
    path = tmp_path / "h.jsonl"
    for i in range(3):
        history.append(_record(i), path=path)
    assert main(["report", "--history", str(path), "--plain"]) == 0
    out = capsys.readouterr().out
    assert "run0" in out and "run2" in out and "frames/s" in out and "3 record(s)" in out
    assert "3.00 GiB" in out  # peak memory of run2
    assert main(["report", "--history", str(path), "--json", "--last", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["label"] for r in data] == ["run1", "run2"]
    assert main(["report", "--history", str(tmp_path / "none.jsonl")]) == 0
    assert "no runs recorded yet" in capsys.readouterr().out


def test_table_rows_and_speed_metric():
    recs = [_record(0), {"kind": "bench", "timings": {"steps_per_s": 3.0}}]
    assert speed_metric(recs) == "frames_per_s"
    rows = table_rows(recs)
    assert rows[0]["speed"] == "2.000 frames/s" and rows[1]["speed"] == ""
    assert speed_metric([{"kind": "bench", "timings": {"total_s": 1.0}}]) is None


def test_report_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib (the 'plot' extra) is not installed")
    path = tmp_path / "h.jsonl"
    for i in range(4):
        history.append(_record(i, kind="bench" if i % 2 else "generate"), path=path)
    out_png = tmp_path / "plots" / "history.png"
    assert main(["report", "--history", str(path), "--plain", "--plot", str(out_png)]) == 0
    data = out_png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert f"wrote {out_png}" in capsys.readouterr().out


def test_plot_without_matplotlib_says_what_to_install(tmp_path, monkeypatch, capsys):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(PlotUnavailable, match="pip install matplotlib"):
        plot_history([_record(0)], tmp_path / "x.png")
    path = tmp_path / "h.jsonl"
    history.append(_record(0), path=path)
    assert main(["report", "--history", str(path), "--plain", "--plot", str(tmp_path / "x.png")]) == 1
    assert "matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
