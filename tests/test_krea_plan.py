"""The krea-14b preset: Wan 2.1 14B with Krea Realtime's 6-frame cache; plans for 24, 32 and 80 GiB cards."""
import json

import pytest

from wan_accel.cli import main as cli_main

FRAME_TOKENS = (480 // 16) * (832 // 16)      # 832x480: 60x104 latents, 2x2 patches


def _plan(capsys, *extra):
    rc = cli_main(["plan", "--model", "krea-14b", "--ram-gb", "64", "--json", *extra])
    out = capsys.readouterr().out
    assert rc == 0, out
    return json.loads(out)


@pytest.mark.parametrize("vram", [24, 32, 80])
def test_each_card_gets_a_setting_that_fits_its_own_estimate(capsys, vram):
    plan = _plan(capsys, "--vram-gb", str(vram))
    assert plan["fits"] is True
    assert plan["estimated_peak_bytes"] <= plan["budget_bytes"] <= vram * 2**30
    assert sum(plan["breakdown"].values()) <= plan["estimated_peak_bytes"]
    assert plan["kv_window"] == 6
    if vram < 30:                                # bf16 weights alone (26.6 GiB) do not fit: blocks are streamed
        assert plan["blocks_to_swap"] > 0
    if vram >= 80:
        assert plan["blocks_to_swap"] == 0


def test_kv_figure_follows_the_formula(capsys):
    """2 (K and V) x 40 layers x tokens x 5120 x 2 bytes (bf16); Krea's default cache of 32760 tokens
    (21 frames) is the ~25 GiB figure, its recompute window of 6 frames 7.1 GiB."""
    plan = _plan(capsys, "--vram-gb", "80")
    assert plan["breakdown"]["kv_cache"] == 2 * 40 * 6 * FRAME_TOKENS * 5120 * 2
    plan = _plan(capsys, "--vram-gb", "80", "--kv-window", "21")
    kv = plan["breakdown"]["kv_cache"]
    assert kv == 2 * 40 * 32760 * 5120 * 2
    assert 24.5 < kv / 2**30 < 25.5
