"""CausalWan Sampler + Decode: sampling with the VAE decode in lockstep, and live frames to the browser.

Each chunk's clean latents are decoded as soon as the chunk is done (``streaming_decode.stream_decoder``: the Wan 2.1
VAE's walk or a tiny decoder's, the frames of one whole decode, flat decoder memory), and its frames are sent to the
page (event ``wan_accel.frames``)
where the node and the panel play them at the video's frame rate with the chunk's latency. The node returns the
IMAGE frames, the LATENT and, with keep_state, the state a later prompt continues from.
"""
from __future__ import annotations

import base64
import io
import time

from ..cache.video_file import FPS
from .comfy.comfy_core import optional
from .model_nodes import CausalWanSampler, _ComfyProgress

EVENT = "wan_accel.frames"
PREVIEW_SIDE = 320               # longest side of the frames sent to the page


def _jpeg_frames(images) -> list:
    """images [frames, H, W, 3] 0..1 -> base64 JPEGs no larger than PREVIEW_SIDE pixels."""
    from PIL import Image
    out = []
    arr = (images.clamp(0, 1) * 255).round().to("cpu").byte().numpy()
    for frame in arr:
        img = Image.fromarray(frame)
        if max(img.size) > PREVIEW_SIDE:
            img.thumbnail((PREVIEW_SIDE, PREVIEW_SIDE))
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=80)
        out.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    return out


def page_server():
    """ComfyUI's running server (``PromptServer.instance``), or None outside a ComfyUI server."""
    return getattr(optional("server.PromptServer"), "instance", None)


def send_to_page(event: str, payload: dict) -> bool:
    """Send ``event`` (a chunk's frames, a play session's news) to the page that queued the running prompt (no-op
    outside a ComfyUI server); True when sent."""
    server = page_server()
    if server is None:
        return False
    server.send_sync(event, payload, getattr(server, "client_id", None))
    return True


class _DecodeInLockstep(_ComfyProgress):
    """Progress callback whose ``chunk_latents`` (the sampler's ``on_chunk_latents``) decodes each finished chunk as
    soon as its latents exist, before the chunk's cache-refresh pass, and sends its frames."""

    def __init__(self, decoder, node_id=None, live: bool = True, keep_walk: bool = False, skip: int = 0):
        super().__init__()
        self.decoder, self.node_id, self.live = decoder, node_id, live
        self.keep_walk, self.skip = keep_walk, skip      # keep the walk for a continuation; frames shown already
        self.walk = None
        self.parts: list = []
        self.t0 = self.mark = time.perf_counter()
        self.first_frames_s = None
        self.chunk_s: list = []
        self.decode_s: list = []
        self.frames = 0

    def chunk_latents(self, ci, num_chunks, x0):
        """The chunk's final latents (once per chunk, even when an out-of-memory retry redoes it): decode, send."""
        import torch
        from ..vae.latents import to_vae_latents
        t = time.perf_counter()
        parts = [self.decoder.push(to_vae_latents(x0.float()))]
        if ci == num_chunks - 1:                            # the last chunk also ends the decode walk
            if self.keep_walk:                              # (a continuation goes on from before that end)
                self.walk = self.decoder.snapshot()
            parts.append(self.decoder.finish())
        parts = [p for p in parts if p is not None]
        images = torch.cat(parts, 1) if parts else None
        now = time.perf_counter()
        self.decode_s.append(now - t)
        self.chunk_s.append(now - self.mark)
        self.mark = now
        if images is not None and self.skip:              # frames the run this one continues has shown
            cut = min(self.skip, images.shape[1])
            images, self.skip = images[:, cut:], self.skip - cut
        if images is None or images.shape[1] == 0:
            return
        images = images.reshape(-1, *images.shape[-3:]).cpu()
        if self.first_frames_s is None:
            self.first_frames_s = now - self.t0
        if self.live:
            send_to_page(EVENT, {"node": str(self.node_id) if self.node_id is not None else None, "chunk": ci,
                                 "chunks": num_chunks, "first_frame": self.frames, "fps": FPS,
                                 "latency_s": round(self.chunk_s[-1], 4), "frames": _jpeg_frames(images)})
        self.frames += images.shape[0]
        self.parts.append(images)


class CausalWanSamplerDecode(CausalWanSampler):
    DESCRIPTION = ("CausalWan Sampler with the VAE decode in lockstep: each chunk is decoded as soon as it is sampled "
                   "(the frames of one whole decode, with decoder memory that stays flat in video length) and its "
                   "frames play live in this node while the rest is made. Takes the Wan 2.1 VAE or a tiny decoder "
                   "(taew2_1 / lighttaew2_1: much faster, a little less detail).")
    RETURN_TYPES = ("IMAGE", "LATENT", "CAUSALWAN_STATE")
    RETURN_NAMES = ("images", "latent", "state")
    OUTPUT_TOOLTIPS = ("The decoded video frames (same as VAE Decode of the latent).",) + CausalWanSampler.OUTPUT_TOOLTIPS

    @classmethod
    def INPUT_TYPES(cls):
        spec = CausalWanSampler.INPUT_TYPES()
        spec["required"] = {"vae": ("VAE", {"tooltip": "The Wan 2.1 VAE (wan_2.1_vae.safetensors), or a tiny "
                                                       "decoder (taew2_1 / lighttaew2_1) from Load VAE."}),
                            **spec["required"]}
        spec["optional"]["live_preview"] = ("BOOLEAN", {"default": True, "tooltip":
                                            "Send each decoded chunk's frames to this node while sampling."})
        spec["hidden"] = {"unique_id": "UNIQUE_ID"}
        return spec

    def sample(self, vae, model, *args, live_preview=True, unique_id=None, **kwargs):
        import dataclasses
        import inspect

        import torch
        from .comfy import streaming_decode
        decoder = streaming_decode.stream_decoder(vae)      # a clear error now for a VAE that does not stream
        self._krea_vae = vae                     # recache krea: its first-frame re-encode goes through this VAE
        given = inspect.signature(CausalWanSampler.sample).bind(self, model, *args, **kwargs).arguments
        before = getattr(given.get("continue_from"), "extra", None) or {}
        skip = 0
        if before.get("decoder") is not None:       # go on with the first run's decode walk: no seam
            decoder.restore(before["decoder"])
            skip = 4 if before["decoder"].get("held") is not None else 0   # its held frame, shown when that run ended
        self._lockstep = _DecodeInLockstep(decoder, unique_id, bool(live_preview),
                                           keep_walk=bool(given.get("keep_state")), skip=skip)
        try:
            out = super().sample(model, *args, **kwargs)
        finally:
            decoder.release()
        ui = out.get("ui") if isinstance(out, dict) else None      # the sampler's notes (doctor, linear fp8 path)
        latent, state = out["result"] if isinstance(out, dict) else out
        run = self._lockstep
        if state is not None and run.walk is not None:
            state = dataclasses.replace(state, extra=dict(state.extra or {}, decoder=run.walk))
        self.last_report = dict(getattr(self, "last_report", {}), first_frames_s=run.first_frames_s,
                                chunk_s=run.chunk_s, decode_s=run.decode_s)
        images = torch.cat(run.parts, 0) if run.parts else torch.zeros(0, 8, 8, 3)
        return {"ui": ui, "result": (images, latent, state)} if ui else (images, latent, state)


NODE_CLASS_MAPPINGS = {"CausalWanSamplerDecode": CausalWanSamplerDecode}
NODE_DISPLAY_NAME_MAPPINGS = {"CausalWanSamplerDecode": "CausalWan Sampler + Decode (streaming)"}
