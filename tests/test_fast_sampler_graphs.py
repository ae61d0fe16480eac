"""Optimized path plumbing: CUDA-graph bookkeeping (with a stand-in backend on CPU), capture failures recorded in
the limit cache, attention backend choice, the fused q/k/v weight, options and path selection."""
import pytest
import torch

from wan_accel.cache import LimitCache
from wan_accel.model.attachments import model_signature
from wan_accel.model import attention as att
from wan_accel.sampling import runner as fast_runner
from wan_accel.model.fused_qkv import QKV_WEIGHT, ensure_fused_qkv, fused_qkv_intact
from wan_accel.sampling.runner import FastOptions, get_runner, release_buffers
from wan_accel.sampling.sampler import resolve_path
from run_helpers import generate_latents
from wan_accel.model.tiny import TINY_CONFIG, tiny_causal_model

CTX = torch.randn(1, 4, TINY_CONFIG.text_dim, generator=torch.Generator().manual_seed(0))


class FakeGraphs:
    """Stand-in for CudaGraphBackend: 'capture' runs fn once and keeps it; 'replay' reruns it into the same output
    tensor, so static-buffer plumbing (inputs read at replay time, outputs reused) is exercised for real."""
    instances: list = []

    def __init__(self, device, fail: bool = False):
        self.fail, self.captures, self.replays = fail, 0, 0
        FakeGraphs.instances.append(self)

    def capture(self, fn):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captures += 1
        out = fn()
        return (fn, out), out

    def replay(self, graph):
        self.replays += 1
        fn, out = graph
        new = fn()
        if out is not None:
            out.copy_(new)


@pytest.fixture
def fake_graphs(monkeypatch):
    FakeGraphs.instances = []
    monkeypatch.setattr(fast_runner, "graphs_device", lambda device: True)
    monkeypatch.setattr(fast_runner, "CudaGraphBackend", FakeGraphs)
    return FakeGraphs


def _run(model, report=None, oom_retry="off", **opts):
    from wan_accel.memory.sampling_guard import oom_guard
    guard = oom_guard(model, (1, 9, TINY_CONFIG.out_dim, 4, 6), 3, mode=oom_retry)
    return generate_latents(model, CTX, 9, 4, 6, seed=2, path="optimized", fast_options=opts,
                            report=report if report is not None else {}, chunk_guard=guard)


def test_graphs_capture_on_second_use_then_replay(fake_graphs):
    model = tiny_causal_model()
    expected = generate_latents(model, CTX, 9, 4, 6, seed=2, path="reference")
    reports = [{}, {}, {}]
    outs = [_run(model, r) for r in reports]
    for out in outs:
        assert (out - expected).abs().max().item() <= 1e-5
    assert torch.equal(outs[0], outs[2])
    g = [r["graphs"] for r in reports]
    assert reports[0]["cuda_graphs"] and g[0]["enabled"]
    # run 1: 3 denoise keys captured at their 2nd step (the 1st warms up), and the 2 refresh keys (last refresh
    # skipped) captured at their 1st call: their chunk's denoise calls warmed the same shapes and write plan
    assert g[0]["captures"] == 5 and g[0]["eager_calls"] == 3 and g[0]["replays"] == 11
    assert g[1]["captures"] == 5 and g[1]["graphs"] == 5          # run 2 captures nothing new (cumulative)
    assert g[2]["captures"] == 5 and g[2]["eager_calls"] == g[1]["eager_calls"]   # run 3: replays only
    assert len(fake_graphs.instances) == 1                        # one manager for the session


def test_new_prompt_and_new_geometry_keep_graphs_correct(fake_graphs):
    model = tiny_causal_model()
    other = torch.randn(1, 6, TINY_CONFIG.text_dim, generator=torch.Generator().manual_seed(9))
    _run(model)
    _run(model)
    got = generate_latents(model, other, 9, 4, 6, seed=2, path="optimized")            # new prompt, replayed
    want = generate_latents(model, other, 9, 4, 6, seed=2, path="reference")
    assert (got - want).abs().max().item() <= 1e-5
    got = generate_latents(model, other, 9, 4, 6, seed=2, path="optimized",             # other switches
                           fast_options={"fused_qkv": False, "lean_refresh": False})
    assert (got - want).abs().max().item() <= 1e-5
    got = generate_latents(model, other, 6, 4, 4, seed=2, path="optimized")            # new geometry
    want = generate_latents(model, other, 6, 4, 4, seed=2, path="reference")
    assert (got - want).abs().max().item() <= 1e-5


def test_capture_failure_is_recorded_and_not_retried(monkeypatch, cache_path):
    FakeGraphs.instances = []
    monkeypatch.setattr(fast_runner, "graphs_device", lambda device: True)
    monkeypatch.setattr(fast_runner, "CudaGraphBackend", lambda device: FakeGraphs(device, fail=True))
    model = tiny_causal_model()
    expected = generate_latents(model, CTX, 9, 4, 6, seed=2, path="reference")
    report = {}
    assert (_run(model, report) - expected).abs().max().item() <= 1e-5      # fell back to eager
    assert not report["graphs"]["enabled"] and "not permitted" in report["graphs"]["error"]
    entry = LimitCache(cache_path).get("sampler", f"cuda_graphs/{model_signature(model)}")
    assert entry["ok"] is False and "not permitted" in entry["error"]
    release_buffers(model)
    again = {}
    assert (_run(model, again) - expected).abs().max().item() <= 1e-5
    assert again["cuda_graphs"] is False and "capture failed earlier" in again["cuda_graphs_reason"]
    assert len(FakeGraphs.instances) == 1                          # no second manager, no second try


def test_graphs_off_when_switched_off_or_swapped(fake_graphs):
    from wan_accel.memory.block_swap import ensure_block_swap, SwapSettings
    model = tiny_causal_model()
    report = {}
    _run(model, report, cuda_graphs="off")
    assert report["cuda_graphs"] is False and report["cuda_graphs_reason"] == "switched off"
    ensure_block_swap(model, SwapSettings(blocks_to_swap=1), device="cpu")
    try:
        report = {}
        out = _run(model, report)
        assert report["cuda_graphs"] is False and "block swap" in report["cuda_graphs_reason"]
        assert report["swapped_blocks"] == 1 and report["fused_qkv_blocks"] == 1     # swapped block stays unfused
    finally:
        ensure_block_swap(model, None)
    ref = generate_latents(model, CTX, 9, 4, 6, seed=2, path="reference")
    assert (out - ref).abs().max().item() <= 1e-5


def test_a_swap_installed_during_a_run_turns_graphs_off(fake_graphs):
    """A learned limit installs the swap inside the first chunk (after start): graphs must not be captured then."""
    from wan_accel.memory.block_swap import active_swap, ensure_block_swap
    model = tiny_causal_model()
    expected = generate_latents(model, CTX, 9, 4, 6, seed=2, path="reference")
    calls = [0]

    def oom_once(_module, _args):
        calls[0] += 1
        if calls[0] == 7:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    handle = model.blocks[1].register_forward_pre_hook(oom_once)
    try:
        _run(model, oom_retry="on")                      # learns: one block resident
    finally:
        handle.remove()
        ensure_block_swap(model, None)
    release_buffers(model)
    report = {}
    try:
        out = _run(model, report, oom_retry="on")        # starts unswapped; chunk 0 installs the learned swap
        assert active_swap(model) is not None
    finally:
        ensure_block_swap(model, None)
    assert (out - expected).abs().max().item() <= 1e-5
    assert len(fake_graphs.instances) == 2 and fake_graphs.instances[-1].captures == 0
    assert report["cuda_graphs"] is False and "block swap" in report["cuda_graphs_reason"]


def test_keep_buffers_and_release():
    model = tiny_causal_model()
    _run(model, keep_buffers=False)
    assert get_runner(model).session is None
    _run(model)
    assert get_runner(model).session is not None
    assert release_buffers(model) and get_runner(model).session is None


# ----------------------------------------------------------------------------- attention backends
def test_backend_choice_by_capability_dtype_and_head_size(monkeypatch):
    monkeypatch.setitem(att._FUNCS, "fa3", lambda q, k, v: (q, None))
    monkeypatch.setitem(att._FUNCS, "fa2", lambda q, k, v: q)
    bf16 = torch.bfloat16
    assert att.explain_backend("auto", "cuda:0", bf16, 128, capability=(9, 0))[0] == "fa3"
    assert att.explain_backend("auto", "cuda:0", bf16, 128, capability=(8, 0))[0] == "fa2"
    assert att.explain_backend("auto", "cuda:0", bf16, 128, capability=(10, 0))[0] == "fa2"
    assert att.explain_backend("auto", "cuda:0", bf16, 128, capability=(7, 5))[0] == "sdpa"
    assert att.explain_backend("auto", "cuda:0", torch.float32, 128, capability=(9, 0))[0] == "sdpa"
    assert att.explain_backend("auto", "cuda:0", bf16, 100, capability=(9, 0))[0] == "sdpa"
    assert att.explain_backend("auto", "cpu", bf16, 128)[0] == "sdpa"
    assert att.explain_backend("fa2", "cuda:0", bf16, 128, capability=(9, 0))[0] == "fa2"
    name, why = att.explain_backend("fa3", "cuda:0", bf16, 128, capability=(8, 6))
    assert name == "sdpa" and "8.6 not supported" in why
    monkeypatch.setitem(att._FUNCS, "fa3", None)
    name, why = att.explain_backend("auto", "cuda:0", bf16, 128, capability=(9, 0))
    assert name == "fa2" and "fa3: flash_attn_interface or fa3_fwd_interface not installed" in why


def test_flash_return_types_are_both_handled(monkeypatch):
    q = torch.randn(1, 3, 2, 8)
    monkeypatch.setitem(att._FUNCS, "fa3", lambda q, k, v: (q * 2, torch.zeros(1)))
    monkeypatch.setitem(att._FUNCS, "fa2", lambda q, k, v: q * 3)
    assert torch.equal(att._flash("fa3", q, q, q), q * 2)
    assert torch.equal(att._flash("fa2", q, q, q), q * 3)
    # on a CPU tensor a resolved FlashAttention name still runs SDPA (FlashAttention needs CUDA half tensors)
    torch.testing.assert_close(att.attention(q, q, q, backend="fa3"), att.attention(q, q, q, backend="sdpa"))


def test_forcing_a_missing_flash_attention_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(att._FUNCS, "fa3", None)
    with pytest.raises(RuntimeError, match="flash_attn_interface or fa3_fwd_interface does not import"):
        att.check_backend("fa3")


# ----------------------------------------------------------------------------- fused q/k/v weight
def test_fused_qkv_keeps_the_state_dict_and_heals_after_a_dtype_change():
    model = tiny_causal_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _run(model)
    sa = model.blocks[0].self_attn
    assert fused_qkv_intact(sa) and QKV_WEIGHT in dict(sa.named_buffers())
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    w = getattr(sa, QKV_WEIGHT)
    assert sa.k.weight.data_ptr() == w.data_ptr() + sa.q.weight.numel() * w.element_size()
    model.set_precision("self_forcing", torch.bfloat16)            # breaks the views
    assert not fused_qkv_intact(sa)
    assert ensure_fused_qkv(sa) and fused_qkv_intact(sa) and getattr(sa, QKV_WEIGHT).dtype == torch.bfloat16
    assert torch.equal(sa.q.weight.float(), before["blocks.0.self_attn.q.weight"].bfloat16().float())


# ----------------------------------------------------------------------------- options and path
def test_options_validation_and_path_choice():
    with pytest.raises(ValueError, match="cuda_graphs"):
        FastOptions(cuda_graphs="always")
    from wan_accel.memory.sampling_guard import oom_guard
    with pytest.raises(ValueError, match="oom_retry"):
        oom_guard(tiny_causal_model(), (1, 3, 16, 4, 4), 3, mode="sometimes")
    assert oom_guard(tiny_causal_model(), (1, 3, 16, 4, 4), 3, mode="auto") is None      # CPU: errors pass through
    assert FastOptions.coerce({"fused_kernels": False}).fused_kernels is False
    assert resolve_path("auto", "cpu") == "reference"
    assert resolve_path("auto", "cuda") == "optimized"
    assert resolve_path("auto", "cuda", tracer=print) == "reference"
    model = tiny_causal_model()
    model.forward_chunk = model.forward_chunk                      # replaced on the instance (e.g. a capture)
    assert resolve_path("auto", "cuda", model=model) == "reference"
    assert resolve_path("optimized", "cpu") == "optimized" and resolve_path("reference", "cuda") == "reference"
    with pytest.raises(ValueError, match="sampler path"):
        resolve_path("fastest", "cpu")
