"""ComfyUI nodes of the compile area. Nothing heavy is imported at module level."""
from __future__ import annotations

CATEGORY = "wan_accel/compile"


class WanCompileSettings:
    DESCRIPTION = ("Compile settings for Wan models: backend, mode, tiling preset, scope and the guards against "
                   "recompiles. Feed the output to a loader or to 'Apply Compile (native Wan)'.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("WANACCEL_COMPILE",)
    RETURN_NAMES = ("compile_settings",)
    FUNCTION = "build"

    @classmethod
    def INPUT_TYPES(cls):
        from ..compile.settings import BACKENDS, DYNAMIC, MODES, SCOPES, STANCES, TILING_PRESETS   # no torch there
        return {"required": {
            "backend": (list(BACKENDS), {"default": "inductor", "tooltip":
                        "inductor: generated fused kernels (fastest). cudagraphs: replay CUDA graphs without "
                        "code generation. eager: Dynamo capture only, to find graph breaks."}),
            "mode": (list(MODES), {"default": "default", "tooltip":
                     "torch.compile mode. reduce-overhead adds CUDA graphs; max-autotune benchmarks GEMM "
                     "kernels (long first run). Translated into Inductor options when the preset adds more."}),
            "lock_global_ops": ("BOOLEAN", {"default": True, "tooltip":
                                "Never change process-wide Dynamo/Inductor settings: every option is scoped to "
                                "this model, with conservative limits (fusion size 64, kernel tiles <= 64, "
                                "<= 8 warps). Keep on when other nodes compile too."}),
            "tiling_preset": (list(TILING_PRESETS), {"default": "default", "tooltip":
                              "EXTREME-PLUS: autotune GEMMs and pointwise kernels, coordinate descent, 3-D "
                              "tiles, bigger fusions and kernel tiles (caps stay conservative when locked). "
                              "Slower first run, faster steps."}),
            "fullgraph": ("BOOLEAN", {"default": False, "tooltip":
                          "Fail on graph breaks instead of splitting the graph. Use to verify a clean capture."}),
            "dynamic": (list(DYNAMIC), {"default": "auto", "tooltip":
                        "Dynamic shapes. auto: recompile once with dynamic sizes after a shape change; "
                        "true: dynamic from the start; false: one graph per shape."}),
            "scope": (list(SCOPES), {"default": "blocks", "tooltip":
                      "blocks: compile each transformer block (identical blocks share one compile: much "
                      "faster first run). whole: compile the whole forward."}),
            "recompile_limit": ("INT", {"default": 8, "min": 1, "max": 1024, "tooltip":
                                "Recompiles allowed per compiled region before it runs eager. Scoped to this "
                                "model when lock_global_ops is on."}),
            "warm_start": ("BOOLEAN", {"default": True, "tooltip":
                           "Keep compile caches beside the pack's limit cache and reload saved compile "
                           "artifacts: the second launch of ComfyUI compiles much faster."}),
            "stance_after_warmup": (list(STANCES), {"default": "eager_on_recompile", "tooltip":
                                    "After the first sampling run: eager_on_recompile runs new shapes eagerly "
                                    "instead of stalling on a recompile; fail_on_recompile raises; default "
                                    "recompiles."}),
        }}

    def build(self, **widgets):
        from ..compile.settings import CompileSettings

        try:
            return (CompileSettings.from_dict(widgets),)
        except (TypeError, ValueError) as exc:
            raise Exception(f"Wan Compile Settings: {exc}") from exc


class ApplyCompileNativeWan:
    DESCRIPTION = ("Compile ComfyUI's own Wan diffusion model per block (or whole) with the pack's presets, "
                   "scoped options and warm start. Returns a patched copy; the input model is not changed.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL",)
    RETURN_NAMES = ("model",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {"model": ("MODEL", {"tooltip": "A Wan model loaded by ComfyUI (diffusion_model.blocks)."})},
            "optional": {"compile_settings": ("WANACCEL_COMPILE", {"tooltip":
                         "From 'Wan Compile Settings'; defaults are used when not connected."})},
        }

    def apply(self, model, compile_settings=None):
        from .comfy.comfy_compile import compile_for_comfy

        try:
            return (compile_for_comfy(model, compile_settings),)
        except (TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"Apply Compile (native Wan): {exc}") from exc


NODE_CLASS_MAPPINGS = {
    "WanAccelCompileSettings": WanCompileSettings,
    "WanAccelApplyCompileNative": ApplyCompileNativeWan,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "WanAccelCompileSettings": "Wan Compile Settings",
    "WanAccelApplyCompileNative": "Apply Compile (native Wan)",
}
