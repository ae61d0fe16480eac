"""A VRAM plan that swaps blocks decides how the loader places the model."""
import torch

from wan_accel.memory.block_swap import SwapSettings
from wan_accel.memory.plan import Workload, make_plan
from wan_accel.memory.system import SystemInfo
from wan_accel.memory.weights import preset_weights
from wan_accel.app.jobs.handle import _planned_swap


def test_planned_swap_from_dicts():
    assert _planned_swap(None) is None
    assert _planned_swap({"blocks_to_swap": 0}) is None
    s = _planned_swap({"blocks_to_swap": 12, "prefetch": 2})
    assert isinstance(s, SwapSettings) and s.blocks_to_swap == 12 and s.prefetch == 2


def test_planned_swap_follows_a_real_plan():
    workload = Workload(width=832, height=480, frames=81)
    small = make_plan(preset_weights("14b"), workload, SystemInfo.simulated_gpu(24))
    big = make_plan(preset_weights("1.3b"), workload, SystemInfo.simulated_gpu(80))
    assert small.blocks_to_swap > 0 and _planned_swap(small).blocks_to_swap == small.blocks_to_swap
    assert big.blocks_to_swap == 0 and _planned_swap(big) is None


def test_auto_dtype_follows_the_device(monkeypatch):
    """dtype 'auto': fp32 on the CPU; fp16 on a GPU without bf16 tensor cores (SM 7.5), with the reason."""
    from wan_accel.app.jobs import handle as h
    from wan_accel.memory import system
    cpu = h.load_model_handle(None, "auto", device="cpu")
    assert cpu.dtype == torch.float32 and "CPU" in cpu.extra["dtype_reason"]
    turing = SystemInfo(device="cuda", gpu_name="sm75", capability=(7, 5), bf16=False)
    monkeypatch.setattr(system, "detect_system", lambda device=None: turing)
    handle = h.load_model_handle(None, "auto", precision="self_forcing", device="cpu")
    assert handle.dtype == torch.float16 and "no bf16 tensor cores" in handle.extra["dtype_reason"]
