"""The native MODEL path (nodes/comfy/native_engine.py over model/borrowed.py) as lean as the pack's own optimized path:
one host read per video, one q/k/v GEMM over the owner's own weights when they are plain (off, with a reason,
when its layers cast or patch them), the pack's out-of-memory retry, and a shorter last block as core accepts.
ComfyUI is stood in for by the guider/BaseModel stand-ins of test_native_sampler.py."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from wan_accel.cache import LimitCache
from wan_accel.memory.block_swap import active_swap
from wan_accel.model.fused_qkv import QKV_WEIGHT
from wan_accel.model.kv_cache import CrossAttnCache, KVCache
from wan_accel.model.tiny import TINY_CONFIG, tiny_causal_model
from wan_accel.nodes.comfy.native_engine import RECORDED_NOISE_KEY, sample_wan_accel
from wan_accel.profiling.dispatch_counts import DispatchCounts
from run_helpers import run_causal
from wan_accel.sampling.scheduler import FlowMatchScheduler, resolve_schedule, schedule_from_sigmas

from .test_native_sampler import _native, _recorded
from tests.test_fast_sampler_oom import _oom_at   # the one OOM-injecting hook of the tests

SCHED = resolve_schedule("self_forcing")
SIGMAS = torch.tensor(SCHED.sigmas())
EPS32 = torch.finfo(torch.float32).eps


def _inputs(frames=6, seed=5):
    ctx = torch.randn(1, 5, TINY_CONFIG.text_dim, generator=torch.Generator().manual_seed(4))
    noise = torch.randn(1, frames, 16, 8, 8, generator=torch.Generator().manual_seed(seed))      # [B, F, C, H, W]
    return ctx, noise


def _run(model, ctx, noise, rec=None, **kw):
    model_k, _ = _native(model, ctx)
    opts = {"seed": 1}
    if rec is not None:
        opts["model_options"] = {"transformer_options": {RECORDED_NOISE_KEY: rec}}
    kw.setdefault("path", "optimized")
    return sample_wan_accel(model_k, noise.movedim(1, 2), SIGMAS, extra_args=opts, **kw).movedim(1, 2)


def _storage_bytes(module) -> int:
    seen = {}
    for p in module.parameters():
        s = p.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def test_one_host_read_per_video_and_ops_per_step_of_the_optimized_path():
    model = tiny_causal_model(seed=2)
    ctx, noise = _inputs(9)
    _run(model, ctx, noise)                               # warm-up: the sigma list's schedule is resolved once
    with torch.no_grad(), DispatchCounts() as native:
        _run(model, ctx, noise, step_callback=native.step_callback())
    # the noise checked before the first chunk (NaN noise is refused before sampling), the sigmas read once, the
    # finite check at the end
    assert native.syncs <= 3 and native.sync_names["__bool__"] <= 1, dict(native.sync_names)
    own = tiny_causal_model(seed=2)
    sched = schedule_from_sigmas(SIGMAS)
    with torch.no_grad(), DispatchCounts() as core:
        run_causal(own, ctx, noise, sched, 3, generator=torch.Generator().manual_seed(1), path="optimized",
                      callback=core.step_callback())
    assert dict(core.sync_names) == {"__bool__": 1, "tolist": 1}     # the noise checked, the finite check at the end
    n, c = native.steady_step().ops, core.steady_step().ops
    assert abs(n - c) <= 0.05 * c, (n, c)


def test_plain_weights_fuse_qkv_as_views_without_a_second_copy():
    model = tiny_causal_model(seed=2)
    ctx, noise = _inputs()
    rec = _recorded(noise.shape, len(SCHED.timesteps), 3)
    bytes_before = _storage_bytes(model)
    seen = []

    def during(ci, k, *_):
        sa = model.blocks[0].self_attn
        from wan_accel.nodes.comfy.native_engine import _ENGINES
        buf = _ENGINES[model].blocks[0].self_attn._buffers.get(QKV_WEIGHT)
        seen.append(buf is not None and {t.untyped_storage().data_ptr() for t in (sa.q.weight, sa.k.weight,
                                                                                   sa.v.weight, buf)}
                    == {buf.untyped_storage().data_ptr()})
        seen.append(_storage_bytes(model))

    report = {}
    out = _run(model, ctx, noise, rec, step_callback=during, report=report)
    assert seen[0] is True and set(seen[1::2]) == {bytes_before}, seen[:2]   # one buffer, the weights held once
    assert report["fused_qkv_off"] is None and report["fused_qkv_blocks"] == TINY_CONFIG.num_layers
    own = tiny_causal_model(seed=2)                     # the pack's own optimized path (fused q/k/v too)
    want = run_causal(own, ctx, noise, schedule_from_sigmas(SIGMAS), 3, path="optimized",
                         noise_provider=lambda ci, k, shape, dt, dev: rec[f"extra_noise.block{ci}.step{k}"]
                         .reshape(shape))
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    # after the run the engine holds no buffer of its own; the next run finds the views again (nothing copied)
    from wan_accel.nodes.comfy.native_engine import _ENGINES
    assert _ENGINES[model].blocks[0].self_attn._buffers.get(QKV_WEIGHT) is None
    ptr = model.blocks[0].self_attn.q.weight.data_ptr()
    torch.testing.assert_close(_run(model, ctx, noise, rec), out, rtol=0, atol=0)
    assert model.blocks[0].self_attn.q.weight.data_ptr() == ptr


class _CallTimeLinear(nn.Linear):
    """A layer as a weight-managing runtime has them: patches (``weight_function``) and casts applied per call."""
    comfy_cast_weights = False
    weight_function: list = []
    bias_function: list = []

    def forward(self, x):
        w = self.weight
        for f in self.weight_function:
            w = f(w)
        return F.linear(x, w.to(x.dtype), self.bias)


def _call_time_qkv(model):
    for block in model.blocks:
        for name in ("q", "k", "v"):
            getattr(block.self_attn, name).__class__ = _CallTimeLinear
    return model


@pytest.mark.parametrize("case", ["patch", "cast", "fp8"])
def test_fusion_is_off_with_a_reason_when_layers_cast_or_patch_their_weights(case, caplog):
    model = _call_time_qkv(tiny_causal_model(seed=2))
    plain = tiny_causal_model(seed=2)                   # what the layers compute, as plain weights
    g = torch.Generator().manual_seed(11)
    for block, ref in zip(model.blocks, plain.blocks):
        for name in ("q", "k", "v"):
            layer, ref_layer = getattr(block.self_attn, name), getattr(ref.self_attn, name)
            if case == "patch":                         # a LoRA applied when called (low-VRAM mode)
                delta = 0.05 * torch.randn(layer.weight.shape, generator=g)
                layer.weight_function = [lambda w, d=delta: w + d]
                ref_layer.weight.data += delta
            elif case == "cast":
                layer.comfy_cast_weights = True
            else:                                       # stored in float8, upcast when called
                layer.weight = nn.Parameter(layer.weight.detach().to(torch.float8_e4m3fn), requires_grad=False)
                ref_layer.weight.data = layer.weight.detach().float()
    ctx, noise = _inputs()
    rec = _recorded(noise.shape, len(SCHED.timesteps), 3)
    report = {}
    with caplog.at_level(logging.INFO, logger="wan_accel"):
        out = _run(model, ctx, noise, rec, report=report)
    want = {"patch": "weight patches", "cast": "cast their weights", "fp8": "float8_e4m3fn"}[case]
    assert report["fused_qkv_off"] and want in report["fused_qkv_off"], report.get("fused_qkv_off")
    assert report["fused_qkv_blocks"] == 0
    assert any("fused q/k/v off" in r.getMessage() and want in r.getMessage() for r in caplog.records)
    ref = _run(plain, ctx, noise, rec)
    torch.testing.assert_close(out, ref, rtol=0, atol=64 * EPS32 * float(ref.abs().max()))


def test_native_sampler_retries_a_block_after_out_of_memory(cache_path):
    model = tiny_causal_model(seed=2)
    ctx, noise = _inputs(9)
    rec = _recorded(noise.shape, len(SCHED.timesteps), 3)
    expected = _run(copy.deepcopy(model), ctx, noise, rec)
    handle = _oom_at(model.blocks[1], {7})              # block 1's 7th call: chunk 1, step 2
    try:
        out = _run(model, ctx, noise, rec, oom_retry="on")
    finally:
        handle.remove()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)     # the block was redone with the same noise
    assert active_swap(model) is None                     # the retry's swap does not outlive the run
    assert not [e for e in LimitCache(cache_path).entries("memory")]   # no learned limit for the native model
    with pytest.raises(ValueError, match="oom_retry"):
        _run(model, ctx, noise, rec, oom_retry="sometimes")


@pytest.mark.parametrize("path", ["reference", "optimized"])
def test_a_shorter_last_block_is_sampled_as_core_does(path):
    model = tiny_causal_model(seed=2)
    ctx, noise = _inputs(7)                               # 3 + 3 + 1 latent frames
    g = torch.Generator().manual_seed(9)
    lens = (3, 3, 1)
    rec = {f"extra_noise.block{ci}.step{k}": torch.randn(n, 16, 8, 8, generator=g)
           for ci, n in enumerate(lens) for k in range(len(SCHED.timesteps) - 1)}
    out = _run(model, ctx, noise, rec, path=path)
    # core's loop written out: each block's steps, then its refresh pass at sigma 0
    sched = schedule_from_sigmas(SIGMAS)
    kv, cross = KVCache.for_model(model, 1, 16, 7), CrossAttnCache(TINY_CONFIG.num_layers)
    call = lambda x, t, f0, **kw: model.forward_chunk(x, torch.full(x.shape[:2], t), ctx, kv, cross, f0 * 16, **kw)  # noqa: E731
    frames = []
    with torch.no_grad():
        for ci, (f0, n) in enumerate(zip((0, 3, 6), lens)):
            xt = noise[:, f0:f0 + n]
            for k, t in enumerate(sched.timesteps):
                x0 = FlowMatchScheduler.to_x0(xt, call(xt, t, f0), sched.x0_sigmas[k])
                if k + 1 < len(sched.timesteps):
                    a, s = sched.renoise[k + 1]
                    xt = FlowMatchScheduler.renoise(x0, rec[f"extra_noise.block{ci}.step{k}"][None], a, s)
            call(x0, 0.0, f0, return_output=False)
            frames.append(x0)
    want = torch.cat(frames, 1)
    assert out.shape == want.shape == (1, 7, 16, 8, 8)
    torch.testing.assert_close(out, want, rtol=0, atol=64 * EPS32 * float(want.abs().max()))
