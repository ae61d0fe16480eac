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


@pytest.mark.parametrize("vram", [24, 32, 80])
def test_plan_lists_the_settings_that_fit_and_marks_one(capsys, vram):
    """fp8 weights, block swap and a shorter window each come with their own estimate; exactly one is recommended,
    it fits, and no other fitting option swaps fewer blocks."""
    plan = _plan(capsys, "--vram-gb", str(vram), "--no-learned")
    alts = {a["kind"]: a for a in plan["alternatives"]}
    assert {"block swap", "fp8 weights"} <= set(alts)
    rec = [a for a in plan["alternatives"] if a["recommended"]]
    assert len(rec) == 1 and rec[0]["fits"] and rec[0]["estimated_peak_bytes"] <= plan["budget_bytes"]
    assert rec[0]["blocks_to_swap"] == min(a["blocks_to_swap"] for a in plan["alternatives"] if a["fits"])
    swap, fp8 = alts["block swap"], alts["fp8 weights"]
    assert swap["blocks_to_swap"] == plan["blocks_to_swap"] and swap["estimated_peak_bytes"] == plan["estimated_peak_bytes"]
    # fp8 block linear weights are 1 byte: the 14B's ~13.3e9 block weight elements save about that many bytes
    assert fp8["weights_bytes"] < swap["weights_bytes"] or swap["blocks_to_swap"] > 0
    if vram < 30:
        assert plan["blocks_to_swap"] > 0 and rec[0]["kind"] == "fp8 weights"
        shorter = alts["shorter KV window"]
        assert shorter["kv_window"] < plan["kv_window"] and shorter["blocks_to_swap"] < plan["blocks_to_swap"]
    if vram >= 80:
        assert rec[0]["kind"] == "block swap" and rec[0]["blocks_to_swap"] == 0


def test_fp8_estimate_counts_block_linears_at_one_byte():
    from wan_accel.memory.plan import fp8_weights
    from wan_accel.memory.weights import preset_weights
    bf16 = preset_weights("krea-14b")
    fp8 = fp8_weights(bf16)
    linear = sum(t.numel for n, t in bf16.tensors.items() if t.dtype == "BF16" and len(t.shape) == 2
                 and n.startswith("blocks.") and n.endswith(".weight"))
    assert sum(bf16.block_bytes_at(2)) - sum(fp8.block_bytes_at(2)) == linear
    assert fp8.other_bytes_at(2) == bf16.other_bytes_at(2)


def test_docs_card_table_is_the_planners_answer(capsys):
    """The 'Which card runs which setting' rows of docs/model.md equal what the planner answers now."""
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parent.parent / "docs" / "model.md").read_text()
    section = text.split("#### Which card runs which setting", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| (krea-14b|longlive \(1\.3B\)) \| (\d+) \| ([^|]+) \| ([\d.]+) \| (\d+) \| ([^|]*) \|$",
                      section, re.M)
    assert len(rows) == 6, section
    for model, vram, option, peak, swapped, others in rows:
        args = ["--model", "krea-14b"] if model == "krea-14b" else ["--model", "1.3b", "--kv-window", "12"]
        rc = cli_main(["plan", *args, "--ram-gb", "64", "--json", "--no-learned", "--vram-gb", vram])
        plan = json.loads(capsys.readouterr().out)
        assert rc == 0
        rec = [a for a in plan["alternatives"] if a["recommended"]][0]
        assert (rec["option"], f"{rec['estimated_peak_bytes'] / 2**30:.1f}", str(rec["blocks_to_swap"])) == \
            (option.strip(), peak, swapped), (model, vram)
        rest = "; ".join(f"{a['option']} {a['estimated_peak_bytes'] / 2**30:.1f}" for a in plan["alternatives"]
                         if a["fits"] and not a["recommended"])
        assert others.strip() == rest, (model, vram)
