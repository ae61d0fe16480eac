"""`python -m wan_accel check-reference` on the LongLive and Krea Realtime fixtures: every recorded tensor gets a
row on both sampler paths, the folders pass on a CPU in float32, and a damaged fixture fails on exactly the rows of
the tensor that was damaged."""
import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from wan_accel.app.jobs.reference import FORMATS, TOLERANCE, survey
from wan_accel.cli import main as cli_main

FIXTURES = Path(__file__).parent / "fixtures"
LONGLIVE = FIXTURES / "longlive"
KREA = FIXTURES / "krea_realtime"
PATHS = ("reference", "optimized")


def _check(folder, capsys, *extra):
    rc = cli_main(["check-reference", str(folder), *extra])
    return rc, capsys.readouterr().out


def _rows(folder, capsys):
    rc, out = _check(folder, capsys, "--json")
    report = json.loads(out)
    return rc, {r["tensor"]: r["max_abs_diff"] for r in report["rows"]}, report


def _passing_rows(folder, capsys) -> dict:
    """The text report of a folder that passes: exit 0, a last line that says PASS, no FAIL; {row name: verdict}."""
    rc, out = _check(folder, capsys)
    assert rc == 0, out
    lines = out.splitlines()
    assert lines[-1].endswith("PASS") and "FAIL" not in out
    return {line.split()[0]: line.split()[-1] for line in lines[1:-1]}


def _copy(fixture: Path, tmp_path: Path) -> Path:
    """A copy of the fixture folder beside a copy of the base weights it names by relative path."""
    (tmp_path / "wan_reference").mkdir()
    shutil.copy(FIXTURES / "wan_reference" / "causal_weights.safetensors", tmp_path / "wan_reference")
    return Path(shutil.copytree(fixture, tmp_path / fixture.name))


def _perturb(folder: Path, io_name: str, key: str) -> None:
    """Move one element of one recorded tensor by 100 x the tolerance (the parity runs land near 1e-6)."""
    path = folder / io_name
    io = load_file(str(path))
    io[key] = io[key].clone()
    io[key].view(-1)[io[key].numel() // 2] += 100 * TOLERANCE
    save_file(io, str(path))


def _keep_variants(folder: Path, *names) -> dict:
    path = folder / "longlive_config.json"
    cfg = json.loads(path.read_text())
    cfg["variants"] = {n: cfg["variants"][n] for n in names}
    path.write_text(json.dumps(cfg))
    return cfg


def test_both_folders_are_recognised():
    assert {"longlive", "krea_realtime"} <= set(FORMATS)
    assert [name for name, _, _ in survey(LONGLIVE)[0]] == ["longlive"]
    found = [(name, path.name) for name, path, _ in survey(KREA)[0]]      # every Krea case of the folder runs
    assert found == [("krea_realtime", "krea_config.json"), ("krea_realtime", "krea_interrupted_config.json"),
                     ("krea_realtime", "krea_partial_block_config.json")]


def test_longlive_folder_passes(capsys):
    cfg = json.loads((LONGLIVE / "longlive_config.json").read_text())
    rows = _passing_rows(LONGLIVE, capsys)
    for variant, v in cfg["variants"].items():
        for path in PATHS:
            for part in ("latents", "calls") + (("x0_steps",) if not v["lora"] else ()):
                assert rows[f"longlive/{path}.{variant}.{part}"] == "ok", (variant, path, part)
        assert rows[f"longlive/{variant}.denoising_step_list"] == "ok"
    lora = [name for name, v in cfg["variants"].items() if v["lora"]]
    assert lora and all(f"longlive/{p}.{lora[0]}.merged.latents" in rows for p in PATHS)
    assert rows["longlive/base_weights_sha256"] == "ok"


def test_krea_folder_passes(capsys):
    cfg = json.loads((KREA / "krea_config.json").read_text())
    rows = _passing_rows(KREA, capsys)
    s = cfg["session"]
    for path in PATHS:
        assert rows[f"krea/{path}.output"] == rows[f"krea/{path}.calls"] == "ok"
        for b in range(s["num_blocks"]):
            for k in range(s["num_denoising_steps"]):
                assert rows[f"krea/{path}.block{b}.step{k}.x0"] == "ok"
        assert sum(n.startswith(f"krea/{path}.reencode_input.") for n in rows) >= 1
    assert all(rows[f"krea/block{b}.prompt_embeds"] == "ok" for b in range(s["num_blocks"]))
    assert rows["krea/denoising_step_list"] == "ok"


def test_damaged_longlive_fixture_fails_on_its_rows(tmp_path, capsys):
    folder = _copy(LONGLIVE, tmp_path)
    _keep_variants(folder, "w9s3", "w12s3")                 # the LoRA runs add nothing to this check
    _perturb(folder, "longlive_io.safetensors", "w12s3.latents")
    rc, rows, report = _rows(folder, capsys)
    assert rc == 1 and report["pass"] is False
    failed = {n for n, d in rows.items() if d > TOLERANCE}
    assert failed == {f"longlive/{p}.w12s3.latents" for p in PATHS}
    for p in PATHS:
        assert rows[f"longlive/{p}.w12s3.latents"] == pytest.approx(100 * TOLERANCE, abs=TOLERANCE)


def test_damaged_longlive_switch_frames_move_the_video(tmp_path, capsys):
    """A config number is what the run follows: a switch moved by one chunk changes the video after it."""
    folder = _copy(LONGLIVE, tmp_path)
    keep = "w9s3"
    cfg = _keep_variants(folder, keep)
    cfg["variants"][keep]["switch_frame_indices"][0] += cfg["frames_per_block"]
    (folder / "longlive_config.json").write_text(json.dumps(cfg))
    rc, rows, _ = _rows(folder, capsys)
    assert rc == 1
    for p in PATHS:
        assert rows[f"longlive/{p}.{keep}.latents"] > 100 * TOLERANCE


def test_damaged_krea_fixture_fails_on_its_rows(tmp_path, capsys):
    folder = _copy(KREA, tmp_path)
    _perturb(folder, "krea_io.safetensors", "block4.step2.x0")
    rc, rows, report = _rows(folder, capsys)
    assert rc == 1 and report["pass"] is False
    failed = {n for n, d in rows.items() if d > TOLERANCE}
    assert failed == {f"krea/{p}.block4.step2.x0" for p in PATHS}
