"""The pack's block swap and ComfyUI's offload: one manager at a time.

The fakes carry the attributes ComfyUI's ``ModelPatcher`` sets (``is_dynamic()``; on ``.model``: ``model_lowvram``,
``lowvram_patch_counter``, ``model_loaded_weight_memory``)."""
import logging
import types

import pytest
import torch

from wan_accel.memory.offload import COMFY_DYNAMIC, COMFY_FULL, COMFY_PARTIAL, PACK, memory_manager
from wan_accel.nodes import memory_nodes


class FakeBaseModel:
    def __init__(self, lowvram=False, patches=0, loaded=1 << 30):
        self.model_lowvram = lowvram
        self.lowvram_patch_counter = patches
        self.model_loaded_weight_memory = loaded
        self.diffusion_model = types.SimpleNamespace(blocks=[object()] * 4)


class FakePatcher:                      # comfy.model_patcher.ModelPatcher
    def __init__(self, model, dynamic=False):
        self.model = model
        self._dynamic = dynamic
        self.pinned = set()

    def is_dynamic(self):               # True on ModelPatcherDynamic (comfy-aimdo)
        return self._dynamic


def test_pack_loader_and_full_load_let_the_swap_run():
    assert memory_manager(None) == (PACK, True, memory_manager(None).line)
    full = memory_manager(FakePatcher(FakeBaseModel()))
    assert (full.who, full.swap_allowed) == (COMFY_FULL, True)


@pytest.mark.parametrize("lowvram, patches", [(True, 12), (False, 3), (True, 0)])
def test_partial_load_stands_the_swap_down(lowvram, patches):
    m = memory_manager(FakePatcher(FakeBaseModel(lowvram=lowvram, patches=patches)))
    assert (m.who, m.swap_allowed) == (COMFY_PARTIAL, False)
    assert "partially" in m.line and "stands down" in m.line and f"{patches} weights" in m.line


def test_dynamic_vram_stands_the_swap_down_whatever_is_loaded():
    m = memory_manager(FakePatcher(FakeBaseModel(), dynamic=True))
    assert (m.who, m.swap_allowed) == (COMFY_DYNAMIC, False)
    assert "--disable-dynamic-vram" in m.line


def test_the_line_is_logged_once_per_manager(caplog):
    holder = types.SimpleNamespace()
    partial = memory_manager(FakePatcher(FakeBaseModel(lowvram=True, patches=2)))
    with caplog.at_level(logging.INFO, logger="wan_accel"):
        for _ in range(3):
            partial.log_once(holder)
        memory_manager(FakePatcher(FakeBaseModel())).log_once(holder)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "partially" in lines[0] and "completely" in lines[1]


class FakeSwapLib:
    """Stands in for memory/block_swap: records installs."""

    def __init__(self):
        self.installed = []

    def active_swap(self, dm):
        return None

    def apply_block_swap(self, dm, settings, **kw):
        self.installed.append(dm)
        return types.SimpleNamespace(describe=lambda: "swap", remove=lambda restore: None)


@pytest.mark.parametrize("patcher, installs", [
    (FakePatcher(FakeBaseModel()), 1),
    (FakePatcher(FakeBaseModel(lowvram=True, patches=7)), 0),
    (FakePatcher(FakeBaseModel(), dynamic=True), 0)])
def test_block_swap_node_installs_only_where_it_is_the_manager(monkeypatch, patcher, installs):
    monkeypatch.setattr(memory_nodes, "_swap_saves_memory", lambda device: True)
    patch = memory_nodes._ComfySwapPatch(types.SimpleNamespace(blocks_to_swap=2, offload_embeddings=False))
    patch._lib = FakeSwapLib()
    patch.on_load(patcher, torch.device("cpu"), 0, False, True)
    # a later forward through the wrapper does not install it behind ComfyUI's back either
    class Executor:                     # comfy.patcher_extension.WrapperExecutor
        class_obj = patcher.model.diffusion_model

        def __call__(self, *args, **kwargs):
            return "ran"

    assert patch.wrapper(Executor(), torch.zeros(1)) == "ran"
    assert len(patch._lib.installed) == installs * 2      # on load, and again at the call (the fake keeps none)
