"""Header-only model sizes: exact per-tensor and per-block bytes, presets, live modules."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from wan_accel.memory.weights import HeaderError, preset_weights, weights_from_checkpoint, weights_from_module
from wan_accel.model.checkpoint import expected_shapes, read_header as read_safetensors_header
from wan_accel.model.config import WanConfig

FIXTURES = Path(__file__).parent / "fixtures" / "wan_reference"


def _mixed_state_dict() -> dict:
    g = torch.Generator().manual_seed(0)
    sd = {
        "model.patch_embedding.weight": torch.randn(8, 4, 1, 2, 2, generator=g),
        "model.text_embedding.0.weight": torch.randn(8, 6, generator=g).to(torch.bfloat16),
        "model.head.head.weight": torch.randn(16, 8, generator=g).half(),
        "model.blocks.0.self_attn.q.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "model.blocks.0.ffn.0.weight": torch.randn(24, 8, generator=g),
        "model.blocks.0.ffn.0.bias": torch.randn(24, generator=g).half(),
        "model.blocks.1.self_attn.q.weight": torch.randint(-5, 5, (8, 8), generator=g, dtype=torch.int8),
        "model.blocks.1.ffn.0.weight": torch.randn(24, 8, generator=g).double(),
        "model.blocks.1.mask": torch.zeros(3, 5, dtype=torch.bool),
        "model.blocks.10.norm3.weight": torch.randn(8, generator=g),
    }
    if hasattr(torch, "float8_e4m3fn"):
        sd["model.blocks.1.modulation"] = torch.randn(1, 6, 8, generator=g).to(torch.float8_e4m3fn)
    for i in range(2, 10):
        sd[f"model.blocks.{i}.norm3.weight"] = torch.randn(8, generator=g)
    return sd


def test_header_sizes_equal_real_tensor_bytes(tmp_path):
    sd = _mixed_state_dict()
    path = tmp_path / "mixed.safetensors"
    save_file(sd, str(path), metadata={"config": json.dumps({"num_heads": 2})})
    tensors, meta = read_safetensors_header(path)
    loaded = load_file(str(path))
    assert set(tensors) == set(loaded)
    with safe_open(str(path), framework="pt") as f:
        for name, t in loaded.items():
            info = tensors[name]
            assert info.nbytes == t.numel() * t.element_size(), name
            assert list(info.shape) == list(f.get_slice(name).get_shape())
            assert info.dtype == f.get_slice(name).get_dtype()
    w = weights_from_checkpoint(path)
    assert w.num_layers == 11 and w.num_heads == 2 and w.dim == 8 and w.ffn_dim == 24
    for i in range(11):
        expect = sum(t.numel() * t.element_size() for n, t in loaded.items() if n.startswith(f"model.blocks.{i}."))
        assert w.block_bytes[i] == expect, i
    assert w.total_bytes == sum(t.numel() * t.element_size() for t in loaded.values())
    assert w.other_bytes == w.total_bytes - sum(w.block_bytes)
    assert w.embedding_bytes == loaded["model.text_embedding.0.weight"].numel() * 2
    assert "blocks.0.ffn.0.weight" in w.tensors  # the 'model.' prefix is stripped
    # holding floats at 2 bytes: non-float tensors keep their size
    b1 = w.block_bytes_at(2)[1]
    floats = [t for n, t in loaded.items() if n.startswith("model.blocks.1.") and t.is_floating_point()]
    others = [t for n, t in loaded.items() if n.startswith("model.blocks.1.") and not t.is_floating_point()]
    assert b1 == sum(t.numel() for t in floats) * 2 + sum(t.numel() * t.element_size() for t in others)


def test_reference_fixture_matches_the_preset_key_spec():
    path = FIXTURES / "causal_weights.safetensors"
    if not path.exists():
        pytest.skip("reference fixture not present")
    cfg = json.loads((FIXTURES / "causal_config.json").read_text())["config"]
    tensors, _ = read_safetensors_header(path)
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    assert shapes == expected_shapes(WanConfig.from_dict(cfg))
    w = weights_from_checkpoint(path)
    assert (w.dim, w.ffn_dim, w.num_layers, w.text_dim) == (cfg["dim"], cfg["ffn_dim"], cfg["num_layers"],
                                                            cfg["text_dim"])
    assert w.total_bytes == sum(t.numel() * t.element_size() for t in load_file(str(path)).values())


def test_presets_have_the_published_sizes():
    small, big = preset_weights("1.3b"), preset_weights("14b")
    assert 1.40e9 < small.total_params < 1.44e9           # "1.3B" is about 1.42B parameters
    assert 14.0e9 < big.total_params < 14.6e9
    assert (small.num_layers, big.num_layers) == (30, 40)
    assert small.total_bytes == small.total_params * 2    # bf16
    assert preset_weights("1.3b", "F32").total_bytes == small.total_params * 4
    i2v = preset_weights("14b-i2v")
    assert i2v.model_type == "i2v" and i2v.total_params > big.total_params
    with pytest.raises(ValueError, match="unknown model preset"):
        preset_weights("7b")


def test_damaged_files_give_clear_errors(tmp_path):
    good = tmp_path / "good.safetensors"
    save_file({"blocks.0.w": torch.zeros(64, 64)}, str(good))
    raw = good.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(raw[: len(raw) - 100])
    with pytest.raises(HeaderError, match="truncated"):
        read_safetensors_header(cut)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(struct.pack("<Q", 4) + b"nope")
    with pytest.raises(HeaderError, match="not valid JSON"):
        read_safetensors_header(junk)
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 10 ** 12) + b"{}")
    with pytest.raises(HeaderError, match="header length"):
        read_safetensors_header(huge)
    not_wan = tmp_path / "vae.safetensors"
    save_file({"decoder.conv.weight": torch.zeros(2)}, str(not_wan))
    with pytest.raises(HeaderError, match="not a Wan DiT"):
        weights_from_checkpoint(not_wan)


def test_live_module_table_is_exact():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(6, 10)
            self.register_buffer("scale", torch.ones(10, dtype=torch.float16))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.patch_embedding = torch.nn.Conv3d(4, 6, (1, 2, 2), (1, 2, 2))
            self.blocks = torch.nn.ModuleList(Block() for _ in range(3))

    m = Model()
    w = weights_from_module(m)
    assert w.num_layers == 3 and w.block_bytes == [(60 + 10) * 4 + 10 * 2] * 3
    assert w.other_bytes == sum(p.numel() * 4 for p in m.patch_embedding.parameters())


def test_module_table_skips_non_persistent_buffers():
    import torch
    from torch import nn

    from wan_accel.memory.weights import weights_from_module

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(8, 8, bias=False)
            self.register_buffer("fused", torch.zeros(24, 8), persistent=False)  # an alias-style cache
            self.register_buffer("scale", torch.ones(8))  # persistent: counted

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])

    table = weights_from_module(Model())
    names = set(table.tensors)
    assert "blocks.0.scale" in names and "blocks.0.fused" not in names
