"""Loader: safetensors only, config from shapes, key mapping, one clear error for mismatches, converter."""
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from wan_accel.model.config import WAN_1_3B, WAN_14B, WAN_14B_I2V, WanConfig
from wan_accel.model.convert import convert_pt_to_safetensors
from wan_accel.model.checkpoint import (CheckpointError, canonical_names, diffusers_to_official, expected_shapes,
                                      infer_config)
from checkpoint_files import save_wan_checkpoint
from wan_accel.model.loader import load_wan_checkpoint
from wan_accel.model.tiny import TINY_CONFIG, tiny_causal_model

FIXTURES = Path(__file__).parent / "fixtures" / "wan_reference"
WEIGHTS = FIXTURES / "wan_t2v_weights.safetensors"
FIXTURE_CFG = json.loads((FIXTURES / "wan_t2v_config.json").read_text())["config"]

# official -> diffusers, the inverse of the loader's mapping, written out independently
TO_DIFFUSERS = [
    ("time_embedding.0.", "condition_embedder.time_embedder.linear_1."),
    ("time_embedding.2.", "condition_embedder.time_embedder.linear_2."),
    ("text_embedding.0.", "condition_embedder.text_embedder.linear_1."),
    ("text_embedding.2.", "condition_embedder.text_embedder.linear_2."),
    ("time_projection.1.", "condition_embedder.time_proj."),
    ("head.modulation", "scale_shift_table"), ("head.head.", "proj_out."),
    (".modulation", ".scale_shift_table"),
    (".self_attn.o.", ".attn1.to_out.0."), (".cross_attn.o.", ".attn2.to_out.0."),
    (".self_attn.norm_", ".attn1.norm_"), (".cross_attn.norm_", ".attn2.norm_"),
    (".self_attn.", ".attn1.to_"), (".cross_attn.", ".attn2.to_"),
    (".ffn.0.", ".ffn.net.0.proj."), (".ffn.2.", ".ffn.net.2."), (".norm3.", ".norm2."),
]


def _to_diffusers(name):
    for a, b in TO_DIFFUSERS:
        if a in name:
            return name.replace(a, b, 1)
    return name


def _fixture_tensors():
    return load_file(str(WEIGHTS))


def _forward(model):
    torch.manual_seed(0)
    x = torch.randn(16, 3, 8, 12)
    ctx = torch.randn(5, model.config.text_dim)
    with torch.no_grad():
        return model.forward_full([x], torch.tensor([500.0]), [ctx])[0]


def _cfg():
    return WanConfig.from_dict(FIXTURE_CFG)


def test_loads_fixture_by_explicit_config():
    model = load_wan_checkpoint(WEIGHTS, config=_cfg())
    ref = _fixture_tensors()
    for name, t in model.state_dict().items():
        assert torch.equal(t, ref[name]), name
    assert not any(p.requires_grad for p in model.parameters())


def test_missing_and_wrong_shape_keys_one_error(tmp_path):
    t = _fixture_tensors()
    for name in [n for n in t if n.startswith("blocks.1.")][:12]:
        del t[name]
    t["head.head.bias"] = torch.zeros(3)
    t["extra.weight"] = torch.zeros(1)
    save_file(t, str(tmp_path / "broken.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_wan_checkpoint(tmp_path / "broken.safetensors", config=_cfg())
    msg = str(err.value)
    assert "missing 12 keys" in msg and "and 2 more" in msg
    assert "unexpected 1 keys: extra.weight" in msg
    assert "head.head.bias (3,) (expected (64,))" in msg
    assert "nothing was loaded" in msg


@pytest.mark.parametrize("suffix", [".pt", ".pth", ".ckpt"])
def test_pickle_paths_are_refused_without_reading(tmp_path, suffix):
    path = tmp_path / f"model{suffix}"
    path.write_bytes(b"not even opened")
    with pytest.raises(CheckpointError, match="python -m wan_accel convert"):
        load_wan_checkpoint(path)


def test_pickle_disguised_as_safetensors_is_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    torch.save({"a": torch.zeros(2)}, str(path))
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        load_wan_checkpoint(path)


def test_diffusers_names_map_to_official(tmp_path):
    t = _fixture_tensors()
    diff = {_to_diffusers(n): v for n, v in t.items()}
    assert "blocks.0.norm2.weight" in diff and "blocks.0.attn1.to_out.0.weight" in diff
    assert {diffusers_to_official(n) for n in diff} == set(t)
    save_file(diff, str(tmp_path / "diffusers.safetensors"))
    a = load_wan_checkpoint(WEIGHTS, config=_cfg())
    b = load_wan_checkpoint(tmp_path / "diffusers.safetensors", config=_cfg())
    torch.testing.assert_close(_forward(a), _forward(b), rtol=0, atol=1e-5)


def test_unknown_diffusers_key_is_reported(tmp_path):
    diff = {_to_diffusers(n): v for n, v in _fixture_tensors().items()}
    diff["condition_embedder.image_embedder.pos_embed"] = torch.zeros(1, 4, 64)
    save_file(diff, str(tmp_path / "d.safetensors"))
    with pytest.raises(CheckpointError, match="unexpected 1 keys: condition_embedder.image_embedder.pos_embed"):
        load_wan_checkpoint(tmp_path / "d.safetensors", config=_cfg())


def test_prefixes_are_stripped():
    names = canonical_names(["model.patch_embedding.weight", "model.blocks.0.ffn.0.bias"])
    assert names == {"patch_embedding.weight": "model.patch_embedding.weight",
                     "blocks.0.ffn.0.bias": "model.blocks.0.ffn.0.bias"}


@pytest.mark.parametrize("preset", [WAN_1_3B, WAN_14B, WAN_14B_I2V])
def test_infer_config_from_real_shape_tables(preset):
    shapes = expected_shapes(preset)          # shape dict only, built on the meta device
    cfg = infer_config(shapes)
    for field in ("model_type", "patch_size", "in_dim", "dim", "ffn_dim", "freq_dim", "text_dim", "out_dim",
                  "num_heads", "num_layers", "qk_norm", "cross_attn_norm"):
        assert getattr(cfg, field) == getattr(preset, field), field
    assert cfg.head_dim == 128


def test_real_1_3b_key_table():
    shapes = expected_shapes(WAN_1_3B)
    assert shapes["blocks.29.ffn.0.weight"] == (8960, 1536)
    assert shapes["time_projection.1.weight"] == (9216, 1536)
    assert shapes["head.head.weight"] == (64, 1536)
    assert shapes["patch_embedding.weight"] == (1536, 16, 1, 2, 2)
    assert sum(torch.Size(s).numel() for s in shapes.values()) == pytest.approx(1.42e9, rel=0.01)
    i2v = expected_shapes(WAN_14B_I2V)
    assert i2v["img_emb.proj.1.weight"] == (1280, 1280) and i2v["img_emb.proj.3.weight"] == (5120, 1280)
    assert i2v["blocks.0.cross_attn.k_img.weight"] == (5120, 5120)
    assert "blocks.0.cross_attn.norm_k_img.weight" in i2v


def test_small_dim_needs_heads():
    shapes = expected_shapes(_cfg())
    with pytest.raises(CheckpointError, match="cannot infer num_heads"):
        infer_config(shapes)
    assert infer_config(shapes, num_heads=4).num_heads == 4


def test_metadata_config_round_trip_and_dtypes(tmp_path):
    model = tiny_causal_model()
    path = save_wan_checkpoint(model, tmp_path / "tiny.safetensors")
    with safe_open(str(path), "pt") as f:
        assert json.loads(f.metadata()["wan_accel.config"])["num_heads"] == TINY_CONFIG.num_heads
    bf = load_wan_checkpoint(path, dtype=torch.bfloat16, precision="self_forcing")
    assert bf.config.to_dict() == TINY_CONFIG.to_dict()
    assert {p.dtype for p in bf.parameters()} == {torch.bfloat16}
    w21 = load_wan_checkpoint(path, dtype=torch.bfloat16, precision="wan21")
    assert w21.blocks[0].modulation.dtype == torch.float32
    assert w21.time_embedding[0].weight.dtype == torch.float32 and w21.head.head.weight.dtype == torch.float32
    assert w21.blocks[0].self_attn.q.weight.dtype == torch.bfloat16
    assert w21.blocks[0].ffn[0].weight.dtype == torch.bfloat16
    f32 = load_wan_checkpoint(path)
    assert all(torch.equal(a, b) for a, b in zip(f32.state_dict().values(), model.state_dict().values()))
    torch.testing.assert_close(_forward(f32), _forward(model), rtol=0, atol=1e-5)


def _training_checkpoint(tmp_path):
    sd = _fixture_tensors()
    ema = {f"model.{k}": v + 1 for k, v in sd.items()}
    path = tmp_path / "self_forcing_dmd.pt"
    torch.save({"generator": {f"model.{k}": v for k, v in sd.items()}, "generator_ema": ema}, str(path))
    return path, sd


@pytest.mark.parametrize("ema", [False, True])
def test_convert_training_checkpoint(tmp_path, ema):
    src, sd = _training_checkpoint(tmp_path)
    dst = tmp_path / "out.safetensors"
    summary = convert_pt_to_safetensors(src, dst, ema=ema, num_heads=4)
    assert summary["entry"] == ("generator_ema" if ema else "generator")
    out = load_file(str(dst))
    assert set(out) == set(sd)
    assert torch.equal(out["head.head.bias"], sd["head.head.bias"] + (1 if ema else 0))
    model = load_wan_checkpoint(dst)            # heads from the written metadata
    assert model.config.num_heads == 4


def test_convert_refuses_unsafe_pickle(tmp_path):
    class Payload:
        def __reduce__(self):
            return (print, ("unsafe code ran",))
    src = tmp_path / "evil.pt"
    torch.save({"generator": Payload()}, str(src))
    with pytest.raises(CheckpointError, match="weights_only"):
        convert_pt_to_safetensors(src, tmp_path / "o.safetensors")


def test_convert_cli_reports_missing_ema(tmp_path, capsys):
    from wan_accel.cli import main
    src = tmp_path / "g.pt"
    torch.save({"generator": {f"model.{k}": v for k, v in _fixture_tensors().items()}}, str(src))
    assert main(["convert", str(src), str(tmp_path / "o.safetensors"), "--ema"]) == 2
    assert "no 'generator_ema'" in capsys.readouterr().err
    assert main(["convert", str(src), str(tmp_path / "o.safetensors"), "--num-heads", "4"]) == 0
