"""Matrix-Game-2 play mode through its nodes and routes, outside ComfyUI (the decoder is a stand-in; the real one and
the browser are checked in tests/e2e): keys sent with a step reach the model as that chunk's actions, each step makes
one chunk, the saved script and seed reproduce the session exactly, and an interrupted, ended or abandoned session
frees its memory."""
from __future__ import annotations

import gc
import time
import sys
import types
import weakref

import pytest
import torch
from safetensors.torch import load_file

import wan_accel.app.play.registry as play_mod
import wan_accel.server_routes as sr
from fake_decoder import FakeDecoder
from wan_accel.app.play.registry import PlayError, PlayRegistry, PlaySession
from wan_accel.nodes import play_nodes
from wan_accel.nodes.comfy import streaming_decode
from wan_accel.nodes.mg2_nodes import GameActions, MatrixGame2Sampler, to_latent_space
from wan_accel.nodes.model_nodes import TINY_MG2_NAME, CausalWanModelLoader


@pytest.fixture(scope="module")
def handle():
    (h,) = CausalWanModelLoader().load(TINY_MG2_NAME, "fp32", "float32", "sdpa")
    return h


@pytest.fixture()
def env(monkeypatch, tmp_path):
    """A fresh registry, the stand-in decoder, the events sent and a ComfyUI-like output folder."""
    registry = PlayRegistry(reaper=False)
    monkeypatch.setattr(play_mod, "REGISTRY", registry)
    decoders, events = [], []
    monkeypatch.setattr(streaming_decode, "WanStreamDecoder", lambda vae: decoders.append(FakeDecoder(vae)) or decoders[-1])
    monkeypatch.setattr(play_nodes, "send_play_event", lambda kind, session, **p: events.append(dict(p, kind=kind)))

    def save_path(prefix, out):
        folder = tmp_path / "output" / prefix.rsplit("/", 1)[0]
        return str(folder), prefix.rsplit("/", 1)[-1], 1, prefix.rsplit("/", 1)[0], prefix
    monkeypatch.setitem(sys.modules, "folder_paths", types.SimpleNamespace(
        get_output_directory=lambda: str(tmp_path / "output"), get_save_image_path=save_path))
    return types.SimpleNamespace(registry=registry, decoders=decoders, events=events, out=tmp_path / "output")


START = {"samples": torch.randn(1, 16, 1, 4, 4, generator=torch.Generator().manual_seed(4))}


def _start(handle, **kw):
    out = play_nodes.MatrixGame2PlaySession().start(handle, object(), START, **dict(dict(seed=11), **kw))
    return out["result"][0], out


def test_the_loader_offers_a_tiny_matrix_game2_model(handle):
    assert hasattr(handle.model, "action_config") and handle.is_tiny and handle.source == TINY_MG2_NAME


def test_keys_reach_their_chunk_and_the_saved_script_reproduces_the_session(handle, env):
    sid, out = _start(handle)
    assert out["ui"]["wan_accel_play"] == [sid] and "W S A D" in out["ui"]["text"][0]
    assert env.events[0]["kind"] == "ready" and env.events[0]["keys"] == ["w", "s", "a", "d"]
    step = play_nodes.MatrixGame2PlayStep()
    for i, (keys, pitch, yaw) in enumerate([("w", 0, 0), ("W+a", 0.0, 0.1), ("", 0, 0), ("d", -0.1, 0)]):
        step.step(sid, keys, pitch, yaw, chunk=i)
    play = env.registry.get(sid)
    assert play.chunks == 4                                      # one chunk per step
    chunks = [e for e in env.events if e["kind"] == "chunk"]
    assert [e["chunk"] for e in chunks] == [0, 1, 2, 3]
    assert [e["action"] for e in chunks] == ["w", "w+a+mouse(0.0,0.1)", "idle", "d+mouse(-0.1,0.0)"]
    assert [len(e["frames"]) for e in chunks] == [9, 8, 16, 8] and [e["first_frame"] for e in chunks] == [0, 9, 17, 33]
    dec = env.decoders[0]
    assert torch.equal(torch.cat(dec.pushed, 2), to_latent_space(play.latent_video()))  # decoded as made

    # what the model was given, chunk by chunk (the panel's touch route reports it)
    seen = sr.play_touch({"session": sid}, env.registry)["chunk_actions"]
    assert seen[0]["keyboard"] == [[1, 0, 0, 0]] * 9 and seen[0]["mouse"] == [[0, 0]] * 9
    assert seen[1]["keyboard"] == [[1, 0, 1, 0]] * 12 and seen[1]["mouse"] == [[0.0, pytest.approx(0.1)]] * 12
    assert seen[2]["keyboard"] == [[0, 0, 0, 0]] * 12 and seen[3]["keyboard"] == [[0, 0, 0, 1]] * 12
    assert seen[3]["mouse"] == [[pytest.approx(-0.1), 0.0]] * 12

    saved = play_nodes.MatrixGame2PlaySave().save(sid, "wan_accel/play", "webp")
    files = saved["ui"]["wan_accel_play_saved"][0]
    folder = env.out / files["subfolder"]
    script = (folder / files["script"]).read_text()
    assert saved["result"] == (play.script,) and "seed 11" in script
    assert (folder / files["video"]).stat().st_size > 0
    assert env.events[-1]["kind"] == "saved" and env.events[-1]["frames"] == 1 + 4 * 11   # the held frame's too
    session_latent = load_file(str(folder / files["latent"]))["latent_tensor"]

    actions = GameActions().build(script, "universal")["result"][0]
    replay, _ = MatrixGame2Sampler().sample(handle, START, None, actions, seed=11, preset="universal")
    assert torch.equal(replay["samples"], session_latent)                      # same seed, same actions: same frames
    other = GameActions().build(script.replace("w+a+mouse", "s+mouse"), "universal")["result"][0]
    changed, _ = MatrixGame2Sampler().sample(handle, START, None, other, seed=11, preset="universal")
    assert torch.equal(changed["samples"][:, :, :3], session_latent[:, :, :3])
    assert not torch.equal(changed["samples"][:, :, 3:6], session_latent[:, :, 3:6])   # other keys, other frames


def test_refused_steps_leave_the_session_as_it_was(handle, env):
    sid, _ = _start(handle)
    step = play_nodes.MatrixGame2PlayStep()
    step.step(sid, "w")
    with pytest.raises(ValueError, match="has made 1: is another tab"):
        step.step(sid, "w", chunk=0)
    with pytest.raises(PlayError, match="'q' is not an action of mode 'universal'"):
        step.step(sid, "q")
    with pytest.raises(PlayError, match="no play session 'beef'"):
        step.step("beef", "w")
    play = env.registry.get(sid)
    assert play.chunks == 1 and play.ended is None and play.state is not None
    assert play_nodes.parse_keys(" W + a ") == ["w", "a"] and play_nodes.parse_keys("idle") == []
    with pytest.raises(ValueError, match="play mode needs a Matrix-Game-2 model"):
        play_nodes.MatrixGame2PlaySession().start(CausalWanModelLoader().load("(built-in tiny model)", "fp32",
                                                                              "float32", "sdpa")[0], object(), START)
    with pytest.raises(ValueError, match="has 4: use preset universal"):
        _start(handle, preset="templerun")


def test_an_interrupted_chunk_ends_the_session_and_frees_its_memory(handle, env, monkeypatch):
    sid, _ = _start(handle, state_on="cpu")
    step = play_nodes.MatrixGame2PlayStep()
    step.step(sid, "w")
    play = env.registry.get(sid)
    kv = weakref.ref(play.state.kv.layers[0].k)
    model = weakref.ref(play.model)

    class InterruptProcessingException(BaseException):      # as ComfyUI's (not an Exception)
        pass

    def interrupt():
        raise InterruptProcessingException()
    monkeypatch.setattr("wan_accel.nodes.comfy.comfy_core.progress_and_interrupt", lambda: (None, interrupt))
    with pytest.raises(InterruptProcessingException):
        step.step(sid, "a")
    assert play.ended == "interrupted" and play.state is None and play.model is None and play.chunks == 1
    assert env.decoders[0].released == 1 and env.events[-1]["kind"] == "ended"
    gc.collect()
    assert kv() is None and model() is not None                 # its caches are gone; the loaded model is not its own
    with pytest.raises(PlayError, match="has ended \\(interrupted\\)"):
        play.step({"w"})
    monkeypatch.setattr("wan_accel.nodes.comfy.comfy_core.progress_and_interrupt", lambda: (None, None))
    saved = play_nodes.MatrixGame2PlaySave().save(sid, "wan_accel/play", "webp")     # what was made can be saved
    latent = load_file(str(env.out / "wan_accel" / saved["ui"]["wan_accel_play_saved"][0]["latent"]))
    assert latent["latent_tensor"].shape[2] == 3


def test_end_route_and_bad_route_bodies(handle, env):
    sid, _ = _start(handle)
    play_nodes.MatrixGame2PlayStep().step(sid, "w")
    listed = sr.play_sessions(env.registry)["sessions"]
    assert [s["session"] for s in listed] == [sid] and listed[0]["chunks"] == 1
    for body in ([], {"session": 3}, {"session": "../x"}, {"session": sid, "more": 1}, {"session": "abc"}):
        with pytest.raises(sr.RequestError):
            sr.play_touch(body, env.registry)
    ended = sr.play_end({"session": sid}, env.registry)
    assert ended["ended"] == "ended by the user" and env.registry.get(sid).state is None
    assert env.decoders[0].released == 1
    with pytest.raises(PlayError, match="has ended"):
        play_nodes.MatrixGame2PlayStep().step(sid, "w")


def _session(handle):
    ctx = torch.zeros(1, 9, 32)
    return PlaySession(handle.model, START["samples"], ctx)


def test_registry_replaces_caps_and_reaps_abandoned_sessions(handle):
    now = [0.0]
    reg = PlayRegistry(max_sessions=2, clock=lambda: now[0], reaper=False)
    a, b = _session(handle), _session(handle)
    ida = reg.open(a, owner="tab:1", idle_timeout_s=60)
    idb = reg.open(b, owner="tab:1", idle_timeout_s=60)          # the same node again: the first is replaced
    assert a.ended == "replaced by a new session" and b.ended is None
    with pytest.raises(PlayError, match="no play session"):
        reg.get(ida)
    c, d = _session(handle), _session(handle)
    now[0] = 1.0
    reg.open(c, owner="tab:2", idle_timeout_s=60)
    reg.open(d, owner="tab:3", idle_timeout_s=60)                # over the limit: the least recently used ends
    assert b.ended.startswith("too many") and c.ended is None and d.ended is None
    now[0] = 50.0
    reg.get(idb)                                                 # watched by a panel: kept
    now[0] = 70.0
    assert sorted(reg.reap()) != [] and c.ended.startswith("abandoned") and d.ended.startswith("abandoned")
    reg.get(idb)
    now[0] = 200.0
    reg.reap()                                                   # ended ones are forgotten after another timeout
    assert len(reg) <= 2
    now[0] = 400.0
    reg.reap()
    assert len(reg) == 0
    with pytest.raises(PlayError, match="above 0"):
        reg.open(_session(handle), idle_timeout_s=0)


def test_the_reaper_thread_frees_an_abandoned_session(handle):
    reg = PlayRegistry()
    s = _session(handle)
    s.step({"w"})
    reg.open(s, idle_timeout_s=0.2)
    deadline = time.monotonic() + 20
    while s.ended is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s.ended and s.ended.startswith("abandoned") and s.state is None
    reg.clear()
