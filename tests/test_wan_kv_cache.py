"""KV cache: host-side ring-buffer plans, and the rolling window against a from-scratch windowed recompute."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from wan_accel.model.config import WanConfig
from wan_accel.model.kv_cache import CacheStep, KVCache
from kv_reference import ShiftingCache
from wan_accel.model.dit import WanModel
from run_helpers import run_causal
from wan_accel.model.tiny import init_tiny_weights

CFG = WanConfig(dim=32, ffn_dim=64, num_heads=2, num_layers=2, text_dim=16, text_len=4, freq_dim=8)
FRAME_TOKENS = 4            # latent 4x4 -> 2x2 patches


def _cache(frames, sink=0, window=None, total=12):
    return KVCache(1, 1, (window or total) * FRAME_TOKENS, 1, 2, rolling=window is not None,
                   sink_tokens=sink * FRAME_TOKENS)


def test_global_plan_is_absolute():
    kv = _cache(12)
    assert kv.plan(0, 12) == CacheStep(((0, 12, 0, 12),), 12)
    assert kv.plan(0, 12) == CacheStep(((0, 12, 0, 12),), 12)       # recompute the same chunk
    assert kv.plan(12, 12) == CacheStep(((12, 24, 0, 12),), 24)
    with pytest.raises(ValueError, match="gap"):
        kv.plan(40, 12)


def test_ring_plan_wraps_without_moving_data():
    kv = _cache(12, sink=1, window=7)                 # 28 slots: 4 sink + 24 ring
    ptr = kv.layers[0].k.data_ptr()
    assert kv.plan(0, 12).writes == ((0, 4, 0, 4), (4, 12, 4, 12))
    assert kv.plan(12, 12).writes == ((12, 24, 0, 12),)
    step = kv.plan(24, 12)                            # tokens 24..35 -> ring offsets 20..23, 0..7
    assert step.writes == ((24, 28, 0, 4), (4, 12, 4, 12)) and step.read_len == 28
    assert kv.plan(24, 12).writes == step.writes      # later steps of the same chunk hit the same slots
    assert kv.layers[0].k.data_ptr() == ptr
    with pytest.raises(ValueError, match="only appends the next chunk"):
        kv.plan(12, 12)


def test_ordered_view_is_chronological():
    kv = KVCache(1, 1, 5, 1, 1, rolling=True, sink_tokens=1)
    for start in range(0, 9, 3):
        step = kv.plan(start, 3)
        vals = torch.arange(start, start + 3, dtype=torch.float32).reshape(1, 3, 1, 1)
        kv.layers[0].update(vals, vals, step)
    k, _ = kv.ordered(0)
    assert k.flatten().tolist() == [0, 5, 6, 7, 8]


def test_window_must_hold_a_chunk():
    kv = _cache(12, sink=2, window=4)
    with pytest.raises(ValueError, match="does not fit the rolling window"):
        kv.plan(0, 12)


FRAMES = 9
SCHEDULE = {"preset": "custom", "steps": [1000, 500], "shift": 5.0}


def _run(model, cache=None, frames_per_block=3, **kw):
    g = torch.Generator().manual_seed(5)
    noise = torch.randn(1, FRAMES, 16, 4, 4, generator=g)
    ctx = torch.randn(1, 3, CFG.text_dim, generator=g)
    return run_causal(model, ctx, noise, SCHEDULE, frames_per_block, generator=torch.Generator().manual_seed(9),
                         kv_cache=cache, **kw)


@pytest.fixture(scope="module")
def model():
    return init_tiny_weights(WanModel(CFG), 1).eval()


@pytest.fixture(scope="module")
def global_result(model):
    return _run(model)


@pytest.mark.parametrize("window,sink", [(6, 0), (7, 1), (5, 2)])
def test_rolling_window_equals_windowed_recompute(model, global_result, window, sink):
    ring = _run(model, kv_window=window, sink=sink)
    ref = _run(model, ShiftingCache(CFG.num_layers, 1, window * FRAME_TOKENS, CFG.num_heads, CFG.dim // CFG.num_heads,
                                    sink=sink * FRAME_TOKENS))
    torch.testing.assert_close(ring, ref, rtol=0, atol=1e-5)
    assert not torch.allclose(ring, global_result, atol=1e-4)      # the window really limits attention


def test_window_covering_the_video_is_global(model, global_result):
    assert torch.equal(_run(model, kv_window=FRAMES), global_result)


def test_a_sink_that_leaves_no_room_for_a_chunk_is_refused_in_frames_before_any_work(model):
    calls = []
    handle = model.blocks[0].register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=r"window of 4 latent frames cannot hold 2 sink frame\(s\) plus one "
                                             r"3-frame chunk; use kv_window >= 5 or sink <= 1"):
            _run(model, kv_window=4, sink=2)
        with pytest.raises(ValueError, match="sink must be at least 0"):
            _run(model, kv_window=6, sink=-1)
        with pytest.raises(ValueError, match="cannot hold 3 sink"):       # even when the video is shorter than
            _run(model, kv_window=FRAMES + 1, sink=3, frames_per_block=9)  # the window (one chunk)
        with pytest.raises(ValueError, match="needs a rolling KV window"):
            _run(model, sink=1)
    finally:
        handle.remove()
    assert not calls                                   # refused before the first model call
    _run(model, kv_window=5, sink=2)                   # the suggested values pass


def test_a_contiguous_write_is_one_slice_and_a_wrapped_one_keeps_its_index():
    kv = _cache(12, sink=1, window=7)                 # 28 slots: 4 sink + 24 ring
    assert kv.plan(0, 12).span == slice(0, 12)        # split at the sink, contiguous in the slots: one range
    assert kv.plan(12, 12).span == slice(12, 24)
    assert kv.plan(24, 12).span is None               # wraps: ring offsets 20..23, then 0..7
    assert _cache(12).plan(0, 12).span == slice(0, 12)


@pytest.mark.parametrize("sink,window", [(0, None), (1, 7), (0, 5)])
def test_slice_writes_leave_the_cache_as_index_writes_do(sink, window):
    """Every chunk of a video written through the step (slice where it can) against index_copy_ everywhere."""
    g = torch.Generator().manual_seed(0)
    fast, plain = _cache(12, sink, window), _cache(12, sink, window)
    spans = []
    for start in range(0, 48, 12):
        rows = torch.randn(1, 12, 1, 2, generator=g, dtype=torch.float64).float()
        step, ref = fast.plan(start, 12), plain.plan(start, 12)
        spans.append(step.span is not None)
        fast.layers[0].update(rows, 2 * rows, step)
        plain.layers[0].k.index_copy_(1, ref.index, rows)
        plain.layers[0].v.index_copy_(1, ref.index, 2 * rows)
        assert torch.equal(fast.layers[0].k, plain.layers[0].k) and torch.equal(fast.layers[0].v, plain.layers[0].v)
    assert all(spans) if window is None else any(spans) and not all(spans)    # a ring wraps within 4 chunks


def test_a_contiguous_step_dispatches_no_index_copy():
    from wan_accel.profiling.dispatch_counts import DispatchCounts
    kv = _cache(12, sink=1, window=7)
    rows = torch.ones(1, 12, 1, 2)
    with DispatchCounts() as c:
        kv.layers[0].update(rows, rows, kv.plan(0, 12))
    assert "index_copy_" not in {n.split(".")[0] for n in c.op_names} and c.kv_write_bytes == 2 * 12 * 2 * 4
    kv.plan(12, 12)
    with DispatchCounts() as c:
        kv.layers[0].update(rows, rows, kv.plan(24, 12))          # wrapped: index_copy_
    assert any(n.startswith("index_copy") for n in c.op_names) and c.kv_write_bytes == 2 * 12 * 2 * 4


class _Copies(TorchDispatchMode):
    """The dtypes of the copies the code under it runs."""

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.dtypes.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_strided_value_write_copies_8_byte_words_bit_for_bit(dtype):
    """The values of the fused q/k/v output (rows 3 x width apart) go into their cache slots as 8-byte words: the
    same bits as an element copy, neighbouring slots untouched."""
    from wan_accel.model.kv_cache import WIDE, copy_rows
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 30, 3 * 64, generator=g).to(dtype)
    v = qkv[..., 128:].unflatten(2, (4, 16))
    cache = torch.full((2, 50, 4, 16), 7.0, dtype=dtype)
    with _Copies() as seen:
        copy_rows(cache[:, 10:40], v)
    assert seen.dtypes == [WIDE]
    assert torch.equal(cache[:, 10:40], v)
    assert (cache[:, :10] == 7).all() and (cache[:, 40:] == 7).all()


@pytest.mark.parametrize("case", ["cast", "odd_stride", "misaligned", "broadcast"])
def test_copies_that_cannot_be_words_stay_element_copies(case):
    from wan_accel.model.kv_cache import copy_rows
    g = torch.Generator().manual_seed(1)
    dst = torch.zeros(1, 8, 2, 6, dtype=torch.bfloat16)
    src = {"cast": torch.randn(1, 8, 2, 6, generator=g),                                  # float32 into bf16
           "odd_stride": torch.randn(1, 8, 2, 7, generator=g).to(torch.bfloat16)[..., :6],  # rows 7 apart
           "misaligned": torch.randn(1, 8 * 12 + 1, generator=g).to(torch.bfloat16)[:, 1:].view(1, 8, 2, 6),
           "broadcast": torch.randn(1, 1, 2, 6, generator=g).to(torch.bfloat16)}[case]
    with _Copies() as seen:
        copy_rows(dst, src)
    assert seen.dtypes == [torch.bfloat16]
    assert torch.equal(dst, src.to(torch.bfloat16).expand_as(dst))
