"""Sequence-parallel node: "CausalWan Sequence Parallel" (a CAUSALWAN_MODEL that samples on several GPUs)."""
from __future__ import annotations

from .comfy import Node


class CausalWanSequenceParallel(Node):
    DESCRIPTION = ("Samples this causal Wan model sequence-parallel on several GPUs: this ComfyUI process is rank 0 "
                   "on the model's GPU, and the next GPUs get one worker process each (loading the same checkpoint "
                   "with the same settings) at the first sampling run. Each rank keeps 1/N of the KV cache; the "
                   "output equals one GPU's within float32 rounding. The workers stop after an error or an "
                   "interrupt (the next run starts them again) and when the model is unloaded. The model's head "
                   "count must divide by world_size.")
    CATEGORY = "wan_accel/model"
    FUNCTION = "apply"
    RETURN_TYPES = ("CAUSALWAN_MODEL",)
    RETURN_NAMES = ("model",)

    INPUTS = {
        "required": {
            "model": ("CAUSALWAN_MODEL", {"tooltip": "From CausalWan Model Loader (a checkpoint or the tiny "
                                                     "model; the workers load it again on their GPUs)."}),
            "world_size": ("INT", {"default": 2, "min": 1, "max": 64, "tooltip":
                           "GPUs (ranks) to sample on, starting at the model's GPU. 1: one GPU (stops the "
                           "workers). Must divide the model's attention heads (Wan 1.3B: 12, 14B: 40)."}),
            "timeout_s": ("INT", {"default": 300, "min": 10, "max": 7200, "tooltip":
                          "Seconds any rank may wait for the others (every collective): a worker that died "
                          "or hangs gives an error in this node after at most this long, never a hang."}),
        },
    }

    def apply(self, model, world_size=2, timeout_s=300):
        from ..app.ranks.pool import POOL_KEY, RankPool
        if not hasattr(model, "extra") or not hasattr(model, "model"):
            raise ValueError("model must come from CausalWan Model Loader (a CAUSALWAN_MODEL)")
        if int(world_size) <= 1:
            pool = model.extra.pop(POOL_KEY, None)
            if pool is not None:
                pool.close(model.model)
            return (model,)
        RankPool.attach(model, int(world_size), float(timeout_s))
        return (model,)


NODE_CLASS_MAPPINGS = {"CausalWanSequenceParallel": CausalWanSequenceParallel}
NODE_DISPLAY_NAME_MAPPINGS = {"CausalWanSequenceParallel": "CausalWan Sequence Parallel"}
