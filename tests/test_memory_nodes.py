"""Memory nodes outside ComfyUI: plan node, block swap on a stand-in ModelPatcher and on a causal handle."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from wan_accel.memory.block_swap import active_swap, handle_swap_settings
from wan_accel.nodes import memory_nodes
from wan_accel.nodes.memory_nodes import CausalWanBlockSwap, WanBlockSwap, WanVRAMPlan


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.sin(self.lin(x))


class DiffusionModel(nn.Module):
    """Stand-in for ComfyUI's WanModel: forward goes through the DIFFUSION_MODEL wrappers like core does."""

    def __init__(self, d=8, n=5):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.wrappers = []

    def _forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x

    def forward(self, x):
        run = self._forward
        for w in reversed(self.wrappers):
            run = (lambda w, inner: lambda *a: w(Executor(self, inner), *a))(w, run)
        return run(x)


class Executor:
    def __init__(self, obj, fn):
        self.class_obj, self.fn = obj, fn

    def __call__(self, *a, **k):
        return self.fn(*a, **k)


class FakePatcher:
    """The parts of comfy.model_patcher.ModelPatcher the node uses; clones share the model object."""

    def __init__(self, model):
        self.model = model
        self.callbacks, self.wrappers = {}, {}

    def clone(self, disable_dynamic=False):
        n = FakePatcher(self.model)
        n.callbacks = {k: dict(v) for k, v in self.callbacks.items()}
        n.wrappers = {k: dict(v) for k, v in self.wrappers.items()}
        return n

    def get_model_object(self, name):
        return getattr(self.model, name)

    def add_callback_with_key(self, kind, key, fn):
        self.callbacks.setdefault(kind, {})[key] = fn

    def add_wrapper_with_key(self, kind, key, fn):
        self.wrappers.setdefault(kind, {})[key] = fn

    # what ComfyUI does around a run
    def load(self, device):
        for fn in self.callbacks.get("on_load_after", {}).values():
            fn(self, device, 0, False, True)

    def run(self, x):
        dm = self.model.diffusion_model
        dm.wrappers = list(self.wrappers.get("diffusion_model", {}).values())
        try:
            return dm(x)
        finally:
            dm.wrappers = []

    def detach(self):
        for fn in self.callbacks.get("on_detach_after", {}).values():
            fn(self, True)


class BaseModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.diffusion_model = DiffusionModel()


def test_wan_block_swap_patches_a_clone_and_keeps_outputs(monkeypatch):
    monkeypatch.setattr(memory_nodes, "_swap_saves_memory", lambda device: True)   # the glue on a CPU
    torch.manual_seed(0)
    base = FakePatcher(BaseModel())
    x = torch.randn(3, 8)
    with torch.no_grad():
        ref = base.run(x)
        (patched,) = WanBlockSwap().apply(base, blocks_to_swap=3, prefetch_blocks=1, offload_embeddings=False)
        assert patched is not base and base.callbacks == {} and base.wrappers == {}
        dm = base.model.diffusion_model
        assert active_swap(dm) is None                      # nothing happens until ComfyUI loads it
        patched.load(torch.device("cpu"))
        swap = active_swap(dm)
        assert swap is not None and swap.blocks_to_swap == 3
        assert torch.equal(patched.run(x), ref) and swap.stats.copies == 3
        patched.load(torch.device("cpu"))                   # a reload keeps the same swap
        assert active_swap(dm) is swap
        assert torch.equal(base.run(x), ref)                # the unpatched clone gives the same result
        patched.detach()
        assert active_swap(dm) is None and not dm.blocks[4]._forward_pre_hooks
        assert torch.equal(base.run(x), ref)
        assert torch.equal(patched.run(x), ref)             # the wrapper reinstalls if needed
        assert active_swap(dm) is not None
        patched.detach()


def test_wan_block_swap_does_nothing_on_a_cpu_comfyui():
    base = FakePatcher(BaseModel())
    (patched,) = WanBlockSwap().apply(base, blocks_to_swap=2, prefetch_blocks=1, offload_embeddings=False)
    patched.load(torch.device("cpu"))
    assert active_swap(base.model.diffusion_model) is None
    (same,) = WanBlockSwap().apply(base, blocks_to_swap=0, prefetch_blocks=1, offload_embeddings=False)
    assert same is base


def test_blocks_from_the_plan_and_clear_errors():
    base = FakePatcher(BaseModel())
    with pytest.raises(ValueError, match="connect a Wan VRAM Plan"):
        WanBlockSwap().apply(base, blocks_to_swap=-1, prefetch_blocks=1, offload_embeddings=False)
    (plan, summary) = WanVRAMPlan().plan(model_source="1.3b", width=832, height=480, frames=81)["result"]
    assert "VRAM plan" in summary and plan.blocks_total == 30
    with pytest.raises(ValueError, match="30 blocks"):
        WanBlockSwap().apply(base, blocks_to_swap=-1, prefetch_blocks=1, offload_embeddings=False, plan=plan)
    small = dataclasses.replace(plan, blocks_total=5, blocks_to_swap=2, prefetch=1)
    (patched,) = WanBlockSwap().apply(base, blocks_to_swap=-1, prefetch_blocks=3, offload_embeddings=False,
                                      plan=small)
    key = memory_nodes.PATCH_KEY
    assert patched.callbacks["on_load_after"][key].__self__.settings.blocks_to_swap == 2


@dataclasses.dataclass
class Handle:
    model: nn.Module
    extra: dict = dataclasses.field(default_factory=dict)


class CausalModel(DiffusionModel):
    @property
    def device(self):
        return self.blocks[0].lin.weight.device


def test_causal_block_swap_and_plan_from_a_live_model(monkeypatch):
    monkeypatch.setattr(memory_nodes, "_swap_saves_memory", lambda device: True)   # the glue on a CPU
    torch.manual_seed(0)
    handle = Handle(CausalModel())
    x = torch.randn(2, 8)
    with torch.no_grad():
        ref = handle.model(x)
        (out,) = CausalWanBlockSwap().apply(handle, blocks_to_swap=4, prefetch_blocks=1, offload_embeddings=False)
        assert handle.extra == {} and handle_swap_settings(out).blocks_to_swap == 4 and out.model is handle.model
        assert active_swap(handle.model).blocks_to_swap == 4
        assert torch.equal(out.model(x), ref)
    result = WanVRAMPlan().plan(model_source="1.3b", causal_model=handle, width=64, height=64, frames=9)
    plan = result["result"][0]
    assert plan.blocks_total == 5 and plan.model["params"] == sum(p.numel() for p in handle.model.parameters())
    active_swap(handle.model).remove()


def test_causal_block_swap_on_a_cpu_model_only_carries_the_setting():
    handle = Handle(CausalModel())
    (out,) = CausalWanBlockSwap().apply(handle, blocks_to_swap=4, prefetch_blocks=1, offload_embeddings=False)
    assert active_swap(handle.model) is None                  # nothing to save in host RAM
    assert handle_swap_settings(out).blocks_to_swap == 4       # the sampler still sees the setting


def test_plan_node_reads_a_checkpoint_header(tmp_path):
    from safetensors.torch import save_file

    ck = tmp_path / "wan.safetensors"
    save_file({f"model.blocks.{i}.self_attn.q.weight": torch.zeros(128, 128) for i in range(3)}, str(ck))
    plan, text = WanVRAMPlan().plan(model_source="checkpoint", checkpoint=str(ck), width=256, height=256,
                                    frames=17)["result"]
    assert plan.blocks_total == 3 and str(ck) in text
    with pytest.raises(ValueError, match="no checkpoint is selected"):
        WanVRAMPlan().plan(model_source="checkpoint", checkpoint="none")


def test_comfy_pinned_registrations_of_swapped_weights_are_released():
    class Pinned:
        pinned = {"diffusion_model.blocks.1.lin.weight", "diffusion_model.blocks.3.lin.weight",
                  "diffusion_model.blocks.12.lin.bias", "diffusion_model.text_embedding.0.weight",
                  "diffusion_model.head.weight"}
        released = []

        def unpin_weight(self, key):
            self.released.append(key)
            self.pinned.discard(key)

    p = Pinned()
    memory_nodes._unpin_comfy_weights(p, 3, embeddings=False)
    assert sorted(p.released) == ["diffusion_model.blocks.12.lin.bias", "diffusion_model.blocks.3.lin.weight"]
    memory_nodes._unpin_comfy_weights(p, 3, embeddings=True)
    assert "diffusion_model.text_embedding.0.weight" in p.released
    assert p.pinned == {"diffusion_model.blocks.1.lin.weight", "diffusion_model.head.weight"}
