"""Krea Realtime's re-encoded first frame through ComfyUI's own Wan 2.1 VAE (skipped unless COMFYUI_DIR and
COMFYUI_VENV are set).

Runs tests/e2e/krea_reencode_check.py with ComfyUI's python in its work tree: ComfyUI's WanVAE class with the weights
of the official stream fixture (tests/fixtures/krea_realtime/krea_stream_vae.*, made by Krea's own decoder), float32
on the CPU. recache krea's re-encode for a ComfyUI VAE (``nodes.model_nodes.comfy_krea_reencode``, what the nodes
build) must hand the encoder the frame Krea's session hands it, the last pixel frame of latent frame f0 - K as its
streaming decoder made it, and encode it as Krea's procedure does (a video's first frame, fresh encoder cache).

Krea's decoder is not Wan 2.1's: in its first temporal upsampling it keeps the new frame twice where Wan 2.1 keeps the
frame before it and the new one, so ComfyUI's own decode (``WanStreamDecoder``, ``VAE.decode``) gives other pixels
from latent frame 3 on. The re-encode walks ComfyUI's layers as Krea's decoder does (``KreaStreamDecoder``).
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

COMFY_DIR = os.environ.get("COMFYUI_DIR")
COMFY_VENV = os.environ.get("COMFYUI_VENV")
CHECK = Path(__file__).with_name("krea_reencode_check.py")
# float32 values of order 1 through the VAE's ~30 layers, and Krea's and ComfyUI's code summing in other orders:
# about 800 float32 steps at 1.0 (2 ** -23 each), the bound of every Krea parity test
TOL = 1e-4

pytestmark = pytest.mark.skipif(not (COMFY_DIR and COMFY_VENV),
                                reason="set COMFYUI_DIR and COMFYUI_VENV to check Krea's re-encode with ComfyUI's VAE")


@pytest.fixture(scope="module")
def result() -> dict:
    out = subprocess.run([str(Path(COMFY_VENV) / "bin" / "python"), str(CHECK)], cwd=COMFY_DIR,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_krea_walk_of_comfyuis_vae_is_the_official_stream(result):
    """Block by block, the pixel frames of Krea's session decoder on the same weights and latents; ComfyUI's own walk
    agrees for latent frames 0-2 only (Krea's temporal upsampling cache)."""
    assert result["krea_stream_frames_per_block"] == [9] + [12] * (result["blocks"] - 1)
    assert result["krea_stream_vs_official"] <= TOL
    assert result["comfy_stream_vs_official_latent_frames_0_2"] <= TOL
    assert result["comfy_stream_vs_official_from_latent_frame_3"] > 0.1


def test_the_pack_re_encodes_the_frame_the_official_session_re_encodes(result):
    """The frame the policy hands to ComfyUI's encoder is the official session's (the oldest of its queue of the last
    1 + (K - 1) * 4 pixel frames, written out from the fixture's stream), and the latent standing in for the first
    frame is Krea's procedure: that frame encoded as a first frame. The frame decoded on its own is another one."""
    assert result["stream_reencode"] == "StreamReencode"
    assert result["queue_oldest_vs_official_input"] == 0.0
    assert result["encoded"] == 3                                   # blocks 2, 3 and 4 (K = 3, 3-frame blocks)
    assert result["encoder_input_vs_official"] <= TOL
    assert result["reencoded_scale"] > 0.1                         # the latents compared are not all near zero
    assert result["reencoded_vs_official"] <= TOL
    assert result["alone_vs_official"] > 0.1


def test_a_sampled_run_re_encodes_through_the_krea_walk(result):
    """The node's krea cache setup with this VAE in a sampled run (the pack's tiny model): frames f0 - K of blocks
    2, 3 and 4 re-encoded, each Krea's procedure on the run's own clean latents."""
    assert result["run_reencoded_frames"] == [3, 6, 9]
    assert result["run_reencoded_vs_procedure"] <= TOL
