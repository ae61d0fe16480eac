"""Hard edges, round five (A): no non-finite or substituted result is reported as a success, every input is parsed
and checked once where it is read (on every device), and every JSON the pack prints or writes is strict JSON."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cli_run import refused, run_cli, run_cli_in

FIXTURES = Path(__file__).parent / "fixtures"
KREA = FIXTURES / "krea_realtime"
SMALL = ["--device", "cpu", "--frames", "9", "--height", "32", "--width", "32", "--no-preview"]


def strict_json(text: str):
    """``text`` read as a strict reader (jq, JSON.parse) reads it: the bare words NaN / Infinity are refused."""
    def refuse(word):
        raise AssertionError(f"not JSON: the bare word {word} in the output")
    return json.loads(text, parse_constant=refuse)


# ============================================================================ 4. strict JSON everywhere
def test_the_json_writer_encodes_non_finite_numbers_as_strings():
    from wan_accel.cache.json_out import to_json
    text = to_json({"a": float("nan"), "b": [float("inf"), -float("inf"), 0.5], "c": (1, "NaN"), "d": None})
    assert strict_json(text) == {"a": "NaN", "b": ["Infinity", "-Infinity", 0.5], "c": [1, "NaN"], "d": None}
    assert [float(v) for v in strict_json(text)["b"][:2]] == [float("inf"), -float("inf")]   # read back


def _krea_copy(tmp_path) -> Path:
    (tmp_path / "wan_reference").mkdir(exist_ok=True)
    shutil.copy(FIXTURES / "wan_reference" / "causal_weights.safetensors", tmp_path / "wan_reference")
    folder = tmp_path / "krea_realtime"
    folder.mkdir()
    shutil.copy(KREA / "krea_config.json", folder)
    shutil.copy(KREA / json.loads((KREA / "krea_config.json").read_text())["io_file"], folder)
    return folder


def test_check_reference_json_with_a_nan_row_is_strict_json(tmp_path):
    folder = _krea_copy(tmp_path)
    io = load_file(str(folder / "krea_io.safetensors"))
    io["output"].view(-1)[0] = float("nan")
    save_file({k: v.contiguous() for k, v in io.items()}, str(folder / "krea_io.safetensors"))
    code, out, err = run_cli("check-reference", folder, "--json")
    report = strict_json(out)
    assert code == 1 and report["pass"] is False and report["worst"] == "NaN", err
    assert any(r["max_abs_diff"] == "NaN" and r["ok"] is False for r in report["rows"])


def test_report_json_with_non_finite_figures_is_strict_json(tmp_path):
    history = tmp_path / "history.jsonl"     # written by an older pack, or by hand: NaN and Infinity in it
    history.write_text('{"kind": "bench", "ts": 1.0, "metrics": {"fps": NaN, "peak": Infinity}}\n')
    code, out, err = run_cli("report", "--history", history, "--json")
    assert code == 0, err
    assert strict_json(out)[0]["metrics"] == {"fps": "NaN", "peak": "Infinity"}


def test_json_files_the_pack_writes_are_strict(tmp_path):
    from wan_accel.cache.owned_files import write_json
    path = write_json(tmp_path / "x.json", {"diff": float("nan")})
    assert strict_json(path.read_text()) == {"diff": "NaN"}


def test_no_command_prints_or_writes_json_around_the_writer():
    """Every JSON a command prints (``print(json.dumps(...))``, ``json.dump(..., sys.stdout)``) or writes as a file
    (``write_text(..., json.dumps(...))``) goes through cache/json_out.py. Left alone: a child process's message
    to its parent (a marked line), and checks/selftest.py's file (another change routes it)."""
    import re
    root = Path(__file__).resolve().parent.parent
    printed = re.compile(r"(print|out|write_text|write)\(.*\bjson\.dumps?\(|json\.dump\(.*sys\.std")
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.split("/")[0] in ("tests", "tools", ".venv", "build") or rel == "checks/selftest.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if printed.search(line) and "_MARK +" not in line:
                found.append(f"{rel}:{n}")
    assert found == [], f"JSON printed or written without cache/json_out.py: {found}"
