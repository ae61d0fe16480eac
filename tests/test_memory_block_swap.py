"""Block swap through the host store: outputs identical to no swap, copies really happen, clean removal."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from wan_accel.cache import LimitCache
from wan_accel.memory.block_swap import (ATTR, BlockSwap, SwapSettings, active_swap, apply_block_swap,
                                         attach_swap_settings, ensure_block_swap, handle_swap_settings,
                                         run_with_swap_fallback)
from wan_accel.memory.limits import NAMESPACE


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.lin = nn.Linear(d, d)
        self.register_buffer("scale", torch.rand(d))
        self.seen_ptrs = []
        self.fail = False

    def forward(self, x):
        self.seen_ptrs.append(self.lin.weight.data_ptr())
        if self.fail:
            raise RuntimeError("boom")
        return x + torch.tanh(self.lin(self.norm(x))) * self.scale


class Model(nn.Module):
    def __init__(self, d=16, n=6):
        super().__init__()
        self.text_embedding = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x):
        x = self.text_embedding(x)
        for b in self.blocks:
            x = b(x)
        return x


@pytest.fixture
def model():
    torch.manual_seed(0)
    return Model().eval()


def _state(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("n", [0, 1, 3, 5, 6])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_outputs_identical_to_no_swap(model, n, prefetch):
    x = torch.randn(4, 16)
    with torch.no_grad():
        ref = model(x)
        before = _state(model)
        params = {k: p for k, p in model.named_parameters()}
        swap = apply_block_swap(model, SwapSettings(n, prefetch, offload_embeddings=True), device="cpu")
        for _ in range(3):
            assert torch.equal(model(x), ref)
        stats = swap.stats
        per_forward = n + 1  # swapped blocks + the embedding
        assert stats.copies == 3 * per_forward
        assert stats.bytes_copied == 3 * stats.swapped_bytes
        if prefetch and 0 < n < 6:
            assert stats.sync_loads == 3  # only the embedding; every swapped block was prefetched
        swap.remove()
    assert active_swap(model) is None and not hasattr(model.blocks, ATTR)
    assert all(p is params[k] for k, p in model.named_parameters())  # same Parameter objects
    after = _state(model)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert all(not h for b in model.blocks for h in (b._forward_pre_hooks, b._forward_hooks))


def test_swapped_weights_are_materialised_per_call_and_dropped_after(model):
    x = torch.randn(2, 16)
    swap = apply_block_swap(model, SwapSettings(3, 1), device="cpu")
    host_ptrs = {i: model.blocks[i].lin.weight.data_ptr() for i in range(6)}
    for b in model.blocks:
        b.seen_ptrs.clear()
    with torch.no_grad():
        model(x)
        model(x)
    for i in range(6):
        seen = model.blocks[i].seen_ptrs
        if i < 3:   # resident: the same storage every time
            assert seen == [host_ptrs[i]] * 2
        else:       # swapped: a fresh device copy per call, never the host store
            assert host_ptrs[i] not in seen and len(seen) == 2
            assert model.blocks[i].lin.weight.data_ptr() == host_ptrs[i]  # back on the host store after the call
    swap.remove()


def test_exception_inside_a_block_leaves_a_usable_model(model):
    x = torch.randn(2, 16)
    with torch.no_grad():
        ref = model(x)
        swap = apply_block_swap(model, SwapSettings(4, 1), device="cpu")
        model.blocks[4].fail = True
        with pytest.raises(RuntimeError, match="boom"):
            model(x)
        model.blocks[4].fail = False
        assert torch.equal(model(x), ref)
        swap.release()
        assert torch.equal(model(x), ref)
        swap.remove()
        assert torch.equal(model(x), ref)


def test_ensure_is_idempotent_and_validates(model):
    s = SwapSettings(2, 1)
    a = ensure_block_swap(model, s, device="cpu")
    assert ensure_block_swap(model, SwapSettings(2, 1), device="cpu") is a
    b = ensure_block_swap(model, SwapSettings(4, 1), device="cpu")
    assert b is not a and not a._handles and b._handles and active_swap(model) is b
    with pytest.raises(RuntimeError, match="already have a block swap"):
        BlockSwap(model.blocks, blocks_to_swap=1, device="cpu")
    assert ensure_block_swap(model, None) is None and active_swap(model) is None
    with pytest.raises(ValueError, match="between 0 and 6"):
        apply_block_swap(model, SwapSettings(7, 1), device="cpu")
    with pytest.raises(TypeError, match="no 'blocks'"):
        apply_block_swap(nn.Linear(2, 2), SwapSettings(1, 1), device="cpu")
    assert active_swap(model) is None


def test_removal_without_restore_leaves_weights_on_the_host(model):
    swap = apply_block_swap(model, SwapSettings(2, 1), device="cpu")
    swap.remove(restore=False)
    assert all(p.device.type == "cpu" for p in model.parameters())
    # a parameter replaced by someone else is left alone
    swap = apply_block_swap(model, SwapSettings(2, 1), device="cpu")
    replacement = nn.Parameter(torch.zeros(16, 16))
    model.blocks[5].lin.weight = replacement
    assert not swap.is_intact()
    swap.remove()
    assert model.blocks[5].lin.weight is replacement


@dataclasses.dataclass
class Handle:
    model: object
    extra: dict = dataclasses.field(default_factory=dict)


def test_handle_carries_settings_without_touching_the_original(model):
    h = Handle(model)
    h2 = attach_swap_settings(h, SwapSettings(3, 2, True))
    assert h.extra == {} and h2.model is model
    assert handle_swap_settings(h2) == SwapSettings(3, 2, True) and handle_swap_settings(h) is None
    d = attach_swap_settings({"model": model}, SwapSettings(1, 1))
    assert handle_swap_settings(d).blocks_to_swap == 1


def test_sampler_oom_reaction_swaps_more_blocks_and_learns(model, tmp_path):
    cache = LimitCache(tmp_path / "limits.json")
    x = torch.randn(2, 16)
    with torch.no_grad():
        ref = model(x)
    seen, cleaned = [], []

    def chunk():
        swap = active_swap(model)
        n = swap.blocks_to_swap if swap is not None else 0
        seen.append(n)
        if n < 4:   # this "GPU" only fits two resident blocks
            raise torch.OutOfMemoryError("CUDA out of memory")
        with torch.no_grad():
            return model(x)

    out = run_with_swap_fallback(model, chunk, key="dit/test", cache=cache, step=1, device="cpu",
                                 on_oom=cleaned.append)
    assert torch.equal(out, ref) and seen == [0, 1, 2, 3, 4] and cleaned == [6, 5, 4, 3]
    assert cache.get(NAMESPACE, "dit/test")["size"] == 2 and active_swap(model).blocks_to_swap == 4
    seen.clear()
    assert torch.equal(run_with_swap_fallback(model, chunk, key="dit/test", cache=cache, device="cpu"), ref)
    assert seen == [4]   # the next run starts at the learned split
    active_swap(model).remove()
    with torch.no_grad():
        assert torch.equal(model(x), ref)


def test_offload_bench_runs_its_cpu_pass(capsys):
    import argparse

    from wan_accel.bench import memory as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--json"])
    if torch.cuda.is_available():
        pytest.skip("the GPU path is a benchmark, not a test")
    assert bench.run(args) == 0
    import json

    data = json.loads(capsys.readouterr().out)
    assert data["functional_pass"] and [r["blocks_swapped"] for r in data["rows"]] == [0, 2, 3]


def test_causal_wan_sampling_is_unchanged_by_block_swap():
    try:
        from run_helpers import generate_latents
        from wan_accel.model.tiny import tiny_causal_model
    except ImportError:
        pytest.skip("the causal Wan model is not part of this build")
    m = tiny_causal_model(0)
    ctx = torch.randn(1, m.config.text_len, m.config.text_dim, generator=torch.Generator().manual_seed(0))
    ref = generate_latents(m, ctx, 6, 8, 8, seed=1)
    n = len(m.blocks)
    swap = apply_block_swap(m, SwapSettings(n, 1, offload_embeddings=True), device="cpu")
    assert torch.equal(generate_latents(m, ctx, 6, 8, 8, seed=1), ref)
    assert swap.stats.copies > n
    swap.remove()
