"""Matrix-Game-2 sampling: presets, conditioning and the run's layout for the base causal loop with actions
(``mg2_run``; ``app.jobs.mg2.sample_mg2`` runs it through the one prepare call).

Layouts follow the released pipeline and ComfyUI: latents ``[B, C, F, H, W]`` (channels before frames),
model space (normalised Wan 2.1 VAE latents). Per chunk of 3 latent frames the model sees the noisy
latent, ``cond_concat[:, :, s:s+3]``, the projected CLIP tokens and the action windows; the self, mouse
and keyboard caches roll over ``window`` latent frames and are refreshed by a t=0 pass on the chunk's x0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .actions_script import video_frames

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
    frames = video_frames(latent_frames)
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


def mg2_run(model, noise, cond_concat: torch.Tensor, visual_context: torch.Tensor, mouse: torch.Tensor | None,
            keyboard: torch.Tensor | None, schedule, window: int, noise_provider=None,
            generator: torch.Generator | None = None, kv_cache=None, actions=None, start_frame: int = 0) -> tuple:
    """A Matrix-Game-2 run checked and laid out for the causal loop: (the spec's fields: 3-frame chunks, the rolling
    ``window``, no sink, the schedule; the ``RunInputs``: the visual context, the noise [B, F, 16, H, W] or its
    shape, y from cond_concat, the action call). Arguments as ``app.jobs.mg2.sample_mg2``, which runs it."""
    from ..model.kv_cache import KVCache
    from ..model.mg2_model import MatrixGameModel
    from .request import RunInputs
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
    base_noise = noise.transpose(1, 2) if isinstance(noise, torch.Tensor) else (b, f) + shape[1:2] + (h, w)
    fields = {"frames_per_block": FRAMES_PER_BLOCK, "kv_window": window, "sink": 0, "schedule": schedule}
    return fields, RunInputs(context=visual_context.to(device), noise=base_noise, generator=generator,
                             noise_provider=noise_provider, y=cond_concat.transpose(1, 2).to(device), kv_cache=kv,
                             model_kwargs={"actions": call}, start_frame=start_frame)


def batch_noise(gens: list, device):
    """noise_provider drawing batch element i's noise from ``gens[i]``, in chunk order (each chunk's initial noise at
    step -1, then its re-noising)."""
    def provide(_ci, _k, shape, dtype, dev):
        eps = [torch.randn((1,) + tuple(shape[1:]), generator=g, device=device) for g in gens]
        return torch.cat(eps).to(device=dev, dtype=dtype)
    return provide


def channels_first(hook):
    """An ``on_chunk_latents`` hook of this module's layout ([B, C, F, H, W]) as ``sample_causal`` calls it."""
    if hook is None:
        return None
    return lambda ci, n, x0: hook(ci, n, x0.transpose(1, 2))


def check_actions(model, mouse, keyboard) -> None:
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
