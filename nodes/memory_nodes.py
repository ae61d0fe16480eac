"""Memory nodes: "Wan VRAM Plan", "Wan Block Swap", "CausalWan Block Swap", "Wan Chunked VAE Decode".

Thin adapters: widgets -> memory library calls. ComfyUI modules are imported lazily and optionally.
"""
from __future__ import annotations

import logging

from .comfy import Node, node_mappings
from .comfy.comfy_core import ComfyProgress, add_outer_sample_guard, optional, wrapper_types

log = logging.getLogger("wan_accel")
CATEGORY = "wan_accel/memory"
PATCH_KEY = "wan_accel_block_swap"
PRESET_CHOICES = ["1.3b", "14b", "14b-i2v", "checkpoint"]


def _swap_saves_memory(device) -> bool:
    """Whether block swap can save memory on ``device`` (a torch.device): not on the CPU, where the blocks already
    live in host RAM and a swap would only add copies."""
    return device.type != "cpu"


def _diffusion_model_files() -> list | None:
    folder_paths = optional("folder_paths")
    if folder_paths is None:
        return None
    try:
        from .model_nodes import loadable_checkpoints

        return loadable_checkpoints(folder_paths.get_filename_list("diffusion_models"))[0]
    except Exception:  # noqa: BLE001 - an odd folder setup must not break INPUT_TYPES
        return []


def _resolve_checkpoint(name: str) -> str:
    if not name or name == "none":
        raise ValueError("model_source is 'checkpoint' but no checkpoint is selected")
    from .comfy.comfy_files import model_file
    return model_file("diffusion_models", name, input_name="checkpoint")   # never outside ComfyUI's folders


def _causal_module(handle):
    """The nn.Module inside a CAUSALWAN_MODEL handle (ModelHandle.model, a dict's 'model', or the module)."""
    for candidate in (getattr(handle, "model", None), handle.get("model") if isinstance(handle, dict) else None,
                      handle):
        if candidate is not None and hasattr(candidate, "blocks"):
            return candidate
    raise TypeError(f"CAUSALWAN_MODEL of type {type(handle).__name__} has no model with 'blocks'")


class _BlockSwapNode:
    """What the two block swap nodes share: their category, function and widgets after the model (``MODEL_INPUT``:
    its name and declaration)."""
    CATEGORY = CATEGORY
    FUNCTION = "apply"
    MODEL_INPUT: tuple = ()

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            cls.MODEL_INPUT[0]: cls.MODEL_INPUT[1],
            "blocks_to_swap": ("INT", {"default": -1, "min": -1, "max": 128, "step": 1,
                                       "tooltip": "How many of the last transformer blocks live in host RAM and are "
                                                  "streamed to the GPU when used. -1 takes the number from the plan "
                                                  "input; 0 turns swapping off."}),
            "prefetch_blocks": ("INT", {"default": 1, "min": 0, "max": 8, "step": 1,
                                        "tooltip": "Swapped blocks copied ahead on a side CUDA stream while the "
                                                   "current block computes. 1 is enough unless copies are slower "
                                                   "than compute; each costs one block of VRAM."}),
            "offload_embeddings": ("BOOLEAN", {"default": False,
                                               "tooltip": "Also keep the text/image embedding layers in host RAM "
                                                          "(copied in when used)."}),
        }, "optional": {
            "plan": ("WANACCEL_PLAN", {"tooltip": "A Wan VRAM Plan; used when blocks_to_swap is -1."}),
        }}


def _resolve_settings(blocks_to_swap: int, prefetch: int, offload_embeddings: bool, plan, n_blocks: int):
    from ..memory.block_swap import SwapSettings

    if blocks_to_swap < 0:
        if plan is None:
            raise ValueError("blocks_to_swap is -1 (take it from the plan) but no plan is connected: connect a "
                             "Wan VRAM Plan node or set a number of blocks")
        if plan.blocks_total != n_blocks:
            raise ValueError(f"the plan was made for a model with {plan.blocks_total} blocks; this model has "
                             f"{n_blocks}. Plan for the same model (or set blocks_to_swap by hand)")
        return SwapSettings(plan.blocks_to_swap, plan.prefetch if plan.blocks_to_swap else prefetch,
                            bool(offload_embeddings or plan.offload_embeddings))
    if blocks_to_swap > n_blocks:
        log.warning("wan_accel: blocks_to_swap %d is more than the model's %d blocks; swapping all",
                    blocks_to_swap, n_blocks)
    return SwapSettings(min(blocks_to_swap, n_blocks), prefetch, bool(offload_embeddings))


VAE_KIND_CHOICES = ["auto", "wan2.1", "wan2.2"]


class WanVRAMPlan:
    DESCRIPTION = ("Plans memory for a Wan / causal Wan generation on this GPU: dtype, how many blocks to swap, "
                   "prefetch, KV window, VAE chunk size and attention backend, each with its reason. Sizes come "
                   "from the checkpoint header (nothing is loaded) or a preset; limits learned on this machine "
                   "override the estimates.")
    CATEGORY = CATEGORY
    FUNCTION = "plan"
    RETURN_TYPES = ("WANACCEL_PLAN", "STRING")
    RETURN_NAMES = ("plan", "summary")
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        files = _diffusion_model_files()
        ckpt = ((["none"] + files, {"default": "none",
                                    "tooltip": "Wan DiT checkpoint in models/diffusion_models (only its header is "
                                               "read). Used when model_source is 'checkpoint'."})
                if files is not None else
                ("STRING", {"default": "", "tooltip": "Path of a Wan DiT .safetensors file (only its header is "
                                                      "read). Used when model_source is 'checkpoint'."}))
        return {"required": {
            "model_source": (PRESET_CHOICES, {"default": "1.3b",
                                              "tooltip": "A model preset, or 'checkpoint' to read the file below."}),
            "checkpoint": ckpt,
            "width": ("INT", {"default": 832, "min": 16, "max": 8192, "step": 16, "tooltip": "Video width."}),
            "height": ("INT", {"default": 480, "min": 16, "max": 8192, "step": 16, "tooltip": "Video height."}),
            "frames": ("INT", {"default": 81, "min": 1, "max": 8193, "step": 4,
                               "tooltip": "Video frames (4k+1 for Wan)."}),
            "reserve_gb": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 256.0, "step": 0.25,
                                     "tooltip": "VRAM to leave unused for other models and programs."}),
            "sampling": (["causal", "full"], {"default": "causal",
                                              "tooltip": "causal: chunks with a KV cache (Self-Forcing, CausVid); "
                                                         "full: one bidirectional sequence (Wan 2.1)."}),
        }, "optional": {
            "causal_model": ("CAUSALWAN_MODEL", {"tooltip": "A loaded causal Wan model; its exact sizes are "
                                                            "used instead of the preset/checkpoint."}),
            "vae_kind": (VAE_KIND_CHOICES, {"default": "auto",
                                            "tooltip": "The VAE that will decode, whose learned chunk limit the plan "
                                                       "uses. auto: from the model's latent channels (16: Wan 2.1 "
                                                       "VAE, 48: Wan 2.2 VAE)."}),
        }}

    def plan(self, model_source="1.3b", checkpoint="", width=832, height=480, frames=81, reserve_gb=1.0,
             sampling="causal", causal_model=None, vae_kind="auto"):
        from ..cache import open_cache
        from ..memory.estimate import Workload
        from ..memory.plan import make_plan
        from ..memory.system import GiB, detect_system
        from ..memory.weights import preset_weights, weights_from_checkpoint, weights_from_module

        from ..app.validate import check_float, check_geometry

        check_geometry(frames, height, width, 1)  # names as the widgets: frames, height, width
        check_float("reserve_gb", reserve_gb, 0.0, 1024.0)
        if causal_model is not None:
            weights = weights_from_module(_causal_module(causal_model))
        elif model_source == "checkpoint":
            weights = weights_from_checkpoint(_resolve_checkpoint(checkpoint))
        else:
            weights = preset_weights(model_source)
        plan = make_plan(weights, Workload(width, height, frames, mode=sampling), detect_system(),
                         reserve_bytes=int(reserve_gb * GiB), cache=open_cache(), reserve_name="reserve_gb",
                         vae_kind=None if vae_kind in (None, "", "auto") else vae_kind)
        text = plan.summary()
        return {"ui": {"text": [text]}, "result": (plan, text)}


# ---------------------------------------------------------------------- block swap on ComfyUI's MODEL
def _unpin_comfy_weights(patcher, first_swapped: int, embeddings: bool) -> None:
    """ComfyUI registers offloaded CPU weights as pinned memory (by address); release those registrations for the
    tensors the swap is about to replace, so no registration outlives its memory."""
    pinned, unpin = getattr(patcher, "pinned", None), getattr(patcher, "unpin_weight", None)
    if not pinned or unpin is None:
        return
    prefixes = ("diffusion_model.text_embedding.", "diffusion_model.img_emb.") if embeddings else ()
    for key in list(pinned):
        parts = key.split(".")
        swapped = len(parts) > 2 and parts[:2] == ["diffusion_model", "blocks"] and parts[2].isdigit() \
            and int(parts[2]) >= first_swapped
        if swapped or key.startswith(prefixes):
            try:
                unpin(key)
            except Exception as exc:  # noqa: BLE001 - a failed unpin only costs pinned memory
                log.warning("wan_accel: could not unpin %s: %s", key, exc)


class _ComfySwapPatch:
    """Installs the swap after ComfyUI loads the model (ON_LOAD), keeps it through runs (DIFFUSION_MODEL wrapper),
    removes it when ComfyUI detaches the model (ON_DETACH); the shared model is never left patched."""

    def __init__(self, settings):
        from ..memory import block_swap

        self.settings = settings
        self.swap = None
        self.manager = None      # memory/offload.memory_manager of the last load: the swap stands down unless allowed
        self._lib = block_swap   # bound now: detach can run during interpreter shutdown, when imports fail

    def _install(self, dm, device, patcher=None) -> None:
        import torch

        from ..memory.system import detect_system

        device = torch.device(device) if device is not None else None
        if device is None or not _swap_saves_memory(device):
            return
        if self.manager is not None:
            self.manager.log_once(self)
            if not self.manager.swap_allowed:     # ComfyUI offloads this model itself: one manager, not two
                return
        current = self._lib.active_swap(dm)
        if current is not None and current is self.swap:
            if current.is_intact():
                current.release()      # ComfyUI may have reloaded swapped tensors: point them back to the host
                return
            current.remove(restore=False)
        elif current is not None:
            current.remove(restore=True)   # another patcher's swap on the same model
        if patcher is not None:
            _unpin_comfy_weights(patcher, len(dm.blocks) - self.settings.blocks_to_swap, self.settings.offload_embeddings)
        self.swap = self._lib.apply_block_swap(dm, self.settings, device=device, move_resident=False,
                                     pin_limit_bytes=detect_system(device).pinned_budget)
        log.info("wan_accel: %s", self.swap.describe())

    def on_load(self, patcher, device_to, lowvram_model_memory, force_patch_weights, full_load):
        from ..memory.offload import memory_manager

        self.manager = memory_manager(patcher)
        if not self.manager.swap_allowed:
            swap = self._lib.active_swap(patcher.model.diffusion_model)
            if swap is not None and swap is self.swap:
                swap.remove(restore=False)      # ComfyUI just placed the weights: they are its to move
            self.swap = None
        self._install(patcher.model.diffusion_model, device_to, patcher)

    def on_detach(self, patcher, unpatch_all):
        swap = self._lib.active_swap(patcher.model.diffusion_model)
        if swap is not None and swap is self.swap:
            swap.remove(restore=False)   # the model is going to the offload device anyway
        self.swap = None

    def wrapper(self, executor, *args, **kwargs):
        dm = executor.class_obj
        if self._lib.active_swap(dm) is not self.swap or self.swap is None:
            x = args[0] if args else kwargs.get("x")
            self._install(dm, getattr(x, "device", None))
        return executor(*args, **kwargs)


class WanBlockSwap(_BlockSwapNode):
    DESCRIPTION = ("Block swap for ComfyUI's native Wan MODEL: the last N transformer blocks stay in pinned host RAM "
                   "and are copied to the GPU just before they run (prefetched on a side stream), then dropped, "
                   "never copied back. Outputs are unchanged. Patches a clone; the shared model is untouched.")
    RETURN_TYPES = ("MODEL",)
    RETURN_NAMES = ("model",)
    MODEL_INPUT = ("model", ("MODEL", {"tooltip": "A Wan diffusion model (diffusion_model.blocks)."}))

    def apply(self, model, blocks_to_swap=-1, prefetch_blocks=1, offload_embeddings=False, plan=None):
        dm = model.get_model_object("diffusion_model")
        blocks = getattr(dm, "blocks", None)
        if blocks is None:
            raise ValueError(f"{type(dm).__name__} has no 'blocks'; Wan Block Swap works on Wan models")
        settings = _resolve_settings(blocks_to_swap, prefetch_blocks, offload_embeddings, plan, len(blocks))
        if settings.blocks_to_swap == 0 and not settings.offload_embeddings:
            return (model,)
        try:
            m = model.clone(disable_dynamic=True)   # dynamic VRAM manages placement itself; opt out like core compile
        except TypeError:
            m = model.clone()
        except RuntimeError as exc:
            log.warning("wan_accel: Wan Block Swap could not leave ComfyUI's dynamic VRAM mode (%s); start ComfyUI "
                        "with --disable-dynamic-vram to use it", exc)
            return (model,)
        patch = _ComfySwapPatch(settings)
        kinds = wrapper_types()
        m.add_callback_with_key(kinds["on_load"], PATCH_KEY, patch.on_load)
        m.add_callback_with_key(kinds["on_detach"], PATCH_KEY, patch.on_detach)
        m.add_wrapper_with_key(kinds["diffusion_model"], PATCH_KEY, patch.wrapper)
        add_outer_sample_guard(m, PATCH_KEY)     # the swap's copies never recorded in core's memory graph
        return (m,)


class CausalWanBlockSwap(_BlockSwapNode):
    DESCRIPTION = ("Block swap for a causal Wan model: the last N blocks live in pinned host RAM and stream to the "
                   "GPU when used (prefetched on a side stream). Outputs are unchanged. The sampler applies the "
                   "setting carried by the model handle at the start of every run.")
    RETURN_TYPES = ("CAUSALWAN_MODEL",)
    RETURN_NAMES = ("causal_model",)
    MODEL_INPUT = ("causal_model", ("CAUSALWAN_MODEL", {"tooltip": "A loaded causal Wan model."}))

    def apply(self, causal_model, blocks_to_swap=-1, prefetch_blocks=1, offload_embeddings=False, plan=None):
        import torch

        from ..memory.block_swap import attach_swap_settings, ensure_block_swap

        module = _causal_module(causal_model)
        settings = _resolve_settings(blocks_to_swap, prefetch_blocks, offload_embeddings, plan, len(module.blocks))
        device = getattr(module, "device", None)
        if isinstance(device, torch.device) and not _swap_saves_memory(device):
            log.info("wan_accel: the causal model runs on the CPU; block swap has nothing to save there")
        else:
            from ..memory.system import detect_system

            ensure_block_swap(module, settings, device=device, pin_limit_bytes=detect_system(device).pinned_budget)
        return (attach_swap_settings(causal_model, settings),)


# ---------------------------------------------------------------------- chunked VAE decode
class _TiledFallbackWatch(logging.Handler):
    """Notices ComfyUI's "ran out of memory ... retrying with tiled VAE decoding" warning."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.fired = False

    def emit(self, record):
        try:
            text = record.getMessage().lower()
        except Exception:  # noqa: BLE001
            return
        if "out of memory" in text and "tiled" in text:
            self.fired = True


def _comfy_free(_size=None) -> None:
    mm = optional("comfy.model_management")
    if mm is not None:
        mm.soft_empty_cache()


def _vae_ratio(vae, name: str, default=None):
    """The VAE's ``temporal_compression_decode()`` / ``spacial_compression_decode()``; ``default`` when it has none,
    its call fails or it gives no number >= 1."""
    fn = getattr(vae, name, None)
    try:
        r = fn() if callable(fn) else None
    except Exception:  # noqa: BLE001
        r = None
    return int(r) if isinstance(r, (int, float)) and r >= 1 else default


def _auto_chunk(vae, latent, plan) -> tuple[int, str]:
    from ..memory.estimate import vae_decode_bytes
    from ..memory.system import detect_system

    b, _, t, h, w = latent.shape
    if plan is not None:
        wl = plan.workload or {}
        if wl.get("height", 0) // 8 == h and wl.get("width", 0) // 8 == w:
            return max(1, plan.vae_chunk_frames), "from the plan"
        log.info("wan_accel: the plan is for %sx%s, the latent is %dx%d pixels; estimating the VAE chunk instead",
                 wl.get("width"), wl.get("height"), w * 8, h * 8)
    system = detect_system(getattr(vae, "device", None))
    elem = getattr(getattr(vae, "vae_dtype", None), "itemsize", 2)
    space = _vae_ratio(vae, "spacial_compression_decode", 8)
    # ComfyUI unloads other models to make room for the VAE, so count most of the card, not only what is free now
    avail = max(system.free_vram, int(0.8 * system.total_vram)) if system.has_gpu else system.host_ram_available
    budget = avail - 512 * 1024 ** 2
    for c in range(t, 0, -1):
        if vae_decode_bytes(c, h, w, elem, b, space_ratio=space) <= budget:
            return c, "estimated from memory"
    return 1, "estimated from memory"


class WanChunkedVAEDecode(Node):
    DESCRIPTION = ("Decodes a video latent in temporal chunks with overlap and a linear cross-fade, so long videos "
                   "decode within VRAM. On out-of-memory the chunk is halved and redone; the size that worked is "
                   "remembered for this GPU and resolution, so the next run starts there.")
    CATEGORY = CATEGORY
    FUNCTION = "decode"
    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("images",)

    INPUTS = {"required": {
        "samples": ("LATENT", {"tooltip": "The video latent to decode."}),
        "vae": ("VAE", {"tooltip": "The Wan VAE."}),
        "chunk_frames": ("INT", {"default": 0, "min": 0, "max": 4096, "step": 1,
                                 "tooltip": "Latent frames per chunk. 0 = auto (plan, else learned limit, else "
                                            "estimate). A number is an upper bound, lowered on out-of-memory."}),
        "overlap": ("INT", {"default": 2, "min": 0, "max": 16, "step": 1,
                            "tooltip": "Latent frames shared by neighbouring chunks; their video frames are "
                                       "cross-faded. At least 1 for Wan (4x temporal compression)."}),
    }, "optional": {
        "plan": ("WANACCEL_PLAN", {"tooltip": "A Wan VRAM Plan; supplies the chunk size when chunk_frames is 0."}),
    }}

    def decode(self, samples, vae, chunk_frames=0, overlap=2, plan=None):
        from ..cache import open_cache
        from ..cache.oom import SoftOOM
        from ..memory.chunked_decode import decode_chunked, min_chunk
        from ..memory.limits import vae_kind, vae_limit_key

        from ..app.validate import check_decode_fits, check_latent

        latent = check_latent("samples", samples, dims=(3, 4, 5))
        if latent.dim() == 4 and getattr(vae, "latent_dim", 2) == 3:
            latent = latent.unsqueeze(2)  # an image latent for a video VAE: one latent frame
        if latent.dim() != 5:
            try:
                images = vae.decode(latent)
            except (IndexError, RuntimeError, ValueError, TypeError) as exc:
                raise ValueError(f"Wan Chunked VAE Decode: 'samples' is a {latent.dim()}-D latent "
                                 f"{list(latent.shape)} (an image latent [B, C, H, W]) that this VAE cannot decode "
                                 f"({type(exc).__name__}: {exc}); connect a video latent [B, 16, T, H, W] or use "
                                 f"VAE Decode with the VAE that made this latent") from None
            return (images.reshape(-1, *images.shape[-3:]) if images.dim() == 5 else images,)
        b, c, t, h, w = latent.shape
        ratio = _vae_ratio(vae, "temporal_compression_decode")
        check_decode_fits("samples", latent.shape, ratio or 4,
                          _vae_ratio(vae, "spacial_compression_decode", 8))     # before the first chunk
        if (ratio or 4) > 1:
            overlap = max(1, overlap)
        start, how = (chunk_frames, "widget") if chunk_frames > 0 else _auto_chunk(vae, latent, plan)
        floor = min(min_chunk(overlap, ratio or 4), t)
        key = vae_limit_key(vae_kind(c, vae), b, h, w)
        log.info("wan_accel: chunked VAE decode of %d latent frames, chunk %d (%s), overlap %d", t, start, how, overlap)

        def decode_fn(chunk):
            watch = _TiledFallbackWatch()
            root = logging.getLogger()
            root.addHandler(watch)
            try:
                out = vae.decode(chunk)
            finally:
                root.removeHandler(watch)
            if watch.fired and chunk.shape[2] > floor:
                del out
                raise SoftOOM(f"the VAE fell back to tiled decoding at {chunk.shape[2]} latent frames")
            return out

        progress = ComfyProgress()

        def between(done, total):
            progress.check()
            progress.update(done, total)

        hint = (f"Lower the resolution ({w * 8}x{h * 8}), close other programs using VRAM, or use ComfyUI's "
                "'VAE Decode (Tiled)' node with smaller tiles.")
        frames, used = decode_chunked(latent, decode_fn, chunk_frames=max(start, floor), overlap=overlap,
                                      time_ratio=ratio, key=key, cache=open_cache(), on_oom=_comfy_free,
                                      hint=hint, between=between)
        return (frames.reshape(-1, *frames.shape[-3:]),)


NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = node_mappings({
    "WanAccelVRAMPlan": (WanVRAMPlan, "Wan VRAM Plan"),
    "WanAccelBlockSwap": (WanBlockSwap, "Wan Block Swap"),
    "WanAccelCausalBlockSwap": (CausalWanBlockSwap, "CausalWan Block Swap"),
    "WanAccelChunkedVAEDecode": (WanChunkedVAEDecode, "Wan Chunked VAE Decode"),
})
