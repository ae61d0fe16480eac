"""Apply Compile (native Wan): ComfyUI's own Wan model compiled per block (or whole) without changing it.

The ModelPatcher is cloned; the compiled stand-ins (``compile.apply.compile_regions``) are swapped in only while
ComfyUI's ``apply_model`` runs (an APPLY_MODEL wrapper) and swapped back in a ``finally``; the end of the first
sampling run (an OUTER_SAMPLE wrapper, which also keeps the run outside core's memory graph on cores with the Comfy Compiler)
ends warm-up. The stand-ins fire the original blocks' forward hooks, so a
Wan Block Swap before or after this node keeps streaming its blocks.
"""
from __future__ import annotations

from .comfy_core import outside_memory_graph, wrapper_types

COMFY_KEY = "wan_accel.compile"


def compile_for_comfy(patcher, settings=None, cache=None):
    """A clone of a ComfyUI ModelPatcher whose diffusion model runs compiled, per block or whole."""
    from ...compile.apply import compile_regions, swapped_in

    model = patcher.clone()
    diffusion_model = model.get_model_object("diffusion_model")
    handle, regions = compile_regions(diffusion_model, settings, cache, prefix="diffusion_model")
    kinds = wrapper_types()

    def apply_model_wrapper(executor, *args, **kwargs):
        with swapped_in(executor.class_obj, regions):
            return executor(*args, **kwargs)

    def outer_sample_wrapper(executor, *args, **kwargs):
        with outside_memory_graph():     # compiled regions (and their CUDA graphs) never recorded in core's graph
            out = executor(*args, **kwargs)
        handle.end_warmup()
        return out

    for wrapper_type, fn in ((kinds["apply_model"], apply_model_wrapper),
                             (kinds["outer_sample"], outer_sample_wrapper)):
        fn.handle = handle  # reachable for reports; functions survive ComfyUI's deepcopy of model options as is
        remove = getattr(model, "remove_wrappers_with_key", None)
        if remove is not None:
            remove(wrapper_type, COMFY_KEY)
        model.add_wrapper_with_key(wrapper_type, COMFY_KEY, fn)
    return model
