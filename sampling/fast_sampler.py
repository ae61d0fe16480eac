"""The optimized causal sampling loop (``sample_causal(..., path='optimized')``).

Same algorithm, schedule, noise order and outputs as the reference loop in ``wan.sampler`` (to rounding), run
through ``fast_runner.Run``: precomputed prompt and timestep inputs, one KV write plan per chunk (host ints),
CUDA graphs where possible, lean refresh passes and an optional skip of the final refresh. No host syncs in the
loop: sigmas are host floats, noise comes from device generators. The latent state (xt, x0) is float32 by default
whatever the model dtype (``FastOptions.latent_dtype``); only the model's input and output are in its dtypes.

On CUDA an out-of-memory error inside a chunk swaps more blocks to the host (memory/block_swap.py) and redoes the
chunk (generator state restored, so the result does not change); the resident block count that worked is
remembered for this machine. When even every block swapped does not fit, the run stops with a message that says
what would.
"""
from __future__ import annotations

import logging

import torch

from .runner import FastOptions, get_runner
from .sampler import _text_batch
from .scheduler import FlowMatchScheduler

log = logging.getLogger("wan_accel")


def _no_fit_message(model, exc, shape, frames_per_block) -> str:
    """The NoFitError text plus what the VRAM plan says would fit."""
    msg = str(exc)
    try:
        from ..memory.estimate import Workload
        from ..memory.plan import make_plan
        from ..memory.system import detect_system
        from ..memory.weights import weights_from_module
        b, f, _, h, w = shape
        ph, pw = model.config.patch_size[1:]
        plan = make_plan(weights_from_module(model), Workload(w * 8, h * 8, 4 * (f - 1) + 1, batch=b,
                                                                frames_per_block=frames_per_block),
                         detect_system(model.device))
        advice = plan.reasons.get("fits") or ""
        kv = "global" if plan.kv_window < 0 else f"{plan.kv_window} latent frames"
        msg += (f" What would fit on this GPU: {plan.blocks_to_swap} of {plan.blocks_total} blocks swapped with a "
                f"KV window of {kv}" + (f"; {advice}" if advice else "") + ".")
    except Exception as plan_exc:  # noqa: BLE001 - the advice is a bonus; the error itself must get through
        log.debug("wan_accel: no VRAM plan for the error message: %s", plan_exc)
    return msg


def _oom_enabled(options: FastOptions, device) -> bool:
    return options.oom_retry == "on" or (options.oom_retry == "auto" and torch.device(device).type == "cuda")


def _limit_key(model, shape) -> str:
    """The learned-limit key the VRAM plan reads for this model and video size (memory.limits.dit_limit_key)."""
    from ..memory.limits import dit_limit_key
    from ..memory.weights import weights_from_module
    b, f, _, h, w = shape
    return dit_limit_key(weights_from_module(model).signature, w * 8, h * 8, 4 * (f - 1) + 1, batch=b)


def _run_chunk_guarded(model, run, chunk_fn, generator, shape, frames_per_block, cache, key):
    """chunk_fn() with the OOM reaction: swap more blocks and redo the chunk (same noise)."""
    from ..memory.block_swap import active_swap, run_with_swap_fallback
    from ..memory.oom import NoFitError
    state = generator.get_state() if generator is not None else None

    def attempt():
        if state is not None:
            generator.set_state(state)
        return chunk_fn()

    swap = active_swap(model)
    settings = getattr(swap, "settings", None) if swap is not None else None
    try:
        return run_with_swap_fallback(model, attempt, key=key, settings=settings, cache=cache,
                                      device=model.device, on_oom=lambda _resident: run.on_oom())
    except NoFitError as exc:
        raise NoFitError(_no_fit_message(model, exc, shape, frames_per_block), key=exc.key, size=exc.size) from None


def sample_fast(model, context, noise, sched, plan, frame_tokens, grid_hw, noise_provider, *, generator=None,
                kv_window=-1, sink=0, skip_last_refresh=False, callback=None, refresh_t=0.0, tracer=None,
                on_chunk=None, clip_fea=None, y=None, kv_cache=None, model_kwargs=None, options=None, report=None,
                cache=None):
    """The optimized loop; arguments as ``wan.sampler.sample_causal`` (already validated there)."""
    options = FastOptions.coerce(options)
    shape = tuple(noise.shape) if isinstance(noise, torch.Tensor) else tuple(int(v) for v in noise)
    b, num_frames = shape[:2]
    device, dtype = model.device, options.latent_dtype_for(model)     # latent state (xt, x0)
    extra = dict(model_kwargs or {})
    actions = extra.pop("actions", None)
    if extra:
        raise ValueError(f"the optimized sampler does not take model arguments {sorted(extra)}; use path='reference'")
    if cache is None:
        from ..memory.limits import open_cache
        cache = open_cache()
    run = get_runner(model).start(options, batch=b, num_frames=num_frames, grid_hw=grid_hw, kv_window=kv_window,
                                  sink=sink, kv_cache=kv_cache, actions=actions, cache=cache)
    skip_last = skip_last_refresh or (options.skip_last_refresh and kv_cache is None and tracer is None)
    steps = list(sched.timesteps)
    guard = _limit_key(model, shape) if _oom_enabled(options, device) else None
    ok = False
    try:
        with torch.no_grad():
            text = model.embed_text(_text_batch(context, b)).tensor
            run.set_prompt(text, model.embed_image(clip_fea))
            run.embed_timesteps(steps + [float(refresh_t)], b)
            out = torch.empty(shape, dtype=torch.float32, device=device)
            for ci, (f0, n) in enumerate(plan):
                def chunk(ci=ci, f0=f0, n=n):
                    return _chunk(run, sched, steps, noise, noise_provider, shape, ci, f0, n, frame_tokens,
                                  len(plan), dtype, device, y, callback, tracer, refresh_t,
                                  refresh=not (skip_last and ci == len(plan) - 1))
                x0 = chunk() if guard is None else _run_chunk_guarded(model, run, chunk, generator, shape,
                                                                        plan[-1][1], cache, guard)
                out[:, f0:f0 + n] = x0.float()
                if on_chunk is not None:
                    on_chunk(ci, len(plan))
        ok = True
    finally:
        info = run.finish(ok)
    if report is not None:
        report.update(info, skipped_last_refresh=skip_last)
    return out


def _chunk(run, sched, steps, noise, noise_provider, shape, ci, f0, n, frame_tokens, num_chunks, dtype, device, y,
           callback, tracer, refresh_t, refresh: bool):
    start = f0 * frame_tokens
    step = run.kv.plan(start, n * frame_tokens)        # one write plan for every call of the chunk
    yc = None if y is None else y[:, f0:f0 + n].to(device)
    if isinstance(noise, torch.Tensor):
        xt = noise[:, f0:f0 + n].to(device, dtype)
    else:
        xt = noise_provider(ci, -1, (shape[0], n) + tuple(shape[2:]), dtype, device)
    x0 = None
    last = len(steps) - 1
    for k, t in enumerate(steps):
        flow = run.forward("denoise", xt, t, f0, step, y=yc)
        x0 = FlowMatchScheduler.to_x0(xt, flow, sched.x0_sigmas[k])
        if tracer is not None:
            tracer(dict(chunk=ci, kind="denoise", step=k, current_start=start, t=t, xt=xt, flow=flow.clone(), x0=x0))
        if callback is not None:
            callback(ci, k, num_chunks, len(steps), x0)
        if k < last:
            eps = noise_provider(ci, k, tuple(xt.shape), xt.dtype, xt.device)
            a, s = sched.renoise[k + 1]
            xt = FlowMatchScheduler.renoise(x0, eps, a, s, dtype=xt.dtype)
    if refresh:
        flow = run.forward("refresh", x0, float(refresh_t), f0, step, y=yc, want_output=tracer is not None)
        if tracer is not None:
            ctx = FlowMatchScheduler.to_x0(x0, flow, sched.x0_sigma_at(refresh_t))
            tracer(dict(chunk=ci, kind="context", step=None, current_start=start, t=refresh_t, xt=x0,
                        flow=flow.clone(), x0=ctx))
    return x0
