"""The fixture replayer (app/jobs/replay.py) and the one random-weight maker (model/tiny.py draw_weights)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from wan_accel.app.jobs.replay import Fixture, replay
from wan_accel.model.tiny import TINY_CONFIG, draw_weights, init_tiny_weights
from wan_accel.model.dit import WanModel

FIXTURES = Path(__file__).parent / "fixtures"


def _fixture(folder: str, name: str) -> Fixture:
    return Fixture(FIXTURES / folder, json.loads((FIXTURES / folder / name).read_text()))


@pytest.mark.parametrize("folder, name, kind", [("wan_reference", "causal_config.json", "causal_wan"),
                                                ("matrix_game2", "mg2_config.json", "matrix_game2")])
def test_a_replay_is_the_recorded_run_in_the_fixtures_layout(folder, name, kind):
    fx = _fixture(folder, name)
    assert fx.kind == kind
    out = replay(fx, fx.model("cpu"), path="reference")
    assert out.shape == fx.io["output"].shape and (out - fx.io["output"]).abs().max() <= 1e-4


def test_a_fixture_without_a_sampling_run_is_refused_by_name():
    fx = _fixture("wan_reference", "wan_t2v_config.json")
    with pytest.raises(ValueError, match="wan_t2v_full fixture has no sampling run"):
        replay(fx, None)


def test_one_generator_draws_the_tiny_model_in_name_order():
    model = init_tiny_weights(WanModel(TINY_CONFIG), 3)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    drawn = dict(draw_weights(shapes, 3))
    assert all(torch.equal(p, drawn[n]) for n, p in model.named_parameters())
    first = sorted(shapes)[0]
    alone = dict(draw_weights({first: shapes[first]}, 3))[first]
    assert torch.equal(alone, drawn[first])                        # the first drawn: the same alone
    second = sorted(shapes)[1]
    assert not torch.equal(dict(draw_weights({second: shapes[second]}, 3))[second], drawn[second])
    half = dict(draw_weights(shapes, 3, dtype=torch.bfloat16))
    assert all(torch.equal(half[n], drawn[n].to(torch.bfloat16)) for n in shapes)   # drawn in float32, cast


def test_per_tensor_draws_do_not_depend_on_the_other_tensors():
    shapes = {n: p.shape for n, p in WanModel(TINY_CONFIG).named_parameters()}
    every = dict(draw_weights(shapes, 5, dtype=torch.bfloat16, per_tensor=True))
    for name in sorted(shapes)[1::7]:
        alone = dict(draw_weights({name: shapes[name]}, 5, dtype=torch.bfloat16, per_tensor=True))[name]
        assert alone.dtype == torch.bfloat16 and torch.equal(alone, every[name])
    other = dict(draw_weights(shapes, 6, per_tensor=True))
    assert not any(torch.equal(other[n].to(torch.bfloat16), every[n]) for n in shapes if every[n].numel() > 4)
