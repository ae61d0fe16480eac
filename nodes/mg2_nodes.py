"""ComfyUI nodes of Matrix-Game-2: Game Actions (script -> per-frame actions) and Matrix-Game-2 Sampler."""
from __future__ import annotations

from .comfy import Node, node_mappings, with_notes
from .model_nodes import LINEAR_CHOICES, LINEAR_TOOLTIP

MODES = ["universal", "gta_drive", "templerun"]
PRESETS = ["universal", "gta_drive", "templerun"]
DEFAULT_SCRIPT = "W*20, W+A*8, mouse(0.1,0)*12, idle*4"


def linear_spec(linear: str):
    """(the run spec of a run started by a node, the note to show) for the node's ``linear``: the defaults for
    exact; fp8 through the one path rule (the optimized path runs it); another value is refused by ``RunSpec``."""
    from ..app.prepare import RunSpec
    from ..sampling.sampler import path_for_linear
    path, note = path_for_linear("auto", linear)
    return RunSpec(path=path, linear=linear), note


class GameActions(Node):
    DESCRIPTION = ("Builds the per-video-frame keyboard and mouse actions of a Matrix-Game-2 run from a short "
                   "script such as 'W*20, W+A*8, mouse(0.1,0)*12, idle*4' (ACTION*FRAMES items; keys joined "
                   "with '+'; mouse(pitch,yaw); idle). Counts are video frames after the start frame and must "
                   "add up to a multiple of 4. Shows the video and latent frame counts it implies.")
    CATEGORY = "wan_accel/matrix_game2"
    FUNCTION = "build"
    RETURN_TYPES = ("GAME_ACTIONS", "INT", "INT", "STRING")
    RETURN_NAMES = ("actions", "video_frames", "latent_frames", "summary")

    INPUTS = {"required": {
        "script": ("STRING", {"default": DEFAULT_SCRIPT, "multiline": True, "tooltip":
                   "Comma- or line-separated ACTION*FRAMES items. universal keys W S A D (forward back left "
                   "right), gta_drive W S, templerun nomove jump slide turnleft turnright leftside "
                   "rightside; mouse(pitch,yaw) or look_up/down/left/right (0.1); idle; '#' comments."}),
        "mode": (MODES, {"default": "universal", "tooltip":
                 "Action layout of the checkpoint: universal (4 keys + mouse), gta_drive (2 keys + mouse), "
                 "templerun (7 keys, no mouse)."}),
    }}

    def build(self, script, mode="universal"):
        from ..sampling.actions_script import ActionScriptError, parse_action_script
        try:
            actions = parse_action_script(script, mode)
        except ActionScriptError as exc:   # ComfyUI shows the message: name the widget, as the CLI names --actions
            raise ActionScriptError(f"script: {exc}") from None
        summary = actions.summary()
        return {"ui": {"text": [summary]},
                "result": (actions, actions.video_frames, actions.latent_frames, summary)}


def clip_tokens(clip_vision_output, model=None):
    """CLIP_VISION_OUTPUT (penultimate_hidden_states [B, 257, 1280]) or a tensor -> float tensor [B, L, C].

    None is taken only by a built-in tiny model (given zero tokens of its own size)."""
    import torch
    if clip_vision_output is None:
        config = getattr(model, "config", None)
        if getattr(model, "source", "").startswith("(built-in tiny") and config is not None:
            return torch.zeros(1, config.clip_tokens, config.clip_dim)
        raise ValueError("connect clip_vision_output: CLIP Vision Encode (CLIP ViT-H/14, clip_vision_h) of the start "
                         "image (only the built-in tiny model runs without it)")
    if isinstance(clip_vision_output, torch.Tensor):
        t = clip_vision_output
    else:
        t = getattr(clip_vision_output, "penultimate_hidden_states", None)
        if t is None and hasattr(clip_vision_output, "get"):
            t = clip_vision_output.get("penultimate_hidden_states")
        if t is None:
            raise ValueError("clip_vision_output has no penultimate_hidden_states: connect a CLIP Vision Encode "
                             "node (CLIP ViT-H/14, as Wan 2.1 i2v uses) on the start image")
    if t.dim() == 2:
        t = t[None]
    return t.float()


CLIP_INPUT = ("CLIP_VISION_OUTPUT", {"tooltip": "CLIP Vision Encode of the start image (penultimate hidden states, "
                                                "257 tokens x 1280). Only the built-in tiny model runs without it."})


def model_space_start(start_latent):
    """A Wan 2.1 LATENT (VAE space) of the start image -> the model-space start latent [B, 16, frames, h, w]."""
    from ..app.validate import check_latent

    raw = check_latent("start_latent", start_latent, dims=(4, 5), channels=16)
    if raw.dim() == 4:
        raw = raw[:, :, None]
    if raw.dim() != 5 or raw.shape[1] != 16:
        raise ValueError(f"start_latent must be a Wan 2.1 LATENT [B, 16, frames, h, w], got {tuple(raw.shape)}")
    from ..vae.latents import from_vae_latents
    return from_vae_latents(raw.float().cpu()).transpose(1, 2)


def to_latent_space(latents):
    """Model-space latents -> a Wan 2.1 LATENT's samples (VAE space, float32, CPU)."""
    from ..vae.latents import to_vae_latents
    return to_vae_latents(latents.float().cpu().transpose(1, 2))


class MatrixGame2Sampler(Node):
    DESCRIPTION = ("Interactive Matrix-Game-2 video: samples latents chunk by chunk (3 latent frames each) from "
                   "the start image latent, its CLIP vision tokens and the Game Actions, with rolling self, "
                   "mouse and keyboard caches, exactly as the released pipeline. Outputs a Wan 2.1 LATENT and, "
                   "with keep_state, the state a later prompt continues the video from with the next actions.")
    CATEGORY = "wan_accel/matrix_game2"
    FUNCTION = "sample"
    RETURN_TYPES = ("LATENT", "CAUSALWAN_STATE")
    RETURN_NAMES = ("latent", "state")
    OUTPUT_TOOLTIPS = ("Wan 2.1 latent of the frames made by this prompt (only the new ones when continuing).",
                       "Where the video stopped (caches, noise generators, the actions so far), kept in RAM: connect "
                       "it to continue_from of a later Matrix-Game-2 Sampler. Empty unless keep_state is on.")

    INPUTS = {
        "required": {
            "model": ("CAUSALWAN_MODEL", {"tooltip": "A Matrix-Game-2 checkpoint from CausalWan Model Loader."}),
            "start_latent": ("LATENT", {"tooltip":
                             "VAE Encode (Wan 2.1 VAE) of the start image, [B, 16, 1, h, w]; or of the start "
                             "image followed by 4*(F-1) gray frames (exact to the released pipeline)."}),
            "actions": ("GAME_ACTIONS", {"tooltip": "From Game Actions; its mode must match the checkpoint."}),
            "seed": ("INT", {"default": 0, "min": 0, "max": 0xFFFFFFFFFFFFFFFF, "tooltip":
                     "Seed of the initial and per-step noise (batch element i uses seed + i)."}),
            "num_frames": ("INT", {"default": 0, "min": 0, "max": 1020, "step": 3, "tooltip":
                           "Latent frames to generate (multiple of 3; video frames = 4*(n-1)+1). 0: every "
                           "whole 3-frame chunk the actions cover."}),
            "preset": (PRESETS, {"default": "universal", "tooltip":
                       "Released settings: universal and gta_drive 3 steps [1000,666,333]; templerun 4 steps "
                       "[1000,750,500,250]; all shift 5. Rolling window 6 latent frames (gta_drive 4)."}),
        },
        "optional": {
            "clip_vision_output": CLIP_INPUT,
            "kv_window": ("INT", {"default": 0, "min": 0, "max": 1024, "tooltip":
                          "Override the rolling cache window in latent frames (0: the preset's; >= 3)."}),
            "keep_state": ("BOOLEAN", {"default": False, "tooltip":
                           "Output the sampler state (caches, noise generators, actions so far; kept in RAM) so "
                           "a later prompt can continue this video with new actions."}),
            "continue_from": ("CAUSALWAN_STATE", {"tooltip":
                              "A state from an earlier Matrix-Game-2 Sampler with keep_state on: the actions then "
                              "drive the new frames only (4 video frames per latent frame), num_frames is the "
                              "total to reach (0: every whole chunk the actions cover) and seed is not used."}),
            "linear": (LINEAR_CHOICES, {"default": "exact", "tooltip": LINEAR_TOOLTIP}),
        },
    }

    def sample(self, model, start_latent, clip_vision_output=None, actions=None, seed=0, num_frames=0,
               preset="universal", kv_window=0, keep_state=False, continue_from=None, linear="exact"):
        import torch
        from ..sampling.mg2 import PRESETS as LIB_PRESETS
        from .comfy.comfy_core import ComfyProgress
        net = getattr(model, "model", model)
        if not hasattr(net, "action_config"):
            raise ValueError("this model has no action modules: load a Matrix-Game-2 checkpoint (or use the "
                             "CausalWan Sampler for text-to-video models)")
        if actions is None or not hasattr(actions, "tensors"):
            raise ValueError("actions must come from a Game Actions node")
        if 0 < kv_window < 3:
            raise ValueError(f"kv_window {kv_window} is too small: 0 (the preset's window) or at least 3 latent "
                             f"frames (one chunk)")
        if num_frames < 0 or num_frames % 3:
            near = sorted({v for v in (num_frames // 3 * 3, num_frames // 3 * 3 + 3) if v >= 3})
            raise ValueError(f"num_frames {num_frames} must be 0 (every whole chunk the actions cover) or a multiple "
                             f"of 3 latent frames; use {' or '.join(map(str, near))}")
        if preset in LIB_PRESETS and actions.mode != LIB_PRESETS[preset]["mode"]:
            raise ValueError(f"the actions were written for mode {actions.mode!r} but preset {preset!r} is for "
                             f"{LIB_PRESETS[preset]['mode']!r}: set both to the checkpoint's mode")
        image = model_space_start(start_latent)        # the start frame only; checked before the video's tensors
        from ..app.validate import MAX_SEED, check_fits, check_int
        from ..sampling.actions_script import check_action_values
        seed = check_int("seed", seed, 0, MAX_SEED)
        check_action_values(actions)
        lh, lw = image.shape[-2:]
        latent = num_frames or actions.latent_frames // 3 * 3 or 3
        window = kv_window or LIB_PRESETS.get(preset, {}).get("window", 6)
        check_fits(net.config.to_dict(), 4 * (latent - 1) + 1, 8 * int(lh), 8 * int(lw), device=net.device,
                   dtype=str(net.compute_dtype), kv_window=window,
                   names={"frames": "num_frames (video frames)", "kv_window": "kv_window"})
        tokens = clip_tokens(clip_vision_output, model)
        progress = ComfyProgress()                     # interrupt checked per step, the bar moved per chunk
        from ..app.jobs.mg2 import generate_mg2
        from ..app.prepare import prepare_model
        from ..sampling.request import SamplingHooks
        spec, note = linear_spec(linear)                       # the CLI's one rule: fp8 on the optimized path
        doctor_notes: list = [note] if note else []
        with torch.inference_mode():
            setup = prepare_model(net, spec, notes=doctor_notes)   # the doctor's verdicts, said in the node's text
            run = {"spec": spec, "setup": setup, "hooks": SamplingHooks(callback=progress.check,
                                                                    on_chunk=lambda ci, n: progress.update(ci + 1, n))}
            if keep_state or continue_from is not None:
                latents, kept = _continuable(net, image, tokens, actions, num_frames, seed, preset, kv_window,
                                             continue_from, bool(keep_state), run)
            else:
                latents, kept = generate_mg2(net, image, tokens, actions, num_frames, seed, preset,
                                             window=kv_window or None, **run), None
        return with_notes(({"samples": to_latent_space(latents)}, kept), doctor_notes)


def _continuable(net, image, tokens, actions, num_frames, seed, preset, kv_window, state, keep_state, run):
    """A Matrix-Game-2 run that keeps its state, or continues one (the actions then drive the new frames only);
    run: the keywords of the run (its spec, setup and hooks)."""
    from ..app.jobs.mg2 import sample_mg2
    from ..sampling.mg2 import FRAMES_PER_BLOCK, resolve_preset
    from ..sampling.mg2_continuation import mg2_continuation
    settings = resolve_preset(preset, window=kv_window or None)
    mouse, keyboard = actions.tensors(batch=1)
    seq = keyboard if keyboard is not None else mouse
    done = 0 if state is None else getattr(state, "frames", 0)
    if state is None:
        cover = 1 + (seq.shape[1] - 1) // 4
    else:
        cover = done + seq.shape[1] // 4
        mouse = None if mouse is None else mouse[:, :4 * (cover - done)]
        keyboard = None if keyboard is None else keyboard[:, :4 * (cover - done)]
    total = num_frames or done + (cover - done) // FRAMES_PER_BLOCK * FRAMES_PER_BLOCK
    args, state_after = mg2_continuation(net, image, tokens, mouse, keyboard, total, seed, settings, state, "cpu")
    return sample_mg2(net, **args, **run), state_after() if keep_state else None


class MatrixGame2StartLatent(Node):
    DESCRIPTION = ("Builds the Matrix-Game-2 conditioning latent exactly as the released pipeline does: the start "
                   "image followed by 4*(F-1) blank (mid-gray) frames, encoded by the Wan 2.1 VAE into F latent "
                   "frames. Feed it to the Matrix-Game-2 Sampler's start_latent; connect Game Actions' "
                   "latent_frames to latent_frames.")
    CATEGORY = "wan_accel/matrix_game2"
    FUNCTION = "encode"
    RETURN_TYPES = ("LATENT",)
    RETURN_NAMES = ("start_latent",)

    INPUTS = {"required": {
        "vae": ("VAE", {"tooltip": "The Wan 2.1 VAE."}),
        "start_image": ("IMAGE", {"tooltip": "The start frame at the model's resolution (640x352 for the "
                                             "released models); one image per batch element."}),
        "latent_frames": ("INT", {"default": 15, "min": 1, "max": 1020, "tooltip":
                                  "Latent frames the sampler will generate (connect Game Actions' "
                                  "latent_frames, or match the sampler's num_frames)."}),
    }}

    def encode(self, vae, start_image, latent_frames=15):
        from ..sampling.mg2 import start_video

        latents = [vae.encode(start_video(img, latent_frames)) for img in start_image]
        import torch

        return ({"samples": torch.cat([lat if lat.dim() == 5 else lat[None] for lat in latents], dim=0)},)


NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = node_mappings({
    "MatrixGame2Actions": (GameActions, "Game Actions"),
    "MatrixGame2StartLatent": (MatrixGame2StartLatent, "Matrix-Game-2 Start Latent"),
    "MatrixGame2Sampler": (MatrixGame2Sampler, "Matrix-Game-2 Sampler"),
})
