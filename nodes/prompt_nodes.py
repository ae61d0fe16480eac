"""Prompt switching in ComfyUI: the prompt_schedule widget's text encoded with the graph's text encoder, the Wan
Accel Prompt Schedule node for the native AR sampler, and the live prompt play session of the pack's panel.

* The prompt_schedule widget of the causal sampler nodes and the text encoder of its prompts live in
  ``model_nodes`` (``parse_schedule``, ``text_encoder``: the graph's CLIP, or the built-in tiny model's stand-in).
* **Wan Accel Prompt Schedule**: CONDITIONING for the Wan Accel AR Sampler's guider that carries a schedule: the
  first chunk's context as the ordinary conditioning, the schedule and its texts' embeddings alongside.
* **CausalWan Prompt Play Session / Step**: a play session (``app.play.t2v``) whose next chunk follows the prompt
  typed in the panel; Matrix-Game-2 Play Save saves it (video, the prompt schedule that reproduces it, latent).
"""
from __future__ import annotations

from .comfy import Node, check_choice, node_mappings
from .model_nodes import (GRAMMAR, LINEAR_CHOICES, LINEAR_TOOLTIP, comfy_krea_reencode, encode_schedule,
                          parse_schedule, text_encoder)
from .play_nodes import STATE_PLACES, PlaySessionNode, PlayStepNode

SCHEDULE_KEY = "wan_accel_prompt_schedule"     # conditioning dict entry read by the native sampler


class WanAccelPromptSchedule(Node):
    DESCRIPTION = ("A prompt schedule for the Wan Accel AR Sampler: encodes each prompt of the schedule with the "
                   "graph's text encoder and outputs a CONDITIONING (the first chunk's prompt, with the schedule "
                   "attached) for the guider's positive input. The sampler switches the prompt at the chunks named, "
                   "re-caching the window as LongLive does.")
    CATEGORY = "wan_accel/native"
    FUNCTION = "encode"
    RETURN_TYPES = ("CONDITIONING",)
    RETURN_NAMES = ("positive",)

    INPUTS = {"required": {
        "clip": ("CLIP", {"tooltip": "The graph's text encoder (umt5-xxl for Wan, from Load CLIP)."}),
        "prompt_schedule": ("STRING", {"default": "0: a cat walks in the garden\n3: the cat starts to run",
                                       "multiline": True, "tooltip": "Prompt schedule. " + GRAMMAR}),
        "recache": (["switch", "none", "krea"], {"default": "switch", "tooltip":
                    "switch: at a prompt switch re-cache the frames in the window under the new prompt "
                    "(LongLive). none: only the cross-attention cache changes. krea: before every chunk the "
                    "sampler rebuilds the KV cache from a context of K = kv_window - frames_per_block frames "
                    "(Krea Realtime; kv_window -1: K = 3), the first one re-encoded with vae if connected."}),
    }, "optional": {
        "vae": ("VAE", {"tooltip": "recache krea: the Wan VAE that re-encodes the frame standing in for the "
                                   "first frame (without it the frame is used as it is)."}),
    }}

    def encode(self, clip, prompt_schedule, recache="switch", vae=None):
        from ..sampling.krea import CACHE_MODES
        schedule = parse_schedule(prompt_schedule)
        if schedule is None:
            raise ValueError("prompt_schedule is empty: give at least '0: <prompt>'")
        check_choice("recache", recache, CACHE_MODES)
        def encode_one(text):
            cond = clip.encode_from_tokens(clip.tokenize(text))
            return cond[0] if isinstance(cond, (tuple, list)) else cond

        embeddings = encode_schedule(schedule, encode_one)      # read and bounded first; each answer checked
        first = schedule.contexts(embeddings, 1)[0]
        return ([[first, {SCHEDULE_KEY: {"schedule": schedule, "embeddings": embeddings, "recache": recache,
                                        "vae": vae}}]],)


# ---------------------------------------------------------------------------------------------- live prompt play
class CausalWanPromptPlaySession(PlaySessionNode):
    DESCRIPTION = ("Starts a live prompt session for a causal text-to-video model: open the Wan Accel panel, press "
                   "Play, and type a prompt while the video plays; it takes effect at the next chunk (re-caching "
                   "the window, as LongLive does). Each chunk is its own short prompt. Save writes the video, the "
                   "prompt schedule that reproduces it exactly with the same seed and its latent.")
    CATEGORY = "wan_accel/model"

    INPUTS = {"required": {
        "model": ("CAUSALWAN_MODEL", {"tooltip": "A causal text-to-video model from CausalWan Model Loader."}),
        "vae": ("VAE", {"tooltip": "The Wan 2.1 VAE, or a tiny decoder (taew2_1 / lighttaew2_1: faster; not "
                                   "with recache krea, whose re-encode needs the Wan 2.1 VAE): each chunk is "
                                   "decoded as it is made."}),
        "prompt": ("STRING", {"default": "a cat walks in the garden", "tooltip":
                   "The first chunk's prompt (one schedule prompt: a text, or a mix 'a :0.7 | b :0.3')."}),
        "width": ("INT", {"default": 832, "min": 16, "max": 4096, "step": 16,
                          "tooltip": "Video width in pixels (multiple of 16)."}),
        "height": ("INT", {"default": 480, "min": 16, "max": 4096, "step": 16,
                           "tooltip": "Video height in pixels (multiple of 16)."}),
        "seed": ("INT", {"default": 0, "min": 0, "max": 0xFFFFFFFFFFFFFFFF, "tooltip":
                 "Seed of the noise; the saved schedule with this seed reproduces the session."}),
        "preset": (["self_forcing", "causvid"], {"default": "self_forcing", "tooltip":
                   "The sampling schedule: self_forcing (4 warped steps, shift 5; LongLive uses it) or causvid."}),
        "frames_per_block": ("INT", {"default": 3, "min": 1, "max": 64, "tooltip":
                             "Latent frames per chunk (3 for the released models): a typed prompt takes effect "
                             "at the next chunk."}),
        "kv_window": ("INT", {"default": 12, "min": -1, "max": 1024, "tooltip":
                      "Rolling KV window in latent frames (LongLive: 12); -1 keeps every frame (memory grows "
                      "with the session)."}),
        "sink": ("INT", {"default": 3, "min": 0, "max": 1024, "tooltip": "Sink frames kept in the window."}),
        "recache": (["switch", "none", "krea"], {"default": "switch", "tooltip":
                    "switch: a new prompt re-caches the window under it (LongLive). none: only the "
                    "cross-attention cache changes. krea: the cache is rebuilt before every chunk from the "
                    "first frame and the newest ones (Krea Realtime; kv_window -1: K = 3), the stand-in first "
                    "frame re-encoded with vae; a typed prompt eases in over 4 chunks as Krea's server does it "
                    "('<prompt> (blend 0)' switches at once)."}),
    }, "optional": {
        "clip": ("CLIP", {"tooltip": "The graph's text encoder (umt5-xxl); not needed by the built-in tiny model."}),
        "idle_timeout_s": ("INT", {"default": 300, "min": 10, "max": 86400, "tooltip":
                           "End the session (freeing its memory) after this many seconds with no chunk made and "
                           "no panel watching it."}),
        "state_on": (STATE_PLACES, {"default": "model device", "tooltip":
                     "Where the session's caches wait between chunks: the model's device, or the CPU."}),
        "linear": (LINEAR_CHOICES, {"default": "exact", "tooltip": LINEAR_TOOLTIP}),
    }, "hidden": {"unique_id": "UNIQUE_ID"}}

    def start(self, model, vae, prompt, width=832, height=480, seed=0, preset="self_forcing", frames_per_block=3,
              kv_window=12, sink=3, recache="switch", clip=None, idle_timeout_s=300, state_on="model device",
              linear="exact", unique_id=None):
        from ..app.play.registry import PlayError
        from ..app.play.t2v import PromptPlaySession
        from ..app.validate import MAX_SEED, check_geometry, check_int
        from .comfy import streaming_decode
        seed = check_int("seed", seed, 0, MAX_SEED)
        geo = check_geometry(4 * (int(frames_per_block) - 1) + 1, height, width, frames_per_block, kv_window, sink,
                             names={"frames": "frames_per_block"}, recache=recache)   # window, sink and recache
        net = getattr(model, "model", model)
        if hasattr(net, "action_config"):
            raise ValueError("this is a Matrix-Game-2 model: use the Matrix-Game-2 Play Session node")
        ph, pw = net.config.patch_size[1:]
        if geo["latent_height"] % ph or geo["latent_width"] % pw:
            raise ValueError(f"width and height must be multiples of {8 * max(ph, pw)} for this model")
        decoder = streaming_decode.stream_decoder(vae)  # a clear error now for a VAE that does not stream
        encode = text_encoder(clip, model)
        try:                                            # a bad first prompt is refused now, not at the first chunk
            session = PromptPlaySession(net, encode, geo["latent_height"], geo["latent_width"], seed=seed,
                                        schedule=preset, frames_per_block=frames_per_block, kv_window=kv_window,
                                        sink=sink, recache=recache, prompt=prompt,
                                        reencode=comfy_krea_reencode(vae) if recache == "krea" else None,
                                        state_device="cpu" if state_on == "cpu" else None,
                                        settings={"width": width, "height": height, "preset": preset})
        except PlayError as exc:                        # its message names the input (the prompt, kv_window...)
            raise ValueError(str(exc)) from None
        return self._open(session, vae, decoder, linear, idle_timeout_s, unique_id, lambda sid: (
            f"Prompt play session {sid} ready. Open the Wan Accel panel, press Play and type prompts."), prompt=prompt)


class CausalWanPromptPlayStep(PlayStepNode):
    DESCRIPTION = ("Makes the next chunk of a prompt play session with the given prompt (empty: the prompt in "
                   "effect), decodes it and shows its frames in the Wan Accel panel. The panel queues it per chunk.")
    CATEGORY = "wan_accel/model"
    KIND, OTHER = "t2v", "this session is a Matrix-Game-2 play session: use Matrix-Game-2 Play Step"

    INPUTS = {"required": {
        "session": ("STRING", {"default": "", "tooltip": "The id from CausalWan Prompt Play Session."}),
        "prompt": ("STRING", {"default": "", "tooltip": "The prompt from this chunk on; empty: keep the current."}),
        "chunk": ("INT", {"default": -1, "min": -1, "max": 1_000_000, "tooltip":
                  "The chunk this step should make (refused if the session is elsewhere); -1: the next one."}),
    }}

    def step(self, session, prompt="", chunk=-1):
        return self._step(session, chunk, prompt)

    @staticmethod
    def said(entry) -> dict:
        return {"action": entry["prompt"], "prompt": entry["prompt"]}


NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = node_mappings({
    "WanAccelPromptSchedule": (WanAccelPromptSchedule, "Wan Accel Prompt Schedule"),
    "CausalWanPromptPlaySession": (CausalWanPromptPlaySession, "CausalWan Prompt Play Session"),
    "CausalWanPromptPlayStep": (CausalWanPromptPlayStep, "CausalWan Prompt Play Step"),
})
