"""What ``python -m wan_accel profile`` runs: the built-in tiny causal model or a checkpoint, sampled once.

Also the explain targets (factories for ``explain_worker.py``): they build the same model, capture the real
arguments of its first block call (or of its first chunk call) and hand back ``(fn, args, kwargs)``.
"""
from __future__ import annotations

import dataclasses

COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs",
                 "eager", "aot_eager")
TINY_LATENT = (6, 8, 8)          # frames, height, width (latent units) for the tiny model
CHECKPOINT_LATENT = (21, 60, 104)  # 81 frames at 480x832
SHAPES = ("tiny", "1.3b")        # random-weight models: the built-in tiny one, Wan 2.1 1.3B's architecture
SAMPLER_PATHS = ("auto", "optimized", "reference")


@dataclasses.dataclass
class ProfileTarget:
    checkpoint: str | None = None
    device: str | None = None
    dtype: str | None = None          # float32 | bfloat16 | float16 (default: float32 on CPU, bfloat16 on GPU)
    frames: int | None = None
    height: int | None = None
    width: int | None = None
    steps: str | None = None          # step list like "1000,750,500,250" (default: the preset's)
    preset: str | None = None         # sampler schedule preset (default: self_forcing)
    seed: int = 0
    shape: str = "tiny"               # without a checkpoint: tiny | 1.3b (random weights of that architecture)
    sampler: str = "auto"             # sampler path: auto | optimized | reference

    def resolved(self) -> "ProfileTarget":
        import torch

        t = dataclasses.replace(self)
        t.device = t.device or ("cuda" if torch.cuda.is_available() else "cpu")
        t.dtype = t.dtype or ("float32" if t.device.startswith("cpu") else "bfloat16")
        f, h, w = CHECKPOINT_LATENT if t.checkpoint or t.shape != "tiny" else TINY_LATENT
        t.frames, t.height, t.width = t.frames or f, t.height or h, t.width or w
        return t

    def settings(self) -> dict:
        return dataclasses.asdict(self)


def torch_dtype(name: str):
    import torch

    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    except KeyError:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {name!r}") from None


def load_model(target: ProfileTarget):
    """The tiny built-in model, random weights of Wan 2.1 1.3B's architecture (``shape='1.3b'``), or the checkpoint
    (safetensors) when given."""
    dtype = torch_dtype(target.dtype)
    if target.checkpoint:
        from ...model.loader import load_wan_checkpoint

        return load_wan_checkpoint(target.checkpoint, device=target.device, dtype=dtype)
    from ...model.tiny import tiny_causal_model

    config = None
    if target.shape == "1.3b":
        from ...model.config import WAN_1_3B
        config = WAN_1_3B
    return tiny_causal_model(seed=target.seed, device=target.device, dtype=dtype, config=config)


def make_inputs(model, target: ProfileTarget) -> dict:
    """Random text embedding and noise shaped for ``model`` (t2v)."""
    import torch

    cfg = model.config
    if getattr(cfg, "model_type", "t2v") != "t2v":
        raise ValueError("profiling runs text-to-video models only; this checkpoint is "
                         f"{cfg.model_type!r}")
    g = torch.Generator(device="cpu").manual_seed(target.seed)
    dtype = torch_dtype(target.dtype)
    context = torch.randn(1, cfg.text_len, cfg.text_dim, generator=g).to(target.device, dtype)
    noise = torch.randn(1, target.frames, cfg.out_dim, target.height, target.width, generator=g).to(target.device)
    return {"context": context, "noise": noise}


def sampler_call(model, target: ProfileTarget, inputs: dict):
    """A zero-argument callable running the causal sampler once on ``inputs``, prepared by the one prepare step
    (the doctor's verdicts, compile and fast options applied once, here; each call is one run)."""
    import torch

    from ..prepare import RunInputs, RunSpec, prepare, prepare_model

    schedule = target.preset or "self_forcing"
    if target.steps:
        schedule = {"preset": schedule, "steps": str(target.steps)}
    spec = RunSpec(path=target.sampler, schedule=schedule)
    setup = prepare_model(model, spec)

    def run():
        with torch.inference_mode():
            return prepare(model, spec, RunInputs(**inputs), setup=setup).latents()

    return run


def work_per_run(model, target: ProfileTarget) -> tuple[int, dict]:
    """(model forward calls, {'gemm': FLOPs, 'attention': FLOPs}) of one sampler run of ``target`` on ``model``:
    the attention products apart from every other matmul (``model/flops.py``); (None, None) for a model that is
    not a Wan DiT (no count to give)."""
    from ...model import flops as fl
    from ...sampling.sampler import resolve_path
    from ...sampling.scheduler import resolve_schedule

    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "patch_size"):
        return None, None
    steps = len(resolve_schedule(target.preset or "self_forcing", target.steps).timesteps)
    path = resolve_path(target.sampler, target.device)
    _pt, ph, pw = cfg.patch_size
    geo = fl.Geometry(1, target.frames, (target.height // ph) * (target.width // pw))
    optimized = path == "optimized"
    whole = fl.run_flops(cfg, geo, steps, optimized=optimized, skip_last_refresh=optimized)
    linear = fl.run_flops(cfg, geo, steps, optimized=optimized, skip_last_refresh=optimized, attention=False)
    return whole["forwards"], {"gemm": linear["flops"], "attention": whole["flops"] - linear["flops"]}


def apply_compile(model, mode: str):
    """Regional compile: each transformer block compiled in place (``none`` leaves the model eager)."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"--compile must be one of {', '.join(COMPILE_MODES)}; got {mode!r}")
    if mode == "none":
        return model
    if mode == "aot_eager":  # a debugging backend outside the pack's compile settings
        for block in model.blocks:
            block.compile(backend="aot_eager")
        return model
    from ...compile import CompileSettings
    from ...compile.apply import compile_model

    backend = "eager" if mode == "eager" else "inductor"
    settings = CompileSettings(backend=backend, mode="default" if backend == "eager" else mode, scope="blocks")
    return compile_model(model, settings)


# ------------------------------------------------------------------ explain targets
class _Captured(Exception):
    pass


def _capture_first_call(model, target: ProfileTarget, scope: str):
    """Run the sampler until the first block (or chunk) call; return that callable and its arguments."""
    inputs = make_inputs(model, target)
    run = sampler_call(model, target, inputs)
    seen = {}
    if scope == "block":
        block = model.blocks[0]

        def hook(_module, args, kwargs):
            seen.update(fn=block, args=args, kwargs=kwargs)
            raise _Captured

        restore = block.register_forward_pre_hook(hook, with_kwargs=True).remove
    elif scope == "model":
        original = model.forward_chunk

        def capture(*args, **kwargs):
            seen.update(fn=original, args=args, kwargs=kwargs)
            raise _Captured

        model.forward_chunk = capture
        restore = lambda: delattr(model, "forward_chunk")  # noqa: E731 - back to the class method
    else:
        raise ValueError(f"scope must be 'block' or 'model', got {scope!r}")
    try:
        run()
    except _Captured:
        pass
    finally:
        restore()
    if not seen:
        raise RuntimeError(f"the sampler never called the model's {scope}; nothing to explain")
    return seen["fn"], tuple(seen["args"]), dict(seen["kwargs"])


def explain_model(scope: str = "block", **target_kwargs):
    """Explain factory (``package_target("app.jobs.profile_targets:explain_model")``): the first transformer block
    call (scope 'block', what regional compile compiles) or the first chunk call (scope 'model')."""
    target = ProfileTarget(**target_kwargs).resolved()
    model = load_model(target)
    fn, args, kwargs = _capture_first_call(model, target, scope)
    return {"fn": fn, "args": args, "kwargs": kwargs, "inference_mode": True}
