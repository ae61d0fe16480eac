"""Matrix-Game-2 action module and its rolling caches, checked standalone against the reference fixture."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from wan_accel.model.action import ActionCall, ActionConfig, ActionModule, apply_action_rope, window_indices
from wan_accel.model.kv_cache import KVCache

FIX = Path(__file__).parent / "fixtures" / "matrix_game2"
TOL = 1e-4


@pytest.fixture(scope="module")
def fixture():
    cfg = json.loads((FIX / "mg2_config.json").read_text())
    return cfg, load_file(str(FIX / "mg2_weights.safetensors")), load_file(str(FIX / "mg2_io.safetensors"))


def _module(cfg, weights, block):
    acfg = ActionConfig.from_dict(cfg["config"]["action_config"])
    mod = ActionModule(cfg["config"]["dim"], acfg)
    prefix = f"blocks.{block}.action_model."
    mod.load_state_dict({k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}, strict=True)
    return mod


def _run(mod, x, mouse, keyboard, start, frames, window=6, call=None):
    call = call or ActionCall(mod.cfg, mouse, keyboard, window)
    call.begin(start, frames, x.shape[0], x.shape[1] // frames, x.device, x.dtype)
    return mod(x, call), call


def _hooked(mod):
    seen = {}
    for name in ("proj_mouse", "proj_keyboard"):
        getattr(mod, name).register_forward_hook(lambda _m, _i, out, n=name: seen.__setitem__(n, out))
    return seen


def test_call0_action_module_matches_fixture(fixture):
    cfg, weights, io = fixture
    s = cfg["frame_seq_length"]
    call = cfg["calls"][0]
    for block in cfg["config"]["action_config"]["blocks"]:
        mod = _module(cfg, weights, block)
        seen = _hooked(mod)
        x = io[f"inter.call0.block{block}.action_in"]
        t = x.shape[1] // s
        out, state = _run(mod, x, io["mouse_cond"][:, :call["mouse_cond_len"]],
                          io["keyboard_cond"][:, :call["keyboard_cond_len"]], call["start_frame"], t,
                          cfg["config"]["local_attn_size"])
        seen["action_out"] = out
        for name in ("proj_mouse", "proj_keyboard", "action_out"):
            ref = io[f"inter.call0.block{block}.{name}"]
            assert (seen[name] - ref).abs().max().item() <= TOL, name
        assert state.mouse_cache.end == t and state.keyboard_cache.end == t
        assert tuple(state.mouse_cache.layers[0].k.shape) == (s, cfg["config"]["local_attn_size"], 2, 64)


def test_full_sequence_prefix_gives_same_result(fixture):
    """The module reads only the windows of the chunk's frames: a longer action sequence changes nothing."""
    cfg, weights, io = fixture
    s = cfg["frame_seq_length"]
    mod = _module(cfg, weights, cfg["config"]["action_config"]["blocks"][0])
    x = io["inter.call0.block0.action_in"]
    outs = [_run(mod, x, io["mouse_cond"][:, :n], io["keyboard_cond"][:, :n], 0, x.shape[1] // s)[0]
            for n in (9, io["mouse_cond"].shape[1])]
    assert torch.equal(outs[0], outs[1])


def test_too_short_actions_raise(fixture):
    cfg, weights, io = fixture
    mod = _module(cfg, weights, 0)
    x = io["inter.call0.block0.action_in"]
    with pytest.raises(ValueError, match="video frames"):
        _run(mod, x, io["mouse_cond"][:, :20], io["keyboard_cond"][:, :20], 6, 3)
    with pytest.raises(ValueError, match="mouse actions"):
        ActionCall(mod.cfg, None, io["keyboard_cond"], 6)


def test_batch_rows_are_independent(fixture):
    """Batch 2 gives each element its own mouse and keyboard cache rows (the original supports batch 1)."""
    cfg, weights, io = fixture
    s = cfg["frame_seq_length"]
    mod = _module(cfg, weights, 0)
    x = io["inter.call0.block0.action_in"]
    g = torch.Generator().manual_seed(3)
    x2 = torch.randn(x.shape, generator=g)
    m2 = torch.randn(io["mouse_cond"].shape, generator=g)
    k2 = (torch.rand(io["keyboard_cond"].shape, generator=g) < 0.4).float()
    singles, both = [], None
    calls = [None, None]
    call2 = None
    for start in (0, 3):    # two chunks: the second one attends to the first through the caches
        for i, (xs, ms, ks) in enumerate(((x, io["mouse_cond"], io["keyboard_cond"]), (x2, m2, k2))):
            out, calls[i] = _run(mod, xs, ms, ks, start, 3, call=calls[i])
            if start == 3:
                singles.append(out)
        both, call2 = _run(mod, torch.cat([x, x2]), torch.cat([io["mouse_cond"], m2]),
                           torch.cat([io["keyboard_cond"], k2]), start, 3, call=call2)
    assert (both - torch.cat(singles)).abs().max().item() <= 1e-5
    assert call2.keyboard_cache.layers[0].k.shape[0] == 2 and call2.mouse_cache.layers[0].k.shape[0] == 2 * s


def test_window_indices_follow_the_official_rule():
    idx = window_indices(torch.arange(0, 4), ratio=4, window=12)
    assert idx[0].tolist() == [0] * 12
    assert idx[1].tolist() == [0] * 8 + [0, 1, 2, 3]
    assert idx[3].tolist() == list(range(0, 12))
    assert window_indices(torch.tensor([5]), 4, 12)[0].tolist() == list(range(8, 20))


def test_action_rope_rotates_only_the_frame_dims():
    x = torch.randn(2, 3, 2, 64)
    cos, sin = torch.cos(torch.ones(3, 4)), torch.sin(torch.ones(3, 4))
    y = apply_action_rope(x, cos, sin)
    assert torch.equal(y[..., 8:], x[..., 8:])
    assert not torch.allclose(y[..., :8], x[..., :8])
    pair_norm = lambda z: z[..., :8].unflatten(-1, (4, 2)).norm(dim=-1)
    assert torch.allclose(pair_norm(x), pair_norm(y), atol=1e-6)


@pytest.mark.parametrize("kind", ["self_attn", "mouse", "keyboard"])
def test_cache_ends_match_the_recorded_calls(fixture, kind):
    """Replaying every recorded call gives the official [global_end, local_end] after each one."""
    cfg, _, _ = fixture
    s, window = cfg["frame_seq_length"], cfg["config"]["local_attn_size"]
    unit = s if kind == "self_attn" else 1
    cache = KVCache(1, 1, window * unit, 1, 1, rolling=True)
    for call in cfg["calls"]:
        step = cache.plan(call["start_frame"] * unit, 3 * unit)
        assert [cache.end, step.read_len] == call["cache_ends_after_call"][kind][0], call["call"]


@pytest.mark.parametrize("window", [3, 4, 5, 7])
def test_rolling_cache_keeps_exactly_the_newest_window(window):
    """Entries tagged with their absolute frame: after each chunk the cache holds the newest ``window``
    frames (oldest first in ordered()); rewrites of the newest chunk stay in place, nothing is shifted."""
    cache = KVCache(1, 1, window, 1, 1, rolling=True)
    layer = cache.layers[0]
    for chunk in range(7):
        start = 3 * chunk
        for _ in range(2):      # denoising steps / refresh rewrite the same entries
            vals = torch.arange(start, start + 3, dtype=torch.float32).view(1, 3, 1, 1)
            k, _v = layer.update(vals, vals + 0.5, cache.plan(start, 3))
        end = start + 3
        want = list(range(max(0, end - window), end))
        assert sorted(k.flatten().tolist()) == want
        ok, ov = cache.ordered(0)
        assert ok.flatten().tolist() == want and ov.flatten().tolist() == [w + 0.5 for w in want]
