"""One checkpoint module: what the loader builds from a file is what the planner sizes, whoever wrote the file
(our converter, save_wan_checkpoint, or ComfyUI's metadata convention)."""
from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import pytest
import torch
from safetensors.torch import save_file

from wan_accel.memory.estimate import Workload
from wan_accel.memory.plan import make_plan
from wan_accel.memory.system import SystemInfo
from wan_accel.memory.weights import weights_from_checkpoint
from wan_accel.model.checkpoint import open_checkpoint
from wan_accel.model.config import WanConfig
from wan_accel.model.convert import convert_pt_to_safetensors
from wan_accel.model.loader import load_wan_checkpoint
from wan_accel.model.tiny import TINY_CONFIG, tiny_causal_model

FIELDS = ("num_heads", "local_attn_size", "sink_size", "dim", "ffn_dim", "num_layers", "in_dim", "text_dim",
          "model_type")


def _training_pt(tmp_path, config=TINY_CONFIG):
    """A Self-Forcing-style training checkpoint of the tiny model (wrapper prefix, generator entry)."""
    sd = tiny_causal_model(config=config).state_dict()
    path = tmp_path / "tiny_dmd.pt"
    torch.save({"generator": {f"model.{k}": v for k, v in sd.items()}}, str(path))
    return path


def _cli_plan(path) -> dict:
    from wan_accel.cli import main

    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["plan", "--checkpoint", str(path), "--vram-gb", "80", "--ram-gb", "64", "--json"]) == 0
    return json.loads(out.getvalue())


def _assert_plan_matches_loader(path):
    loaded = load_wan_checkpoint(path).config
    weights = weights_from_checkpoint(path)
    plan = make_plan(weights, Workload(832, 480, 81), SystemInfo.simulated_gpu(80, ram_gb=64))
    cli = _cli_plan(path)
    for field in FIELDS:
        want = getattr(loaded, field)
        assert getattr(weights, field) == want, field
        assert plan.model[field] == want, field
        assert cli["model"][field] == want, field
    window = loaded.local_attn_size if loaded.local_attn_size > 0 else -1
    assert plan.kv_window == window and cli["kv_window"] == window
    return loaded, plan


def test_convert_then_plan_reports_the_config_the_loader_infers(tmp_path):
    dst = tmp_path / "tiny.safetensors"
    convert_pt_to_safetensors(_training_pt(tmp_path), dst, num_heads=TINY_CONFIG.num_heads)
    loaded, _ = _assert_plan_matches_loader(dst)
    assert loaded.num_heads == TINY_CONFIG.num_heads


def test_convert_with_a_rolling_window_then_plan_uses_that_window(tmp_path):
    dst = tmp_path / "tiny_window.safetensors"
    convert_pt_to_safetensors(_training_pt(tmp_path), dst, num_heads=TINY_CONFIG.num_heads,
                              config={"local_attn_size": 6, "sink_size": 1})
    loaded, plan = _assert_plan_matches_loader(dst)
    assert (loaded.num_heads, loaded.local_attn_size, loaded.sink_size) == (TINY_CONFIG.num_heads, 6, 1)
    assert plan.kv_window == 6 and "rolling window of 6" in plan.reasons["kv_window"]
    with pytest.raises(ValueError, match="cannot be set"):
        convert_pt_to_safetensors(_training_pt(tmp_path), tmp_path / "x.safetensors", config={"dim": 128})


@pytest.mark.parametrize("nested_ours", [False, True], ids=["comfy-fields", "our-config-nested"])
def test_comfyui_metadata_config_is_read_by_loader_and_planner(tmp_path, nested_ours):
    """ComfyUI loads a file as causal when its metadata 'config' is {"transformer": {"causal_ar": true, ...}}."""
    config = TINY_CONFIG.replace(local_attn_size=6, sink_size=1)
    transformer = {"causal_ar": True, "num_heads": config.num_heads, "local_attn_size": 6, "sink_size": 1}
    if nested_ours:
        transformer = {**config.to_dict(), "causal_ar": True}
    path = tmp_path / "comfy_causal.safetensors"
    sd = {k: v.contiguous() for k, v in tiny_causal_model(config=config).state_dict().items()}
    save_file(sd, str(path), metadata={"config": json.dumps({"transformer": transformer})})
    loaded, _ = _assert_plan_matches_loader(path)
    assert (loaded.num_heads, loaded.local_attn_size, loaded.sink_size) == (config.num_heads, 6, 1)
    assert open_checkpoint(path).stated_config["causal_ar"] is True


def test_our_metadata_key_wins_over_comfyui(tmp_path):
    path = tmp_path / "both.safetensors"
    sd = {k: v.contiguous() for k, v in tiny_causal_model().state_dict().items()}
    ours = TINY_CONFIG.replace(local_attn_size=9).to_dict()
    save_file(sd, str(path), metadata={"wan_accel.config": json.dumps(ours),
                                       "config": json.dumps({"transformer": {"num_heads": 2, "local_attn_size": 3}})})
    assert open_checkpoint(path).config == WanConfig.from_dict(ours)
    assert weights_from_checkpoint(path).local_attn_size == 9


def test_convert_writes_the_metadata_core_loads_as_causal_wan(tmp_path):
    from safetensors import safe_open

    from wan_accel.model.checkpoint import core_causal_metadata
    dst = tmp_path / "tiny_core.safetensors"
    convert_pt_to_safetensors(_training_pt(tmp_path), dst, num_heads=TINY_CONFIG.num_heads,
                              config={"local_attn_size": 6, "sink_size": 1, "text_len": TINY_CONFIG.text_len})
    with safe_open(str(dst), "pt") as f:
        meta = f.metadata()
    transformer = json.loads(meta["config"])["transformer"]
    c = TINY_CONFIG       # dim 64: core's dim // 128 rule gives no heads, so they are written; so are the sizes
    assert transformer == {"causal_ar": True, "num_heads": c.num_heads, "text_len": c.text_len,
                           "freq_dim": c.freq_dim, "text_dim": c.text_dim}     # no window keys: core's model has none
    assert load_wan_checkpoint(dst).config.local_attn_size == 6          # ours still wins for the pack's loader
    real = WanConfig(dim=1536, num_heads=12, ffn_dim=8960, num_layers=30)
    assert json.loads(core_causal_metadata(real)["config"]) == {"transformer": {"causal_ar": True}}
    assert core_causal_metadata(real.replace(model_type="i2v", in_dim=36)) == {}
