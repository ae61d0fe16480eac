"""Continue a video later: a run that goes on from a returned state equals one long run, bit for bit (CPU float32),
with global and rolling caches; a state refuses another model or other settings with a clear error."""
import pytest
import torch

from wan_accel.model.config import WanConfig
from wan_accel.model.dit import WanModel
from wan_accel.model.tiny import init_tiny_weights
from wan_accel.sampling.continuation import SamplerState
from run_helpers import sample_continuable
from run_helpers import generate_latents

CFG = WanConfig(dim=32, ffn_dim=64, num_heads=2, num_layers=2, text_dim=16, text_len=4, freq_dim=8)
SCHEDULE = {"preset": "custom", "steps": [1000, 600, 300], "shift": 5.0}


@pytest.fixture(scope="module")
def model():
    return init_tiny_weights(WanModel(CFG), 1).eval()


@pytest.fixture(scope="module")
def context():
    return torch.randn(1, 3, CFG.text_dim, generator=torch.Generator().manual_seed(3))


def _long(model, context, frames, **kw):
    return generate_latents(model, context, frames, 4, 6, seed=11, schedule=SCHEDULE, frames_per_block=2,
                            path="reference", **kw)


def _pieces(model, context, lengths, **kw):
    state, outs = None, []
    for n in lengths:
        out, state = sample_continuable(model, context, n, 4, 6, seed=11, schedule=SCHEDULE, frames_per_block=2,
                                        state=state, path="reference", **kw)
        outs.append(out)
    return torch.cat(outs, dim=1), state


@pytest.mark.parametrize("window, sink, lengths", [
    (-1, 0, (4, 8, 10)),        # global cache, grown by each continuation
    (6, 1, (4, 10, 12)),        # first piece below the window (global), then rolling
    (4, 0, (6, 10)),            # rolling from the first piece on
])
def test_continuation_equals_one_long_run(model, context, window, sink, lengths):
    long = _long(model, context, lengths[-1], kv_window=window, sink=sink)
    pieced, state = _pieces(model, context, lengths, kv_window=window, sink=sink)
    assert pieced.shape == long.shape
    assert torch.equal(pieced, long)
    assert state.frames == lengths[-1]


def test_continuation_from_a_cpu_copy_and_twice_from_one_state(model, context):
    first, state = sample_continuable(model, context, 4, 4, 6, seed=2, schedule=SCHEDULE, frames_per_block=2,
                                      path="reference", state_device="cpu")
    a, _ = sample_continuable(model, context, 8, 4, 6, schedule=SCHEDULE, frames_per_block=2, state=state,
                              path="reference")
    b, _ = sample_continuable(model, context, 8, 4, 6, schedule=SCHEDULE, frames_per_block=2, state=state.to("cpu"),
                              path="reference")
    assert torch.equal(a, b)            # the state is not consumed by a continuation
    assert torch.equal(torch.cat([first, a], 1), generate_latents(model, context, 8, 4, 6, seed=2, schedule=SCHEDULE,
                                                                    frames_per_block=2, path="reference"))


def test_state_refuses_other_settings_and_models(model, context):
    _, state = sample_continuable(model, context, 4, 4, 6, schedule=SCHEDULE, frames_per_block=2, path="reference")
    assert isinstance(state, SamplerState) and state.frames == 4
    with pytest.raises(ValueError, match="KV window: the state has -1, this run 6"):
        sample_continuable(model, context, 8, 4, 6, schedule=SCHEDULE, frames_per_block=2, kv_window=6, state=state)
    with pytest.raises(ValueError, match="latent width"):
        sample_continuable(model, context, 8, 4, 8, schedule=SCHEDULE, frames_per_block=2, state=state)
    with pytest.raises(ValueError, match="schedule steps"):
        sample_continuable(model, context, 8, 4, 6, schedule="self_forcing", frames_per_block=2, state=state)
    other = init_tiny_weights(WanModel(WanConfig(dim=32, ffn_dim=64, num_heads=2, num_layers=3, text_dim=16,
                                                 text_len=4, freq_dim=8)), 1).eval()
    with pytest.raises(ValueError, match="model"):
        sample_continuable(other, context, 8, 4, 6, schedule=SCHEDULE, frames_per_block=2, state=state)
    with pytest.raises(ValueError, match="already has 4 latent frames"):
        sample_continuable(model, context, 4, 4, 6, schedule=SCHEDULE, frames_per_block=2, state=state)
    with pytest.raises(ValueError, match="skip_last_refresh"):
        sample_continuable(model, context, 4, 4, 6, schedule=SCHEDULE, frames_per_block=2, skip_last_refresh=True)
    with pytest.raises(TypeError, match="causal sampler state"):
        sample_continuable(model, context, 8, 4, 6, schedule=SCHEDULE, frames_per_block=2, state={"frames": 4})


@pytest.mark.parametrize("window", [-1, 4])
def test_optimized_path_continues_exactly_too(model, context, window):
    long = generate_latents(model, context, 8, 4, 6, seed=1, schedule=SCHEDULE, frames_per_block=2,
                            path="optimized", kv_window=window)
    kw = dict(schedule=SCHEDULE, frames_per_block=2, path="optimized", kv_window=window)
    a, state = sample_continuable(model, context, 4, 4, 6, seed=1, **kw)
    b, _ = sample_continuable(model, context, 8, 4, 6, state=state, **kw)
    assert torch.equal(torch.cat([a, b], 1), long)


def test_matrix_game2_continuation_equals_one_long_run():
    from wan_accel.model.mg2_model import tiny_mg2_model
    from wan_accel.app.jobs.mg2 import generate_mg2
    from run_helpers import sample_mg2_continuable
    mg2 = tiny_mg2_model(seed=7)
    g = torch.Generator().manual_seed(4)
    img, ctx = torch.randn(1, 16, 1, 4, 4, generator=g), torch.randn(1, 9, 32, generator=g)
    mouse, keyboard = 0.1 * torch.randn(1, 33, 2, generator=g), (torch.rand(1, 33, 4, generator=g) < 0.4).float()
    long = generate_mg2(mg2, img, ctx, (mouse, keyboard), num_frames=9, seed=3)   # window 6: the caches roll
    a, state = sample_mg2_continuable(mg2, img, ctx, mouse[:, :9], keyboard[:, :9], 3, seed=3)
    b, mid = sample_mg2_continuable(mg2, img, ctx, mouse[:, 9:21], keyboard[:, 9:21], 6, state=state)
    c, state = sample_mg2_continuable(mg2, img, ctx, mouse[:, 21:], keyboard[:, 21:], 9, state=mid)
    assert torch.equal(torch.cat([a, b, c], 2), long)
    assert state.actions["keyboard"].shape[1] == 33
    other = keyboard[:, 21:].flip(1)                  # other actions for the last chunk change its frames
    d, _ = sample_mg2_continuable(mg2, img, ctx, mouse[:, 21:], other, 9, state=mid)
    assert not torch.equal(d, c)
    with pytest.raises(ValueError, match="give 12 for the new frames"):
        sample_mg2_continuable(mg2, img, ctx, mouse[:, 21:25], keyboard[:, 21:25], 9, state=mid)
