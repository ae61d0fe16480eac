"""recache krea from every place a cache mode is chosen: the one mapping (sampling.krea.cache_setup), the command
line, the sampler node, the native schedule node, the play session, and the VAE round trip of the first frame."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from wan_accel.cli import main as cli_main
from wan_accel.model.config import WanConfig
from wan_accel.model.loader import load_wan_checkpoint
from wan_accel.sampling.krea import (KREA_CONTEXT_FRAMES, KreaRecompute, cache_setup, krea_schedule,
                                     krea_schedule_entry, vae_reencode)
from run_helpers import run_causal
from wan_accel.sampling.scheduler import resolve_schedule

FIX = Path(__file__).parent / "fixtures" / "krea_realtime"


def test_mapping_of_each_mode():
    krea = cache_setup("krea", 3, -1)
    assert krea.recache == "none" and isinstance(krea.cache_policy, KreaRecompute)
    assert krea.cache_policy.k == KREA_CONTEXT_FRAMES and krea.kv_window == KREA_CONTEXT_FRAMES + 3
    assert krea.note and "no VAE" in krea.note
    nine = cache_setup("krea", 3, 9, reencode=lambda x: x)
    assert nine.cache_policy.k == 6 and nine.kv_window == 9 and nine.note is None
    for mode in ("switch", "none"):
        s = cache_setup(mode, 3, 12)
        assert s.sampler_kwargs() == {"recache": mode, "cache_policy": None} and s.kv_window == 12
    with pytest.raises(ValueError, match=r"^kv_window 4: .*K must be at least 2; use kv_window at least 5"):
        cache_setup("krea", 3, 4)
    with pytest.raises(ValueError, match=r"--recache must be one of switch, none, krea"):
        cache_setup("later", 3, 6, names={"recache": "--recache"})


def test_krea_preset_is_kreas_step_list():
    assert resolve_schedule("krea").timesteps == krea_schedule().timesteps


def test_the_mapping_reproduces_the_official_session():
    """cache_setup('krea') with the fixture's window and re-encode stand-in gives the official session's output."""
    cfg = json.loads((FIX / "krea_config.json").read_text())
    io, s = load_file(str(FIX / cfg["io_file"])), cfg["session"]
    model = load_wan_checkpoint(FIX / cfg["weights_file"], device="cpu", dtype=torch.float32, precision="float32",
                                config=WanConfig.from_dict(cfg["config"]), attention="sdpa")
    r = cfg["reencode"]
    fpb, k = s["num_frame_per_block"], s["kv_cache_num_frames"]
    setup = cache_setup("krea", fpb, k + fpb, reencode=lambda x: r["a"] * x.half().float() + r["b"])
    lines = ["0: p0"] + [f"{krea_schedule_entry(c['block'], c['interp_steps'])[0]}: p{c['prompt']} "
                         f"(blend {krea_schedule_entry(c['block'], c['interp_steps'])[1]})"
                         for c in cfg["prompt_changes"]]
    out = run_causal(model, None, io["initial_noise"], krea_schedule(s["num_denoising_steps"], s["strength"],
                                                                        s["timestep_shift"]), fpb,
                        noise_provider=lambda ci, st, shape, dt, dev: io[f"extra_noise.block{ci}.step{st}"],
                        kv_window=setup.kv_window, path="reference", prompt_schedule="\n".join(lines),
                        prompt_embeddings={f"p{i}": io[f"prompt{i}"] for i in range(3)}, **setup.sampler_kwargs())
    assert (out - io["output"]).abs().max() <= 1e-4


def test_cli_recache_krea_runs_the_policy(tmp_path, capsys):
    def run(*extra):
        rc = cli_main(["generate", "--out", str(tmp_path), "--no-preview", "--json", "--device", "cpu", "--frames",
                       "45", "--height", "32", "--width", "32", "--kv-window", "6", *extra])
        out = capsys.readouterr().out
        assert rc == 0, out
        return load_file(str(tmp_path / "latents.safetensors"))["latents"], json.loads(out)
    krea, report = run("--recache", "krea")
    plain, _ = run()                      # no prompt switch: no --recache of its own
    assert report["settings"]["recache"] == "krea" and any("no VAE at hand" in n for n in report["notes"])
    assert torch.equal(krea[:, :3], plain[:, :3])            # the first block has no context: the same
    assert not torch.equal(krea[:, 3:], plain[:, 3:])         # later blocks sample after the rebuilt context
    rc = cli_main(["generate", "--out", str(tmp_path / "x"), "--recache", "krea", "--kv-window", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: --kv-window 4: --recache krea") and "Traceback" not in err


@pytest.fixture(scope="module")
def handle():
    from wan_accel.app.jobs.handle import load_model_handle
    return load_model_handle(None, "fp32", "float32", "sdpa", device="cpu")


NODE_ARGS = dict(width=32, height=32, num_frames=4 * 11 + 1, seed=4, preset="self_forcing", frames_per_block=3,
                 kv_window=-1, sink=0, sampler="reference")


def test_sampler_node_recache_krea_equals_the_engine_run(handle):
    from wan_accel.vae.latents import to_vae_latents
    from wan_accel.model.tiny import tiny_text_embedding
    from wan_accel.nodes.model_nodes import CausalWanSampler
    latent, _ = CausalWanSampler().sample(handle, recache="krea", **NODE_ARGS)
    cfg = handle.model.config
    ctx = torch.zeros(1, 0, cfg.text_dim)
    gen = torch.Generator().manual_seed(4)
    want = run_causal(handle.model, ctx, (1, 12, cfg.out_dim, 4, 4), resolve_schedule("self_forcing"), 3,
                         generator=gen, kv_window=6, recache="none", cache_policy=KreaRecompute(3, 3),
                         path="reference")
    assert torch.allclose(latent["samples"], to_vae_latents(want), atol=1e-5)
    plain, _ = CausalWanSampler().sample(handle, recache="none", **NODE_ARGS)
    assert not torch.allclose(latent["samples"][:, :, 3:], plain["samples"][:, :, 3:])
    with pytest.raises(ValueError, match="kv_window 4: recache krea"):
        CausalWanSampler().sample(handle, recache="krea", **{**NODE_ARGS, "kv_window": 4})
    assert tiny_text_embedding is not None


class FakeVAE:
    """decode: [1, 16, T, h, w] -> [1, 1 + 4 (T - 1), 8h, 8w, 3] pixels (each latent frame's mean, then its index);
    encode: [T, H, W, 3] -> [1, 16, 1, H/8, W/8] (a linear function of the pixels)."""
    def __init__(self):
        self.decoded, self.encoded = [], []

    def decode(self, z):
        self.decoded.append(z.shape)
        b, c, t, h, w = z.shape
        px = z.mean(1, keepdim=True).repeat_interleave(8, -2).repeat_interleave(8, -1)   # [1, 1, T, 8h, 8w]
        frames = 1 + 4 * (t - 1)
        out = px[:, :, :1].expand(-1, 3, frames, -1, -1).clone()
        out[:, :, -1] += 0.5                                            # the last pixel frame is told apart
        return out.permute(0, 2, 3, 4, 1)

    def encode(self, pixels):
        self.encoded.append(pixels.shape)
        lat = pixels[..., 0].unsqueeze(0)[:, :1, ::8, ::8]              # [1, 1, h, w]
        return (0.5 * lat).unsqueeze(1).expand(-1, 16, -1, -1, -1).clone()


def test_vae_round_trip_takes_the_last_pixel_frame():
    from wan_accel.vae.latents import from_vae_latents, to_vae_latents
    from wan_accel.nodes.model_nodes import comfy_vae_reencode
    vae = FakeVAE()
    z = torch.randn(2, 1, 16, 4, 4)
    got = comfy_vae_reencode(vae)(z)
    assert got.shape == z.shape and vae.decoded == [(1, 16, 1, 4, 4)] * 2 and vae.encoded == [(1, 32, 32, 3)] * 2
    raw = to_vae_latents(z).mean(1)                                       # [2, 1, 4, 4]
    want = from_vae_latents((0.5 * (raw + 0.5)).unsqueeze(1).expand(-1, 16, -1, -1, -1))
    assert torch.allclose(got, want, atol=1e-5)
    plain = vae_reencode(lambda x: x.repeat(1, 3, 1, 1, 1) * torch.tensor([1., 1., 2.]).view(1, 3, 1, 1, 1),
                         lambda p: p)
    assert torch.equal(plain(z), 2 * z)                                   # the last decoded frame, encoded


def test_sampler_decode_node_re_encodes_through_its_vae(handle, monkeypatch):
    from wan_accel.nodes import model_nodes
    seen = []
    real = model_nodes.comfy_vae_reencode
    monkeypatch.setattr(model_nodes, "comfy_vae_reencode", lambda vae: seen.append(vae) or real(vae))
    node = model_nodes.CausalWanSampler()
    node._krea_vae = FakeVAE()
    with_vae, _ = node.sample(handle, recache="krea", **NODE_ARGS)
    without, _ = model_nodes.CausalWanSampler().sample(handle, recache="krea", **NODE_ARGS)
    assert seen == [node._krea_vae] and node._krea_vae.encoded
    assert torch.equal(with_vae["samples"][:, :, :6], without["samples"][:, :, :6])   # before frame K + 3: none
    assert not torch.equal(with_vae["samples"][:, :, 6:], without["samples"][:, :, 6:])


def test_native_schedule_node_carries_krea_to_the_sampler():
    from wan_accel.model.tiny import tiny_text_embedding
    from wan_accel.nodes.comfy.native_engine import positive_schedule, schedule_cache
    from wan_accel.nodes.prompt_nodes import WanAccelPromptSchedule

    class Clip:
        def tokenize(self, text):
            return text

        def encode_from_tokens(self, text):
            return tiny_text_embedding(text, 6, 8)
    vae = FakeVAE()
    (cond,) = WanAccelPromptSchedule().encode(Clip(), "0: a cat\n2: a dog", recache="krea", vae=vae)
    guider = type("Guider", (), {"conds": {"positive": [dict(cond[0][1], model_conds={})]}})()
    kwargs, window = schedule_cache(positive_schedule(guider), 3, -1)
    assert window == 6 and kwargs["recache"] == "none" and isinstance(kwargs["cache_policy"], KreaRecompute)
    assert kwargs["cache_policy"].reencode is not None and "vae" not in kwargs
    plain, window = schedule_cache(positive_schedule(type("G", (), {"conds": {}})()), 3, 12)
    assert plain == {} and window == 12
    with pytest.raises(ValueError, match="recache must be one of"):
        WanAccelPromptSchedule().encode(Clip(), "0: a cat", recache="later")


def test_play_session_takes_krea_and_refuses_other_modes_in_one_message(handle):
    from wan_accel.app.play.registry import PlayError
    from wan_accel.app.play.t2v import PromptPlaySession
    from wan_accel.model.tiny import tiny_text_embedding
    cfg = handle.model.config
    enc = lambda t: tiny_text_embedding(t, cfg.text_len, cfg.text_dim)      # noqa: E731
    play = PromptPlaySession(handle.model, enc, 4, 4, prompt="a cat", frames_per_block=3, recache="krea")
    assert isinstance(play.cache.cache_policy, KreaRecompute) and play.kv_window == KREA_CONTEXT_FRAMES + 3
    play.step("")
    play.step("a dog")                              # a continued run: the policy rebuilt the cache at position K
    assert play.cache.cache_policy.positions == [(0, 0), (3, 3)] and play.frames == 6
    with pytest.raises(PlayError, match="recache must be one of"):
        PromptPlaySession(handle.model, enc, 4, 4, prompt="a cat", frames_per_block=3, recache="later")
