"""Who manages a model's memory: the pack's block swap, or ComfyUI's own offload.

ComfyUI places the weights of a MODEL itself (``comfy/model_patcher.py``): with enough VRAM it loads every weight
to the GPU ("loaded completely"); in low VRAM it loads what fits and leaves the rest on the CPU, where its layers
(``comfy.ops``) copy each weight to the GPU when called ("loaded partially": ``model_lowvram``, one "lowvram
patch" per such layer); with dynamic VRAM (``ModelPatcherDynamic``, the comfy-aimdo allocator; on unless ComfyUI
starts with ``--disable-dynamic-vram``) it faults weights in and out on its own. The pack's block swap moves the
last blocks' weights to pinned host RAM and streams them before each block runs; on top of either of ComfyUI's
offloads it would move weights ComfyUI also moves, so it stands down there and composes only with a full load.

``memory_manager`` reads the attributes ComfyUI sets on a model patcher (nothing is imported from ComfyUI).
"""
from __future__ import annotations

import logging
from typing import NamedTuple

log = logging.getLogger("wan_accel")

PACK, COMFY_FULL, COMFY_PARTIAL, COMFY_DYNAMIC = "pack", "comfyui-full", "comfyui-partial", "comfyui-dynamic"


class MemoryManager(NamedTuple):
    who: str            # PACK | COMFY_FULL | COMFY_PARTIAL | COMFY_DYNAMIC
    swap_allowed: bool  # whether the pack's block swap may run on this model
    line: str           # the one console line that says who manages memory

    def log_once(self, holder, attr: str = "_wan_accel_memory_line") -> None:
        """Log ``line`` unless ``holder`` already logged this very line (once per change of manager)."""
        if getattr(holder, attr, None) == self.line:
            return
        try:
            setattr(holder, attr, self.line)
        except (AttributeError, TypeError):
            pass
        log.info("wan_accel: %s", self.line)


def memory_manager(patcher) -> MemoryManager:
    """Who manages the memory of the model behind ``patcher`` (a ComfyUI ``ModelPatcher``, or None for a model the
    pack's loader built). Reads ``patcher.is_dynamic()`` and, on ``patcher.model``, ComfyUI's ``model_lowvram`` and
    ``lowvram_patch_counter``."""
    if patcher is None:
        return MemoryManager(PACK, True, "the pack's loader holds this model; Wan Block Swap manages its memory")
    is_dynamic = getattr(patcher, "is_dynamic", None)
    if callable(is_dynamic) and is_dynamic():
        return MemoryManager(COMFY_DYNAMIC, False,
                             "ComfyUI's dynamic VRAM (comfy-aimdo) manages this model's memory; the pack's block "
                             "swap stands down (start ComfyUI with --disable-dynamic-vram to use Wan Block Swap)")
    model = getattr(patcher, "model", None)
    patches = int(getattr(model, "lowvram_patch_counter", 0) or 0)
    if getattr(model, "model_lowvram", False) or patches > 0:
        return MemoryManager(COMFY_PARTIAL, False,
                             f"ComfyUI loaded this model partially (low VRAM: {patches} weights stay on the CPU and "
                             f"are copied when their layer runs); ComfyUI manages its memory and the pack's block "
                             f"swap stands down")
    return MemoryManager(COMFY_FULL, True, "ComfyUI loaded this model completely; Wan Block Swap moves its last "
                                           "blocks to host RAM and streams them back when they run")
