"""Matrix-Game-2 nodes (called directly, outside ComfyUI) and the generate CLI job."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from wan_accel.nodes.mg2_nodes import NODE_CLASS_MAPPINGS, GameActions, MatrixGame2Sampler
from wan_accel.sampling.actions_script import ActionScriptError


def _handle():
    from wan_accel.app.jobs.mg2 import load_mg2_handle
    return load_mg2_handle(None, dtype="fp32", device="cpu", seed=3)


def test_node_contract():
    for cls in NODE_CLASS_MAPPINGS.values():
        spec = cls.INPUT_TYPES()
        for section in spec.values():
            for name, (_type, opts) in section.items():
                assert opts.get("tooltip"), name
        assert cls.CATEGORY.startswith("wan_accel/") and cls.DESCRIPTION and cls.RETURN_NAMES


def test_game_actions_node_reports_frames():
    out = GameActions().build("W*20, W+A*8, mouse(0.1,0)*12, idle*4", "universal")
    actions, video, latent, summary = out["result"]
    assert (video, latent) == (45, 12) and actions.video_frames == 45
    assert out["ui"]["text"] == [summary] and "12 latent frames" in summary
    with pytest.raises(ActionScriptError, match="unknown key"):
        GameActions().build("W*4, Z*4", "universal")
    with pytest.raises(ActionScriptError, match="multiple of 4"):
        GameActions().build("W*5", "universal")


def test_sampler_node_outputs_a_latent():
    handle = _handle()
    actions = GameActions().build("W*8, look_left*12, idle*4", "universal")["result"][0]
    start = {"samples": torch.randn(1, 16, 1, 8, 8)}
    clip = SimpleNamespace(penultimate_hidden_states=torch.randn(1, 9, 32))
    latent, _ = MatrixGame2Sampler().sample(handle, start, clip, actions, seed=1, num_frames=0, preset="universal")
    assert latent["samples"].shape == (1, 16, 6, 8, 8)
    again, _ = MatrixGame2Sampler().sample(handle, start, clip, actions, seed=1, num_frames=3, preset="universal")
    assert again["samples"].shape == (1, 16, 3, 8, 8)
    # the first chunk does not depend on later frames
    assert torch.allclose(again["samples"], latent["samples"][:, :, :3], atol=1e-5)


def test_sampler_node_continues_with_the_next_actions():
    from wan_accel.sampling.actions_script import GameActions as Actions
    handle = _handle()
    actions = GameActions().build("W*8, look_left*12, idle*4", "universal")["result"][0]
    start = {"samples": torch.randn(1, 16, 1, 8, 8)}
    clip = SimpleNamespace(penultimate_hidden_states=torch.randn(1, 9, 32))
    long, _ = MatrixGame2Sampler().sample(handle, start, clip, actions, seed=1, num_frames=6, preset="universal")
    first, state = MatrixGame2Sampler().sample(handle, start, clip, actions, seed=1, num_frames=3,
                                               preset="universal", keep_state=True)
    assert state.frames == 3 and state.kv.device.type == "cpu"
    later = Actions(actions.mode, actions.keyboard[9:21], actions.mouse[9:21])      # the next chunk's 12 frames
    rest, after = MatrixGame2Sampler().sample(handle, start, clip, later, seed=99, preset="universal",
                                              continue_from=state)
    assert after is None and rest["samples"].shape[2] == 3
    assert torch.equal(torch.cat([first["samples"], rest["samples"]], 2), long["samples"])
    with pytest.raises(ValueError, match="KV window"):
        MatrixGame2Sampler().sample(handle, start, clip, later, preset="universal", kv_window=3, continue_from=state)


def test_sampler_node_errors():
    handle = _handle()
    acts = GameActions().build("jump*8", "templerun")["result"][0]
    start = {"samples": torch.randn(1, 16, 1, 8, 8)}
    clip = SimpleNamespace(penultimate_hidden_states=torch.randn(1, 9, 32))
    with pytest.raises(ValueError, match="mode"):
        MatrixGame2Sampler().sample(handle, start, clip, acts, preset="universal")
    with pytest.raises(ValueError, match="keyboard channels"):
        MatrixGame2Sampler().sample(handle, start, clip, acts, preset="templerun")
    with pytest.raises(ValueError, match="penultimate_hidden_states"):
        MatrixGame2Sampler().sample(handle, start, object(), acts, preset="templerun")
    from wan_accel.app.jobs.handle import load_model_handle
    t2v = load_model_handle(None, dtype="fp32", device="cpu")
    with pytest.raises(ValueError, match="action modules"):
        MatrixGame2Sampler().sample(t2v, start, clip, acts, preset="templerun")


def test_generate_cli_matrix_game2(tmp_path, capsys):
    from wan_accel.cli import main
    rc = main(["generate", "--model-kind", "matrix-game2", "--out", str(tmp_path), "--json",
               "--actions", "W*8, W+D*12, mouse(0,0.1)*4"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model_kind"] == "matrix-game2" and report["latent_shape"] == [1, 16, 6, 16, 16]
    assert len(report["chunk_seconds"]) == 2
    for key in ("latents", "report"):
        assert (tmp_path / report["files"][key].split("/")[-1]).exists()
    from safetensors.torch import load_file
    lat = load_file(str(tmp_path / "latents.safetensors"))["latents"]
    assert lat.shape == (1, 6, 16, 16, 16) and torch.isfinite(lat).all()


def test_start_latent_node_encodes_image_then_blank_frames():
    import torch

    from wan_accel.nodes.mg2_nodes import MatrixGame2StartLatent

    class FakeWanVAE:  # ComfyUI's Wan VAE: [T, H, W, 3] pixels -> [1, 16, (T-1)/4+1, H/8, W/8]
        def __init__(self):
            self.seen = []

        def encode(self, pixels):
            self.seen.append(pixels.clone())
            t, h, w, _ = pixels.shape
            lat = torch.zeros(1, 16, (t - 1) // 4 + 1, h // 8, w // 8)
            lat[:, :3] = torch.nn.functional.avg_pool2d(pixels[::4].permute(3, 0, 1, 2), 8)[None]
            return lat

    vae = FakeWanVAE()
    images = torch.rand(2, 16, 24, 3)
    (out,) = MatrixGame2StartLatent().encode(vae, images, latent_frames=4)
    assert out["samples"].shape == (2, 16, 4, 2, 3)
    first = vae.seen[0]
    assert first.shape == (13, 16, 24, 3)
    assert torch.equal(first[0], images[0]) and torch.all(first[1:] == 0.5)
    assert torch.equal(vae.seen[1][0], images[1])
