"""ComfyUI nodes of the model area: CausalWan Model Loader and CausalWan Sampler (thin adapters over wan/)."""
from __future__ import annotations

from .comfy import Node, check_choice, node_mappings, with_notes
from .comfy.comfy_core import ComfyProgress

TINY_NAME = "(built-in tiny model)"   # same string as app.jobs.handle.TINY_NAME (kept here: no heavy import)
TINY_MG2_NAME = "(built-in tiny Matrix-Game-2 model)"   # app.jobs.handle.TINY_MG2_NAME
PRESETS = ["self_forcing", "causvid", "custom"]
SAMPLER_CHOICES = {   # widget value -> (path, cuda_graphs, fused_kernels)
    "auto": ("auto", "auto", True),
    "optimized": ("optimized", "auto", True),
    "optimized, no CUDA graphs": ("optimized", "off", True),
    "optimized, no fused kernels": ("optimized", "auto", False),
    "reference": ("reference", "auto", True),
}


LOADABLE_SUFFIXES = (".safetensors", ".sft")   # pickle files (.pt, .ckpt, ...) are never opened: convert them


def loadable_checkpoints(names) -> tuple[list, list]:
    """(files the loader can open, pickle files it will always refuse) of a model folder listing."""
    keep = [n for n in names if str(n).lower().endswith(LOADABLE_SUFFIXES)]
    return keep, [n for n in names if n not in keep]


def _checkpoint_input():
    from .comfy.comfy_core import optional
    folder_paths = optional("folder_paths")
    if folder_paths is not None:
        names, refused = loadable_checkpoints(folder_paths.get_filename_list("diffusion_models"))
        hidden = (f" {len(refused)} pickle file(s) there are not listed ({', '.join(map(str, refused[:3]))}"
                  f"{', ...' if len(refused) > 3 else ''}): convert them first." if refused else "")
        return ([TINY_NAME, TINY_MG2_NAME] + names, {"default": TINY_NAME, "tooltip":
                "Causal Wan DiT (.safetensors in models/diffusion_models), or a built-in tiny random model "
                "for smoke tests (text-to-video, or Matrix-Game-2 with the universal keys). Convert .pt checkpoints with: python -m wan_accel convert IN.pt OUT.safetensors."
                + hidden})
    return ("STRING", {"default": TINY_NAME, "tooltip":
                "Path of a causal Wan DiT .safetensors file, or '(built-in tiny model)'."})


NO_LORA = "(none)"
OPS_TOOLTIP = ("Which implementation runs LayerNorm+modulate and RMSNorm+RoPE on the optimized sampler. auto: the "
               "fastest one verified against plain torch on this machine (the pack's Triton kernel, comfy-kitchen's "
               "backends or torch; measured once, kept in the operator store) where the fused kernels run, plain "
               "torch elsewhere. pack: the pack's fused Triton kernels. kitchen: comfy-kitchen's backends (needs "
               "comfy-kitchen). torch: plain torch. A choice that cannot run here stops with the reason.")

LINEAR_TOOLTIP = ("exact (default), or fp8 (opt-in, approximate: within a stated error of exact, docs/sampler.md: "
                  "Fidelity): the blocks' linear layers run fp8 copies of their weights. Judged per layer group "
                  "against exact on this GPU before the first chunk: only the groups measured faster run fp8, the "
                  "others (or all) stay exact. Needs the optimized sampler path (auto means optimized with it; the "
                  "reference path is refused).")
LINEAR_CHOICES = ["exact", "fp8"]


def _lora_input():
    """The loader's lora widget: ComfyUI's loras folder (safetensors files), or a path outside ComfyUI."""
    tooltip = ("A LoRA merged into the weights at load: LongLive's (peft names) or one in ComfyUI's layout, from "
               "models/loras. (none): no LoRA.")
    from .comfy.comfy_core import optional
    folder_paths = optional("folder_paths")
    if folder_paths is not None:
        names, _refused = loadable_checkpoints(folder_paths.get_filename_list("loras"))
        return ([NO_LORA] + names, {"default": NO_LORA, "tooltip": tooltip})
    return ("STRING", {"default": "", "tooltip": tooltip + " Outside ComfyUI: the file's path."})


def _resolve_lora(name) -> str | None:
    """The LoRA file of the loader's lora widget (None for none), resolved inside models/loras."""
    text = "" if name is None else str(name).strip()
    if text in ("", NO_LORA):
        return None
    from .comfy.comfy_files import model_file
    return model_file("loras", text, input_name="lora")


def _resolve_checkpoint(name: str) -> str:
    if name in ("", TINY_NAME, TINY_MG2_NAME):
        return name or TINY_NAME
    from .comfy.comfy_files import model_file
    return model_file("diffusion_models", name, input_name="checkpoint")   # never outside ComfyUI's folders


class CausalWanModelLoader:
    DESCRIPTION = ("Loads a causal Wan 2.1 DiT (Self-Forcing / CausVid) from safetensors, with the config inferred "
                   "from the weights. The built-in tiny model needs no download (random weights, for testing).")
    CATEGORY = "wan_accel/model"
    FUNCTION = "load"
    RETURN_TYPES = ("CAUSALWAN_MODEL",)
    RETURN_NAMES = ("model",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "checkpoint": _checkpoint_input(),
                "dtype": (["auto", "bf16", "fp16", "fp32"], {"default": "auto", "tooltip":
                          "Weight / matmul dtype. auto: bf16 on GPUs with bf16 tensor cores (SM 8.0+), fp16 on "
                          "older GPUs (SM 7.5: bf16 would be emulated), fp32 on the CPU. bf16 is what causal "
                          "checkpoints run in; fp32 for parity checks."}),
                "precision": (["self_forcing", "wan21", "float32"], {"default": "self_forcing", "tooltip":
                              "self_forcing: whole model in dtype (as Self-Forcing runs). wan21: time embedding, "
                              "modulation, residual stream and head in float32. float32: everything float32."}),
                "attention": (["auto", "sdpa", "flash_attn", "fa3", "fa2", "int8", "fp8"], {"default": "auto",
                              "tooltip":
                              "auto: exact attention; FlashAttention 3 (Hopper) / 2 (compute capability 8.0+) "
                              "where installed and supported, else torch SDPA; on CUDA the optimized sampler keeps "
                              "the fastest one verified on this GPU per shape (operator store). fa3 / fa2 / sdpa "
                              "force one (SDPA where the forced one cannot run). int8 (opt-in): SageAttention-"
                              "style int8 Q/K (comfy-kitchen's kernel on CUDA), close to exact but not equal "
                              "(docs/sampler.md: Fidelity). fp8 (opt-in): keys and values smoothed, Q/K in int8, V and P in "
                              "fp8, K/V quantized once as they enter the KV cache (the pack's kernel on GPUs of SM "
                              "8.9+), within a stated error of exact; kept only where measured faster than exact "
                              "(docs/sampler.md: Fidelity)."}),
            },
            "optional": {
                "compile_settings": ("WANACCEL_COMPILE", {"tooltip": "Compile settings, stored for the sampler."}),
                "plan": ("WANACCEL_PLAN", {"tooltip": "VRAM plan, stored for the sampler."}),
                "lora": _lora_input(),
                "lora_strength": ("FLOAT", {"default": 1.0, "min": -100.0, "max": 100.0, "step": 0.01, "tooltip":
                                  "Scale of the LoRA's update (1.0: as trained; 0: none)."}),
            },
        }

    def load(self, checkpoint, dtype="bf16", precision="self_forcing", attention="auto",
             compile_settings=None, plan=None, lora=NO_LORA, lora_strength=1.0):
        from ..app.jobs.handle import load_model_handle
        from ..app.validate import check_float
        from .comfy.comfy_core import optional
        lora_file = _resolve_lora(lora)
        strength = check_float("lora_strength", lora_strength, -100.0, 100.0)
        mm = optional("comfy.model_management")
        handle = load_model_handle(_resolve_checkpoint(checkpoint), dtype, precision, attention,
                                   device=None if mm is None else mm.get_torch_device(),
                                   compile_settings=compile_settings, plan=plan, lora=lora_file, lora_strength=strength)
        return (handle,)


def conditioning_to_context(conditioning, text_dim: int, text_len: int, what: str = "positive (the CONDITIONING)"):
    """ComfyUI CONDITIONING ([[tensor [1, L, C], dict], ...]) -> [1, L, C] text embedding (first entry);
    None -> zero context. Raises a clear error when C differs from the model's text_dim, or when it holds NaN or
    inf (``what`` names it)."""
    import torch

    from ..model.finite import check_conditioning
    if conditioning is None:
        return torch.zeros(1, 0, text_dim)
    try:
        cond = conditioning[0][0]
    except (IndexError, TypeError, KeyError):
        raise ValueError("positive must be a CONDITIONING (from a CLIP Text Encode node with umt5-xxl)") from None
    cond = cond if cond.dim() == 3 else cond[None]
    if cond.shape[-1] != text_dim:
        raise ValueError(f"the conditioning is {cond.shape[-1]} wide but the model's text_dim is {text_dim}. "
                         f"Wan models take umt5-xxl conditioning (4096); the built-in tiny model takes none: "
                         f"leave 'positive' unconnected for it.")
    from ..model.dit import check_text_tokens
    check_text_tokens(cond.shape[1], text_len, what)
    check_conditioning(cond[:1], what)
    return cond[:1].float()


# ---------------------------------------------------------------------------- prompt schedules (prompt switching)
GRAMMAR = ("One entry per line, '<chunk>: <prompt>' ('#' comments and blank lines ignored); chunk 0 first. A prompt "
           "is one text or a weighted mix 'text :0.7 | text :0.3'; a trailing '(blend N)' (or '(blend N, slerp)') "
           "blends the previous prompt into this one over N chunks. Example:\n"
           "0: a cat walks in the garden\n6: the cat starts to run (blend 2)\n"
           "9: a red fox :0.7 | snow falls :0.3 (blend 3, slerp)")


def text_encoder(clip, model):
    """text -> [1, L, text_dim] float32 context. ``model``: a WanModel (its config) or a model handle (``.model``).
    The built-in tiny model: its stand-in encoder; any other: ComfyUI's CLIP, or a clear error without one."""
    net = getattr(model, "model", model)
    cfg = net.config
    if getattr(model, "is_tiny", False) is True:        # the built-in tiny model: its stand-in, CLIP or not
        from ..model.tiny import tiny_text_embedding
        return lambda text: tiny_text_embedding(text, cfg.text_len, cfg.text_dim)
    if clip is not None:
        def encode(text: str):
            cond = clip.encode_from_tokens(clip.tokenize(text))
            cond = cond[0] if isinstance(cond, (tuple, list)) else cond
            return conditioning_to_context([[cond, {}]], cfg.text_dim, cfg.text_len,
                                           what=f"the text encoder's answer for {text[:60]!r}")
        return encode
    raise ValueError("a prompt schedule needs the graph's text encoder: connect the CLIP (umt5-xxl, from Load CLIP) "
                     "to the clip input (the built-in tiny model needs none)")


def parse_schedule(text: str, num_chunks: int | None = None):
    """The schedule of a prompt_schedule widget's text (None when empty); its errors name the input, the line and
    the fix."""
    if not str(text or "").strip():
        return None
    from ..sampling.prompts import PromptSchedule
    try:
        schedule = PromptSchedule.parse(str(text))
        if num_chunks is not None:
            schedule.validate(int(num_chunks))
    except ValueError as exc:
        raise ValueError(f"prompt_schedule: {exc}") from None
    return schedule


def encode_schedule(schedule, encode) -> dict:
    """{text: [1, L, D] embedding} of every text of ``schedule`` (each encoded once, each checked finite: a text
    encoder that answers NaN is named with the prompt). The schedule was read and bounded first (at most
    ``sampling.prompts.MAX_CHUNKS`` entries, every text within what the encoder reads)."""
    from ..model.finite import check_conditioning
    out = {}
    for t in schedule.texts():
        out[t] = encode(t)
        check_conditioning(out[t], f"the text encoder's answer for prompt {t[:60]!r}",
                           "the text encoder (CLIP) is broken or in the wrong precision: load it again, or in fp32")
    return out


def _schedule_kwargs(model, text, recache, clip, num_frames, frames_per_block) -> dict:
    """The sampler's prompt-switch arguments for a prompt_schedule widget ({} when it is empty): the schedule
    (checked against the video's chunks) and its texts encoded with ``clip`` (the tiny model: its stand-in)."""
    if not str(text or "").strip():
        return {}
    chunks = ((int(num_frames) - 1) // 4 + 1) // max(1, int(frames_per_block))
    schedule = parse_schedule(text, chunks)
    embeddings = encode_schedule(schedule, text_encoder(clip, model))
    return {"prompt_schedule": schedule, "prompt_embeddings": embeddings, "recache": recache}


def comfy_vae_reencode(vae):
    """Krea's first-frame re-encode (``sampling.krea.vae_reencode``) through a ComfyUI VAE: the model-space latent
    frame decoded, its last pixel frame encoded again, per video of the batch."""
    import torch

    from ..vae.latents import from_vae_latents, to_vae_latents
    from ..sampling.krea import vae_reencode

    def decode(z):
        parts = []
        for b in range(z.shape[0]):
            img = vae.decode(to_vae_latents(z[b:b + 1]))
            parts.append(img.reshape(-1, *img.shape[-3:]))          # [T, H, W, 3]
        return torch.stack(parts)

    def encode(pixels):
        return torch.cat([from_vae_latents(vae.encode(pixels[b])) for b in range(pixels.shape[0])])

    return vae_reencode(decode, encode)


def comfy_krea_reencode(vae):
    """Krea's first-frame re-encode for a ComfyUI VAE as Krea's server does it: through the stream decoder's state
    (``sampling.krea.StreamReencode`` over ``streaming_decode.KreaStreamDecoder``, Krea's session decoder walked over
    the VAE's own layers: the policy's own walk decodes every clean latent frame once, in order, and the last pixel
    frame of latent frame f0 - K as the stream gave it is encoded again as a first frame). A VAE that the streaming
    decoder cannot walk (not Wan 2.1, or no ComfyUI) falls back to ``comfy_vae_reencode`` (that latent frame decoded
    on its own); a tiny decoder (taew2_1 / lighttaew2_1) is refused: the re-encode needs the full VAE."""
    import torch

    from ..vae.latents import from_vae_latents, to_vae_latents
    from ..sampling.krea import StreamReencode
    from .comfy import streaming_decode
    streaming_decode.refuse_tiny_for_reencode(vae)
    try:
        decoder = streaming_decode.KreaStreamDecoder(vae)
    except (ImportError, ValueError):
        return comfy_vae_reencode(vae)

    def push(z):                                        # model space [B, n, C, H, W] -> [B, frames, H, W, 3] or None
        return decoder.push(to_vae_latents(z))

    def encode(pixels):                                 # [B, 1, H, W, 3] -> model space [B, 1, C, h, w]
        return torch.cat([from_vae_latents(vae.encode(pixels[b])) for b in range(pixels.shape[0])])

    return StreamReencode(push, encode)


def krea_cache(recache, frames_per_block, kv_window, vae=None, sink=0, preset=None):
    """``sampling.krea.cache_setup`` for a node's recache widget, with the graph's VAE for the first-frame
    re-encode when there is one (else the identity, said once in the console log); ``sink`` and ``preset`` for
    its refusal of settings the official code runs differently."""
    import logging

    from ..sampling.krea import cache_setup
    setup = cache_setup(recache, frames_per_block, kv_window,
                        None if vae is None or recache != "krea" else comfy_krea_reencode(vae),
                        sink=sink, preset=preset)
    if setup.note:
        logging.getLogger("wan_accel").warning(setup.note)
    return setup


def widget_schedule(preset: str, steps, shift, warp: bool = True, names: dict | None = None):
    """The Schedule of a node's preset widget (its step list, shift and warp are read for 'custom' only), checked
    first (``app.validate.check_schedule_args``: an error naming the widget; ``names``: widget names)."""
    from ..app.validate import check_schedule_args
    from ..sampling.scheduler import resolve_schedule
    if preset != "custom":
        check_schedule_args(preset)
        return resolve_schedule(preset)
    check_schedule_args(preset, steps, shift, warp, names=names)
    return resolve_schedule("custom", steps, shift, warp)


RECACHE_TOOLTIP = ("At a prompt switch of prompt_schedule: switch re-caches the frames in the KV window under the new "
                   "prompt (LongLive); none changes only the cross-attention cache. krea: before every chunk the KV "
                   "cache is rebuilt from a context of K = kv_window - frames_per_block frames, the first one "
                   "re-encoded with the VAE where the node has one (Krea Realtime; kv_window -1: K = 3).")


def _check_ops(ops, path: str, model) -> str:
    """The sampler's ops widget checked: ValueError naming it when the value is unknown, or when a forced family
    cannot run where the model is (before anything is sampled)."""
    from ..kernels.candidates import MODES, mode_problem
    from ..sampling.sampler import resolve_path
    check_choice("ops", ops, MODES)
    device = model.model.device
    if ops != "auto" and resolve_path(path, device, model=model.model) == "reference":
        raise ValueError(f"ops {ops!r} picks the optimized sampler's implementation, but the reference sampler runs "
                         f"here: set sampler to optimized, or ops to auto")
    problem = mode_problem(ops, device)
    if problem:
        raise ValueError(f"ops: {problem}")
    return ops


class _ComfyProgress(ComfyProgress):
    """Per-step progress bar, latent preview and interrupt check (no-ops outside ComfyUI)."""

    def __call__(self, ci, k, num_chunks, num_steps, x0):
        self.check()
        if self.bar_cls is None:
            return
        try:
            from ..app.jobs.preview import _to_image, latents_to_rgb
            preview = ("JPEG", _to_image(latents_to_rgb(x0[:1, -1:])[0, 0]), 512)
        except Exception:
            preview = None
        self.update(ci * num_steps + k + 1, num_chunks * num_steps, preview)


class CausalWanSampler(Node):
    DESCRIPTION = ("Chunk-autoregressive few-step sampling of a causal Wan model with a KV cache "
                   "(Self-Forcing / CausVid). Outputs a Wan 2.1 LATENT for the Wan VAE decoder and, with "
                   "keep_state on, the sampler state a later prompt continues the video from (continue_from).")
    CATEGORY = "wan_accel/model"
    FUNCTION = "sample"
    RETURN_TYPES = ("LATENT", "CAUSALWAN_STATE")
    RETURN_NAMES = ("latent", "state")
    OUTPUT_TOOLTIPS = ("Wan 2.1 latent of the frames made by this prompt (only the new ones when continuing).",
                       "Where the video stopped (KV caches, frame position, noise generator), kept in RAM: connect "
                       "it to continue_from of a later sampler. Empty unless keep_state is on.")

    INPUTS = {
        "required": {
            "model": ("CAUSALWAN_MODEL", {"tooltip": "From CausalWan Model Loader."}),
            "width": ("INT", {"default": 832, "min": 16, "max": 4096, "step": 16,
                              "tooltip": "Video width in pixels (multiple of 16)."}),
            "height": ("INT", {"default": 480, "min": 16, "max": 4096, "step": 16,
                               "tooltip": "Video height in pixels (multiple of 16)."}),
            "num_frames": ("INT", {"default": 81, "min": 1, "max": 4093, "step": 4, "tooltip":
                           "Video frames (4k+1); latent frames (n-1)/4+1 must be whole blocks."}),
            "seed": ("INT", {"default": 0, "min": 0, "max": 0xFFFFFFFFFFFFFFFF,
                             "tooltip": "Seed of the initial and per-step noise."}),
            "preset": (PRESETS, {"default": "self_forcing", "tooltip":
                       "self_forcing: 4 warped steps, shift 5. causvid: [1000,757,522], shift 8. "
                       "custom: custom_steps and shift below."}),
            "frames_per_block": ("INT", {"default": 3, "min": 1, "max": 64,
                                         "tooltip": "Latent frames per chunk (3 for released models)."}),
            "kv_window": ("INT", {"default": -1, "min": -1, "max": 1024, "tooltip":
                          "Rolling KV cache window in latent frames; -1 keeps every frame (global)."}),
            "sink": ("INT", {"default": 0, "min": 0, "max": 1024,
                             "tooltip": "First latent frames always kept in a rolling window."}),
        },
        "optional": {
            "positive": ("CONDITIONING", {"tooltip": "umt5-xxl text conditioning; leave empty for the tiny model."}),
            "custom_steps": ("STRING", {"default": "1000,750,500,250",
                                        "tooltip": "Step list used by preset 'custom' (warped)."}),
            "shift": ("FLOAT", {"default": 5.0, "min": 0.1, "max": 100.0, "step": 0.1,
                                "tooltip": "Timestep shift used by preset 'custom'."}),
            "skip_last_refresh": ("BOOLEAN", {"default": False, "tooltip":
                                  "Skip the last chunk's cache-refresh pass (its result is unused). The "
                                  "optimized sampler always skips it."}),
            "sampler": (list(SAMPLER_CHOICES), {"default": "auto", "tooltip":
                        "auto: the optimized sampler on CUDA, the reference one elsewhere. optimized: static "
                        "buffers, fused kernels, CUDA graphs, the loader's compile settings (same results "
                        "within rounding). The 'no CUDA graphs' / 'no fused kernels' variants switch one part "
                        "off for debugging. reference: the plain loop."}),
            "keep_state": ("BOOLEAN", {"default": False, "tooltip":
                           "Output the sampler state (the KV caches: about the size of the model's cache for "
                           "the whole window, kept in RAM) so a later prompt can continue this video. Needs "
                           "skip_last_refresh off."}),
            "prompt_schedule": ("STRING", {"default": "", "multiline": True, "tooltip":
                                "Prompt schedule: the prompt changes at the chunks named. " + GRAMMAR
                                + "\nEmpty: the one prompt (positive) for every chunk."}),
            "recache": (["switch", "none", "krea"], {"default": "switch", "tooltip": RECACHE_TOOLTIP}),
            "clip": ("CLIP", {"tooltip": "The text encoder (umt5-xxl) that encodes prompt_schedule's prompts; "
                              "not needed by the built-in tiny model."}),
            "ops": (["auto", "pack", "kitchen", "torch"], {"default": "auto", "tooltip": OPS_TOOLTIP}),
            "linear": (LINEAR_CHOICES, {"default": "exact", "tooltip": LINEAR_TOOLTIP}),
            "continue_from": ("CAUSALWAN_STATE", {"tooltip":
                              "A state from an earlier sampler with keep_state on: go on from where it stopped, "
                              "exactly as one long run. num_frames is then the total length to reach, seed is "
                              "not used (the noise goes on), the other settings must match the earlier run."}),
        },
    }

    def sample(self, model, width, height, num_frames, seed, preset, frames_per_block, kv_window, sink,
               positive=None, custom_steps="1000,750,500,250", shift=5.0, skip_last_refresh=False,
               sampler="auto", keep_state=False, continue_from=None, prompt_schedule="", recache="switch", clip=None,
               ops="auto", linear="exact"):
        from ..profiling.session import maybe_profile
        from ..app.prepare import RunInputs, RunSpec, prepare_model, prepare_video
        from ..sampling.request import SamplingHooks
        from ..vae.latents import to_vae_latents
        from ..app.validate import MAX_SEED, check_fits, check_geometry, check_int
        seed = check_int("seed", seed, 0, MAX_SEED)
        schedule = widget_schedule(preset, custom_steps, shift, names={"steps": "custom_steps"})
        cfg = model.config
        names = {"frames": "num_frames", "kv_window": "kv_window", "width": "width", "height": "height"}
        check_geometry(num_frames, height, width, frames_per_block, kv_window, sink, names=names, recache=recache)
        cache = krea_cache(recache, frames_per_block, kv_window, getattr(self, "_krea_vae", None), sink=sink,
                           preset=preset)
        kv_window = cache.kv_window
        check_fits(cfg.to_dict(), num_frames, height, width, device=model.model.device,
                   dtype=str(model.model.compute_dtype), frames_per_block=frames_per_block,
                   kv_window=kv_window, names=names)        # before any tensor is made
        context = conditioning_to_context(positive, cfg.text_dim, cfg.text_len)
        prompts = _schedule_kwargs(model, prompt_schedule, cache.recache, clip, num_frames, frames_per_block)
        if cache.cache_policy is not None:
            prompts.update(cache.sampler_kwargs())
        check_choice("sampler", sampler, SAMPLER_CHOICES)
        path, graphs, fused = SAMPLER_CHOICES[sampler]
        doctor_notes: list = []
        spec = RunSpec.for_handle(model, path=path, cuda_graphs=graphs, fused_kernels=fused,
                                  ops=_check_ops(ops, path, model), linear=linear, schedule=schedule,
                                  frames_per_block=frames_per_block, kv_window=kv_window, sink=sink,
                                  skip_last_refresh=bool(skip_last_refresh), seed=seed,
                                  recache=prompts.pop("recache", "switch"))
        setup = prepare_model(model.model, spec, notes=doctor_notes)    # the doctor's verdicts, swap, compile
        report: dict = {}
        lockstep = getattr(self, "_lockstep", None)     # Sampler + Decode's: each chunk decoded before its refresh
        hooks = SamplingHooks(callback=_ComfyProgress(), report=report,
                              on_chunk_latents=getattr(lockstep, "chunk_latents", None))
        pool = getattr(model, "extra", {}).get("rank_pool")       # CausalWan Sequence Parallel: several GPUs
        kept = keep_state or continue_from is not None or bool(prompts)
        if pool is not None and kept:       # what needs the state refused on several GPUs, with its own way out
            what, fix = (("recache krea does", ", or choose recache switch") if cache.cache_policy is not None
                         else ("prompt_schedule does", ", or clear prompt_schedule") if prompts
                         else ("keep_state / continue_from do", " to keep or continue a video"))
            raise ValueError(f"{what} not run on several GPUs yet: remove the CausalWan Sequence Parallel node (or "
                             f"set its world_size to 1){fix}")

        def sampled(*args, **kw):       # the video, and the state it ends in (kept on the CPU between prompts)
            if pool is not None:
                return pool.sample(*args, **kw), None
            run = prepare_video(*args, keep_state=bool(keep_state), continuable=kept, state_device="cpu", **kw)
            return run.latents(), run.state
        inputs = RunInputs(context=context, state=continue_from, **prompts)
        latents, state = maybe_profile(model, sampled, model.model, spec, inputs, width, height, num_frames,
                                       setup=setup, hooks=hooks)
        self.last_report = report
        return with_notes(({"samples": to_vae_latents(latents).cpu()}, state), doctor_notes)


NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = node_mappings({
    "CausalWanModelLoader": (CausalWanModelLoader, "CausalWan Model Loader"),
    "CausalWanSampler": (CausalWanSampler, "CausalWan Sampler"),
})
