"""Matrix-Game-2 parity with the original implementation: every recorded tensor of the public fixture."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from wan_accel.app.jobs import reference
from wan_accel.app.jobs.reference import FORMATS, check_reference, survey
from wan_accel.app.jobs.replay import MG2_FIXTURE, Fixture

FIX = Path(__file__).parent / "fixtures" / "matrix_game2"
TOL = 1e-4
INPUTS = ("initial_noise", "cond_concat", "visual_context", "mouse_cond", "keyboard_cond", "extra_noise.")


@pytest.fixture(scope="module")
def rows():
    cfg = json.loads((FIX / "mg2_config.json").read_text())
    return cfg, dict(FORMATS["matrix_game2"](Fixture(FIX, cfg), "cpu"))


def test_every_recorded_tensor_within_tolerance(rows):
    _cfg, got = rows
    bad = {k: v for k, v in got.items() if not v <= TOL}
    assert not bad, bad


def test_every_recorded_output_is_compared(rows):
    """Nothing recorded is skipped: each call's xt/flow/x0, the intermediates, the caches and output."""
    from safetensors import safe_open
    _cfg, got = rows
    with safe_open(str(FIX / "mg2_io.safetensors"), "pt") as f:
        recorded = [k for k in f.keys() if not k.startswith(INPUTS)]
    missing = [k for k in recorded if k not in got]
    assert not missing, missing
    assert "calls" in got            # call order, timesteps and every cache's ends after every call
    assert any(k.startswith("inter.call12.") for k in got) and any(k.startswith("mouse_kv_final") for k in got)


def test_check_reference_recognises_the_format():
    names = [name for name, _path, _cfg in survey(FIX)[0]]
    assert names == ["matrix_game2"]
    worst = max(d for _n, d in check_reference(FIX))
    assert worst <= TOL


def test_a_wrong_window_is_caught(tmp_path, rows):
    """The check is sensitive: the same run with another rolling window fails."""
    import shutil
    cfg, _ = rows
    for name in ("mg2_weights.safetensors", "mg2_io.safetensors"):
        shutil.copy(FIX / name, tmp_path / name)
    cfg = json.loads(json.dumps(cfg))
    cfg["config"]["local_attn_size"] = 9
    got = dict(FORMATS["matrix_game2"](Fixture(tmp_path, cfg), "cpu"))
    assert got["output"] > 1e-2 and got["calls"] == float("inf")


def _write_variant(directory: Path, seed=5, layers=3, blocks=(1, 2), dim=48, heads=3, action_heads=3,
                   window=4, steps=(1000, 750, 500, 250), frames=9, h=6, w=10):
    """A fixture in the official format for another configuration, recorded from this implementation.

    It is self-consistent by construction: it checks that the check reads every number (widths, heads,
    layers, action blocks, latent size, frames, window, step list) from the JSON, not the numerics."""
    import torch
    from safetensors.torch import save_file
    from wan_accel.model.config import WanConfig
    from wan_accel.model.kv_cache import KVCache
    from wan_accel.app.jobs.mg2 import sample_mg2
    from wan_accel.sampling.request import SamplingHooks
    from wan_accel.sampling.mg2 import build_cond_concat
    from wan_accel.model.mg2_model import MatrixGameModel
    from wan_accel.model.tiny import init_tiny_weights
    action = {"blocks": list(blocks), "mouse_dim_in": 2, "keyboard_dim_in": 3, "heads_num": action_heads,
              "mouse_hidden_dim": 64 * action_heads, "keyboard_hidden_dim": 64 * action_heads, "hidden_size": 8,
              "img_hidden_size": dim, "vae_time_compression_ratio": 4, "windows_size": 3, "rope_theta": 256,
              "mouse_qk_dim_list": [8, 28, 28], "rope_dim_list": [8, 28, 28], "qk_norm": True, "qkv_bias": False,
              "enable_mouse": True, "enable_keyboard": True, "patch_size": [1, 2, 2]}
    conf = {"model_type": "i2v", "patch_size": [1, 2, 2], "in_dim": 36, "dim": dim, "ffn_dim": 2 * dim,
            "freq_dim": 16, "out_dim": 16, "num_heads": heads, "num_layers": layers, "local_attn_size": window,
            "sink_size": 0, "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6, "action_config": action}
    clip_dim, s = 24, (h // 2) * (w // 2)
    model = init_tiny_weights(MatrixGameModel(WanConfig.from_dict(dict(conf, clip_dim=clip_dim))), seed)
    g = torch.Generator().manual_seed(seed)
    nv = 1 + 4 * (frames - 1)
    io = {"initial_noise": torch.randn(1, 16, frames, h, w, generator=g),
          "cond_concat": build_cond_concat(torch.randn(1, 16, 1, h, w, generator=g), frames),
          "visual_context": torch.randn(1, 7, clip_dim, generator=g),
          "mouse_cond": 0.5 * torch.randn(1, nv, 2, generator=g),
          "keyboard_cond": (torch.rand(1, nv, 3, generator=g) < 0.35).float()}
    for b in range(frames // 3):
        for k in range(len(steps) - 1):
            io[f"extra_noise.chunk{b}.step{k}"] = torch.randn(3, 16, h, w, generator=g)
    last = (frames // 3 - 1) * (len(steps) + 1)
    cfg = {"fixture": MG2_FIXTURE, "config": conf, "clip_dim": clip_dim, "frame_seq_length": s,
           "sampler": {"num_frame_per_block": 3, "denoising_step_list_config": list(steps), "timestep_shift": 5.0,
                       "warp_denoising_step": True, "context_noise": 0},
           "intermediates": {"calls": {"call0": 0, f"call{last}": last}},
           "weights_file": "v_weights.safetensors", "io_file": "v_io.safetensors"}
    kv = KVCache.for_model(model, 1, s, frames, window, 0)
    actions = model.new_action_call(io["mouse_cond"], io["keyboard_cond"], window)
    rec = reference._Recorder(model, cfg["intermediates"]["calls"])
    calls = []

    def trace(r):
        rec.after_call()
        ends = reference.cache_ends(kv, actions)
        calls.append({"chunk": r["chunk"], "kind": r["kind"], "step": r["step"], "timestep": r["t"],
                      "current_start": r["current_start"],
                      "cache_ends_after_call": {"self_attn": [ends["self_attn"]] * layers,
                                                "mouse": [ends["mouse"]] * len(blocks),
                                                "keyboard": [ends["keyboard"]] * len(blocks)}})
        name = f"chunk{r['chunk']}." + ("context" if r["kind"] == "context" else f"step{r['step']}")
        for part in ("xt", "flow", "x0"):
            io[f"{name}.{part}"] = r[part].transpose(1, 2).contiguous()

    provide = lambda ci, k, shape, dt, dev: io[f"extra_noise.chunk{ci}.step{k}"].reshape(shape)
    with torch.no_grad():
        io["output"] = sample_mg2(model, io["initial_noise"], io["cond_concat"], io["visual_context"],
                                  io["mouse_cond"], io["keyboard_cond"], Fixture(directory, cfg).schedule(), window,
                                  noise_provider=provide, hooks=SamplingHooks(tracer=trace), kv_cache=kv,
                                  actions=actions)
    rec.close()
    for tag, tensors in rec.saved.items():
        io.update({f"inter.{tag}.{k}": v for k, v in tensors.items()})
    for i in range(layers):
        io[f"kv_final.layer{i}.k"], io[f"kv_final.layer{i}.v"] = kv.ordered(i)
    for slot, b in enumerate(blocks):
        io[f"mouse_kv_final.layer{b}.k"], io[f"mouse_kv_final.layer{b}.v"] = actions.mouse_cache.ordered(slot)
        io[f"keyboard_kv_final.layer{b}.k"], io[f"keyboard_kv_final.layer{b}.v"] = actions.keyboard_cache.ordered(slot)
    cfg["calls"] = calls
    io["denoising_step_list"] = torch.tensor(Fixture(directory, cfg).schedule().timesteps, dtype=torch.float32)   # as recorded
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / cfg["weights_file"]))
    save_file({k: v.clone().contiguous() for k, v in io.items()}, str(directory / cfg["io_file"]))
    (directory / "v_config.json").write_text(json.dumps(cfg))
    return cfg, io


def test_other_configuration_is_read_from_the_json(tmp_path):
    """Another width/heads/layers/action blocks/latent size/frames, a window of 4 and a 4-step list: the
    check runs from the JSON alone and compares every recorded tensor."""
    _cfg, io = _write_variant(tmp_path)
    rows = dict(check_reference(tmp_path))
    recorded = {f"v/{k}" for k in io if not k.startswith(INPUTS)}
    assert recorded <= set(rows), recorded - set(rows)
    assert "v/inter.call10.block2.proj_keyboard" in rows and "v/mouse_kv_final.layer1.k" in rows
    assert max(rows.values()) <= 1e-6
