"""Matrix-Game-2 sampling: presets, conditioning and the chunked loop (the base causal sampler + actions).

Layouts follow the released pipeline and ComfyUI: latents ``[B, C, F, H, W]`` (channels before frames),
model space (normalised Wan 2.1 VAE latents). Per chunk of 3 latent frames the model sees the noisy
latent, ``cond_concat[:, :, s:s+3]``, the projected CLIP tokens and the action windows; the self, mouse
and keyboard caches roll over ``window`` latent frames and are refreshed by a t=0 pass on the chunk's x0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FRAMES_PER_BLOCK = 3          # latent frames per chunk (fixed by the released pipeline)
MASK_CHANNELS = 4             # first-frame mask channels of cond_concat

# Released step lists (shift 5, warped), rolling windows and action layouts of the distilled models.
PRESETS = {
    "universal": {"steps": [1000, 666, 333], "shift": 5.0, "window": 6, "mode": "universal"},
    "gta_drive": {"steps": [1000, 666, 333], "shift": 5.0, "window": 4, "mode": "gta_drive"},
    "templerun": {"steps": [1000, 750, 500, 250], "shift": 5.0, "window": 6, "mode": "templerun"},
}


@dataclass
class MG2Settings:
    """A resolved preset: the schedule, the rolling window (latent frames) and the action mode."""
    preset: str
    schedule: object
    window: int
    mode: str


def resolve_preset(preset: str = "universal", steps=None, shift: float | None = None,
                   window: int | None = None) -> MG2Settings:
    """Preset name -> schedule + window; ``steps``/``shift``/``window`` override the preset's values."""
    from .scheduler import resolve_schedule
    if preset not in PRESETS:
        raise ValueError(f"Matrix-Game-2 preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    p = PRESETS[preset]
    sched = resolve_schedule("custom", steps=p["steps"] if steps is None else steps,
                             shift=p["shift"] if shift is None else shift, warp=True)
    sched.name = preset
    win = p["window"] if window in (None, 0, -1) else int(window)
    if win < FRAMES_PER_BLOCK:
        raise ValueError(f"the rolling window ({win} latent frames) must hold at least one chunk "
                         f"({FRAMES_PER_BLOCK} frames)")
    return MG2Settings(preset, sched, win, p["mode"])


def start_video(image: torch.Tensor, latent_frames: int) -> torch.Tensor:
    """The pixel video the released pipeline encodes for its conditioning latent: the start image ``[H, W, 3]``
    (values 0..1) followed by ``4 * (latent_frames - 1)`` blank frames. Blank is 0 in the pipeline's [-1, 1]
    range, which is mid-gray (0.5) in ComfyUI's 0..1 images. Returns ``[1 + 4 * (F - 1), H, W, 3]``."""
    if image.dim() != 3 or image.shape[-1] < 3:
        raise ValueError(f"start image must be [H, W, 3], got {tuple(image.shape)}")
    if int(latent_frames) < 1:
        raise ValueError(f"latent_frames must be at least 1, got {latent_frames}")
    frames = 1 + 4 * (int(latent_frames) - 1)
    video = torch.full((frames, *image.shape[:2], 3), 0.5, dtype=image.dtype, device=image.device)
    video[0] = image[..., :3]
    return video


def build_cond_concat(image_latent: torch.Tensor, num_frames: int, start: int = 0) -> torch.Tensor:
    """cond_concat ``[B, 20, F - start, H, W]`` (frames ``start`` to ``F``): a 4-channel first-frame mask, then the
    conditioning latent.

    ``image_latent`` (model space) is ``[B, 16, 1, H, W]`` (the start image: the later frames are zero) or
    ``[B, 16, >=F, H, W]`` (the VAE encoding of the start image followed by blank frames, as the released
    pipeline builds it: exact). ``start`` > 0: only the frames a continued run makes (its memory stays flat)."""
    if image_latent.dim() != 5 or image_latent.shape[1] != 16:
        raise ValueError(f"the start image latent must be [B, 16, frames, H, W], got {tuple(image_latent.shape)}")
    b, c, fi, h, w = image_latent.shape
    if not 0 <= start < num_frames:
        raise ValueError(f"start {start} must be a frame of the {num_frames}-frame video")
    if fi >= num_frames:
        lat = image_latent[:, :, start:num_frames].float()
    elif fi == 1:
        lat = image_latent.new_zeros(b, c, num_frames - start, h, w, dtype=torch.float32)
        if start == 0:
            lat[:, :, 0] = image_latent[:, :, 0].float()
    else:
        raise ValueError(f"the conditioning latent has {fi} frames: give 1 (start image) or at least "
                         f"{num_frames} (start image + blank frames)")
    mask = lat.new_zeros(b, MASK_CHANNELS, num_frames - start, h, w)
    if start == 0:
        mask[:, :, 0] = 1.0
    return torch.cat([mask, lat], dim=1)


def sample_mg2(model, noise: torch.Tensor, cond_concat: torch.Tensor, visual_context: torch.Tensor,
               mouse: torch.Tensor | None, keyboard: torch.Tensor | None, schedule, window: int,
               noise_provider=None, generator: torch.Generator | None = None, callback=None, tracer=None,
               on_chunk=None, skip_last_refresh: bool = False, kv_cache=None, actions=None,
               start_frame: int = 0, report: dict | None = None, on_chunk_latents=None) -> torch.Tensor:
    """Run the Matrix-Game-2 loop; returns x0 latents ``[B, 16, F, H, W]`` (float32, model space).

    noise ``[B, 16, F, H, W]``, or just that shape: each chunk's initial noise ``[B, 3, 16, H, W]`` then
    comes from noise_provider (step -1) when the chunk starts; cond_concat ``[B, 20, F, H, W]`` (or, continuing,
    its frames from start_frame on);
    visual_context ``[B or 1, tokens, clip_dim]``; mouse/keyboard ``[B or 1, video frames, dims]`` (at least
    ``4*(F-1)`` frames, ``1 + 4*(F-1)`` as released); schedule: a Schedule or preset name; window: the
    rolling window of every cache in latent frames. start_frame: sample only the chunks from that latent frame on
    over caches holding the earlier frames (continue a video: ``mg2_continuation``); returns those frames.
    noise_provider(chunk, step, shape [B, 3, 16, H, W], dtype, device) supplies the re-noising draws
    (default: ``generator``). callback/tracer/on_chunk as in ``sample_causal`` (tracer tensors are
    ``[B, 3, C, H, W]``); on_chunk_latents(chunk, num_chunks, x0) as in ``sample_causal``, x0 ``[B, 16, 3, H, W]``
    (this function's layout). kv_cache / actions: pre-built caches to inspect afterwards. report: a dict that receives
    what the run did (as ``sample_causal``'s).
    """
    from ..model.kv_cache import KVCache
    from .sampler import causal_request, sample_causal
    from ..model.mg2_model import MatrixGameModel
    if not isinstance(model, MatrixGameModel):
        raise TypeError("sample_mg2 needs a Matrix-Game-2 model (a checkpoint with action modules); "
                        "use the CausalWan Sampler for text-to-video models")
    if isinstance(schedule, str):
        schedule = resolve_preset(schedule).schedule
    shape = tuple(noise.shape) if isinstance(noise, torch.Tensor) else tuple(int(v) for v in noise)
    if len(shape) != 5 or cond_concat.dim() != 5 or shape[3:] != tuple(cond_concat.shape[3:]) or \
            cond_concat.shape[2] not in (shape[2], shape[2] - start_frame):
        raise ValueError(f"noise [B, 16, F, H, W] and cond_concat [B, 20, F (or F - start_frame), H, W] must agree, "
                         f"got {shape} and {tuple(cond_concat.shape)}")
    c = model.config
    if shape[1] + cond_concat.shape[1] != c.in_dim:
        raise ValueError(f"noise ({shape[1]}) + cond_concat ({cond_concat.shape[1]}) channels must equal "
                         f"the model's in_dim {c.in_dim}")
    b, _, f, h, w = shape
    if window < FRAMES_PER_BLOCK:
        raise ValueError(f"window ({window} latent frames) must hold at least one {FRAMES_PER_BLOCK}-frame chunk")
    frame_tokens = (h // c.patch_size[1]) * (w // c.patch_size[2])
    kv = kv_cache if kv_cache is not None else KVCache.for_model(model, b, frame_tokens, f, window, 0)
    call = actions if actions is not None else model.new_action_call(mouse, keyboard, window)
    device = model.device
    y = cond_concat.transpose(1, 2).to(device)
    base_noise = noise.transpose(1, 2) if isinstance(noise, torch.Tensor) else (b, f) + shape[1:2] + (h, w)
    out = sample_causal(model, *causal_request(
        model, visual_context.to(device), base_noise, schedule, FRAMES_PER_BLOCK, generator=generator,
        noise_provider=noise_provider, kv_window=window, sink=0, skip_last_refresh=skip_last_refresh,
        callback=callback, tracer=tracer, on_chunk=on_chunk, y=y, kv_cache=kv, model_kwargs={"actions": call},
        start_frame=start_frame, report=report, on_chunk_latents=channels_first(on_chunk_latents)))
    return out.transpose(1, 2)


def channels_first(hook):
    """An ``on_chunk_latents`` hook of this module's layout ([B, C, F, H, W]) as ``sample_causal`` calls it."""
    if hook is None:
        return None
    return lambda ci, n, x0: hook(ci, n, x0.transpose(1, 2))


def _check_actions(model, mouse, keyboard) -> None:
    a = model.action_config
    if a.enable_keyboard and (keyboard is None or keyboard.shape[-1] != a.keyboard_dim_in):
        got = "none" if keyboard is None else keyboard.shape[-1]
        raise ValueError(f"the model takes {a.keyboard_dim_in} keyboard channels per frame but the actions "
                         f"have {got}: pick the Game Actions mode that matches the checkpoint "
                         f"(universal 4 keys, gta_drive 2, templerun 7)")
    if a.enable_mouse and (mouse is None or mouse.shape[-1] != a.mouse_dim_in):
        raise ValueError(f"the model has a mouse branch ({a.mouse_dim_in} values per frame) but the actions "
                         f"have {'no mouse' if mouse is None else mouse.shape[-1]}: use mode universal or "
                         f"gta_drive")


def generate_mg2(model, image_latent: torch.Tensor, visual_context: torch.Tensor, actions, num_frames: int = 0,
                 seed: int = 0, preset: str = "universal", window: int | None = None, steps=None,
                 callback=None, on_chunk=None, skip_last_refresh: bool = False, report: dict | None = None,
                 on_chunk_latents=None) -> torch.Tensor:
    """Seeded end-to-end sampling; returns latents ``[B, 16, F, H, W]`` (float32, model space).

    image_latent: model-space start latent ``[B, 16, 1 or >=F, H, W]``; visual_context: CLIP tokens
    ``[B or 1, tokens, clip_dim]``; actions: a GameActions or a (mouse, keyboard) pair of tensors
    ``[B or 1, video frames, dims]``; num_frames: latent frames (0: every whole chunk the actions cover);
    preset: a preset name (``steps``/``window`` override it) or resolved :class:`MG2Settings`.
    Batch element i draws its noise from its own generator seeded ``seed + i`` (chunk by chunk), so a batch
    gives the same latents as separate batch-1 runs with those seeds, and a longer video starts with
    exactly the frames of a shorter one. report: a dict that receives what the run did. on_chunk_latents: each
    chunk's latents ``[B, 16, 3, H, W]`` before its refresh pass (``sample_mg2``).
    """
    settings = preset if isinstance(preset, MG2Settings) else resolve_preset(preset, steps=steps, window=window)
    device = model.device
    if hasattr(actions, "tensors"):
        frames_avail = actions.latent_frames
        mouse, keyboard = actions.tensors(batch=1)
    else:
        mouse, keyboard = actions
        seq = keyboard if keyboard is not None else mouse
        frames_avail = 1 + (seq.shape[1] - 1) // 4
    _check_actions(model, mouse, keyboard)
    if num_frames <= 0:
        num_frames = (frames_avail // FRAMES_PER_BLOCK) * FRAMES_PER_BLOCK
        if num_frames == 0:
            raise ValueError(f"the actions cover {frames_avail} latent frame(s); a chunk needs "
                             f"{FRAMES_PER_BLOCK} (13 video frames)")
    if num_frames % FRAMES_PER_BLOCK:
        raise ValueError(f"num_frames ({num_frames} latent frames) must be a multiple of {FRAMES_PER_BLOCK}")
    if num_frames > frames_avail:
        raise ValueError(f"{num_frames} latent frames need {1 + 4 * (num_frames - 1)} video frames of actions; "
                         f"the actions give {1 + 4 * (frames_avail - 1)}")
    b, _, _, h, w = image_latent.shape
    cond = build_cond_concat(image_latent.to(device), num_frames)
    gens = [torch.Generator(device=device).manual_seed((int(seed) + i) % 2 ** 64) for i in range(b)]

    def provide(_ci, _k, shape, dtype, dev):      # chunk order: initial noise (k = -1), then each re-noise
        eps = [torch.randn((1,) + tuple(shape[1:]), generator=g, device=device) for g in gens]
        return torch.cat(eps).to(device=dev, dtype=dtype)

    to_dev = lambda t: None if t is None else t.to(device)
    return sample_mg2(model, (b, model.config.out_dim, num_frames, h, w), cond, visual_context.to(device),
                      to_dev(mouse), to_dev(keyboard), settings.schedule, settings.window, noise_provider=provide,
                      callback=callback, on_chunk=on_chunk, skip_last_refresh=skip_last_refresh, report=report,
                      on_chunk_latents=on_chunk_latents)
