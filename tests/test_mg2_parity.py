"""Matrix-Game-2 parity with the original implementation: every recorded tensor of the public fixture."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from wan_accel.wan import mg2_reference
from wan_accel.wan.reference import check_reference, discover

FIX = Path(__file__).parent / "fixtures" / "matrix_game2"
TOL = 1e-4
INPUTS = ("initial_noise", "cond_concat", "visual_context", "mouse_cond", "keyboard_cond", "extra_noise.")


@pytest.fixture(scope="module")
def rows():
    cfg = json.loads((FIX / "mg2_config.json").read_text())
    return cfg, dict(mg2_reference.run(FIX, cfg))


def test_every_recorded_tensor_within_tolerance(rows):
    _cfg, got = rows
    bad = {k: v for k, v in got.items() if not v <= TOL}
    assert not bad, bad


def test_every_recorded_output_is_compared(rows):
    """Nothing recorded is skipped: each call's xt/flow/x0, the intermediates, the caches and output."""
    from safetensors import safe_open
    _cfg, got = rows
    with safe_open(str(FIX / "mg2_io.safetensors"), "pt") as f:
        recorded = [k for k in f.keys() if not k.startswith(INPUTS)]
    missing = [k for k in recorded if k not in got]
    assert not missing, missing
    assert "calls" in got            # call order, timesteps and every cache's ends after every call
    assert any(k.startswith("inter.call12.") for k in got) and any(k.startswith("mouse_kv_final") for k in got)


def test_check_reference_recognises_the_format():
    names = [name for name, _path, _cfg in discover(FIX)]
    assert names == ["matrix_game2"]
    worst = max(d for _n, d in check_reference(FIX, formats=["matrix_game2"]))
    assert worst <= TOL


def test_a_wrong_window_is_caught(tmp_path, rows):
    """The check is sensitive: the same run with another rolling window fails."""
    import shutil
    cfg, _ = rows
    for name in ("mg2_weights.safetensors", "mg2_io.safetensors"):
        shutil.copy(FIX / name, tmp_path / name)
    cfg = json.loads(json.dumps(cfg))
    cfg["config"]["local_attn_size"] = 9
    got = dict(mg2_reference.run(tmp_path, cfg))
    assert got["output"] > 1e-2 and got["calls"] == float("inf")
