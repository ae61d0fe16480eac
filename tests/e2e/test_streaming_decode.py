"""Streaming decode against ComfyUI's own ``VAE.decode`` (skipped unless COMFYUI_DIR and COMFYUI_VENV are set).

Runs tests/e2e/streaming_decode_check.py with ComfyUI's python in its work tree: a random-weight Wan 2.1 VAE built
from ComfyUI's class at a small size, and ComfyUI's tiny video decoder (TAEHV, taew2_1's layout), float32 on the CPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

COMFY_DIR = os.environ.get("COMFYUI_DIR")
COMFY_VENV = os.environ.get("COMFYUI_VENV")
CHECK = Path(__file__).with_name("streaming_decode_check.py")

pytestmark = pytest.mark.skipif(not (COMFY_DIR and COMFY_VENV),
                                reason="set COMFYUI_DIR and COMFYUI_VENV to check the streaming decode in ComfyUI")


def _run(*args) -> dict:
    out = subprocess.run([str(Path(COMFY_VENV) / "bin" / "python"), str(CHECK), *args], cwd=COMFY_DIR,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_streaming_decode_equals_whole_decode():
    result = _run("parity")
    assert result.pop("frames_of_7") == 25                     # 1 + 4 * 6 video frames
    assert result.pop("other_vae_refused") is True              # a walk goes on with the VAE that made it only
    assert set(result) == {f"{f}x{c}" for f in (5, 6, 7) for c in (1, 2, 3)} | {"continued_at_3", "continued_at_4"}
    for case, err in result.items():                           # frames x chunk size
        assert err <= 1e-5, (case, err)


def test_decoder_memory_is_flat_in_video_length():
    """Peak RSS growth of the streaming decode (each chunk's images handed on) for 21 and 81 latent frames; the
    whole ``VAE.decode`` beside it shows the measure sees a decode whose memory grows with the video."""
    short, long = _run("memory", "21"), _run("memory", "81")
    whole_short, whole_long = _run("memory-whole", "21"), _run("memory-whole", "81")
    assert (short["video_frames"], long["video_frames"]) == (81, 321) == (whole_short["video_frames"],
                                                                        whole_long["video_frames"])
    ratio = long["rss_growth_kb"] / max(short["rss_growth_kb"], 1)
    whole = whole_long["rss_growth_kb"] / max(whole_short["rss_growth_kb"], 1)
    print(f"\nstreaming decode peak RSS growth: 21 latent frames {short['rss_growth_kb']} kB, 81 latent frames "
          f"{long['rss_growth_kb']} kB, ratio {ratio:.2f}; whole VAE.decode {whole_short['rss_growth_kb']} kB, "
          f"{whole_long['rss_growth_kb']} kB, ratio {whole:.2f}", file=sys.stderr)
    assert whole > 2.0, (whole_short, whole_long)
    # flat: 60 more latent frames add less than 5 % of what they add to the whole decode (RSS noise is a few MB)
    grown = long["rss_growth_kb"] - short["rss_growth_kb"]
    assert grown < 0.05 * (whole_long["rss_growth_kb"] - whole_short["rss_growth_kb"]), (short, long)


def test_tiny_decoder_streaming_equals_its_whole_decode():
    """ComfyUI's tiny video decoder (its TAEHV with taew2_1's layout, loaded through comfy.sd.VAE as a file is) goes
    through the pack's ComfyTinyStream; chunk by chunk it gives ComfyUI's own VAE.decode, clamped to 0..1."""
    result = _run("tiny")
    assert result.pop("adapter") == "ComfyTinyStream"
    for frames in (5, 6):
        assert result.pop(f"whole_shape_{frames}")[1] == 1 + 4 * (frames - 1)
        lo, hi = result.pop(f"whole_range_{frames}")
        print(f"\nComfyUI's tiny VAE.decode of {frames} latent frames ranges over [{lo:.3f}, {hi:.3f}]",
              file=sys.stderr)
    assert set(result) == {f"{f}x{c}" for f in (5, 6) for c in (1, 2, 3)}
    for case, err in result.items():                           # frames x chunk size; ~30 layers in float32
        assert err <= 1e-4, (case, err)
