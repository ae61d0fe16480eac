"""Scheduler presets and the causal sampling loop (seeding, chunking, callbacks, refresh, limits)."""
import pytest
import torch

from wan_accel.sampling.sampler import chunk_plan
from run_helpers import generate_latents, run_causal
from wan_accel.sampling.scheduler import FlowMatchScheduler, resolve_schedule
from wan_accel.model.tiny import tiny_causal_model


def test_presets():
    sf = resolve_schedule("self_forcing")
    assert sf.shift == 5.0 and sf.warp
    assert sf.timesteps == pytest.approx([1000.0, 937.5, 833.3333129882812, 625.0], abs=1e-4)
    cv = resolve_schedule("causvid")
    assert cv.shift == 8.0 and not cv.warp and cv.timesteps == [1000.0, 757.0, 522.0]
    custom = resolve_schedule("custom", "1000, 750, 500, 250", shift=8.0)
    assert custom.timesteps == pytest.approx([1000.0, 960.0, 888.8889, 727.2727], abs=1e-3)
    with pytest.raises(ValueError, match="needs a step list"):
        resolve_schedule("custom")
    with pytest.raises(ValueError, match="numbers separated by commas"):
        resolve_schedule("custom", "1000,abc")
    with pytest.raises(ValueError, match="preset must be one of"):
        resolve_schedule("dpm")


def test_sigma_lookup_and_conversions():
    s = FlowMatchScheduler(5.0)
    assert s.timesteps[0] == 1000.0 and s.sigmas.dtype == torch.float32
    assert s.sigma(1000.0) == 1.0
    assert s.sigma(0.0) == float(s.sigmas[-1])                    # nearest entry, the smallest sigma
    xt, flow = torch.randn(4), torch.randn(4)
    x0 = s.to_x0(xt, flow, 0.3)
    assert x0.dtype == torch.float32
    assert torch.equal(x0, (xt.double() - 0.3 * flow.double()).float())
    eps = torch.randn(4).bfloat16()
    y = s.renoise(x0.bfloat16(), eps, 0.75, 0.25)
    assert y.dtype == torch.bfloat16


def test_chunk_plan():
    assert chunk_plan(6, 3) == [(0, 3), (3, 3)]
    assert chunk_plan(7, 3, independent_first_frame=True) == [(0, 1), (1, 3), (4, 3)]
    with pytest.raises(ValueError, match="not a whole number of 3-frame blocks"):
        chunk_plan(7, 3)


@pytest.fixture(scope="module")
def model():
    return tiny_causal_model()


def _ctx(model):
    return torch.randn(1, 4, model.config.text_dim, generator=torch.Generator().manual_seed(3))


def test_seeded_reproducibility(model):
    a = generate_latents(model, _ctx(model), 6, 4, 6, seed=11)
    b = generate_latents(model, _ctx(model), 6, 4, 6, seed=11)
    c = generate_latents(model, _ctx(model), 6, 4, 6, seed=12)
    assert a.shape == (1, 6, 16, 4, 6) and a.dtype == torch.float32
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    generate_latents(model, _ctx(model), 3, 4, 6, seed=1)
    assert torch.equal(torch.get_rng_state(), before)            # the global RNG is never used


def test_longer_video_starts_with_the_shorter_one(model):
    short = generate_latents(model, _ctx(model), 3, 4, 6, seed=5)
    long = generate_latents(model, _ctx(model), 9, 4, 6, seed=5)
    assert torch.equal(long[:, :3], short)


def test_callback_progress_and_interrupt(model):
    seen = []
    generate_latents(model, _ctx(model), 6, 4, 6, callback=lambda *a: seen.append(a[:4]))
    assert seen == [(c, k, 2, 4) for c in range(2) for k in range(4)]

    class Stop(Exception):
        pass

    def interrupt(ci, k, nc, ns, x0):
        if (ci, k) == (0, 1):
            raise Stop
    with pytest.raises(Stop):
        generate_latents(model, _ctx(model), 6, 4, 6, callback=interrupt)


def test_noise_provider_is_the_noise_path(model):
    g = torch.Generator().manual_seed(4)
    noise = torch.randn(1, 6, 16, 4, 6, generator=g)
    draws = []

    def provider(ci, k, shape, dtype, device):
        draws.append((ci, k, shape))
        return torch.zeros(shape, dtype=dtype, device=device)
    out = run_causal(model, _ctx(model), noise, noise_provider=provider)
    assert draws == [(c, k, (1, 3, 16, 4, 6)) for c in range(2) for k in range(3)]
    assert not torch.equal(out, run_causal(model, _ctx(model), noise, generator=torch.Generator().manual_seed(1)))


def test_last_refresh_does_not_change_the_output(model):
    a = generate_latents(model, _ctx(model), 6, 4, 6, seed=2)
    calls = []
    b = generate_latents(model, _ctx(model), 6, 4, 6, seed=2, skip_last_refresh=True,
                         tracer=calls.append)
    assert torch.equal(a, b)
    assert [c["kind"] for c in calls].count("context") == 1


def test_refresh_changes_later_chunks(model):
    """The clean-x0 refresh is what later chunks attend to: removing it (t=1000 refresh) changes them."""
    a = generate_latents(model, _ctx(model), 6, 2, 2, seed=2)
    b = generate_latents(model, _ctx(model), 6, 2, 2, seed=2, refresh_t=1000.0)
    assert torch.equal(a[:, :3], b[:, :3]) and not torch.allclose(a[:, 3:], b[:, 3:])


def test_frame_limits_are_checked_before_work(model):
    noise = torch.zeros(1, 1026, 16, 2, 2)
    with pytest.raises(ValueError, match="1024 positions"):
        run_causal(model, _ctx(model), noise)
    with pytest.raises(ValueError, match="divisible by the patch size"):
        run_causal(model, _ctx(model), torch.zeros(1, 3, 16, 3, 4))
    with pytest.raises(ValueError, match="KV cache holds"):
        from wan_accel.model.kv_cache import KVCache
        run_causal(model, _ctx(model), torch.zeros(1, 6, 16, 2, 2), kv_cache=KVCache.for_model(model, 1, 1, 3))


def test_batch_and_context_broadcast(model):
    out = generate_latents(model, _ctx(model), 3, 4, 6, seed=0, batch=2)
    assert out.shape == (2, 3, 16, 4, 6) and not torch.equal(out[0], out[1])
