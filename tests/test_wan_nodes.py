"""Model nodes called as plain Python (outside ComfyUI)."""

import subprocess
import sys

import pytest
import torch

from wan_accel.nodes import model_nodes
from wan_accel.nodes.model_nodes import (NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, CausalWanModelLoader,
                                         CausalWanSampler, conditioning_to_context)


def test_module_import_is_light():
    src = open(model_nodes.__file__).read().split('"""', 2)[2]
    top_level = [ln for ln in src.splitlines() if ln.startswith(("import ", "from "))]
    assert top_level == ["from __future__ import annotations",
                         "from .comfy import Node, check_choice, node_mappings, with_notes",
                         "from .comfy.comfy_core import ComfyProgress"]
    # Node and ComfyProgress bring no torch: ComfyUI lists the nodes before anything loads a model
    code = "import sys, wan_accel.nodes.model_nodes; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_mappings_and_input_metadata():
    assert NODE_DISPLAY_NAME_MAPPINGS == {"CausalWanModelLoader": "CausalWan Model Loader",
                                          "CausalWanSampler": "CausalWan Sampler"}
    for name, cls in NODE_CLASS_MAPPINGS.items():
        assert cls.CATEGORY == "wan_accel/model" and cls.DESCRIPTION and cls.RETURN_NAMES
        spec = cls.INPUT_TYPES()
        for section in spec.values():
            for inp, (_, opts) in section.items():
                assert opts.get("tooltip"), (name, inp)
    loader_inputs = CausalWanModelLoader.INPUT_TYPES()
    assert loader_inputs["required"]["checkpoint"][0] == "STRING"          # no folder_paths here
    assert loader_inputs["optional"]["compile_settings"][0] == "WANACCEL_COMPILE"
    assert loader_inputs["optional"]["plan"][0] == "WANACCEL_PLAN"


@pytest.fixture(scope="module")
def handle():
    (h,) = CausalWanModelLoader().load("(built-in tiny model)", "fp32", "self_forcing", "sdpa",
                                       compile_settings={"backend": "eager", "warm_start": False},
                                       plan={"blocks_on_gpu": 2})
    return h


def test_loader_returns_a_handle(handle):
    assert handle.is_tiny and handle.precision == "float32" and handle.dtype == torch.float32
    from wan_accel.compile.settings import CompileSettings
    assert handle.compile_settings == CompileSettings(backend="eager", warm_start=False)
    assert handle.plan == {"blocks_on_gpu": 2}
    assert handle.model.attn_backend == "sdpa"


def test_loader_rejects_invalid_compile_settings_at_once():
    with pytest.raises(ValueError, match="mode='x'"):
        CausalWanModelLoader().load("(built-in tiny model)", "fp32", "self_forcing", "sdpa",
                                    compile_settings={"mode": "x"})


def test_sampler_smoke_graph_without_conditioning(handle):
    latent, _ = CausalWanSampler().sample(handle, 64, 32, 9, 0, "self_forcing", 3, -1, 0)
    assert latent["samples"].shape == (1, 16, 3, 4, 8)           # [B, C, T, H/8, W/8]
    again, _ = CausalWanSampler().sample(handle, 64, 32, 9, 0, "self_forcing", 3, -1, 0)
    assert torch.equal(latent["samples"], again["samples"])
    custom, _ = CausalWanSampler().sample(handle, 64, 32, 9, 0, "custom", 3, -1, 0,
                                          custom_steps="1000,500", shift=3.0)
    assert not torch.equal(custom["samples"], latent["samples"])


def test_sampler_with_matching_conditioning(handle):
    cond = [[torch.randn(1, 5, handle.config.text_dim), {"pooled_output": None}]]
    a, _ = CausalWanSampler().sample(handle, 32, 32, 9, 1, "causvid", 3, -1, 0, positive=cond)
    b, _ = CausalWanSampler().sample(handle, 32, 32, 9, 1, "causvid", 3, -1, 0)
    assert not torch.equal(a["samples"], b["samples"])


def test_sampler_state_continues_the_video_in_a_later_prompt(handle):
    long, none = CausalWanSampler().sample(handle, 32, 32, 21, 4, "self_forcing", 3, 4, 1)
    assert none is None                                           # keep_state off: no state kept
    first, state = CausalWanSampler().sample(handle, 32, 32, 9, 4, "self_forcing", 3, 4, 1, keep_state=True)
    assert state.frames == 3 and state.kv.device.type == "cpu"   # waits in RAM between prompts
    rest, _ = CausalWanSampler().sample(handle, 32, 32, 21, 99, "self_forcing", 3, 4, 1, continue_from=state)
    assert rest["samples"].shape[2] == 3
    assert torch.equal(torch.cat([first["samples"], rest["samples"]], 2), long["samples"])
    with pytest.raises(ValueError, match="KV window: the state has 4, this run -1"):
        CausalWanSampler().sample(handle, 32, 32, 21, 0, "self_forcing", 3, -1, 0, continue_from=state)
    with pytest.raises(ValueError, match="skip_last_refresh"):
        CausalWanSampler().sample(handle, 32, 32, 9, 0, "self_forcing", 3, 4, 1, skip_last_refresh=True,
                                  keep_state=True)


def test_sampler_errors_are_clear(handle):
    cond = [[torch.randn(1, 5, 4096), {}]]
    with pytest.raises(ValueError, match="leave 'positive' unconnected"):
        CausalWanSampler().sample(handle, 32, 32, 9, 0, "self_forcing", 3, -1, 0, positive=cond)
    with pytest.raises(ValueError, match="not a whole number of 3-frame blocks"):
        CausalWanSampler().sample(handle, 32, 32, 13, 0, "self_forcing", 3, -1, 0)
    with pytest.raises(ValueError, match="width 40 is not a multiple of 16.*use 32 or 48"):
        CausalWanSampler().sample(handle, 40, 32, 9, 0, "self_forcing", 3, -1, 0)


def test_conditioning_to_context():
    assert conditioning_to_context(None, 8, 4).shape == (1, 0, 8)
    ctx = conditioning_to_context([[torch.ones(1, 3, 8), {}]], 8, 4)
    assert ctx.shape == (1, 3, 8)
    with pytest.raises(ValueError, match="at most 4"):
        conditioning_to_context([[torch.ones(1, 5, 8), {}]], 8, 4)


def test_loader_refuses_pickle(tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(b"x")
    with pytest.raises(ValueError, match="wan_accel convert"):
        CausalWanModelLoader().load(str(path), "bf16", "self_forcing", "auto")
