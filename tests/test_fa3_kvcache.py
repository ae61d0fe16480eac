"""FlashAttention 3's append-and-attend (``flash_attn_with_kvcache``) as the cached self-attention's fused way, against
a stand-in with ``fa3-fwd`` 0.0.3's exact signature whose numbers come from torch: the chunk's keys/values land in
the slots ``cache_seqlens`` names and every cached key is attended; a wrong append position fails the check and is
never used; every case it cannot take (a wrapped ring, padding keys, another kernel, an fp8 copy, a build without
it) takes the separate write; a whole video through it equals the separate way's."""
import inspect
import sys
import types

import pytest
import torch

import speed_timer
from test_fa3_fwd import _forget as forget_fa3
from wan_accel.cache.autotune import get_autotuner
from wan_accel.kernels import candidates as C, registry
from wan_accel.model import attention as att
from wan_accel.model import cached_attention as ca
from wan_accel.model.kv_cache import KVCache

# fa3_fwd_interface.flash_attn_with_kvcache's parameters, in order (fa3-fwd 0.0.3)
WHEEL_PARAMS = ["q", "k_cache", "v_cache", "k", "v", "qv", "rotary_cos", "rotary_sin", "cache_seqlens",
                "cache_batch_idx", "cache_leftpad", "page_table", "cu_seqlens_q", "cu_seqlens_k_new", "max_seqlen_q",
                "rotary_seqlens", "q_descale", "k_descale", "v_descale", "softmax_scale", "causal", "window_size",
                "attention_chunk", "softcap", "rotary_interleaved", "scheduler_metadata", "num_splits", "pack_gqa",
                "sm_margin", "return_softmax_lse"]


def _stand_in(calls: list, shift: int = 0):
    """fa3_fwd_interface with flash_attn_func and flash_attn_with_kvcache (0.0.3's signatures): k/v appended into
    the caches at cache_seqlens[b] (+ ``shift``: a wrong append position) in place, then softmax attention of q over
    slots [0, cache_seqlens[b] + rows), float32 math."""
    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                        v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                        pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
        return att.attention_reference(q, k, v)

    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                                cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                                q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                                window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                                scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                                return_softmax_lse=False):
        assert not causal and rotary_cos is None and window_size == (-1, -1) and page_table is None
        assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
        assert cache_seqlens.dtype == torch.int32 and tuple(cache_seqlens.shape) == (q.shape[0],)
        assert k.dtype == k_cache.dtype == q.dtype
        calls.append({"seqlens": cache_seqlens.tolist(), "num_splits": num_splits, "rows": k.shape[1],
                      "grad": torch.is_grad_enabled()})
        outs = []
        for b, n in enumerate(cache_seqlens.tolist()):
            at = n + shift
            k_cache[b, at:at + k.shape[1]] = k[b]
            v_cache[b, at:at + v.shape[1]] = v[b]
            end = n + k.shape[1]
            outs.append(att.attention_reference(q[b:b + 1], k_cache[b:b + 1, :end], v_cache[b:b + 1, :end]))
        out = torch.cat(outs).to(q.dtype)
        return (out, None) if return_softmax_lse else out

    mod = types.ModuleType("fa3_fwd_interface")
    mod.flash_attn_func, mod.flash_attn_with_kvcache = flash_attn_func, flash_attn_with_kvcache
    return mod


def _forget():
    forget_fa3()
    ca._FN.clear()
    ca._VERDICT.clear()


def _install(monkeypatch, mod, kernel="fa3.split2", faster=True):
    """The stand-in as the installed FA3; every cached call's exact kernel ``kernel``; the fused-or-separate
    verdict measured on this CPU with set times (fused 1 ms / 4 ms, separate 2 ms)."""
    _forget()
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", mod)
    monkeypatch.setattr(att, "kernel_of", lambda q, k, v, backend: kernel)
    monkeypatch.setattr(registry, "SPEED_DEVICES", ("cuda", "cpu"))
    return speed_timer.install(monkeypatch, slow=not faster)


@pytest.fixture
def wheel(monkeypatch):
    calls: list = []
    _install(monkeypatch, _stand_in(calls))
    yield calls
    _forget()


def _qkv_cache(batch=2, cap=40, start=16, rows=8, heads=3, hd=16, seed=3):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, rows, heads, hd, generator=g) for _ in range(3))
    kc, vc = (torch.randn(batch, cap, heads, hd, generator=g) for _ in range(2))
    return q, k, v, kc, vc, torch.full((batch,), start, dtype=torch.int32), start, start + rows


def test_the_stand_in_has_the_wheels_signature():
    assert list(inspect.signature(_stand_in([]).flash_attn_with_kvcache).parameters) == WHEEL_PARAMS


def test_the_append_lands_in_the_named_slots_and_every_cached_key_is_attended(wheel):
    q, k, v, kc, vc, lens, start, end = _qkv_cache()
    want_k, want_v = kc.clone(), vc.clone()
    want_k[:, start:end], want_v[:, start:end] = k, v
    want = att.attention_reference(q, want_k[:, :end], want_v[:, :end])
    out = ca.fused_attention(q, k, v, kc, vc, lens, splits=3)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    assert torch.allclose(out, want, atol=1e-6)
    assert wheel == [{"seqlens": [start, start], "num_splits": 3, "rows": 8, "grad": False}]


def test_the_cached_call_takes_the_fused_way_with_the_kernels_splits(wheel):
    q, k, v, kc, vc, lens, start, end = _qkv_cache()
    index = torch.arange(start, end)
    sep_k, sep_v = kc.clone(), vc.clone()
    want = ca._separate(q, k, v, sep_k, sep_v, index, slice(start, end), end, "sdpa")
    out = ca.cached_attention(q, k, v, kc, vc, index, slice(start, end), end, lens, backend="auto")
    assert torch.allclose(out, want, atol=1e-5) and torch.equal(kc, sep_k) and torch.equal(vc, sep_v)
    assert wheel[-1]["num_splits"] == 2 and wheel[-1]["seqlens"] == [start, start]
    n = len(wheel)
    ca.cached_attention(q, k, v, kc, vc, index, slice(start, end), end, lens, backend="auto")
    assert len(wheel) == n + 1                      # the verdict is kept: one call, nothing timed again


def test_a_wrong_append_position_fails_its_check_and_is_never_used(monkeypatch):
    calls: list = []
    _install(monkeypatch, _stand_in(calls, shift=1))
    q, k, v, kc, vc, lens, start, end = _qkv_cache()
    index = torch.arange(start, end)
    want = ca._separate(q, k, v, kc.clone(), vc.clone(), index, slice(start, end), end, "sdpa")
    out = ca.cached_attention(q, k, v, kc, vc, index, slice(start, end), end, lens, backend="auto")
    assert torch.allclose(out, want, atol=1e-5)     # the separate way's result
    assert ca.fused_speed(2, 8, end, 3, 16, torch.float32, "cpu", "auto", 2) is False
    entry = get_autotuner().entry(f"{ca.SPEED_KERNEL}@{C.autotune.TIMING}", "cpu|h3|d16|float32|b2|q8|k32|s2")
    assert "differs from writing then attending" in str(entry["failed"])
    _forget()


def test_measured_slower_it_writes_separately(monkeypatch):
    calls: list = []
    _install(monkeypatch, _stand_in(calls), faster=False)
    q, k, v, kc, vc, lens, start, end = _qkv_cache()
    index = torch.arange(start, end)
    ca.cached_attention(q, k, v, kc, vc, index, slice(start, end), end, lens, backend="auto")
    n = len(calls)                                  # the verdict's own calls
    ca.cached_attention(q, k, v, kc, vc, index, slice(start, end), end, lens, backend="auto")
    assert len(calls) == n and ca.fused_speed(2, 8, end, 3, 16, torch.float32, "cpu", "auto", 2) is False
    _forget()


def test_every_call_it_cannot_take_says_why(wheel, monkeypatch):
    q, k, v, kc, vc, lens, start, end = _qkv_cache()
    ok = ("fa3", q, k, kc, slice(start, end), end, lens)
    assert ca.fused_problem(*ok) is None
    assert "sdpa.cudnn" in ca.fused_problem("sdpa.cudnn", *ok[1:])
    assert "not FlashAttention 3" in ca.fused_problem(None, *ok[1:])
    assert "wrapped ring" in ca.fused_problem("fa3", q, k, kc, slice(start, end), kc.shape[1], lens)   # ring
    assert "wrapped ring" in ca.fused_problem("fa3", q, k, kc, None, end, None)                        # index only
    assert "dtype" in ca.fused_problem("fa3", q, k.double(), kc, slice(start, end), end, lens)
    assert "this batch" in ca.fused_problem("fa3", q, k, kc, slice(start, end), end, lens[:1])
    cache = KVCache(1, 2, 40, 3, 16)
    cache.plan(0, 8)
    cache.use_fp8(True)
    assert "fp8 copy" in ca.fused_problem("fa3", q, k, cache.layers[0].k, slice(start, end), end, lens)
    bare = types.ModuleType("fa3_fwd_interface")
    bare.flash_attn_func = _stand_in([]).flash_attn_func
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", bare)
    _forget()
    assert "has no flash_attn_with_kvcache" in ca.fused_problem(*ok)


def test_the_step_carries_its_first_slot_on_the_device_only_where_it_is_one_range():
    glob = KVCache(1, 2, 40, 1, 4)
    step = glob.plan(0, 8)
    assert step.seqlens.dtype == torch.int32 and step.seqlens.tolist() == [0, 0]
    assert glob.plan(8, 8).seqlens.tolist() == [8, 8]
    assert glob.plan(8, 8).seqlens is glob.plan(8, 8).seqlens              # one tensor per write pattern
    ring = KVCache(1, 1, 20, 1, 4, rolling=True, sink_tokens=4)
    for start in range(0, 24, 8):
        step = ring.plan(start, 8)
    assert step.span is None and step.seqlens is None                       # [16, 24) wraps: slots 12..15, 4..7
    krea = KVCache(1, 1, 40, 1, 4)
    krea.plan(0, 8)
    krea.pad_next(4)
    step = krea.plan(8, 8)
    assert step.read_len == 20 and step.span.stop == 16                      # padding keys: not fused


@pytest.mark.parametrize("window", [-1, 5])
def test_a_video_through_the_fused_way_equals_the_separate_ways(wheel, window):
    """The tiny model's optimized path: with the stand-in fused way every contiguous chunk appends inside the kernel
    (at its chunk's first slot, with the kernel's splits), a wrapped ring writes separately, and the video is the
    separate way's within float32 rounding."""
    from wan_accel.model.tiny import TINY_CONFIG, tiny_causal_model
    from run_helpers import generate_latents
    model = tiny_causal_model()
    ctx = torch.randn(1, 5, TINY_CONFIG.text_dim, generator=torch.Generator().manual_seed(1))
    kw = dict(kv_window=window, sink=1 if window > 0 else 0, seed=4, path="optimized")
    report: dict = {}
    fused = generate_latents(model, ctx, 15, 4, 6, report=report, **kw)
    # every verdict made before the first chunk, one per (query, key) length bucket of the run's self-attention:
    # keys 18, 36..54, 72..90 (global); 18, then 30 from the second chunk on (a 5-frame window)
    want = ("q18/k18", "q18/k54", "q18/k90") if window == -1 else ("q18/k30",)
    assert report["kv_append_in_kernel"] == dict.fromkeys(want, True)
    verdicts = dict(ca._VERDICT)
    starts = {c["seqlens"][0] for c in wheel if c["rows"] < 200}
    assert wheel and {c["num_splits"] for c in wheel} == {2}
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(ca, "fused_problem", lambda *a: "switched off for the comparison")
    try:
        n = len(wheel)
        separate = generate_latents(model, ctx, 15, 4, 6, **kw)
        assert len(wheel) == n                                               # nothing appended inside a kernel
    finally:
        monkeypatch.undo()
    assert (fused - separate).abs().max().item() <= 1e-5
    assert ca._VERDICT == verdicts                                          # nothing measured during the chunks
    chunk = 3 * (4 * 6 // 4)                 # 3 latent frames a chunk, 4 x 6 latents in 2 x 2 patches: 18 tokens
    if window == -1:
        assert starts == {0, chunk, 2 * chunk, 3 * chunk, 4 * chunk}          # each chunk at its own first slot
    else:
        # 5 frames hold 30 slots (6 sink + a 24-slot ring): chunk 1 wraps (slots 18..29 then 6..11: written
        # separately), chunk 2 fills slots 12..29, one range ending the attended ones (fused), chunk 3 wraps again
        assert starts == {0, 12}
