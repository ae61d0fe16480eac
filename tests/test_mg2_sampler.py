"""Matrix-Game-2 sampler: batches, rolling eviction against a naive full-history window, loader, presets."""
from __future__ import annotations

import pytest
import torch
from kv_reference import ShiftingCache

from wan_accel.sampling.actions_script import parse_action_script

from wan_accel.app.jobs.mg2 import generate_mg2, sample_mg2
from wan_accel.sampling.mg2 import build_cond_concat, resolve_preset
from wan_accel.model.mg2_model import MatrixGameModel, tiny_mg2_model

H = W = 4       # tiny latent: 2x2 = 4 tokens per frame


@pytest.fixture(scope="module")
def model():
    return tiny_mg2_model(seed=7)


def _inputs(batch, frames, seed):
    g = torch.Generator().manual_seed(seed)
    nv = 1 + 4 * (frames - 1)
    return dict(noise=torch.randn(batch, 16, frames, H, W, generator=g),
                cond=build_cond_concat(torch.randn(batch, 16, 1, H, W, generator=g), frames),
                ctx=torch.randn(batch, 9, 32, generator=g),
                mouse=0.1 * torch.randn(batch, nv, 2, generator=g),
                keyboard=(torch.rand(batch, nv, 4, generator=g) < 0.4).float(),
                eps=torch.randn(batch, frames, 16, H, W, generator=g))


def _run(model, inp, window, steps=(1000, 666, 333), **kw):
    sched = resolve_preset("universal", steps=list(steps)).schedule

    def provide(ci, k, shape, dtype, dev):
        return (inp["eps"][:, 3 * ci:3 * ci + 3] * (k + 1)).to(dev, dtype)

    return sample_mg2(model, inp["noise"], inp["cond"], inp["ctx"], inp["mouse"], inp["keyboard"], sched, window,
                      noise_provider=provide, **kw)


def test_batch_two_equals_two_single_runs(model):
    a, b = _inputs(1, 6, 1), _inputs(1, 6, 2)
    both = {k: torch.cat([a[k], b[k]]) for k in a}
    out2 = _run(model, both, window=4)
    out1 = torch.cat([_run(model, a, window=4), _run(model, b, window=4)])
    assert (out2 - out1).abs().max().item() <= 1e-5


def test_generate_batch_matches_seeded_single_runs(model):
    acts = parse_action_script("W*8, mouse(0.1,0)*12, idle*4")
    g = torch.Generator().manual_seed(5)
    img, ctx = torch.randn(2, 16, 1, H, W, generator=g), torch.randn(1, 9, 32, generator=g)
    both = generate_mg2(model, img, ctx, acts, seed=11)
    singles = torch.cat([generate_mg2(model, img[i:i + 1], ctx, acts, seed=11 + i) for i in range(2)])
    assert both.shape == (2, 16, 6, H, W)
    assert (both - singles).abs().max().item() <= 1e-5
    again = generate_mg2(model, img[:1], ctx, acts, seed=11)
    assert torch.equal(again, singles[:1])


@pytest.mark.parametrize("window", [4, 5])
def test_rolling_eviction_matches_naive_window(model, window):
    """More chunks than the window holds: the ring-buffer caches give the same video as caches that keep
    the whole history and attend to exactly the window's frames (self-attention, mouse and keyboard)."""
    frames, tokens = 15, (H // 2) * (W // 2)
    inp = _inputs(1, frames, 3)
    ring_actions = model.new_action_call(inp["mouse"], inp["keyboard"], window)
    ring = _run(model, inp, window, actions=ring_actions)

    naive_actions = model.new_action_call(inp["mouse"], inp["keyboard"], window)
    naive_actions._alloc(1, tokens, "cpu", torch.float32)
    a = model.action_config
    n_act = len(a.blocks)
    naive_actions.mouse_cache = ShiftingCache(n_act, tokens, window, a.heads_num, a.head_dim)
    naive_actions.keyboard_cache = ShiftingCache(n_act, 1, window, a.heads_num, a.head_dim)
    kv = ShiftingCache(model.config.num_layers, 1, window * tokens, model.config.num_heads, model.config.head_dim)
    naive = _run(model, inp, window, actions=naive_actions, kv_cache=kv)
    assert (ring - naive).abs().max().item() <= 1e-5
    for cache in ("mouse_cache", "keyboard_cache"):
        k_ring, _ = getattr(ring_actions, cache).ordered(0)
        k_naive, _ = getattr(naive_actions, cache).ordered(0)
        assert torch.allclose(k_ring, k_naive, atol=1e-5)
    # the window matters: with every frame kept the video differs
    full = _run(model, inp, frames)
    assert (ring - full).abs().max().item() > 1e-3


def test_step_list_with_another_length(model):
    inp = _inputs(1, 3, 4)
    out4 = _run(model, inp, 6, steps=(1000, 750, 500, 250))
    out3 = _run(model, inp, 6)
    assert out4.shape == out3.shape and not torch.allclose(out4, out3)


def test_presets():
    u, g, t = resolve_preset("universal"), resolve_preset("gta_drive"), resolve_preset("templerun")
    assert u.schedule.timesteps == pytest.approx([1000.0, 908.8427124023438, 713.9794311523438])
    assert (u.window, g.window, t.window) == (6, 4, 6)
    assert t.schedule.timesteps == pytest.approx([1000.0, 937.5, 833.3333, 625.0], abs=1e-3)
    assert resolve_preset("gta_drive", window=5).window == 5
    with pytest.raises(ValueError, match="preset"):
        resolve_preset("minecraft")
    with pytest.raises(ValueError, match="at least one chunk"):
        resolve_preset("universal", window=2)


def test_cond_concat_layout():
    img = torch.randn(1, 16, 1, H, W)
    cond = build_cond_concat(img, 6)
    assert cond.shape == (1, 20, 6, H, W)
    assert torch.all(cond[:, :4, 0] == 1) and torch.all(cond[:, :4, 1:] == 0)
    assert torch.equal(cond[:, 4:, 0], img[:, :, 0]) and torch.all(cond[:, 4:, 1:] == 0)
    full = torch.randn(1, 16, 9, H, W)
    assert torch.equal(build_cond_concat(full, 6)[:, 4:], full[:, :, :6])
    with pytest.raises(ValueError, match="frames"):
        build_cond_concat(torch.randn(1, 16, 2, H, W), 6)


def test_generate_errors(model):
    acts = parse_action_script("W*8")
    img, ctx = torch.randn(1, 16, 1, H, W), torch.randn(1, 9, 32)
    with pytest.raises(ValueError, match="multiple of 3"):
        generate_mg2(model, img, ctx, acts, num_frames=4)
    with pytest.raises(ValueError, match="video frames of (mouse|keyboard) actions"):
        generate_mg2(model, img, ctx, acts, num_frames=6)
    with pytest.raises(ValueError, match="keyboard channels"):
        generate_mg2(model, img, ctx, parse_action_script("jump*8", "templerun"))
    with pytest.raises(ValueError, match="CLIP"):
        generate_mg2(model, img, torch.randn(1, 9, 1280), acts)


def test_loader_recognises_mg2_checkpoints(model, tmp_path):
    """A released-style file (every key under 'model.') loads as a Matrix-Game-2 model with the inferred
    action config and gives the same latents."""
    from safetensors.torch import save_file
    from wan_accel.model.loader import load_wan_checkpoint
    path = tmp_path / "mg2.safetensors"
    save_file({f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}, str(path))
    loaded = load_wan_checkpoint(path, dtype=torch.float32, num_heads=model.config.num_heads)
    assert isinstance(loaded, MatrixGameModel)
    a, b = loaded.action_config, model.action_config
    for field in ("blocks", "mouse_dim_in", "keyboard_dim_in", "heads_num", "mouse_hidden_dim",
                  "keyboard_hidden_dim", "hidden_size", "windows_size", "enable_mouse", "enable_keyboard"):
        assert getattr(a, field) == getattr(b, field), field
    inp = _inputs(1, 3, 9)
    assert torch.equal(_run(loaded, inp, 6), _run(model, inp, 6))


def test_keyboard_only_model_loads_and_samples(tmp_path):
    """A Temple Run style checkpoint (no mouse branch, 7 keys) is recognised and runs without mouse input."""
    from safetensors.torch import save_file
    from wan_accel.model.loader import load_wan_checkpoint
    model = tiny_mg2_model(seed=2, mode="templerun")
    path = tmp_path / "templerun.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    loaded = load_wan_checkpoint(path, dtype=torch.float32, num_heads=4)
    a = loaded.action_config
    assert (a.enable_mouse, a.enable_keyboard, a.keyboard_dim_in, a.windows_size) == (False, True, 7, 3)
    acts = parse_action_script("jump*8, turnleft+leftside*12, nomove*4", mode="templerun")
    out = generate_mg2(loaded, torch.randn(1, 16, 1, H, W), torch.randn(1, 9, 32), acts, preset="templerun")
    assert out.shape == (1, 16, 6, H, W) and torch.isfinite(out).all()


def test_the_conditioning_of_a_continued_run_is_its_frames_only():
    from wan_accel.sampling.mg2 import build_cond_concat
    g = torch.Generator().manual_seed(0)
    one, many = torch.randn(1, 16, 1, 4, 4, generator=g), torch.randn(1, 16, 12, 4, 4, generator=g)
    for image in (one, many):
        whole = build_cond_concat(image, 9)
        assert whole.shape == (1, 20, 9, 4, 4) and torch.equal(build_cond_concat(image, 9, 0), whole)
        assert torch.equal(build_cond_concat(image, 9, 6), whole[:, :, 6:])
    with pytest.raises(ValueError, match="start 9 must be a frame"):
        build_cond_concat(one, 9, 9)
    model = tiny_mg2_model(seed=1)
    with pytest.raises(ValueError, match="must agree"):       # neither the whole video nor the frames from start_frame
        sample_mg2(model, (1, 16, 9, 4, 4), build_cond_concat(one, 9, 4), torch.zeros(1, 9, 32), None,
                   torch.zeros(1, 33, 4), "universal", 6, start_frame=3)
