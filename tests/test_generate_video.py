"""``generate --decode wan|tiny|none [--vae FILE]`` writes a playable video beside the latents, each chunk's frames
written as they are decoded (app/jobs/video.py), through the frame-by-frame video writer (cache/video_file.py:
animated WebP through Pillow, or MP4 through PyAV where it is installed)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from cli_run import refused, run_cli_in

GEN = ["generate", "--device", "cpu", "--frames", "9", "--height", "32", "--width", "32", "--no-preview", "--json"]


def frames_of(path: Path) -> list:
    """The frames of a video file as uint8 arrays [H, W, 3] (Pillow for WebP, PyAV for MP4)."""
    import numpy as np
    if path.suffix == ".mp4":
        import av
        with av.open(str(path)) as f:
            return [fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)]
    from PIL import Image
    out = []
    with Image.open(path) as im:
        for i in range(im.n_frames):
            im.seek(i)
            out.append(np.asarray(im.convert("RGB")))
    return out


def _decoded(latents_file: Path, decoder) -> torch.Tensor:
    """The video frames [T, H, W, 3] 0..1 of one decode of the saved latents."""
    from safetensors.torch import load_file
    from wan_accel.vae.frames import DecoderFrames
    return DecoderFrames(decoder).push(load_file(str(latents_file))["vae_latents"])[0]


def _close(video: list, want: torch.Tensor) -> float:
    got = torch.tensor(__import__("numpy").stack(video)).float() / 255
    assert got.shape == want.shape, (got.shape, want.shape)
    return float((got - want).abs().mean())


def test_generate_decode_tiny_writes_a_playable_video_of_every_decoded_frame(tmp_path):
    from wan_accel.vae.build import build_decoder
    code, out, err = run_cli_in(tmp_path, *GEN, "--decode", "tiny", "--out", "o")
    assert code == 0, err
    report = json.loads(out)
    video = tmp_path / report["files"]["video"]
    assert video.name in ("video.webp", "video.mp4") and report["video"]["file"] == report["files"]["video"]
    frames = frames_of(video)
    assert len(frames) == report["video"]["frames"] == 1 + 4 * (report["latent_shape"][1] - 1) == 9
    assert report["video"]["decoder"] == "tiny" and "random" in report["video"]["weights"]
    # the frames are the tiny decoder's (its seeded random weights, reduced width) of the saved latents, up to the
    # lossy encoding
    want = _decoded(tmp_path / "o" / "latents.safetensors", build_decoder("tiny", reduced=True, seed=0))
    assert _close(frames, want) < 0.06             # another seed's decoder: 0.1
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == sorted(["latents.safetensors", "report.json",
                                                                         video.name])


def test_generate_decode_none_writes_no_video(tmp_path):
    code, out, err = run_cli_in(tmp_path, *GEN, "--decode", "none", "--out", "o")
    assert code == 0, err
    report = json.loads(out)
    assert "video" not in report["files"] and "video" not in report
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["latents.safetensors", "report.json"]


def test_generate_decodes_with_the_vae_files_decoder(tmp_path):
    """--vae alone: the decoder its keys name (here a narrow taew2_1-layout file), its weights in the video."""
    from safetensors.torch import save_file
    from wan_accel.vae import taehv
    from wan_accel.vae.build import build_decoder
    from wan_accel.vae.weights import init_random
    tiny = init_random(taehv.TinyVideoDecoder(taehv.TinyDecoderConfig(widths=(8, 8, 4, 4))), 7)
    save_file({k: v.contiguous() for k, v in tiny.state_dict().items()}, str(tmp_path / "taew.safetensors"))
    code, out, err = run_cli_in(tmp_path, *GEN, "--vae", "taew.safetensors", "--out", "o")
    assert code == 0, err
    report = json.loads(out)
    assert report["video"]["decoder"] == "tiny" and report["video"]["weights"] == "taew.safetensors"
    want = _decoded(tmp_path / "o" / "latents.safetensors", build_decoder("tiny", tmp_path / "taew.safetensors"))
    assert _close(frames_of(tmp_path / report["files"]["video"]), want) < 0.06
    # the other decoder named for this file: one line, before any work
    line = refused(run_cli_in(tmp_path, *GEN, "--decode", "wan", "--vae", "taew.safetensors", "--out", "p"),
                   "--vae", "'tiny' decoder", "--decode tiny")
    assert not (tmp_path / "p").exists(), line


@pytest.mark.parametrize("args, words", [
    (["--vae", ""], ["--vae is empty"]),
    (["--decode", "tiny", "--vae", "missing.safetensors"], ["--vae", "missing.safetensors", "not found"]),
    (["--decode", "none", "--vae", "x.safetensors"], ["--vae", "--decode none"]),
    (["--vae", "x.safetensors"], ["--vae", "neither decoder"]),
    (["--decode", "mp4"], ["--decode", "invalid choice"]),
])
def test_bad_decode_options_are_one_line_exit_2(tmp_path, args, words):
    from safetensors.torch import save_file
    save_file({"w": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    if args[:2] == ["--decode", "mp4"]:                         # argparse's own refusal
        code, _out, err = run_cli_in(tmp_path, *GEN, *args, "--out", "o")
        assert code == 2 and all(w in err for w in words), err
    else:
        refused(run_cli_in(tmp_path, *GEN, *args, "--out", "o"), *words)
    assert not (tmp_path / "o").exists()


def test_a_checkpoints_video_needs_the_decoders_weights():
    from wan_accel.app.jobs.video import check_decode
    from wan_accel.app.validate import UsageError
    with pytest.raises(UsageError, match="--decode tiny on a checkpoint needs .*--vae FILE"):
        check_decode("tiny", None, "model.safetensors")
    assert check_decode(None, None, "model.safetensors") == "none" == check_decode(None, None, None)
    assert check_decode("wan", None, None) == "wan"                   # the tiny model: random decoder weights


def test_each_chunk_is_written_as_it_is_decoded(tmp_path):
    """The run's ``on_chunk_latents``: a chunk's frames are in the file (its temporary) as soon as it is decoded;
    the target appears whole at the end."""
    from wan_accel.app.jobs.video import open_generate_video
    video = open_generate_video("tiny", None, None, tmp_path, "cpu", "fp32", log=lambda *_: None)
    sizes = []
    x0 = torch.randn(1, 6, 16, 4, 4, generator=torch.Generator().manual_seed(1))
    for ci, chunk in enumerate((x0[:, :3], x0[:, 3:])):
        video(ci, 2, chunk)
        sizes.append((video.file.frames, os.path.getsize(video.file.tmp)))
    assert [f for f, _ in sizes] == [9, 21] and 0 < sizes[0][1] < sizes[1][1]
    assert not any(p.name.startswith("video.") for p in tmp_path.iterdir())
    path = Path(video.close())
    assert len(frames_of(path)) == 21 and not os.path.exists(video.file.tmp)


# ------------------------------------------------------------------------------------------------ the writer
def test_the_animated_webp_is_written_frame_by_frame(tmp_path):
    from PIL import Image
    from wan_accel.cache.video_file import VideoFile
    ramp = (torch.arange(7)[:, None] + torch.arange(9)[None]).float() / 40           # odd sizes are fine
    frames = torch.stack([(ramp + 0.12 * i)[..., None] * torch.tensor([1.0, 0.8, 0.6]) for i in range(5)])
    video = VideoFile(tmp_path / "v.webp", 16)
    video.write(frames[:2])
    video.write((frames[2:] * 255).round().to(torch.uint8))
    assert video.close() == tmp_path / "v.webp" and video.frames == 5
    with Image.open(tmp_path / "v.webp") as im:
        assert (im.n_frames, im.size, im.info.get("loop")) == (5, (9, 7), 0)
        im.seek(3)
        im.load()
        assert (im.info["duration"], im.info["timestamp"]) == (62, 3 * 62)          # 16 fps
    got = torch.tensor(__import__("numpy").stack(frames_of(tmp_path / "v.webp"))).float() / 255
    err = (got[:, None] - frames[None]).abs().mean(dim=(2, 3, 4))                    # [written, given]
    assert (err.argmin(1) == torch.arange(5)).all() and err.diagonal().max() < 0.03  # lossy, but these, in order
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.webp"]                  # no temporary left


def test_a_video_is_renamed_once_from_the_temporary_it_was_written_into(tmp_path, monkeypatch):
    """One temporary per written file: the one the frames went into is the one the writer checks, fsyncs and
    renames onto the target (no second temporary, no second rename)."""
    from wan_accel.cache.video_file import VideoFile
    renames, real = [], os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: renames.append((str(a), str(b))) or real(a, b))
    video = VideoFile(tmp_path / "v.webp")
    video.write(torch.rand(2, 4, 4, 3))
    assert video.close() == tmp_path / "v.webp"
    assert renames == [(video.tmp, str(tmp_path / "v.webp"))]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.webp"]


def test_a_failed_or_empty_video_leaves_nothing(tmp_path):
    from wan_accel.cache.video_file import VideoFile
    video = VideoFile(tmp_path / "v.webp")
    video.write(torch.zeros(1, 4, 4, 3))
    with pytest.raises(ValueError, match="frames of"):
        video.write(torch.zeros(1, 4, 6, 3))
    video.discard()
    empty = VideoFile(tmp_path / "e.webp")
    with pytest.raises(ValueError, match="no frames"):
        empty.close()
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "folder.webp").mkdir()
    with pytest.raises(ValueError, match="folder"):
        VideoFile(tmp_path / "folder.webp")


def test_mp4_falls_back_to_webp_without_pyav(monkeypatch):
    from wan_accel.cache import video_file
    monkeypatch.setattr(video_file, "have_av", lambda: False)
    assert video_file.video_format_for("mp4") == "webp" == video_file.video_format_for("webp")
    monkeypatch.setattr(video_file, "have_av", lambda: True)
    assert video_file.video_format_for("mp4") == "mp4"
