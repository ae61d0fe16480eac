"""int8 attention on ComfyUI's own MODEL: the tiny native workflow (workflows/api/native_causal_tiny.json) queued
in a real ComfyUI with the Wan Accel AR Sampler's attention set to int8, beside the same graph with exact SDPA
(skipped unless COMFYUI_DIR and COMFYUI_VENV are set)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from safetensors.torch import load_file

from e2e.test_comfyui_e2e import COMFY_DIR, COMFY_VENV, WORKFLOWS, _run_prompt, comfy_server

pytestmark = pytest.mark.skipif(not (COMFY_DIR and COMFY_VENV),
                                reason="set COMFYUI_DIR and COMFYUI_VENV to run the native int8 check")


@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    yield from comfy_server(tmp_path_factory)


def _latent(comfy, attention: str, path: str):
    prompt = json.loads((WORKFLOWS / "api" / "native_causal_tiny.json").read_text())
    sampler = next(n for n in prompt.values() if n["class_type"] == "WanAccelARSampler")
    sampler["inputs"].update(attention=attention, path=path)
    run = next(k for k, n in prompt.items() if n["class_type"] == "SamplerCustomAdvanced")
    prefix = f"int8_e2e/{attention}_{path}"
    prompt["900"] = {"class_type": "SaveLatent", "inputs": {"samples": [run, 0], "filename_prefix": prefix}}
    entry = _run_prompt(comfy, prompt, timeout_s=300)
    assert entry.get("status", {}).get("status_str") == "success", entry.get("status", entry)
    files = sorted((comfy["work"] / "output" / "int8_e2e").glob(f"{attention}_{path}_*.latent"),
                   key=os.path.getmtime)
    assert files, f"no latent saved for {prefix}"
    return load_file(str(files[-1]))["latent_tensor"].float()


@pytest.mark.parametrize("path", ["reference", "optimized"])
def test_native_sampler_runs_int8_close_to_exact(comfy, path):
    exact = _latent(comfy, "sdpa", path)
    int8 = _latent(comfy, "int8", path)
    log = Path(comfy["log"]).read_text(errors="replace")
    assert "native sampler: attention int8" in log, log[-3000:]
    assert int8.shape == exact.shape and bool(int8.isfinite().all())
    diff = float((int8 - exact).abs().max())
    scale = float(exact.abs().max())
    assert 0 < diff < 0.05 * scale, (diff, scale)      # different from exact, but close (docs/sampler.md: Fidelity)
