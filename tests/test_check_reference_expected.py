"""Issue 43, class 1 and 2 for the Matrix-Game-2 and LongLive fixture formats: every tensor the fixture's config
implies is expected (one missing from the io file is a failing row naming it), a recorded NaN or inf fails its row,
an input tensor of NaN or inf is refused naming the file and key, and the io file goes through the checkpoints'
header check before it is loaded."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from wan_accel.app.jobs import reference as R
from wan_accel.app.jobs.reference import check_reference

FIXTURES = Path(__file__).parent / "fixtures"


def _edit_io(folder: Path, name: str, edit) -> None:
    io = load_file(str(folder / name))
    edit(io)
    save_file({k: v.contiguous() for k, v in io.items()}, str(folder / name))


def _poison(io: dict, key: str, value: float) -> None:
    io[key] = io[key].clone()
    io[key].view(-1)[0] = value


def _failed(rows) -> dict:
    return {r[0].split("/", 1)[1]: r for r in rows if not R.row_ok(r[1])}


@pytest.mark.parametrize("removed", ["chunk2.step1.flow", "inter.call12.block0.proj_mouse",
                                     "mouse_kv_final.layer0.k", "scheduler.sigmas", "output"])
def test_mg2_a_removed_tensor_and_a_nan_fail_their_rows(removed, tmp_path):
    folder = Path(shutil.copytree(FIXTURES / "matrix_game2", tmp_path / "matrix_game2"))

    def edit(io):
        io.pop(removed)
        _poison(io, "inter.call0.img_emb", float("nan"))
    _edit_io(folder, "mg2_io.safetensors", edit)
    rows = check_reference(folder)
    failed = _failed(rows)
    assert set(failed) == {removed, "inter.call0.img_emb"}, sorted(failed)
    assert "missing from mg2_io.safetensors" in failed[removed].note
    assert "mg2_io.safetensors" in failed["inter.call0.img_emb"].note
    v = R.verdict(rows)
    assert v["pass"] is False and math.isnan(v["worst"])


def test_mg2_an_inf_in_an_input_is_refused_naming_file_and_key(tmp_path):
    folder = Path(shutil.copytree(FIXTURES / "matrix_game2", tmp_path / "matrix_game2"))
    _edit_io(folder, "mg2_io.safetensors", lambda io: _poison(io, "extra_noise.chunk1.step0", float("inf")))
    rows = check_reference(folder)
    assert [r[0] for r in rows] == ["mg2/fixture"] and not R.row_ok(rows[0][1])
    assert "mg2_io.safetensors" in rows[0].note and "'extra_noise.chunk1.step0'" in rows[0].note


def test_mg2_an_inf_in_a_recorded_tensor_is_a_failing_row_naming_it(tmp_path):
    folder = Path(shutil.copytree(FIXTURES / "matrix_game2", tmp_path / "matrix_game2"))
    _edit_io(folder, "mg2_io.safetensors", lambda io: _poison(io, "kv_final.layer1.v", float("inf")))
    failed = _failed(check_reference(folder))
    assert list(failed) == ["kv_final.layer1.v"]


def test_an_io_file_whose_header_claims_more_than_it_holds_is_refused_by_name(tmp_path):
    folder = Path(shutil.copytree(FIXTURES / "matrix_game2", tmp_path / "matrix_game2"))
    data = bytearray((folder / "mg2_io.safetensors").read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    key = next(k for k in header if k != "__metadata__")
    header[key]["shape"] = [4096, 4096]                   # claims 64 MB in a file of a few hundred KB
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(raw) == n
    (folder / "mg2_io.safetensors").write_bytes(bytes(data[:8]) + raw + bytes(data[8 + n:]))
    rows = check_reference(folder)
    assert [r[0] for r in rows] == ["mg2/fixture"]
    assert "mg2_io.safetensors" in rows[0].note and key in rows[0].note and "convert" not in rows[0].note


def _longlive_one_variant(tmp_path, variant="w9s3") -> Path:
    """The LongLive fixture with its config cut to one variant without the LoRA (beside the base weights)."""
    (tmp_path / "wan_reference").mkdir()
    shutil.copy(FIXTURES / "wan_reference" / "causal_weights.safetensors", tmp_path / "wan_reference")
    folder = tmp_path / "longlive"
    folder.mkdir()
    shutil.copy(FIXTURES / "longlive" / "longlive_io.safetensors", folder)
    cfg = json.loads((FIXTURES / "longlive" / "longlive_config.json").read_text())
    cfg["variants"] = {variant: cfg["variants"][variant]}
    (folder / "longlive_config.json").write_text(json.dumps(cfg))
    return folder


def test_longlive_a_removed_tensor_and_a_nan_fail_their_rows(tmp_path):
    folder = _longlive_one_variant(tmp_path)

    def edit(io):
        io.pop("w9s3.x0_steps")
        _poison(io, "w9s3.latents", float("nan"))
    _edit_io(folder, "longlive_io.safetensors", edit)
    rows = check_reference(folder)
    failed = _failed(rows)
    assert set(failed) == {f"{p}.w9s3.{k}" for p in ("reference", "optimized") for k in ("x0_steps", "latents")}
    assert all("missing from longlive_io.safetensors" in failed[f"{p}.w9s3.x0_steps"].note
               for p in ("reference", "optimized"))
    assert all("longlive_io.safetensors" in failed[f"{p}.w9s3.latents"].note for p in ("reference", "optimized"))
    v = R.verdict(rows)
    assert v["pass"] is False and math.isnan(v["worst"])


def test_longlive_an_inf_in_an_input_is_refused_naming_file_and_key(tmp_path):
    folder = _longlive_one_variant(tmp_path)
    _edit_io(folder, "longlive_io.safetensors", lambda io: _poison(io, "prompt1", float("inf")))
    rows = check_reference(folder)
    assert [r[0] for r in rows] == ["longlive/fixture"]
    assert "longlive_io.safetensors" in rows[0].note and "'prompt1'" in rows[0].note


def test_longlive_expects_x0_steps_of_each_variant_without_the_lora():
    from wan_accel.app.jobs.reference import x0_steps_expected
    cfg = json.loads((FIXTURES / "longlive" / "longlive_config.json").read_text())
    expected = {v for v in cfg["variants"] if x0_steps_expected(cfg, v)}
    with_steps = {k[:-len(".x0_steps")] for k in load_file(str(FIXTURES / "longlive" / "longlive_io.safetensors"))
                  if k.endswith(".x0_steps")}
    assert expected == with_steps == {"w9s3", "w12s3"}
