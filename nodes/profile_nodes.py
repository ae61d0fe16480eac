"""Profiling nodes: profile the next sampler runs of a model and show the report in the UI.

"Wan Profile" attaches a profile request to a CAUSALWAN_MODEL (the wan_accel sampler honours it); "Wan Profile
(native MODEL)" wraps a ComfyUI MODEL so its next N model calls are traced; "Wan Profile Report" shows the
latest report of either. Traces go to ComfyUI's output folder (``wan_accel_profiles/``).
"""
from __future__ import annotations

WRAPPER_KEY = "wan_accel_profile"
CATEGORY = "wan_accel/profile"


def _out_dir(subfolder: str):
    from ..profiling.runner import default_out_dir
    from .comfy.comfy_files import check_name_text

    base = default_out_dir().parent  # ComfyUI's output folder, or the working directory outside ComfyUI
    sub = check_name_text((subfolder or "").strip().strip("/\\"), input_name="output_subfolder")
    if not sub or ":" in sub or ".." in sub.replace("\\", "/").split("/"):
        raise ValueError(f"output_subfolder must be a plain folder name inside the output folder, got {subfolder!r}")
    import os

    real_base = os.path.realpath(str(base))
    if os.path.commonpath([real_base, os.path.realpath(str(base / sub))]) != real_base:
        raise ValueError(f"output_subfolder {subfolder!r} leads out of the output folder through a symbolic link; "
                         f"choose a folder inside it")
    return base / sub


_COMMON_INPUTS = {
    "enabled": ("BOOLEAN", {"default": True, "tooltip": "Off: pass the model through untouched (keep the node "
                                                        "in the workflow at no cost)."}),
    "output_subfolder": ("STRING", {"default": "wan_accel_profiles",
                                    "tooltip": "Folder inside ComfyUI's output folder for the Chrome/Perfetto "
                                               "trace files (open them at ui.perfetto.dev)."}),
    "record_shapes": ("BOOLEAN", {"default": False, "tooltip": "Record tensor shapes per op (bigger trace, "
                                                               "more overhead)."}),
}


class _ProfileNode:
    """What both profile nodes share: a fresh request per queued prompt while enabled (a finished request would
    profile nothing)."""
    CATEGORY = CATEGORY
    FUNCTION = "apply"
    RETURN_NAMES = ("model",)
    INPUTS: dict = {}       # the node's model input and how many runs or calls to profile; then _COMMON_INPUTS

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {**cls.INPUTS, **_COMMON_INPUTS}}

    @classmethod
    def IS_CHANGED(cls, enabled=True, **kwargs):
        return float("nan") if enabled else "off"


class WanAccelProfile(_ProfileNode):
    DESCRIPTION = ("Profiles the next run(s) of the wan_accel sampler on this model: a torch.profiler trace "
                   "(Perfetto/Chrome), compile time per phase, graph breaks and recompiles with reasons, GPU idle "
                   "time between kernels (launch-bound detection), top kernels and peak memory. Connect a "
                   "'Wan Profile Report' node to see the report.")
    RETURN_TYPES = ("CAUSALWAN_MODEL",)

    INPUTS = {
        "model": ("CAUSALWAN_MODEL", {"tooltip": "The causal Wan model whose next sampler run(s) to profile."}),
        "runs": ("INT", {"default": 1, "min": 1, "max": 64, "tooltip": "How many sampler runs to profile; "
                                                                       "each gets its own trace and report."}),
    }

    def apply(self, model, runs=1, enabled=True, output_subfolder="wan_accel_profiles", record_shapes=False):
        from ..profiling.session import ProfileRequest, attach_profile_request

        if not enabled:
            return (attach_profile_request(model, None),)
        request = ProfileRequest(runs=runs, out_dir=_out_dir(output_subfolder), name="wan_sampler",
                                 record_shapes=record_shapes, settings={"source": "Wan Profile node"})
        return (attach_profile_request(model, request),)


class WanAccelProfileNative(_ProfileNode):
    DESCRIPTION = ("Profiles the next N calls of a ComfyUI MODEL (any sampler) into one torch.profiler trace: "
                   "compile time, graph breaks, recompiles, GPU idle time, top kernels and peak memory. Connect "
                   "'Wan Profile Report' (model input) to see the report.")
    RETURN_TYPES = ("MODEL",)

    INPUTS = {
        "model": ("MODEL", {"tooltip": "The ComfyUI model to profile (it is cloned; the input stays as is)."}),
        "model_calls": ("INT", {"default": 4, "min": 1, "max": 1000,
                                "tooltip": "How many model calls (one per step and cond batch) go into "
                                           "the trace; the trace also closes when sampling ends."}),
    }

    def apply(self, model, model_calls=4, enabled=True, output_subfolder="wan_accel_profiles",
              record_shapes=False):
        from ..profiling.session import ProfileRequest

        patcher = model.clone()
        if not enabled:
            return (patcher,)
        if not hasattr(patcher, "add_wrapper_with_key"):
            raise RuntimeError("This ComfyUI is too old for model wrappers (ModelPatcher.add_wrapper_with_key): "
                               "update ComfyUI to profile a native MODEL.")
        request = ProfileRequest(runs=model_calls, out_dir=_out_dir(output_subfolder), name="wan_native",
                                 record_shapes=record_shapes, settings={"source": "Wan Profile (native MODEL)"},
                                 device=getattr(patcher, "load_device", None))
        from .comfy.comfy_core import wrapper_types
        kinds = wrapper_types()
        apply_model_key, cleanup_key = kinds["apply_model"], kinds["on_cleanup"]
        if hasattr(patcher, "remove_wrappers_with_key"):
            patcher.remove_wrappers_with_key(apply_model_key, WRAPPER_KEY)
        patcher.add_wrapper_with_key(apply_model_key, WRAPPER_KEY, request.step)     # step(executor, *args, **kwargs)
        if hasattr(patcher, "add_callback_with_key"):
            if hasattr(patcher, "remove_callbacks_with_key"):
                patcher.remove_callbacks_with_key(cleanup_key, WRAPPER_KEY)
            patcher.add_callback_with_key(cleanup_key, WRAPPER_KEY, lambda *_args, **_kwargs: request.finish())
        _store_request(patcher, request)
        return (patcher,)


def _store_request(patcher, request) -> None:
    if hasattr(patcher, "set_attachments"):
        patcher.set_attachments(WRAPPER_KEY, request)
        return
    options = getattr(patcher, "model_options", None)
    if isinstance(options, dict):
        options.setdefault("transformer_options", {})[WRAPPER_KEY] = request


def _native_request(patcher):
    getter = getattr(patcher, "get_attachment", None)
    req = getter(WRAPPER_KEY) if getter is not None else None
    if req is None:
        options = getattr(patcher, "model_options", None) or {}
        req = (options.get("transformer_options") or {}).get(WRAPPER_KEY)
    return req


class WanAccelProfileReport:
    DESCRIPTION = ("Shows the latest profile report of a model prepared by 'Wan Profile' (causal_model) or "
                   "'Wan Profile (native MODEL)' (model). Connect the sampler's output to 'after' so this node "
                   "runs once sampling is done.")
    CATEGORY = CATEGORY
    FUNCTION = "show"
    OUTPUT_NODE = True
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("report",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}, "optional": {
            "causal_model": ("CAUSALWAN_MODEL", {"tooltip": "Output of 'Wan Profile'."}),
            "model": ("MODEL", {"tooltip": "Output of 'Wan Profile (native MODEL)'."}),
            "after": ("*", {"tooltip": "Anything produced by the profiled sampler (e.g. its LATENT): makes this "
                                       "node run after sampling."}),
        }}

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")  # the report changes with every profiled run

    def show(self, causal_model=None, model=None, after=None):
        from ..profiling.session import get_profile_request

        parts = []
        req = get_profile_request(causal_model)
        if causal_model is not None:
            parts.append(req.text() if req is not None else
                         "This causal model carries no profile request: put a 'Wan Profile' node (enabled) "
                         "between the loader and the sampler.")
        nreq = _native_request(model)
        if model is not None:
            if nreq is not None:
                nreq.finish()  # close a window that got fewer model calls than asked for
                parts.append(nreq.text())
            else:
                parts.append("This MODEL carries no profile request: put a 'Wan Profile (native MODEL)' node "
                             "(enabled) before the sampler.")
        if not parts:
            parts.append("Connect the model output of 'Wan Profile' (causal_model) or 'Wan Profile (native MODEL)' "
                         "(model) to see its report.")
        text = "\n\n".join(parts)
        return {"ui": {"text": [text]}, "result": (text,)}


NODE_CLASS_MAPPINGS = {
    "WanAccelProfile": WanAccelProfile,
    "WanAccelProfileNative": WanAccelProfileNative,
    "WanAccelProfileReport": WanAccelProfileReport,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "WanAccelProfile": "Wan Profile",
    "WanAccelProfileNative": "Wan Profile (native MODEL)",
    "WanAccelProfileReport": "Wan Profile Report",
}
