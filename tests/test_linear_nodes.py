"""fp8 linear layers are a choice on the sampler nodes, not only on the command line: the CausalWan Sampler (and its
streaming twin), the Wan Accel AR Sampler, the Matrix-Game-2 Sampler and both play sessions take ``linear`` (exact |
fp8), the request that reaches the chunk loop carries it, and a reference path with fp8 is refused with the command
line's message in the node's own words."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from wan_accel.sampling import sampler as sampler_mod

from .test_hard_edges_round3_options import fake_comfy  # noqa: F401 - a fixture
from .test_native_sampler import WAN21_CausalAR as NativeModel


def _record_requests(monkeypatch) -> list:
    seen = []
    real = sampler_mod.run_chunks

    def run_chunks(model, executor, req, inputs, hooks):
        seen.append(req)
        return real(model, executor, req, inputs, hooks)
    monkeypatch.setattr(sampler_mod, "run_chunks", run_chunks)
    return seen


def _tiny_handle():
    from wan_accel.nodes.model_nodes import CausalWanModelLoader
    return CausalWanModelLoader().load("(built-in tiny model)", "fp32", "self_forcing", "sdpa")[0]


def _cli_message(capsys, tmp_path) -> str:
    from wan_accel.cli import main
    assert main(["generate", "--out", str(tmp_path), "--linear", "fp8", "--sampler", "reference",
                 "--no-preview"]) == 2
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if "--linear fp8" in line)
    return line[line.index("--linear fp8"):].strip()


def test_every_sampler_node_offers_linear_with_a_tooltip():
    from wan_accel.nodes.model_nodes import CausalWanSampler
    from wan_accel.nodes.native_nodes import WanAccelARSampler
    from wan_accel.nodes.mg2_nodes import MatrixGame2Sampler
    from wan_accel.nodes.play_nodes import MatrixGame2PlaySession
    from wan_accel.nodes.prompt_nodes import CausalWanPromptPlaySession
    from wan_accel.nodes.stream_nodes import CausalWanSamplerDecode
    for node in (CausalWanSampler, CausalWanSamplerDecode, WanAccelARSampler, MatrixGame2Sampler,
                 MatrixGame2PlaySession, CausalWanPromptPlaySession):
        choices, opts = node.INPUT_TYPES()["optional"]["linear"]
        assert list(choices) == ["exact", "fp8"] and opts["default"] == "exact"
        tip = opts["tooltip"]
        assert all(w in tip for w in ("approximate", "opt-in", "layer group", "measured faster", "optimized"))


def test_the_sampler_node_passes_linear_fp8_to_the_loop(monkeypatch):
    from wan_accel.nodes.model_nodes import CausalWanSampler
    seen = _record_requests(monkeypatch)
    node = CausalWanSampler()
    out = node.sample(_tiny_handle(), 32, 32, 9, 0, "self_forcing", 3, -1, 0, linear="fp8")
    assert len(seen) == 1 and seen[0].path == "optimized" and seen[0].options.linear == "fp8"
    assert node.last_report["linear"] == "fp8"
    # 'auto' means the optimized path with fp8 linear layers: the node's text says so
    assert isinstance(out, dict) and any("linear fp8" in t for t in out["ui"]["text"])
    seen.clear()
    CausalWanSampler().sample(_tiny_handle(), 32, 32, 9, 0, "self_forcing", 3, -1, 0, sampler="optimized")
    assert seen[0].options.linear == "exact"


def test_the_sampler_node_refuses_fp8_on_the_reference_path_as_the_cli_does(monkeypatch, capsys, tmp_path):
    from wan_accel.nodes.model_nodes import CausalWanSampler
    seen = _record_requests(monkeypatch)
    cli = _cli_message(capsys, tmp_path)
    with pytest.raises(ValueError) as err:
        CausalWanSampler().sample(_tiny_handle(), 32, 32, 9, 0, "self_forcing", 3, -1, 0, sampler="reference",
                                  linear="fp8")
    assert str(err.value) == cli.replace("--sampler", "sampler").replace("--linear", "linear")
    assert not seen                                  # refused before anything ran
    with pytest.raises(ValueError, match="linear must be one of"):
        CausalWanSampler().sample(_tiny_handle(), 32, 32, 9, 0, "self_forcing", 3, -1, 0, linear="fp4")


class WAN21_CausalAR(NativeModel):         # noqa: N801 - named as ComfyUI's class, which the sampler checks
    def process_latent_in(self, latent):
        return latent


def test_the_ar_sampler_node_passes_linear_fp8_to_the_loop(fake_comfy, monkeypatch, capsys, tmp_path):
    from wan_accel.model.tiny import TINY_CONFIG, tiny_causal_model
    from wan_accel.nodes.native_nodes import WanAccelARSampler
    from wan_accel.sampling.scheduler import resolve_schedule
    cli = _cli_message(capsys, tmp_path)
    with pytest.raises(ValueError) as err:
        WanAccelARSampler().get_sampler(path="reference", linear="fp8")
    assert str(err.value) == cli.replace("--sampler", "path").replace("--linear", "linear")
    sampler = WanAccelARSampler().get_sampler(path="optimized", linear="fp8")[0]
    assert sampler.extra_options["linear"] == "fp8"
    seen = _record_requests(monkeypatch)
    dm = tiny_causal_model(seed=2)
    dm.model_type, dm.num_heads, dm.text_len = "t2v", dm.config.num_heads, dm.config.text_len
    ctx = torch.randn(1, 5, TINY_CONFIG.text_dim, generator=torch.Generator().manual_seed(4))
    guider = SimpleNamespace(inner_model=WAN21_CausalAR(dm), cfg=1.0,
                             conds={"positive": [{"model_conds": {"c_crossattn": SimpleNamespace(cond=ctx)}}]})
    noise = torch.randn(1, 16, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    report: dict = {}
    sampler.fn(SimpleNamespace(inner_model=guider), noise, torch.tensor(resolve_schedule("self_forcing").sigmas()),
               extra_args={"seed": 1}, report=report, **sampler.extra_options)
    assert len(seen) == 1 and seen[0].path == "optimized" and seen[0].options.linear == "fp8"
    assert report["linear"] == "fp8"


def test_the_matrix_game2_sampler_node_passes_linear_fp8_to_the_loop(monkeypatch):
    """Matrix-Game-2's sampler node: linear fp8 reaches the chunk loop on the optimized path (the node's text says
    so); exact keeps the path it had; anything else is refused by name."""
    from wan_accel.app.jobs.mg2 import load_mg2_handle
    from wan_accel.nodes.mg2_nodes import GameActions, MatrixGame2Sampler
    seen = _record_requests(monkeypatch)
    handle = load_mg2_handle(None, dtype="fp32", device="cpu", seed=3)
    actions = GameActions().build("W*8, idle*4", "universal")["result"][0]
    start = {"samples": torch.randn(1, 16, 1, 8, 8)}
    clip = SimpleNamespace(penultimate_hidden_states=torch.randn(1, 9, 32))
    out = MatrixGame2Sampler().sample(handle, start, clip, actions, seed=1, num_frames=3, preset="universal",
                                      linear="fp8")
    assert len(seen) == 1 and seen[0].path == "optimized" and seen[0].options.linear == "fp8"
    assert isinstance(out, dict) and any("linear fp8" in t for t in out["ui"]["text"])
    exact = MatrixGame2Sampler().sample(handle, start, clip, actions, seed=1, num_frames=3, preset="universal")
    assert seen[1].options is None or seen[1].options.linear == "exact"
    assert not torch.equal(out["result"][0]["samples"], exact[0]["samples"])
    with pytest.raises(ValueError, match="linear must be one of"):
        MatrixGame2Sampler().sample(handle, start, clip, actions, seed=1, num_frames=3, linear="fp4")


@pytest.mark.parametrize("face", ["mg2", "prompt"])
def test_the_play_sessions_run_every_chunk_with_the_starts_linear_choice(monkeypatch, face):
    """A play session started with linear fp8 makes every chunk on the optimized path with fp8 linear layers (the
    start's text says so); started exact, its chunks keep the defaults."""
    from .test_one_door import _play_env
    from wan_accel.nodes import play_nodes
    from wan_accel.nodes.model_nodes import TINY_MG2_NAME, CausalWanModelLoader
    from wan_accel.nodes.prompt_nodes import CausalWanPromptPlaySession, CausalWanPromptPlayStep
    registry = _play_env(monkeypatch)
    seen = _record_requests(monkeypatch)

    def start(linear):
        if face == "mg2":
            (handle,) = CausalWanModelLoader().load(TINY_MG2_NAME, "fp32", "float32", "sdpa")
            latent = {"samples": torch.randn(1, 16, 1, 4, 4, generator=torch.Generator().manual_seed(4))}
            return play_nodes.MatrixGame2PlaySession().start(handle, object(), latent, seed=11, linear=linear)
        return CausalWanPromptPlaySession().start(_tiny_handle(), object(), "a cat", width=32, height=32, seed=5,
                                                  frames_per_block=3, kv_window=-1, sink=0, linear=linear)

    def step(sid):
        return (play_nodes.MatrixGame2PlayStep().step(sid, "w") if face == "mg2"
                else CausalWanPromptPlayStep().step(sid, ""))

    try:
        out = start("fp8")
        assert "linear fp8" in out["ui"]["text"][0]
        sid = out["result"][0]
        step(sid)
        step(sid)
        assert len(seen) == 2 and all(r.path == "optimized" and r.options.linear == "fp8" for r in seen)
        step(start("exact")["result"][0])
        assert seen[2].options is None or seen[2].options.linear == "exact"
        with pytest.raises(ValueError, match="linear must be one of"):
            start("fp4")
    finally:
        registry.clear()
