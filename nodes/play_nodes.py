"""Matrix-Game-2 play mode in ComfyUI: start a session, make its chunks one prompt at a time, save it.

* **Matrix-Game-2 Play Session** (in a graph): takes a loaded Matrix-Game-2 model, the VAE and the start image's
  latent, registers a play session (``app.play.registry.REGISTRY``) and tells the page (event ``wan_accel.play``, kind
  ``ready``). Nothing is sampled: the prompt ends at once.
* **Matrix-Game-2 Play Step** (queued by the pack's panel, one prompt per chunk): generates the next chunk with the
  keys and camera motion held, decodes it in lockstep (``streaming_decode.stream_decoder``: the Wan 2.1 VAE or a tiny
  decoder, the walk kept between chunks) and sends its frames (kind ``chunk``). Each chunk is its own prompt, so other prompts wait at most one
  chunk, and a stalled or paused session holds nothing in the queue. A chunk that fails or is interrupted ends the
  session (its memory is freed; what was made can still be saved).
* **Matrix-Game-2 Play Save**: the session as a video (mp4, or animated WEBP), the Game Actions script that
  reproduces it, and its LATENT (``.latent``, as Save Latent writes it).
"""
from __future__ import annotations

import re
import time

from ..cache.video_file import FPS, VideoFile, video_format_for
from .comfy import FreshNode, node_mappings
from .mg2_nodes import CLIP_INPUT, PRESETS, clip_tokens, linear_spec, model_space_start, to_latent_space
from .model_nodes import LINEAR_CHOICES, LINEAR_TOOLTIP
from .stream_nodes import _jpeg_frames, page_server, send_to_page    # a chunk's frames: as the streaming sampler's

EVENT = "wan_accel.play"
STATE_PLACES = ["model device", "cpu"]


def _registry():
    from ..app.play.registry import REGISTRY
    return REGISTRY


def send_play_event(kind: str, session: str, **payload) -> bool:
    """Send a play event to the page that queued the running prompt (no-op outside a ComfyUI server)."""
    return send_to_page(EVENT, {"kind": kind, "session": session, **payload})


class PlaySessionNode(FreshNode):   # every run starts a new session (a cached result would name an ended one)
    """What the play Session nodes share: a new session every run, registered with its decoder and run spec, the
    page told it is ready."""
    FUNCTION = "start"
    OUTPUT_NODE = True
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("session",)

    @staticmethod
    def _open(session, vae, decoder, linear, idle_timeout_s, unique_id, text, **event) -> dict:
        """Register ``session`` (its chunks run with ``linear``) and tell the page; ``text(sid)``: the node's text."""
        session.run_spec, note = linear_spec(linear)
        session.attached["decoder"] = decoder
        session.kept["vae"] = vae
        server = page_server()
        owner = f"{getattr(server, 'client_id', None)}:{unique_id}"
        sid = _registry().open(session, owner=owner, idle_timeout_s=float(idle_timeout_s))
        send_play_event("ready", sid, **dict(session.describe(), node=str(unique_id) if unique_id is not None else None,
                                             fps=FPS, idle_timeout_s=float(idle_timeout_s), **event))
        return {"ui": {"text": [text(sid) + (f" ({note})" if note else "")], "wan_accel_play": [sid]}, "result": (sid,)}


class PlayStepNode(FreshNode):
    """What the play Step nodes share: the session's next chunk (``play.step(*inputs)``) made and decoded in lockstep,
    its frames sent to the page. A refused input (PlayError) leaves the session going on; any other failure or an
    interrupt ends it (what was made can still be saved). ``KIND``: the sessions it drives; ``said(entry)``: what
    the page and the text show of the chunk's log entry (``action`` first)."""
    FUNCTION = "step"
    OUTPUT_NODE = True
    RETURN_TYPES = ()
    KIND, OTHER = "mg2", ""

    def _step(self, session, chunk, *inputs) -> dict:
        import torch
        from ..app.play.registry import PlayError
        from .comfy.comfy_core import ComfyProgress
        registry = _registry()
        play = registry.get(session)
        if getattr(play, "kind", "mg2") != self.KIND:
            raise ValueError(self.OTHER)
        if chunk >= 0 and chunk != play.chunks:
            raise ValueError(f"chunk {chunk} was asked for but the session has made {play.chunks}: is another tab "
                             f"playing it? Reload the panel")
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():    # the session prepares its model once (the doctor's verdicts)
                latents = play.step(*inputs, callback=ComfyProgress().check)
                t1 = time.perf_counter()
                decoder = play.attached.get("decoder")
                images = None
                if decoder is not None:
                    vae_latents = to_latent_space(latents)
                    decoder.load(vae_latents.shape)       # other prompts may have unloaded the VAE between chunks
                    images = decoder.push(vae_latents)
        except PlayError:
            raise                                          # a refused input: nothing was made, the session goes on
        except BaseException as exc:
            interrupted = type(exc).__name__ in ("InterruptProcessingException", "KeyboardInterrupt")
            why = "interrupted" if interrupted else f"failed: {type(exc).__name__}: {str(exc)[:200]}"
            registry.end(session, why)
            send_play_event("ended", session, reason=why, chunks=play.chunks)
            raise
        t2 = time.perf_counter()
        entry = play.log[-1]
        said = self.said(entry)
        send_play_event("chunk", session, chunk=entry["chunk"], **said, fps=FPS, latency_s=round(t2 - t0, 4),
                        decode_s=round(t2 - t1, 4), first_frame=play.frames_shown,
                        frames=[] if images is None else _jpeg_frames(images[0].cpu()))
        play.frames_shown += 0 if images is None else images.shape[1]
        notes = play.setup.notes if play.setup is not None else []
        return {"ui": {"text": [f"chunk {entry['chunk']}: {said['action']} ({t2 - t0:.2f} s)", *notes]}}


class MatrixGame2PlaySession(PlaySessionNode):
    DESCRIPTION = ("Starts a Matrix-Game-2 play session: open the Wan Accel panel and press Play, then drive the "
                   "video live with the keyboard (W A S D, or the checkpoint's keys) and a mouse drag (camera). "
                   "Each chunk is made by its own short prompt with the keys held while you watched the previous "
                   "one, so other prompts never wait longer than one chunk. Save writes the video, the Game "
                   "Actions script that reproduces it exactly and its latent.")
    CATEGORY = "wan_accel/matrix_game2"
    OUTPUT_TOOLTIPS = ("The play session's id (the panel drives it; Play Step and Play Save take it).",)

    INPUTS = {
        "required": {
            "model": ("CAUSALWAN_MODEL", {"tooltip": "A Matrix-Game-2 checkpoint from CausalWan Model Loader "
                                                     "(or its built-in tiny Matrix-Game-2 model)."}),
            "vae": ("VAE", {"tooltip": "The Wan 2.1 VAE, or a tiny decoder (taew2_1 / lighttaew2_1: faster): "
                                       "each chunk is decoded as it is made and shown live."}),
            "start_latent": ("LATENT", {"tooltip": "The start image's latent (VAE Encode, or Matrix-Game-2 Start "
                                                   "Latent); its first latent frame starts the video."}),
            "seed": ("INT", {"default": 0, "min": 0, "max": 0xFFFFFFFFFFFFFFFF, "tooltip":
                     "Seed of the noise; the saved script with this seed reproduces the session."}),
            "preset": (PRESETS, {"default": "universal", "tooltip":
                       "The checkpoint's released settings and action layout: universal (W A S D + camera), "
                       "gta_drive (W S + camera), templerun (7 keys, no camera)."}),
        },
        "optional": {
            "clip_vision_output": CLIP_INPUT,
            "kv_window": ("INT", {"default": 0, "min": 0, "max": 1024, "tooltip":
                          "Rolling cache window in latent frames (0: the preset's; at least 3)."}),
            "idle_timeout_s": ("INT", {"default": 300, "min": 10, "max": 86400, "tooltip":
                               "End the session (freeing its memory) after this many seconds with no chunk made "
                               "and no panel watching it (a closed browser tab)."}),
            "state_on": (STATE_PLACES, {"default": "model device", "tooltip":
                         "Where the session's caches wait between chunks: the model's device (fastest), or "
                         "the CPU (frees GPU memory for other prompts between chunks)."}),
            "linear": (LINEAR_CHOICES, {"default": "exact", "tooltip": LINEAR_TOOLTIP}),
        },
        "hidden": {"unique_id": "UNIQUE_ID"},
    }

    def start(self, model, vae, start_latent, seed=0, preset="universal", clip_vision_output=None, kv_window=0,
              idle_timeout_s=300, state_on="model device", linear="exact", unique_id=None):
        from ..app.play.registry import PlaySession
        from ..sampling.mg2 import PRESETS as LIB_PRESETS
        from .comfy import streaming_decode
        net = getattr(model, "model", model)
        if not hasattr(net, "action_config"):
            raise ValueError("play mode needs a Matrix-Game-2 model: load a Matrix-Game-2 checkpoint (or the built-in "
                             "tiny Matrix-Game-2 model) with CausalWan Model Loader")
        if 0 < kv_window < 3:
            raise ValueError(f"kv_window {kv_window} is too small: 0 (the preset's window) or at least 3")
        keys_in = getattr(net.action_config, "keyboard_dim_in", None)
        from ..sampling.actions_script import MODES
        mode = LIB_PRESETS[preset]["mode"] if preset in LIB_PRESETS else preset
        if keys_in is not None and mode in MODES and len(MODES[mode]["keys"]) != keys_in:
            fits = [p for p in PRESETS if len(MODES[LIB_PRESETS[p]["mode"]]["keys"]) == keys_in]
            raise ValueError(f"preset {preset!r} drives {len(MODES[mode]['keys'])} keys but this checkpoint has "
                             f"{keys_in}: use preset {' or '.join(fits) or '(none fits)'}")
        image = model_space_start(start_latent)[:1, :, :1]
        tokens = clip_tokens(clip_vision_output, model)[:1]
        decoder = streaming_decode.stream_decoder(vae)          # a clear error now for a VAE that does not stream
        session = PlaySession(net, image.to(net.device), tokens.to(net.device), seed=seed, preset=preset,
                              window=kv_window or None, state_device="cpu" if state_on == "cpu" else None)
        keys = " ".join(k.upper() if len(k) == 1 else k for k in session.keys)
        camera = ", drag for the camera" if session.has_mouse else ""
        return self._open(session, vae, decoder, linear, idle_timeout_s, unique_id, lambda sid: (
            f"Play session {sid} ready ({session.mode}: keys {keys}{camera}). Open the Wan Accel panel and press "
            f"Play."))


def parse_keys(keys: str) -> list:
    """'w+a', 'W A', 'w,a' -> ['w', 'a']; '' or 'idle' -> []."""
    names = [k for k in re.split(r"[+,\s]+", str(keys or "").strip().lower()) if k]
    return [] if names == ["idle"] else names


class MatrixGame2PlayStep(PlayStepNode):
    DESCRIPTION = ("Makes the next chunk of a Matrix-Game-2 play session with the given keys and camera motion held "
                   "for the whole chunk, decodes it and shows its frames in the Wan Accel panel. The panel queues "
                   "this node once per chunk; it can also be queued by hand.")
    CATEGORY = "wan_accel/matrix_game2"
    OTHER = "this session is a prompt play session: use CausalWan Prompt Play Step"

    INPUTS = {"required": {
        "session": ("STRING", {"default": "", "tooltip": "The id from Matrix-Game-2 Play Session."}),
        "keys": ("STRING", {"default": "", "tooltip":
                 "Keys held during the chunk, joined with '+' (e.g. 'w+a'); empty for none."}),
        "mouse_pitch": ("FLOAT", {"default": 0.0, "min": -1.0, "max": 1.0, "step": 0.01, "tooltip":
                        "Camera pitch per frame (the released demos use 0.1)."}),
        "mouse_yaw": ("FLOAT", {"default": 0.0, "min": -1.0, "max": 1.0, "step": 0.01, "tooltip":
                      "Camera yaw per frame (the released demos use 0.1)."}),
        "chunk": ("INT", {"default": -1, "min": -1, "max": 1_000_000, "tooltip":
                  "The chunk this step should make (refused if the session is elsewhere, e.g. driven from "
                  "another tab); -1: the next one."}),
    }}

    def step(self, session, keys="", mouse_pitch=0.0, mouse_yaw=0.0, chunk=-1):
        return self._step(session, chunk, parse_keys(keys), (float(mouse_pitch), float(mouse_yaw)))

    @staticmethod
    def said(entry) -> dict:
        return {"action": entry["action"]}


class MatrixGame2PlaySave(FreshNode):
    DESCRIPTION = ("Saves a Matrix-Game-2 play session to the output folder: the video (mp4, or animated WEBP), the "
                   "Game Actions script that reproduces it exactly with the session's seed, and its LATENT "
                   "(.latent, as Save Latent writes it). Works after the session ended, too. A CausalWan Prompt Play "
                   "session is saved the same way, with its prompt schedule as the script.")
    CATEGORY = "wan_accel/matrix_game2"
    FUNCTION = "save"
    OUTPUT_NODE = True
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("script",)

    INPUTS = {"required": {
        "session": ("STRING", {"default": "", "tooltip": "The id from Matrix-Game-2 Play Session."}),
        "filename_prefix": ("STRING", {"default": "wan_accel/play", "tooltip":
                            "Output file prefix (a sub-folder of the output folder may be given)."}),
        "video_format": (["mp4", "webp"], {"default": "mp4", "tooltip":
                         "mp4 (H.264, written frame by frame) or animated WEBP (mp4 needs PyAV, which ComfyUI "
                         "installs; WEBP is used when it is missing)."}),
    }}

    def save(self, session, filename_prefix="wan_accel/play", video_format="mp4"):
        import torch
        from safetensors.torch import save_file
        from ..cache.owned_files import check_target, write_text, write_with
        from .comfy import streaming_decode
        play = _registry().get(session)
        with play.lock:
            latents = play.latent_video()
            script_text, seed = play.script_file(), play.seed
        from .comfy.comfy_files import save_path
        try:
            full, name, counter, subfolder = save_path(filename_prefix, input_name="filename_prefix")
        except ImportError:
            raise ValueError("Play Save writes into ComfyUI's output folder: run it inside ComfyUI") from None
        fmt = video_format_for(video_format)                 # mp4 needs PyAV; animated WEBP without it
        base = f"{name}_{counter:05}_"
        from pathlib import Path
        folder = Path(full)
        folder.mkdir(parents=True, exist_ok=True)
        files = {"video": f"{base}.{fmt}", "script": f"{base}.txt", "latent": f"{base}.latent"}
        for f in files.values():   # before any decoding: no link, pipe or folder in the way (cache/owned_files.py)
            check_target(folder / f, option="filename_prefix", purpose="the saved play session")
        vae = play.kept.get("vae")
        written = 0
        if vae is not None:
            decoder = streaming_decode.stream_decoder(vae)
            video = VideoFile(folder / files["video"], FPS, option="filename_prefix",
                              purpose="the saved play video")
            try:
                with torch.inference_mode():
                    for part in latents.split(3, dim=2):    # each chunk (3 latent frames) written as decoded
                        lat = to_latent_space(part)
                        decoder.load(lat.shape)
                        images = decoder.push(lat)
                        if images is not None:
                            video.write(images[0])
                    tail = decoder.finish()
                    if tail is not None:
                        video.write(tail[0])
                if video.frames:
                    video.close()
                else:                                       # nothing made yet: no video
                    files.pop("video")
                written = video.frames
            finally:
                video.discard()                             # (nothing left to discard once closed)
                decoder.release()
        else:
            files.pop("video")
        write_text(folder / files["script"], script_text, option="filename_prefix", purpose="the play script")
        tensors = {"latent_tensor": to_latent_space(latents).contiguous(), "latent_format_version_0": torch.tensor([])}
        write_with(folder / files["latent"], lambda tmp: save_file(tensors, tmp), option="filename_prefix",
                   purpose="the play latent")
        send_play_event("saved", session, subfolder=subfolder, files=files, frames=written, seed=seed)
        ui = {"text": [f"saved {', '.join(files.values())} ({written} frames) in output/{subfolder}"],
              "wan_accel_play_saved": [{"subfolder": subfolder, **files}]}
        return {"ui": ui, "result": (play.script,)}


NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = node_mappings({
    "MatrixGame2PlaySession": (MatrixGame2PlaySession, "Matrix-Game-2 Play Session"),
    "MatrixGame2PlayStep": (MatrixGame2PlayStep, "Matrix-Game-2 Play Step"),
    "MatrixGame2PlaySave": (MatrixGame2PlaySave, "Matrix-Game-2 Play Save"),
})
