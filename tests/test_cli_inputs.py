"""Command-line inputs: one vocabulary, no silent defaults, advice that passes every check, clean output."""
from __future__ import annotations

import json
import os
import re
import sys
import types

import pytest
import torch

from wan_accel.cli import main


def _passes(video: int, fpb: int) -> bool:
    """Independent of the pack: 4k+1 video frames whose latent frames fill whole blocks."""
    return video >= 1 and (video - 1) % 4 == 0 and ((video - 1) // 4 + 1) % fpb == 0


@pytest.mark.parametrize("fpb", [1, 2, 3, 4, 7])
def test_every_suggested_frame_count_passes_every_check(fpb, capsys):
    for frames in range(1, 70):
        if _passes(frames, fpb):
            continue
        code = main(["generate", "--frames", str(frames), "--frames-per-block", str(fpb), "--out", "unused"])
        err = capsys.readouterr().err
        assert code == 2, err
        suggested = [int(x) for x in re.findall(r"use ((?:\d+)(?: or \d+)*)", err)[-1].split(" or ")]
        assert suggested and all(_passes(v, fpb) for v in suggested), (frames, fpb, err)


def test_library_entry_gives_the_same_advice():
    from wan_accel.app.prepare import RunInputs, RunSpec, sample_video
    from wan_accel.model.tiny import tiny_causal_model

    model = tiny_causal_model(0, "cpu", torch.float32, "float32")
    inputs = RunInputs(context=torch.zeros(1, 0, model.config.text_dim))
    with pytest.raises(ValueError, match=r"num_frames 13 .*use 9 or 21"):
        sample_video(model, RunSpec(), inputs, 32, 32, 13)
    with pytest.raises(ValueError, match=r"frames_per_block must be between 1 and 64, got 0") as info:
        sample_video(model, RunSpec(frames_per_block=0), inputs, 32, 32, 33)
    assert "1-frame" not in str(info.value)


@pytest.mark.parametrize("field", ["frames", "height", "width"])
def test_zero_is_not_a_default_in_the_job(field, tmp_path):
    from wan_accel.app.jobs.generate import GenerateOptions, run_generate

    with pytest.raises(ValueError, match="between"):
        run_generate(GenerateOptions(out_dir=str(tmp_path / "o"), **{field: 0}), log=lambda *a: None)
    assert not (tmp_path / "o").exists()


def test_dtype_spellings_are_one_vocabulary(tmp_path, capsys):
    assert main(["generate", "--out", str(tmp_path), "--frames", "9", "--height", "32", "--width", "32",
                 "--dtype", "float32", "--no-preview", "--json"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["dtype"] == "fp32"
    assert "note: --dtype float32 is spelled fp32" in cap.err
    from wan_accel.app.validate import normalize_dtype

    assert normalize_dtype("x", "bf16") == "bf16" and normalize_dtype("x", "bfloat16", quiet=True) == "bf16"


def test_profile_takes_video_frames_and_pixels(tmp_path, capsys):
    assert main(["profile", "--out", str(tmp_path), "--warmup", "0", "--json", "--device", "cpu", "--frames", "9",
                 "--height", "32", "--width", "48", "--dtype", "fp32"]) == 0
    cap = capsys.readouterr()
    settings = json.loads(cap.out)
    from wan_accel.profiling import history

    rec = history.read(kind="profile")[-1]["settings"]
    assert (rec["frames"], rec["height"], rec["width"]) == (3, 4, 6)            # latent units inside
    assert (rec["video_frames"], rec["pixel_height"], rec["pixel_width"]) == (9, 32, 48)
    assert rec["dtype"] == "float32" and settings["profile"]["runs"] == 1
    assert "profile: profiled run 1/1" in cap.err


def test_profiler_marker_lines_are_dropped(capfd):
    from wan_accel.cli.profiling import _without_profiler_chatter

    with _without_profiler_chatter():
        os.write(2, b"USDT:2026-11-24 06:52:23 8921:8921 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a real message\n")
    err = capfd.readouterr().err
    assert "USDT" not in err and "a real message" in err


def test_profile_compile_announces_itself(capsys):
    from wan_accel.cli.profiling import _with_progress

    fn = _with_progress(lambda: 1, warmup=1, runs=1, compile_mode="default")
    fn(), fn()
    err = capsys.readouterr().err
    assert "warm-up 1/1 (compiling the blocks with 'default'" in err and "done in" in err


def test_loader_lists_only_files_it_can_load(monkeypatch):
    fake = types.ModuleType("folder_paths")
    fake.get_filename_list = lambda kind: ["a.safetensors", "old.pt", "b.ckpt", "sub/c.safetensors"]
    monkeypatch.setitem(sys.modules, "folder_paths", fake)
    from wan_accel.nodes.memory_nodes import _diffusion_model_files
    from wan_accel.nodes.model_nodes import CausalWanModelLoader

    choices, opts = CausalWanModelLoader.INPUT_TYPES()["required"]["checkpoint"]
    assert choices == ["(built-in tiny model)", "(built-in tiny Matrix-Game-2 model)", "a.safetensors",
                       "sub/c.safetensors"]
    assert "old.pt" in opts["tooltip"] and "convert" in opts["tooltip"]
    assert _diffusion_model_files() == ["a.safetensors", "sub/c.safetensors"]


def test_counts_are_plural_aware(capsys):
    from wan_accel.cache import LimitCache
    from wan_accel.nodes.cache_nodes import WanAccelLimitCache

    LimitCache().put("memory", "k", {"v": 1})
    text = WanAccelLimitCache().run()["result"][0]
    assert "[memory] 1 entry" in text
    assert main(["cache", "clear"]) == 0
    assert "removed 1 entry from" in capsys.readouterr().out
    from tests.conftest import REPO_ROOT

    js = (REPO_ROOT / "web" / "wan_accel.js").read_text()
    assert "${res.cleared} entries" not in js and 'plural(res.cleared, "entry", "entries")' in js


def test_wrong_rank_tensor_names_key_and_shape():
    from wan_accel.model.checkpoint import CheckpointError, infer_config

    with pytest.raises(CheckpointError, match=r"'patch_embedding.weight' has shape \[4\], expected .*5-D"):
        infer_config({"patch_embedding.weight": (4,)})
    with pytest.raises(CheckpointError, match=r"'head.head.weight' has shape \[8\]"):
        infer_config({"patch_embedding.weight": (64, 16, 1, 2, 2), "blocks.0.x": (1,), "head.head.weight": (8,)})


def test_unknown_errors_are_one_line_and_debuggable(monkeypatch, capsys):
    from wan_accel.cli.errors import run_guarded

    def boom(_args):
        raise IndexError("tuple index out of range")

    assert run_guarded(boom, None) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: internal error IndexError") and "WAN_ACCEL_DEBUG=1" in err
    monkeypatch.setenv("WAN_ACCEL_DEBUG", "1")
    with pytest.raises(IndexError):
        run_guarded(boom, None)
