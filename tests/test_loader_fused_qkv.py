"""The loader puts each self-attention's q, k and v straight into one concatenated buffer: fusing for the
optimized path then copies nothing, and each weight is held once (on the CPU read with plain file reads)."""
import torch
from safetensors.torch import load_file

from wan_accel.model.fused_qkv import QKV_WEIGHT, ensure_fused_qkv, fused_qkv_intact
from checkpoint_files import save_wan_checkpoint
from wan_accel.model.loader import load_wan_checkpoint
from wan_accel.model.tiny import tiny_causal_model


def _saved(tmp_path, dtype=torch.float32):
    model = tiny_causal_model()
    if dtype != torch.float32:
        model.set_precision("self_forcing", dtype)
    return save_wan_checkpoint(model, tmp_path / "tiny.safetensors"), model


def test_qkv_load_into_one_buffer_and_fusing_copies_nothing(tmp_path):
    path, _ = _saved(tmp_path)
    model = load_wan_checkpoint(path, dtype=torch.float32, precision="float32")
    for block in model.blocks:
        sa = block.self_attn
        assert fused_qkv_intact(sa)
        buf = getattr(sa, QKV_WEIGHT)
        storages = {t.untyped_storage().data_ptr() for t in (sa.q.weight, sa.k.weight, sa.v.weight, buf)}
        assert storages == {buf.untyped_storage().data_ptr()}        # one storage: each weight held once
        assert ensure_fused_qkv(sa) and getattr(sa, QKV_WEIGHT) is buf  # nothing rebuilt, nothing copied
    file = load_file(str(path))
    state = model.state_dict()
    assert set(state) == set(file)                                      # the buffer is not in the state dict
    for name, t in file.items():
        assert torch.equal(state[name], t), name


def test_qkv_of_another_dtype_are_cast_into_the_buffer(tmp_path):
    path, _ = _saved(tmp_path, torch.bfloat16)
    model = load_wan_checkpoint(path, dtype=torch.float32, precision="float32")
    file = load_file(str(path))
    sa = model.blocks[0].self_attn
    assert fused_qkv_intact(sa) and sa.q.weight.dtype == torch.float32
    assert torch.equal(sa.k.weight, file["blocks.0.self_attn.k.weight"].float())
