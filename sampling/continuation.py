"""Continue a video later: the state a causal run ends in, and a run that goes on from it.

A causal run's future depends only on its KV caches (self-attention, and Matrix-Game-2's action caches), the next
latent frame's position and the noise generator's state. A continuable run (``app.prepare.prepare(...,
keep_state=True)``) returns them as a ``SamplerState`` beside the latents; given that state (``RunInputs.state``), a
later run samples the next frames exactly as one long run
would have (same chunks, same noise draws, same cache contents and layout: bit for bit on the same device). The
state records the model and the settings it was made with and refuses others with an error naming the difference.

The one long run of F frames holds a global cache of F frames, or a rolling window when ``0 < kv_window < F``; a
continuation builds the cache of that long run and copies the earlier frames in (below the window, a global cache's
slot of a token is the rolling one's, so a short global cache grows into a rolling one unchanged).
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from ..model.attachments import model_signature
from ..model.kv_cache import KVCache
from .prompts import PromptSchedule
from .request import RunInputs
from .sampler import as_schedule, chunk_plan


@dataclass(frozen=True)
class SamplerState:
    """Where a causal run stopped. settings: what must match to go on (model signature, latent size, batch,
    chunking, window, schedule, dtypes); frames: latent frames made so far (the next chunk starts there); kv: the
    self-attention cache after the last chunk's refresh; generator: (device, state) of the noise generator;
    actions: Matrix-Game-2's action history and caches (None for text-to-video); extra: kept alongside, unchecked
    (the streaming decode node keeps its decoder's walk there, so a continuation decodes without a seam)."""
    settings: dict
    frames: int
    kv: KVCache
    generator: tuple
    actions: dict | None = None
    extra: dict | None = None       # what other floors keep with the state (the streaming decoder's walk)
    last_context: Any = None        # the raw text context of the last chunk (a different next one is a switch)
    history: torch.Tensor | None = None   # clean latents [B, H, C, H, W] float32 of the last H frames (the window)

    def to(self, device) -> "SamplerState":
        """The state with its cache tensors on ``device`` (e.g. the CPU between prompts); values unchanged."""
        actions = self.actions
        if actions is not None:
            actions = {k: (copy_cache(v, device=device) if isinstance(v, KVCache) else v) for k, v in actions.items()}
        return dataclasses.replace(self, kv=copy_cache(self.kv, device=device), actions=actions,
                                   last_context=_to(self.last_context, device), history=_to(self.history, device))


def copy_cache(src: KVCache, dst: KVCache | None = None, device=None) -> KVCache:
    """A copy of ``src`` (same layout, on ``device``), or ``src``'s tokens written into ``dst`` (the cache of the
    longer run: same layers and rows, a global cache at least as long, or the same rolling window)."""
    if dst is None:
        dst = KVCache(len(src.layers), *src.layers[0].k.shape[:1], src.capacity, *src.layers[0].k.shape[2:],
                      device=device if device is not None else src.device, dtype=src.layers[0].k.dtype,
                      rolling=src.rolling, sink_tokens=src.sink_tokens)
    same_ring = src.rolling and dst.rolling and (src.capacity, src.sink_tokens) == (dst.capacity, dst.sink_tokens)
    if src.rolling and not same_ring:
        raise ValueError(f"a rolling cache of {src.capacity} tokens (sink {src.sink_tokens}) cannot continue in a "
                         f"cache of {dst.capacity} tokens (sink {dst.sink_tokens})")
    n = src.capacity if src.rolling else src.end
    if n > dst.capacity or len(src.layers) != len(dst.layers):
        raise ValueError(f"the earlier run's cache ({len(src.layers)} layers, {n} tokens) does not fit the new one "
                         f"({len(dst.layers)} layers, {dst.capacity} tokens)")
    for a, b in zip(src.layers, dst.layers):
        b.k[:, :n].copy_(a.k[:, :n])
        b.v[:, :n].copy_(a.v[:, :n])
    dst.end = src.end
    return dst


def _to(t, device):
    return t.to(device) if isinstance(t, torch.Tensor) else t


FINGERPRINT_SAMPLES = 16
_FINGERPRINT_ATTR = "_wan_accel_weight_fingerprint"


def _version(p) -> int | None:
    """The in-place version counter of ``p``; None for an inference tensor (ComfyUI loads weights as those), which
    keeps no counter, so a fingerprint over one is never reused from the cache."""
    return None if p.is_inference() else p._version


def weight_fingerprint(model) -> str:
    """A cheap hash of the weights' values: shape, dtype and FINGERPRINT_SAMPLES evenly spaced values of every
    parameter. Two checkpoints of the same structure differ here. Cached on the model, keyed by the parameters'
    identities and in-place versions (a weight patched in place gets a new fingerprint); recomputed on every call
    where a weight keeps no version (inference tensors). The samples are gathered on each weight's device and
    copied to the host once per device."""
    params = list(model.named_parameters())
    key = tuple((id(p), _version(p), p.data_ptr() if p.device.type != "meta" else 0) for _, p in params)
    cached = getattr(model, _FINGERPRINT_ATTR, None)
    if cached is not None and cached[0] == key and None not in (k[1] for k in key):
        return cached[1]
    h = hashlib.sha256()
    samples: dict = {}                                  # device -> [(position, sampled values)]
    with torch.no_grad():
        for i, (name, p) in enumerate(params):
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
            if p.device.type == "meta" or p.numel() == 0:
                continue
            flat = p.detach().reshape(-1)
            idx = torch.linspace(0, flat.numel() - 1, min(FINGERPRINT_SAMPLES, flat.numel()),
                                 device=flat.device).long()
            samples.setdefault(flat.device, []).append((i, flat[idx].float()))
        values = {}
        for device, items in samples.items():
            host = torch.cat([v for _, v in items]).cpu().numpy()   # one copy per device
            at = 0
            for i, v in items:
                values[i] = host[at:at + v.numel()].tobytes()
                at += v.numel()
    for i in sorted(values):
        h.update(values[i])
    value = h.hexdigest()[:16]
    try:
        object.__setattr__(model, _FINGERPRINT_ATTR, (key, value))
    except (AttributeError, TypeError):
        pass
    return value


def run_settings(model, batch: int, height: int, width: int, schedule, frames_per_block: int, kv_window: int,
                 sink: int, refresh_t: float = 0.0, **extra) -> dict:
    """What a state must share with the run that continues it (plain values: compared and shown in errors)."""
    sched = as_schedule(schedule)
    return {"model": model_signature(model), "weights": weight_fingerprint(model), "batch": int(batch),
            "height": int(height), "width": int(width),
            "frames_per_block": int(frames_per_block), "kv_window": int(kv_window), "sink": int(sink),
            "refresh_t": float(refresh_t), "timesteps": [float(t) for t in sched.timesteps],
            "shift": float(getattr(sched, "shift", 0.0) or 0.0),
            "compute_dtype": str(model.compute_dtype), "stream_dtype": str(model.stream_dtype), **extra}


NAMES = {"model": "model (checkpoint, precision or attention heads)",
         "weights": "model weights (same structure, other values: another checkpoint or fine-tune)", "batch": "batch size",
         "height": "latent height", "width": "latent width", "frames_per_block": "frames per block",
         "kv_window": "KV window", "sink": "sink frames", "refresh_t": "refresh timestep",
         "timesteps": "schedule steps", "shift": "schedule shift", "compute_dtype": "compute dtype",
         "stream_dtype": "stream dtype"}


def check_state(state, settings: dict) -> None:
    """Clear error when ``state`` was made with another model or other settings than ``settings``."""
    if not isinstance(state, SamplerState):
        raise TypeError(f"expected a causal sampler state (the 'state' output of a causal sampler), got "
                        f"{type(state).__name__}")
    diffs = [f"{NAMES.get(k, k)}: the state has {state.settings.get(k)!r}, this run {v!r}"
             for k, v in settings.items() if state.settings.get(k) != v]
    if diffs:
        raise ValueError("this sampler state was made with other settings and cannot be continued here; use the "
                         "settings it was made with (or start a new video): " + "; ".join(diffs))


def capture(settings: dict, frames: int, kv: KVCache, generator: torch.Generator, actions=None,
            device=None, copy: bool = True, last_context=None, history=None) -> SamplerState:
    """The state after ``frames`` latent frames: a copy (the caller's buffers may be reused), or with ``copy``
    False the caller's caches themselves (an owner that goes on from it in place, and only once)."""
    state = SamplerState(dict(settings), int(frames), kv, (str(generator.device), generator.get_state().clone()),
                         dict(actions) if actions is not None else None, last_context=last_context, history=history)
    return state.to(device) if copy else state


def restore_generator(generator: tuple, device) -> torch.Generator:
    """A noise generator on ``device`` from a state's (device, state) pair (``SamplerState.generator``)."""
    want, saved = generator
    if torch.device(want).type != torch.device(device).type:
        raise ValueError(f"the state's noise generator ran on {want}; continue on the same device type "
                         f"(this model is on {device})")
    gen = torch.Generator(device=device)
    gen.set_state(saved)
    return gen


def continued(model, spec, inputs: RunInputs, keep_state: bool, device=None) -> tuple:
    """A continuable run's inputs: from frame 0 (no ``inputs.state``: seeded by the generator given, else the spec's
    seed) or from where ``inputs.state`` stopped (the noise goes on from the state's generator; a context different
    from the state's last one switches the prompt at the first chunk, with its re-cache). The cache is the whole long
    run's, with the state's frames copied in; a prompt schedule is cut to this run's length. Returns (the inputs with
    cache, generator, start frame, previous context and history; ``state_after(out)``: the state after the run, given
    its new latents, its caches copied to ``device`` (default: the model's), None when no state is kept), as
    ``mg2_continuation`` does for Matrix-Game-2."""
    b, num_frames, _, height, width = (tuple(inputs.noise.shape) if isinstance(inputs.noise, torch.Tensor)
                                       else tuple(int(v) for v in inputs.noise))
    fpb, state = spec.frames_per_block, inputs.state
    settings = run_settings(model, b, height, width, spec.schedule, fpb, spec.kv_window, spec.sink, spec.refresh_t)
    if keep_state and spec.skip_last_refresh:
        raise ValueError("skip_last_refresh leaves the last chunk out of the KV cache: turn it off to keep a state "
                         "that can be continued")
    start, changes = 0, {}
    if state is not None:
        check_state(state, settings)
        start = state.frames
        if spec.independent_first_frame:
            raise ValueError("independent_first_frame applies to the first run only, not to a continuation")
        if num_frames <= start:
            raise ValueError(f"the video already has {start} latent frames: ask for more than that in all "
                             f"(num_frames is the length to reach)")
    c = model.config
    frame_tokens = (height // c.patch_size[1]) * (width // c.patch_size[2])
    kv = KVCache.for_model(model, b, frame_tokens, num_frames, spec.kv_window, spec.sink)
    if state is None:
        gen = inputs.generator or torch.Generator(device=model.device).manual_seed(int(spec.seed))
    else:
        copy_cache(state.kv, kv)
        gen = restore_generator(state.generator, model.device)
        if inputs.previous_context is None:                 # a new prompt here is a switch
            changes["previous_context"] = state.last_context
        if inputs.history is None and state.history is not None:
            changes["history"] = state.history.to(model.device)
    if inputs.prompt_schedule is not None:      # the schedule of the whole video: its part up to here
        plan = chunk_plan(num_frames, fpb, spec.independent_first_frame, spec.partial_last_block)
        changes["prompt_schedule"] = PromptSchedule.coerce(inputs.prompt_schedule).until(len(plan))
    inputs = inputs.replace(kv_cache=kv, generator=gen, start_frame=start, state=None, **changes)
    if not keep_state:
        return inputs, None
    last = inputs.context                       # the raw context of the run's last chunk
    if inputs.chunk_contexts is not None:
        last = inputs.chunk_contexts[-1]
    elif inputs.prompt_schedule is not None:    # the schedule cut to this run's plan above
        last = inputs.prompt_schedule.contexts(inputs.prompt_embeddings or {}, len(plan))[-1]

    def state_after(out: torch.Tensor) -> SamplerState:
        # the clean latents a re-cache may read after these frames: the last kv_window frames (all of them with a
        # global cache)
        earlier = None if state is None else state.history
        frames = out if earlier is None else torch.cat([earlier.to(out.device), out], dim=1)
        history = frames[:, -spec.kv_window:] if 0 < spec.kv_window < frames.shape[1] else frames
        return capture(settings, num_frames, kv, gen, device=device, last_context=last, history=history)
    return inputs, state_after


__all__ = ["SamplerState", "continued", "check_state", "run_settings", "copy_cache",
           "weight_fingerprint"]
