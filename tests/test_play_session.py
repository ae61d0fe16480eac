"""Matrix-Game-2 play session (the engine of play mode): keys held during a chunk reach the model as that chunk's
actions, change its frames, and the session's script reproduces it exactly with the same seed."""
import pytest
import torch

from wan_accel.app.play.registry import PlaySession
from wan_accel.profiling.dispatch_counts import DispatchCounts
from wan_accel.model.mg2_model import tiny_mg2_model
from wan_accel.sampling.actions_script import parse_action_script
from wan_accel.app.jobs.mg2 import generate_mg2


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
    play.free()
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


def test_a_chunk_costs_the_same_memory_however_long_the_session():
    """A continued chunk allocates its own frames only (no conditioning or output tensor of the whole video), so a
    play session can go on: the largest tensor of chunk 30 is that of chunk 4, and all it makes grows only by the
    action history (a few numbers per frame)."""
    g = torch.Generator().manual_seed(0)
    play = PlaySession(tiny_mg2_model(seed=1), torch.randn(1, 16, 1, 16, 16, generator=g),
                       torch.randn(1, 9, 32, generator=g), seed=3)
    seen = {}
    for i in range(30):
        if i in (3, 29):
            with DispatchCounts() as counts:
                play.step({"w"})
            seen[i] = counts
        else:
            play.step({"w"})
    assert seen[29].largest_alloc_bytes == seen[3].largest_alloc_bytes
    assert seen[29].alloc_bytes - seen[3].alloc_bytes < 0.01 * seen[3].alloc_bytes, (seen[3], seen[29])


def test_a_session_writes_its_caches_in_place(inputs):
    """Once its cache has the long run's rolling layout, a session goes on in the same cache objects (no copy in,
    no copy out: one cache in memory instead of three); the frames stay those of one long run (the test above)."""
    model, img, ctx = inputs
    play = PlaySession(model, img, ctx, seed=5)
    for keys in ({"w"}, {"w"}, {"a"}):                   # 9 latent frames: past the 6-frame window, rolling
        play.step(keys)
    kv, mouse_cache = play.state.kv, play.state.actions["mouse_cache"]
    play.step({"d"})
    assert play.state.kv is kv and play.state.actions["mouse_cache"] is mouse_cache
    offloaded = PlaySession(model, img, ctx, seed=5, state_device="cpu")
    for keys in ({"w"}, {"w"}, {"a"}, {"d"}):
        last = offloaded.step(keys)
    assert torch.equal(last, play.latents[-1])           # kept on the CPU between chunks (copies): same frames


def test_the_play_bench_compares_in_place_with_copies(capsys):
    """``bench play`` (CPU, tiny model): both modes make the same frames, and the in-place mode makes fewer new bytes
    per chunk (the two cache copies it does without). Nothing is timed here."""
    import json

    from wan_accel.cli import main

    assert main(["bench", "play", "--chunks", "1", "--warmup", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    inplace, copies = report["rows"]
    assert (inplace["mode"], copies["mode"], report["same_frames"]) == ("in place", "copies", True)
    assert inplace["new_bytes_per_chunk"] < copies["new_bytes_per_chunk"] and report["new_bytes_ratio"] > 1
    assert inplace["peak_bytes_per_chunk"] is None                       # no allocator peak on a CPU
    assert main(["bench", "play", "--model", "released", "--device", "cpu"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
