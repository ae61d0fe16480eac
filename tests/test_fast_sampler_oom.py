"""Out-of-memory inside a chunk: swap more blocks, redo the chunk with the same noise, remember what worked."""
import pytest
import torch

from wan_accel.cache import LimitCache
from wan_accel.memory.block_swap import active_swap, ensure_block_swap
from wan_accel.memory.oom import NoFitError
from wan_accel.memory.sampling_guard import oom_guard
from run_helpers import generate_latents
from wan_accel.model.tiny import TINY_CONFIG, tiny_causal_model

CTX = torch.randn(1, 4, TINY_CONFIG.text_dim, generator=torch.Generator().manual_seed(0))


def _oom_at(block, calls: set):
    """Pre-hook raising CUDA-style out-of-memory at the given call numbers of ``block``."""
    seen = [0]

    def hook(_module, _args):
        seen[0] += 1
        if seen[0] in calls or "all" in calls:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    return block.register_forward_pre_hook(hook)


def test_oom_in_a_chunk_swaps_a_block_and_redoes_the_chunk(cache_path):
    model = tiny_causal_model()
    expected = generate_latents(model, CTX, 9, 4, 6, seed=3, path="optimized")
    # block 1 runs once per forward: call 7 is chunk 1, step 2 (after two re-noising draws of that chunk)
    handle = _oom_at(model.blocks[1], {7})
    try:
        report = {}
        out = generate_latents(model, CTX, 9, 4, 6, seed=3, path="optimized", report=report,
                               chunk_guard=oom_guard(model, (1, 9, TINY_CONFIG.out_dim, 4, 6), 3, mode="on"))
        swap = active_swap(model)
        assert swap is not None and swap.blocks_to_swap == 1
    finally:
        handle.remove()
        ensure_block_swap(model, None)
    assert torch.equal(out, expected)                  # same noise on the retry: same video
    learned = [e for e in LimitCache(cache_path).entries("memory") if e["key"].startswith("dit/")]
    assert learned and learned[0]["value"]["size"] == 1 and learned[0]["value"]["failed"] == 2


def test_when_nothing_fits_the_error_says_so_and_the_model_stays_usable():
    model = tiny_causal_model()
    handle = _oom_at(model.blocks[0], {"all"})
    try:
        with pytest.raises(NoFitError, match="ran out of memory"):
            generate_latents(model, CTX, 6, 4, 6, seed=3, path="optimized",
                             chunk_guard=oom_guard(model, (1, 6, TINY_CONFIG.out_dim, 4, 6), 3, mode="on"))
    finally:
        handle.remove()
        ensure_block_swap(model, None)
    out = generate_latents(model, CTX, 6, 4, 6, seed=3, path="optimized")
    ref = generate_latents(model, CTX, 6, 4, 6, seed=3, path="reference")
    assert (out - ref).abs().max().item() <= 1e-5
