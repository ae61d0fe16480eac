"""The engine over borrowed modules (model/borrowed.py): same objects, same results, casts at use."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from wan_accel.model.borrowed import borrow_wan_model, borrowed_config
from wan_accel.model.tiny import TINY_CONFIG, tiny_causal_model
from run_helpers import generate_latents

CTX = torch.randn(1, 7, TINY_CONFIG.text_dim, generator=torch.Generator().manual_seed(1))


def _sample(model, path="reference", **kw):
    return generate_latents(model, CTX, 6, 8, 8, seed=3, frames_per_block=3, path=path, **kw)


def test_borrowed_model_is_the_source_and_samples_identically():
    source = tiny_causal_model(seed=5)
    engine = borrow_wan_model(source)
    assert engine.config == source.config
    assert engine.blocks[1].self_attn.q is source.blocks[1].self_attn.q
    assert engine.blocks[0].ffn is source.blocks[0].ffn and engine.head.head is source.head.head
    source_ptrs = {p.data_ptr() for p in source.parameters()}
    assert {p.data_ptr() for p in engine.parameters()} <= source_ptrs       # no second copy of any weight
    torch.testing.assert_close(_sample(engine), _sample(source), rtol=0, atol=0)
    torch.testing.assert_close(_sample(engine, kv_window=4, sink=1), _sample(source, kv_window=4, sink=1),
                               rtol=0, atol=0)


def test_borrowed_model_optimized_path_matches_reference():
    source = tiny_causal_model(seed=5)
    engine = borrow_wan_model(source)
    torch.testing.assert_close(_sample(engine, path="optimized"), _sample(source), rtol=1e-5, atol=1e-5)


def test_modulation_is_read_from_its_owner_at_each_use():
    source = tiny_causal_model(seed=5)
    engine = borrow_wan_model(source)
    before = _sample(engine)
    block = source.blocks[0]
    block.modulation = nn.Parameter(block.modulation.detach() + 0.5, requires_grad=False)   # a new object
    after = _sample(engine)
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(after, _sample(source), rtol=0, atol=0)


class _StoredFp8Linear(nn.Linear):
    """A layer that stores its weight in float8 and computes with it upcast (as a quantizing runtime does)."""

    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype), self.bias)


def test_layers_that_cast_at_call_time_are_called_as_they_are():
    source = tiny_causal_model(seed=5)
    quant = copy.deepcopy(source)
    calls = []
    for name, mod in list(quant.named_modules()):
        for child_name, child in list(mod.named_children()):
            if type(child) is nn.Linear:
                new = _StoredFp8Linear(child.in_features, child.out_features)
                new.weight = nn.Parameter(child.weight.detach().to(torch.float8_e4m3fn), requires_grad=False)
                new.bias = child.bias
                new.register_forward_hook(lambda *a: calls.append(1))
                setattr(mod, child_name, new)
                # the dequantized copy: the same float8 values in float32
                getattr(source.get_submodule(name) if name else source, child_name).weight.data = \
                    new.weight.detach().float()
    quant.blocks[0].modulation.data = quant.blocks[0].modulation.data.to(torch.float8_e4m3fn)
    source.blocks[0].modulation.data = quant.blocks[0].modulation.data.float()
    out = _sample(borrow_wan_model(quant))
    assert calls, "the source's layers were not called"
    torch.testing.assert_close(out, _sample(source), rtol=0, atol=1e-6)


def test_set_precision_is_refused_and_config_needs_a_dit():
    engine = borrow_wan_model(tiny_causal_model())
    with pytest.raises(RuntimeError, match="set_run"):
        engine.set_precision("float32")
    with pytest.raises(ValueError, match="not a Wan 2.1 DiT"):
        borrowed_config(nn.Linear(2, 2))


def test_source_block_hooks_fire_around_each_block_call():
    source = tiny_causal_model(seed=5)
    events = []
    for i, block in enumerate(source.blocks):
        block.register_forward_pre_hook(lambda m, args, i=i: events.append(("pre", i, args[0].shape[1])))
        block.register_forward_hook(lambda m, args, out, i=i: events.append(("post", i)))
    engine = borrow_wan_model(source)
    generate_latents(engine, CTX, 3, 8, 8, seed=3, frames_per_block=3, path="reference")
    calls = 4 + 1                                         # 4 steps and the refresh pass of the one chunk
    assert events == [("pre", 0, 48), ("post", 0), ("pre", 1, 48), ("post", 1)] * calls
    events.clear()
    generate_latents(engine, CTX, 3, 8, 8, seed=3, frames_per_block=3, path="optimized")   # lean refresh: kv_only
    assert events.count(("post", 1)) == events.count(("post", 0)) > 0
