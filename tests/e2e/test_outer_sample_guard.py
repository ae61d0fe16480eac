"""The OUTER_SAMPLE guard that keeps the pack's work out of the Comfy Compiler's memory graph, registered on a real
ComfyUI ModelPatcher: Wan Block Swap on the tiny native model, sampled by core's Sampler AR Video (core's forward
with the swap's hooks inside the guard) and by the Wan Accel AR Sampler (skipped unless COMFYUI_DIR and
COMFYUI_VENV are set). On a core without the compiler the guard does nothing; this checks that it is registered and
run through core's own wrapper chain."""
from __future__ import annotations

import json

import pytest

from e2e.test_comfyui_e2e import COMFY_DIR, COMFY_VENV, WORKFLOWS, _run_prompt, comfy_server

pytestmark = pytest.mark.skipif(not (COMFY_DIR and COMFY_VENV),
                                reason="set COMFYUI_DIR and COMFYUI_VENV to run the OUTER_SAMPLE guard check")


@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    yield from comfy_server(tmp_path_factory)


@pytest.mark.parametrize("sampler", ["SamplerARVideo", "WanAccelARSampler"])
def test_block_swapped_native_model_samples_through_core_wrappers(comfy, sampler):
    prompt = json.loads((WORKFLOWS / "api" / "native_causal_tiny.json").read_text())
    model = next(k for k, n in prompt.items() if n["class_type"] == "WanTinyNativeModel")
    guider = next(n for n in prompt.values() if n["class_type"] == "BasicGuider")
    prompt["900"] = {"class_type": "WanAccelBlockSwap", "inputs": {"model": [model, 0], "blocks_to_swap": 1,
                                                              "prefetch_blocks": 1, "offload_embeddings": False}}
    guider["inputs"]["model"] = ["900", 0]
    if sampler == "SamplerARVideo":
        key = next(k for k, n in prompt.items() if n["class_type"] == "WanAccelARSampler")
        prompt[key] = {"class_type": "SamplerARVideo", "inputs": {"num_frame_per_block": 3}}
    entry = _run_prompt(comfy, prompt, timeout_s=300)
    assert entry.get("status", {}).get("status_str") == "success", (entry.get("status", entry),
                                                                     comfy["log"].read_text()[-3000:])
