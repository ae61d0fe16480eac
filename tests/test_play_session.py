"""Matrix-Game-2 play session (the engine of play mode): keys held during a chunk reach the model as that chunk's
actions, change its frames, and the session's script reproduces it exactly with the same seed."""
import pytest
import torch

from wan_accel.app.play import PlaySession
from wan_accel.model.mg2_model import tiny_mg2_model
from wan_accel.sampling.actions_script import parse_action_script
from wan_accel.sampling.mg2 import generate_mg2


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(2)
    return tiny_mg2_model(seed=7), torch.randn(1, 16, 1, 4, 4, generator=g), torch.randn(1, 9, 32, generator=g)


def test_held_keys_drive_their_chunk_and_the_script_reproduces_the_session(inputs):
    model, img, ctx = inputs
    play = PlaySession(model, img, ctx, seed=5)
    chunks = [play.step({"w"}), play.step({"a", "w"}, (0.0, 0.1)), play.step(), play.step({"d"})]
    assert play.script == "w*8, w+a+mouse(0.0,0.1)*12, idle*12, d*12"
    kb, ms = play.state.actions["keyboard"][0], play.state.actions["mouse"][0]
    assert kb.shape[0] == ms.shape[0] == 1 + 4 * 11
    assert kb[:9].tolist() == [[1, 0, 0, 0]] * 9                         # chunk 0: start frame + 8, W held
    assert kb[9:21].tolist() == [[1, 0, 1, 0]] * 12 and torch.equal(ms[9:21], torch.tensor([[0.0, 0.1]] * 12))
    assert kb[21:33].abs().sum() == 0 and kb[33:].tolist() == [[0, 0, 0, 1]] * 12
    session = torch.cat(chunks, 2)
    replay = generate_mg2(model, img, ctx, parse_action_script(play.script, "universal"), seed=5)
    assert torch.equal(session, replay)
    other = PlaySession(model, img, ctx, seed=5)
    other.step({"w"})
    assert not torch.equal(other.step({"s"}), chunks[1])                 # other keys, other frames
    play.close()
    assert play.state is None


def test_play_session_errors_are_clear(inputs):
    model, img, ctx = inputs
    play = PlaySession(model, img, ctx)
    with pytest.raises(ValueError, match="not an action of mode 'universal'"):
        play.step({"q"})
    with pytest.raises(ValueError, match="no camera"):
        PlaySession(model, img, ctx, preset="templerun").step({"jump"}, (0.1, 0.0))
    from wan_accel.model.tiny import init_tiny_weights  # noqa: F401 - a text-to-video model is refused
    with pytest.raises(ValueError, match="Matrix-Game-2 model"):
        PlaySession(torch.nn.Linear(1, 1), img, ctx)
