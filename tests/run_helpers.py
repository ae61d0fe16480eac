"""The tests' short ways into the one prepare call: the loop's arguments as keywords (as the official scripts name
them), sorted into the run's spec, inputs and hooks and run through ``app.prepare.prepare`` with the model kept as it
is (no doctor, swap or compile change: the setup is given), as the replay tools do."""
from __future__ import annotations

import dataclasses

import torch

from wan_accel.app.prepare import RunSpec, Setup, prepare
from wan_accel.sampling.request import RunInputs, SamplingHooks
from wan_accel.sampling.runner import FastOptions

SPEC = {f.name for f in dataclasses.fields(RunSpec)}
INPUTS = {f.name for f in dataclasses.fields(RunInputs)}
HOOKS = {f.name for f in dataclasses.fields(SamplingHooks)}


def prepared(model, context, noise, schedule="self_forcing", frames_per_block: int = 3, *, path: str = "auto",
             fast_options=None, keep_state: bool = False, continuable: bool = False, state_device=None, **kw):
    """The ``Run`` of these keyword arguments (``prepare``'s, sorted by name into spec, inputs and hooks)."""
    unknown = sorted(set(kw) - SPEC - INPUTS - HOOKS)
    if unknown:
        raise TypeError(f"unknown run arguments {unknown}")
    spec = RunSpec(schedule=schedule, frames_per_block=frames_per_block, doctor=False, oom_retry="off",
                   **{k: v for k, v in kw.items() if k in SPEC})
    options = None if fast_options is None else FastOptions.coerce(fast_options)
    inputs = RunInputs(context=context, noise=noise, **{k: v for k, v in kw.items() if k in INPUTS})
    hooks = SamplingHooks(**{k: v for k, v in kw.items() if k in HOOKS})
    return prepare(model, spec, inputs, hooks, setup=Setup(path, options, [], {}), keep_state=keep_state,
                   continuable=continuable, state_device=state_device)


def run_causal(model, context, noise, schedule="self_forcing", frames_per_block: int = 3, generator=None, **kw):
    """Latents of one run given as the loop's keywords."""
    return prepared(model, context, noise, schedule, frames_per_block, generator=generator, **kw).latents()


def generate_latents(model, context, num_frames: int, height: int, width: int, seed: int = 0, batch: int = 1,
                     schedule="self_forcing", frames_per_block: int = 3, **kw) -> torch.Tensor:
    """Seeded latents [batch, num_frames, out_channels, height, width]: every draw from one generator seeded
    ``seed`` on the model's device."""
    shape = (batch, num_frames, model.config.out_dim, height, width)
    return run_causal(model, context, shape, schedule, frames_per_block, seed=seed, **kw)


def sample_continuable(model, context, num_frames: int, height: int, width: int, seed: int = 0, batch: int = 1,
                       schedule="self_forcing", frames_per_block: int = 3, state=None, keep_state: bool = True,
                       state_device=None, **kw):
    """(new latents, the state after them or None): a continuable run up to ``num_frames`` latent frames."""
    shape = (batch, num_frames, model.config.out_dim, height, width)
    run = prepared(model, context, shape, schedule, frames_per_block, seed=seed, state=state, keep_state=keep_state,
                   continuable=True, state_device=state_device, **kw)
    return run.latents(), run.state


def sample_mg2_continuable(model, image_latent, visual_context, mouse, keyboard, num_frames: int, seed: int = 0,
                           preset="universal", state=None, keep_state: bool = True, state_device=None,
                           in_place: bool = False, **kw):
    """(new Matrix-Game-2 latents up to ``num_frames`` latent frames in all, the state after them or None): the run
    ``mg2_continuation`` builds, through ``sample_mg2`` (``kw``: its hooks, spec, setup)."""
    from wan_accel.app.jobs.mg2 import sample_mg2
    from wan_accel.sampling.mg2_continuation import mg2_continuation
    run, state_after = mg2_continuation(model, image_latent, visual_context, mouse, keyboard, num_frames, seed, preset,
                                        state, state_device, in_place)
    return sample_mg2(model, **run, **kw), state_after() if keep_state else None
