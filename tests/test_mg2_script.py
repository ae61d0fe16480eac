"""The Matrix-Game-2 action-script parser: valid scripts and clear errors."""
from __future__ import annotations

import pytest

from wan_accel.sampling.actions_script import ActionScriptError, parse_action_script


def test_issue_example_frames_and_values():
    acts = parse_action_script("W*20, W+A*8, mouse(0.1,0)*12, idle*4")
    assert acts.video_frames == 45 and acts.latent_frames == 12
    kb, ms = acts.keyboard, acts.mouse
    assert kb[0] == [1, 0, 0, 0]                  # start frame repeats the first action
    assert kb[1] == kb[20] == [1, 0, 0, 0]
    assert kb[21] == kb[28] == [1, 0, 1, 0]       # W + A
    assert kb[29] == [0, 0, 0, 0] and ms[29] == [0.1, 0.0] and ms[40] == [0.1, 0.0]
    assert kb[41] == [0, 0, 0, 0] and ms[44] == [0.0, 0.0]
    assert "45 video frames = 12 latent frames" in acts.summary()


def test_aliases_comments_newlines_and_case():
    a = parse_action_script("forward*4  # run\nback + right * 4\nlook_left*4\n")
    b = parse_action_script("w*4, S+D*4, mouse(0,-0.1)*4")
    assert a.keyboard == b.keyboard and a.mouse == b.mouse
    assert a.video_frames == 13 and a.latent_frames == 4


def test_tensors_batch_and_prefix():
    acts = parse_action_script("W*8")
    ms, kb = acts.tensors(batch=2, frames=5)
    assert tuple(ms.shape) == (2, 5, 2) and tuple(kb.shape) == (2, 5, 4)
    with pytest.raises(ActionScriptError, match="only 9"):
        acts.tensors(frames=13)


def test_templerun_and_gta_modes():
    t = parse_action_script("jump*4, turnleft+leftside*4", mode="templerun")
    assert t.mouse is None and all(len(row) == 7 for row in t.keyboard)
    assert t.keyboard[5] == [0, 0, 0, 1, 0, 1, 0]
    g = parse_action_script("W+look_right*4", mode="gta_drive")
    assert g.keyboard[1] == [1, 0] and g.mouse[1] == [0.0, 0.1]


@pytest.mark.parametrize("script, mode, match", [
    ("Q*4", "universal", "unknown key 'q'"),
    ("W*3", "universal", "multiple of 4"),
    ("W*0", "universal", "positive whole number"),
    ("W*-4", "universal", "positive whole number"),
    ("W*2.5", "universal", "positive whole number"),
    ("mouse(1)*4", "universal", "mouse\\(PITCH,YAW\\)"),
    ("W+*4", "universal", "empty term"),
    ("  # nothing\n", "universal", "empty"),
    ("look_up*4", "templerun", "no mouse"),
    ("mouse(0.1,0)+look_up*4", "universal", "more than one mouse"),
    ("A*4", "gta_drive", "unknown key 'a'"),
    ("W*4", "minecraft", "unknown action mode"),
    ("mouse(inf,0)*4", "universal", "mouse"),
])
def test_invalid_scripts_raise_clear_errors(script, mode, match):
    with pytest.raises(ActionScriptError, match=match):
        parse_action_script(script, mode)


def test_error_names_the_item():
    with pytest.raises(ActionScriptError, match=r"item 2 \('x\*4'\)"):
        parse_action_script("W*4, X*4")
