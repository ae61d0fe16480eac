"""The pack's decoders (vae/) against ComfyUI's own on the same random weights (skipped unless COMFYUI_DIR and
COMFYUI_VENV are set).

tests/e2e/vae_decoders_check.py runs with ComfyUI's python in its work tree: it builds ComfyUI's Wan 2.1 VAE (base
width 8) and its TAEHV for 16 latent channels (taew2_1's layout) with random weights, saves their state dicts as
.safetensors and decodes random latents with them. Here the pack loads those files by key name and decodes the
same latents, whole and streamed chunk by chunk; float32 on the CPU on both sides.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

COMFY_DIR = os.environ.get("COMFYUI_DIR")
COMFY_VENV = os.environ.get("COMFYUI_VENV")
CHECK = Path(__file__).with_name("vae_decoders_check.py")
# two float32 implementations of ~30 layers in sequence, each free to sum in its own order: a few ulps per layer
# of the output's scale
DEPTH_ULPS = 64

pytestmark = pytest.mark.skipif(not (COMFY_DIR and COMFY_VENV),
                                reason="set COMFYUI_DIR and COMFYUI_VENV to compare the decoders with ComfyUI's")


@pytest.fixture(scope="module")
def comfy_cases(tmp_path_factory):
    out = tmp_path_factory.mktemp("vae_decoders")
    run = subprocess.run([str(Path(COMFY_VENV) / "bin" / "python"), str(CHECK), str(out)], cwd=COMFY_DIR,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    json.loads(run.stdout.strip().splitlines()[-1])
    from safetensors.torch import load_file
    return out, load_file(str(out / "cases.safetensors"))


def _stream(decoder, z: torch.Tensor, chunk: int) -> torch.Tensor:
    stream = decoder.stream()
    return torch.cat([stream.push_raw(z[:, :, f:f + chunk]) for f in range(0, z.shape[2], chunk)], 2)


@pytest.mark.parametrize("kind,cases", [("wan", ("wan_6", "wan_7")), ("tiny", ("tiny_5",))])
def test_pack_decoder_equals_comfyui_decode(kind, cases, comfy_cases):
    from wan_accel.vae.build import build_decoder
    out, tensors = comfy_cases
    decoder = build_decoder(kind, out / f"{kind}.safetensors")        # ComfyUI's state dict, by key name
    for case in cases:
        z = tensors[f"{case}.latent"]
        want = [tensors[k] for k in tensors if k.startswith(case + ".decoded")]
        assert want and all(w.shape[2] == 1 + 4 * (z.shape[2] - 1) for w in want)
        for chunk in (z.shape[2], 1, 2, 3):
            got = _stream(decoder, z, chunk)
            for w in want:
                bound = DEPTH_ULPS * torch.finfo(torch.float32).eps * max(1.0, w.abs().max().item())
                err = (got - w).abs().max().item()
                assert got.shape == w.shape and err <= bound, (case, chunk, err, bound)
