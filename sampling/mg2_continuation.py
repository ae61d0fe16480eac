"""Continue a Matrix-Game-2 video: the state after a run (self-attention and action caches, the per-batch-element
noise generators, the actions so far) and a run that goes on from it with the next actions, exactly as one long run
with all the actions would have gone (``mg2_continuation`` builds it, ``app.jobs.mg2.sample_mg2`` runs it)."""
from __future__ import annotations

import torch

from ..model.kv_cache import KVCache
from .actions_script import video_frames
from .continuation import SamplerState, capture, check_state, copy_cache, restore_generator, run_settings
from .mg2 import FRAMES_PER_BLOCK, MG2Settings, batch_noise, build_cond_concat, resolve_preset


def _cat(old, new):
    if new is None:
        return old
    return new if old is None else torch.cat([old.to(new.device, new.dtype).expand(new.shape[0], -1, -1), new], 1)


def mg2_continuation(model, image_latent: torch.Tensor, visual_context: torch.Tensor, mouse, keyboard,
                     num_frames: int, seed: int = 0, preset="universal", state: SamplerState | None = None,
                     state_device=None, in_place: bool = False, keep_state: bool = True) -> tuple:
    """A Matrix-Game-2 run of latents ``[B, 16, n, H, W]`` up to ``num_frames`` latent frames in all: (the keyword
    arguments of ``app.jobs.mg2.sample_mg2`` that sample it, ``state_after()``: the state once it has run).

    First run (state None): mouse/keyboard ``[B or 1, 1 + 4*(num_frames-1), dims]`` as for ``generate_mg2``; batch
    element i is seeded ``seed + i``. Continuation: mouse/keyboard are the actions of the new frames only, ``4`` video
    frames per new latent frame; they are appended to the state's.

    in_place: the caller owns ``state`` and will only go on from the state returned (a play session): caches of the
    same layout on the model's device are then written in place instead of copied in and out (one cache in memory
    instead of three at the end of a chunk); the frames are the same. keep_state False (a first run that is not
    continued: ``generate_mg2``): no state is kept, and the weights are not fingerprinted (a host read)."""
    settings_obj = preset if isinstance(preset, MG2Settings) else resolve_preset(preset)
    b, _, _, h, w = image_latent.shape
    c = model.config
    settings = None
    if keep_state or state is not None:
        settings = run_settings(model, b, h, w, settings_obj.schedule, FRAMES_PER_BLOCK, settings_obj.window, 0,
                                mode=settings_obj.mode)
    start = 0
    if state is not None:
        check_state(state, settings)
        start = state.frames
        mouse, keyboard = _cat(state.actions["mouse"], mouse), _cat(state.actions["keyboard"], keyboard)
    if num_frames <= start or num_frames % FRAMES_PER_BLOCK:
        raise ValueError(f"num_frames must be a multiple of {FRAMES_PER_BLOCK} latent frames above the {start} made "
                         f"so far, got {num_frames}")
    need, had = video_frames(num_frames), video_frames(start) if start else 0
    for name, seq in (("mouse", mouse), ("keyboard", keyboard)):
        if seq is not None and seq.shape[1] < need:
            raise ValueError(f"{num_frames} latent frames need {need} video frames of {name} actions in all; "
                             f"give {need - had} for the new frames (got {seq.shape[1] - had})")
    device = model.device
    frame_tokens = (h // c.patch_size[1]) * (w // c.patch_size[2])
    window = settings_obj.window
    in_place = in_place and (state_device is None or torch.device(state_device) == torch.device(device))
    # a rolling cache of a state of these settings has the layout of every longer run's: it goes on in place
    reuse = (in_place and state is not None and state.kv.rolling
             and torch.device(state.kv.device) == torch.device(device))
    kv = state.kv if reuse else KVCache.for_model(model, b, frame_tokens, num_frames, window, 0)
    to_dev = lambda t: None if t is None else t[:, :need].to(device)
    call = model.new_action_call(to_dev(mouse), to_dev(keyboard), window)
    if state is None:
        gens = [torch.Generator(device=device).manual_seed((int(seed) + i) % 2 ** 64) for i in range(b)]
    else:
        gens = [restore_generator(saved, device) for saved in state.actions["generators"]]
        if reuse:
            call.adopt_caches(state.actions["mouse_cache"], state.actions["keyboard_cache"], b, frame_tokens)
        else:
            copy_cache(state.kv, kv)
            call._alloc(b, frame_tokens, device, call.dtype or model.compute_dtype)
            for name in ("mouse_cache", "keyboard_cache"):
                if getattr(call, name) is not None:
                    copy_cache(state.actions[name], getattr(call, name))

    cond = build_cond_concat(image_latent.to(device), num_frames, start)      # the new frames' part only
    run = dict(noise=(b, c.out_dim, num_frames, h, w), cond_concat=cond, visual_context=visual_context.to(device),
               mouse=to_dev(mouse), keyboard=to_dev(keyboard), schedule=settings_obj.schedule, window=window,
               noise_provider=batch_noise(gens, device), kv_cache=kv, actions=call, start_frame=start)

    def state_after() -> SamplerState:
        keep = lambda t: None if t is None else t[:, :need].detach().to(state_device or t.device).clone()
        actions = {"mouse": keep(mouse), "keyboard": keep(keyboard),
                   "generators": [(str(g.device), g.get_state().clone()) for g in gens],
                   "mouse_cache": call.mouse_cache, "keyboard_cache": call.keyboard_cache}
        return capture(settings, num_frames, kv, gens[0], actions=actions, device=state_device, copy=not in_place)
    return run, state_after
