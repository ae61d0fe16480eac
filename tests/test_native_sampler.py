"""The sampler function that runs the engine on ComfyUI's own MODEL (nodes/comfy/native_engine.py), with stand-ins for
ComfyUI's guider and BaseModel (no ComfyUI needed), and the engine's start-latent prefix."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from wan_accel.model.kv_cache import CrossAttnCache, KVCache
from wan_accel.model.tiny import TINY_CONFIG, tiny_causal_model
from wan_accel.nodes.comfy.native_engine import RECORDED_NOISE_KEY, sample_wan_accel
from run_helpers import run_causal
from wan_accel.sampling.scheduler import FlowMatchScheduler, resolve_schedule, schedule_from_sigmas

FIXTURE = Path(__file__).parent / "fixtures" / "wan_reference"


class WAN21_CausalAR:                      # noqa: N801 - named as ComfyUI's class, which the sampler checks
    def __init__(self, dm):
        self.diffusion_model = dm
        self.model_sampling = SimpleNamespace(multiplier=1000.0)

    def get_dtype_inference(self):
        return torch.float32

    def process_latent_in(self, latent):
        return latent * 2.0 - 1.0


def _native(dm, context, cfg=1.0, negative=False):
    """(model_k, base) as ComfyUI hands them to a KSAMPLER function: model_k.inner_model is the guider."""
    dm.model_type, dm.num_heads, dm.text_len = "t2v", dm.config.num_heads, dm.config.text_len
    base = WAN21_CausalAR(dm)
    conds = {"positive": [{"model_conds": {"c_crossattn": SimpleNamespace(cond=context)}}]}
    if negative:
        conds["negative"] = conds["positive"]
    guider = SimpleNamespace(inner_model=base, conds=conds, cfg=cfg)
    return SimpleNamespace(inner_model=guider), base


def _recorded(shape, steps, fpb, seed=9):
    g = torch.Generator().manual_seed(seed)
    b, f, c, h, w = shape
    return {f"extra_noise.block{ci}.step{k}": torch.randn(b * fpb, c, h, w, generator=g)
            for ci in range(f // fpb) for k in range(steps - 1)}


def test_sampler_function_runs_the_engine_on_the_native_model():
    model = tiny_causal_model(seed=2)
    ctx = torch.randn(1, 5, TINY_CONFIG.text_dim, generator=torch.Generator().manual_seed(4))
    noise = torch.randn(1, 6, 16, 8, 8, generator=torch.Generator().manual_seed(5))      # [B, F, C, H, W]
    sched = resolve_schedule("self_forcing")
    rec = _recorded(noise.shape, len(sched.timesteps), 3)
    model_k, _ = _native(model, ctx)
    seen = []
    out = sample_wan_accel(model_k, noise.movedim(1, 2), torch.tensor(sched.sigmas()),
                           extra_args={"seed": 1, "model_options": {"transformer_options": {RECORDED_NOISE_KEY: rec}}},
                           callback=seen.append, frames_per_block=3, path="reference")
    want = run_causal(model, ctx, noise, sched, 3, path="reference",
                         noise_provider=lambda ci, k, shape, dt, dev: rec[f"extra_noise.block{ci}.step{k}"].reshape(shape))
    torch.testing.assert_close(out, want.movedim(1, 2), rtol=0, atol=0)
    assert [d["i"] for d in seen] == [0, 0, 1, 1, 2, 2, 3, 3]          # 8 calls scaled onto the 4 sigma steps
    assert seen[0]["denoised"].shape == (1, 16, 3, 8, 8)
    windowed = sample_wan_accel(model_k, noise.movedim(1, 2), torch.tensor(sched.sigmas()),
                                extra_args={"seed": 1}, frames_per_block=1, kv_window=3, sink=1, path="reference")
    gen = torch.Generator().manual_seed(1)
    want = run_causal(model, ctx, noise, sched, 1, generator=gen, kv_window=3, sink=1, path="reference")
    torch.testing.assert_close(windowed, want.movedim(1, 2), rtol=0, atol=0)


def test_sampler_function_reproduces_the_official_causal_fixture():
    from safetensors.torch import load_file

    from wan_accel.app.jobs.replay import Fixture
    cfg = json.loads((FIXTURE / "causal_config.json").read_text())
    io = load_file(str(FIXTURE / "causal_io.safetensors"))
    fx = Fixture(FIXTURE, cfg)
    model = fx.model("cpu")
    rec = {k: v for k, v in io.items() if k.startswith("extra_noise.")}
    model_k, _ = _native(model, io["context"])
    sigmas = torch.tensor(fx.schedule().sigmas())
    out = sample_wan_accel(model_k, io["initial_noise"].movedim(1, 2), sigmas,
                           extra_args={"model_options": {"transformer_options": {RECORDED_NOISE_KEY: rec}}},
                           frames_per_block=3, path="reference")
    assert (out.movedim(1, 2) - io["output"]).abs().max() < 1e-4


def test_start_latent_is_written_to_the_cache_first_as_core_does():
    model = tiny_causal_model(seed=2)
    ctx = torch.randn(1, 5, TINY_CONFIG.text_dim, generator=torch.Generator().manual_seed(4))
    g = torch.Generator().manual_seed(6)
    noise, start = torch.randn(1, 7, 16, 8, 8, generator=g), torch.randn(1, 1, 16, 8, 8, generator=g)
    sched = resolve_schedule("self_forcing")
    rec = _recorded((1, 6, 16, 8, 8), len(sched.timesteps), 3)
    provide = lambda ci, k, shape, dt, dev: rec[f"extra_noise.block{ci}.step{k}"].reshape(shape)   # noqa: E731
    out = run_causal(model, ctx, noise, sched, 3, noise_provider=provide, prefix=start, path="reference")
    # the loop written out: a t=0 pass over the start frame, then each block's steps and its refresh pass
    kv, cross = KVCache.for_model(model, 1, 16, 7), CrossAttnCache(TINY_CONFIG.num_layers)
    call = lambda x, t, f0, **kw: model.forward_chunk(x, torch.full(x.shape[:2], t), ctx, kv, cross, f0 * 16, **kw)  # noqa: E731
    call(start, 0.0, 0, return_output=False)
    frames = [start]
    for ci, f0 in enumerate((1, 4)):
        xt = noise[:, f0:f0 + 3]
        for k, t in enumerate(sched.timesteps):
            x0 = FlowMatchScheduler.to_x0(xt, call(xt, t, f0), sched.x0_sigmas[k])
            if k + 1 < len(sched.timesteps):
                a, s = sched.renoise[k + 1]
                xt = FlowMatchScheduler.renoise(x0, provide(ci, k, x0.shape, None, None), a, s)
        call(x0, 0.0, f0, return_output=False)
        frames.append(x0)
    torch.testing.assert_close(out, torch.cat(frames, 1), rtol=0, atol=1e-6)
    fast = run_causal(model, ctx, noise, sched, 3, noise_provider=provide, prefix=start, path="optimized")
    torch.testing.assert_close(fast, out, rtol=1e-5, atol=1e-5)


def test_clear_errors_for_what_the_sampler_cannot_run():
    model = tiny_causal_model()
    ctx = torch.zeros(1, 4, TINY_CONFIG.text_dim)
    x, sigmas = torch.zeros(1, 16, 3, 8, 8), torch.tensor([1.0, 0.5, 0.0])
    model_k, base = _native(model, ctx)
    with pytest.raises(ValueError, match=r"video latent \[B, C, T, H, W\]"):
        sample_wan_accel(model_k, x[:, :, 0], sigmas)
    with pytest.raises(ValueError, match="last sigma must be 0"):
        sample_wan_accel(model_k, x, torch.tensor([1.0, 0.5]))
    model.model_type = "i2v"
    with pytest.raises(ValueError, match="WAN21_CausalAR model .*model_type='i2v'.*text-to-video"):
        sample_wan_accel(model_k, x, sigmas)
    model_k, _ = _native(model, ctx, cfg=4.0, negative=True)
    with pytest.raises(ValueError, match="cfg=4.0"):
        sample_wan_accel(model_k, x, sigmas)


def test_schedule_from_sigmas_keeps_the_preset_exactly():
    sched = resolve_schedule("self_forcing")
    back = schedule_from_sigmas(torch.tensor(sched.sigmas()))
    assert (back.timesteps, back.x0_sigmas, back.renoise) == (sched.timesteps, sched.x0_sigmas, sched.renoise)
    with pytest.raises(ValueError, match="decrease"):
        schedule_from_sigmas([0.5, 0.9, 0.0])


def test_start_image_of_ar_video_i2v_is_honoured():
    model = tiny_causal_model(seed=2)
    ctx = torch.randn(1, 5, TINY_CONFIG.text_dim, generator=torch.Generator().manual_seed(4))
    g = torch.Generator().manual_seed(8)
    x, start_vae = torch.randn(1, 16, 7, 8, 8, generator=g), torch.randn(1, 16, 1, 8, 8, generator=g)
    model_k, base = _native(model, ctx)
    sigmas = torch.tensor(resolve_schedule("self_forcing").sigmas())
    opts = {"model_options": {"transformer_options": {"ar_config": {"initial_latent": start_vae}}}, "seed": 3}
    out = sample_wan_accel(model_k, x, sigmas, extra_args=opts, frames_per_block=3, path="reference")
    start = base.process_latent_in(start_vae)                  # core puts the start latent in the model's space
    torch.testing.assert_close(out[:, :, :1], start, rtol=0, atol=0)
    want = run_causal(model, ctx, x.movedim(1, 2), schedule_from_sigmas(sigmas), 3, path="reference",
                         generator=torch.Generator().manual_seed(3), prefix=start.movedim(1, 2))
    torch.testing.assert_close(out, want.movedim(1, 2), rtol=0, atol=0)
    plain = sample_wan_accel(model_k, x, sigmas, extra_args={"seed": 3}, frames_per_block=1, path="reference")
    assert (plain[:, :, 1:] - out[:, :, 1:]).abs().max() > 1e-3     # the start frame conditioned what follows


def test_apply_compile_native_settings_compile_the_engine_blocks():
    from wan_accel.compile.apply import compile_handle
    from wan_accel.nodes.comfy.comfy_compile import COMFY_KEY
    model = tiny_causal_model(seed=2)
    ctx = torch.randn(1, 5, TINY_CONFIG.text_dim, generator=torch.Generator().manual_seed(4))
    x = torch.randn(1, 16, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    sigmas = torch.tensor(resolve_schedule("self_forcing").sigmas())
    model_k, base = _native(model, ctx)
    plain = sample_wan_accel(model_k, x, sigmas, extra_args={"seed": 1}, path="optimized")

    def apply_model_wrapper(executor, *a, **kw):        # what Apply Compile (native Wan) adds to the patcher
        return executor(*a, **kw)
    apply_model_wrapper.handle = SimpleNamespace(settings={"backend": "eager", "scope": "blocks"})
    model_k.inner_model.model_patcher = SimpleNamespace(wrappers={"apply_model": {COMFY_KEY: [apply_model_wrapper]}})
    out = sample_wan_accel(model_k, x, sigmas, extra_args={"seed": 1}, path="optimized")
    from wan_accel.nodes.comfy.native_engine import _ENGINES
    engine = _ENGINES[model]
    handle = compile_handle(engine)
    assert handle is not None and handle.settings.backend == "eager" and handle.calls > 0
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-5)
    sample_wan_accel(model_k, x, sigmas, extra_args={"seed": 1}, path="reference")
    assert compile_handle(engine) is None                  # the reference path runs eager
