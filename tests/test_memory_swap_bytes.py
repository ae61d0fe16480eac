"""Block swap holds and moves each weight once (fused q/k/v views move with their buffer), and pins within its
budget as the pinned allocator counts (power-of-two allocations), on every path."""
from __future__ import annotations

import torch
from torch import nn

from wan_accel.memory import block_swap as bs
from wan_accel.memory import pinned
from wan_accel.memory.block_swap import BlockSwap, SwapSettings, apply_block_swap, run_with_swap_fallback

try:  # the fused q/k/v helper moves with the one-engine rewrite
    from wan_accel.model.fused_qkv import ensure_fused_qkv, fused_qkv_intact
except ImportError:
    from wan_accel.model.fast_block import ensure_fused_qkv, fused_qkv_intact


def _pow2(n: int) -> int:
    """What torch's pinned (host) allocator takes for n bytes: the next power of two."""
    return 1 << (int(n) - 1).bit_length()


def _nbytes(t):
    return t.numel() * t.element_size()


def _unique_bytes(module) -> int:
    """Bytes of every distinct piece of memory of a module (a view into a buffer counts once)."""
    ranges = {}
    for t in list(module.parameters()) + list(module.buffers()):
        key = t.untyped_storage().data_ptr()
        lo = t.storage_offset() * t.element_size()
        hi = lo + _nbytes(t)
        a, b = ranges.get(key, (lo, hi))
        ranges[key] = (min(a, lo), max(b, hi))
    return sum(b - a for a, b in ranges.values())


def _fused_tiny():
    from wan_accel.model.tiny import tiny_causal_model

    model = tiny_causal_model(0)
    for block in model.blocks:
        assert ensure_fused_qkv(block.self_attn)
    return model


def test_fused_qkv_block_is_held_and_copied_once():
    model = _fused_tiny()
    blocks = model.blocks
    n = len(blocks)
    unique = sum(_unique_bytes(b) for b in blocks)
    naive = sum(_nbytes(t) for b in blocks for t in list(b.parameters()) + list(b.buffers()))
    assert naive > unique  # the fused buffer duplicates q/k/v when counted per tensor
    x = torch.randn(1, 8, model.config.dim)
    ref = [blk.self_attn.q(x) + blk.self_attn.k(x) for blk in blocks]
    swap = BlockSwap(blocks, blocks_to_swap=n, device="cpu")
    try:
        assert swap.stats.swapped_bytes == unique
        intact = []
        for blk in blocks:   # after the swap's own pre-hook: the device copies are views of one buffer again
            blk.register_forward_pre_hook(lambda m, args: intact.append(fused_qkv_intact(m.self_attn)))
        for i, blk in enumerate(blocks):
            swap._before(i)
            intact.append(fused_qkv_intact(blk.self_attn))
            assert torch.equal(blk.self_attn.q(x) + blk.self_attn.k(x), ref[i])
            swap._after(i)
        assert all(intact)
        assert swap.stats.copies == n and swap.stats.bytes_copied == unique
    finally:
        swap.remove()
    assert all(fused_qkv_intact(b.self_attn) for b in blocks)


def test_fused_model_samples_identically_under_swap():
    from run_helpers import generate_latents

    model = _fused_tiny()
    ctx = torch.randn(1, model.config.text_len, model.config.text_dim, generator=torch.Generator().manual_seed(0))
    ref = generate_latents(model, ctx, 6, 8, 8, seed=1)
    swap = apply_block_swap(model, SwapSettings(len(model.blocks), 1), device="cpu")
    try:
        assert torch.equal(generate_latents(model, ctx, 6, 8, 8, seed=1), ref)
        per_forward = swap.stats.swapped_bytes
        assert swap.stats.bytes_copied == swap.stats.copies * per_forward // len(model.blocks)
    finally:
        swap.remove()


def test_disjoint_tensors_of_one_storage_are_not_copied_together():
    flat = torch.randn(1000)
    lin = nn.Linear(4, 4)
    lin.weight.data = flat[100:116].view(4, 4)
    lin.bias.data = flat[900:904]
    swap = BlockSwap(nn.ModuleList([lin]), blocks_to_swap=1, device="cpu")
    assert swap.stats.swapped_bytes == 20 * 4  # not the 804 elements between them
    swap.remove()


class _Recorder:
    def __init__(self):
        self.sizes = []

    def __call__(self, nbytes):
        self.sizes.append(int(nbytes))
        return torch.empty(int(nbytes), dtype=torch.uint8)


def _stack(n=4, dim=48):
    torch.manual_seed(0)
    return nn.ModuleList(nn.Sequential(nn.Linear(dim, 3 * dim), nn.GELU(), nn.Linear(3 * dim, dim)) for _ in range(n))


def test_pinned_total_is_counted_as_the_allocator_takes_it():
    blocks = _stack()
    raw = sum(_nbytes(p) for b in blocks for p in b.parameters())
    x = torch.randn(2, 48)
    ref = x
    for b in blocks:
        ref = b(ref)
    alloc = _Recorder()
    limit = int(raw * 1.1)   # enough for the raw bytes, not for per-tensor power-of-two rounding
    swap = BlockSwap(blocks, blocks_to_swap=4, device="cpu", pin_memory=True, pin_limit_bytes=limit,
                     pinned_alloc=alloc)
    try:
        taken = sum(_pow2(s) for s in alloc.sizes)   # what pin_memory=True really takes
        assert alloc.sizes and taken == swap.stats.pinned_bytes <= limit
        out = x
        for b in blocks:
            out = b(out)
        assert torch.equal(out, ref)
    finally:
        swap.remove()


def test_per_tensor_pinning_would_overshoot_the_budget():
    sizes = [141_557_760, 52_428_800, 52_428_800]       # a 14B FFN weight and two attention weights (bf16)
    per_tensor = sum(_pow2(s) for s in sizes)
    assert per_tensor >= 1.3 * sum(sizes)
    n, footprint = pinned.plan_pinned([[s] for s in sizes])
    assert n == 3 and footprint < per_tensor
    assert pinned.plan_pinned([[s] for s in sizes], budget=sum(sizes) + 1)[0] < 3   # what no longer fits stays pageable


def test_every_swap_path_is_capped_by_the_machine_pin_budget(monkeypatch):
    """The out-of-memory fallback (and the job / handle, which call apply_block_swap without a limit) pin no
    more than this machine's pinned budget."""
    alloc = _Recorder()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pinned, "default_pinned_alloc", alloc)
    monkeypatch.setattr(bs, "default_pin_limit", lambda: 64 * 1024)
    model = nn.Module()
    model.blocks = _stack(n=6)
    raw = sum(_nbytes(p) for p in model.blocks.parameters())
    assert raw > 2 * 64 * 1024

    x0 = torch.randn(2, 48)

    def run():
        x = x0
        for b in model.blocks:
            x = b(x)
        return x

    with torch.no_grad():
        ref = run()
        out = run_with_swap_fallback(model, run, key=None, settings=SwapSettings(6, 1, pin_memory=True), device="cpu")
    swap = bs.active_swap(model)
    try:
        assert torch.equal(out, ref)
        assert 0 < sum(_pow2(s) for s in alloc.sizes) <= 64 * 1024
        assert swap.stats.pinned_bytes == sum(alloc.sizes)
    finally:
        swap.remove()


def test_plan_shows_the_pinned_total():
    from wan_accel.memory.estimate import Workload
    from wan_accel.memory.plan import make_plan
    from wan_accel.memory.system import SystemInfo
    from wan_accel.memory.weights import preset_weights

    weights = preset_weights("14b")
    plan = make_plan(weights, Workload(832, 480, 81), SystemInfo.simulated_gpu(16, ram_gb=128))
    assert plan.blocks_to_swap > 0 and plan.pinned_bytes > 0
    swapped = sum(weights.block_bytes_at(2)[-plan.blocks_to_swap:])
    assert swapped <= plan.pinned_bytes < 1.1 * swapped   # packed: far below per-tensor rounding
    assert "pinned host RAM" in plan.summary()
