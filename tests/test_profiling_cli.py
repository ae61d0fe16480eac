"""``python -m wan_accel profile``: on a stand-in model and on the built-in tiny model (always in the build)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from wan_accel.cli import main
from wan_accel.profiling import history
from wan_accel.app.jobs import profile_targets as targets

HERE = Path(__file__).resolve().parent


class BreakingBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        x = self.lin(x)
        torch._dynamo.graph_break()
        return torch.relu(x)


class StandIn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([BreakingBlock(), BreakingBlock()])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.fixture
def stand_in(monkeypatch):
    model = StandIn()
    monkeypatch.setattr(targets, "load_model", lambda target: model)
    monkeypatch.setattr(targets, "make_inputs", lambda m, target: {"x": torch.randn(2, 8)})
    monkeypatch.setattr(targets, "sampler_call", lambda m, target, inputs: (lambda: m(inputs["x"])))
    return model


def test_profile_command_on_a_stand_in_with_a_graph_break(tmp_path, capsys, stand_in, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    code = main(["profile", "--out", str(tmp_path / "out"), "--compile", "eager", "--json", "--device", "cpu",
                 "--explain-target", "test_profiling_graph_breaks:planted_break_target"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    prof, explained = data["profile"], data["explain"]
    assert explained["graph_break_count"] == 1 and "graph_break()" in explained["break_reasons"][0]["reason"]
    assert prof["runs"] == 1 and prof["warmup"] == 1 and prof["device"] == "cpu"
    assert prof["compile"]["graph_break_count"] >= 2  # one per compiled block
    assert any("graph_break()" in b["reason"] for b in prof["compile"]["graph_breaks"])
    trace = json.load(open(prof["trace_path"]))
    assert "profile_tiny_eager/run0" in {e.get("name") for e in trace["traceEvents"]}
    recs = history.read(kind="profile")
    assert len(recs) == 1 and recs[0]["settings"]["compile"] == "eager" and recs[0]["graph_breaks"] >= 2


def test_profile_command_text_and_argument_errors(tmp_path, capsys, stand_in):
    assert main(["profile", "--out", str(tmp_path), "--warmup", "0", "--no-history", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Wan profile: profile_tiny_none") and "GPU idle      : N/A" in out
    assert history.read() == []
    assert main(["profile", "--checkpoint", str(tmp_path / "missing.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --checkpoint") and "missing.safetensors: file not found" in err
    assert main(["profile", "--compile", "fastest"]) == 2
    assert "--compile must be one of" in capsys.readouterr().err


def test_profile_command_on_the_tiny_model(tmp_path, capsys):
    assert main(["profile", "--out", str(tmp_path), "--warmup", "0", "--json", "--device", "cpu"]) == 0
    prof = json.loads(capsys.readouterr().out)["profile"]
    assert prof["runs"] == 1 and Path(prof["trace_path"]).is_file()
    assert {"aten::addmm", "aten::linear"} & {r["name"] for r in prof["top_ops"]}
    assert history.read(kind="profile")[0]["settings"]["frames"] == targets.TINY_LATENT[0]


def test_explain_factory_captures_a_real_block_call():
    spec = targets.explain_model(scope="block", device="cpu")
    model_block, args, kwargs = spec["fn"], spec["args"], spec["kwargs"]
    assert spec["inference_mode"] is True and isinstance(model_block, torch.nn.Module)
    with torch.inference_mode():
        out = model_block(*args, **kwargs)  # the captured arguments really drive the block
    assert isinstance(out, torch.Tensor) and out.shape == args[0].shape
