"""``RunSpec``, ``Setup`` and ``Run``: ``app.prepare.prepare``'s second half, apart from its first (which consults the
doctor) so that the doctor's probes make their tiny runs here (the model kept as the probe made it), circle-free."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..compile.settings import CompileSettings
from ..memory.block_swap import SwapSettings
from ..memory.sampling_guard import OOM_RETRY_MODES
from ..model.finite import check_conditioning
from ..sampling.continuation import continued
from ..sampling.recache import RECACHE_MODES
from ..sampling.request import Replaceable, RunInputs, SamplingHooks
from ..sampling.runner import CUDA_GRAPH_MODES, FastOptions, check_linear_mode, check_ops_mode
from ..sampling.sampler import PATHS, build_request, sample_causal
from .validate import MAX_FRAMES_PER_BLOCK, check_int

KEEP = "keep"          # RunSpec.swap / compile: the model's own (what it carries now), still judged by the doctor


@dataclasses.dataclass(frozen=True)
class RunSpec(Replaceable):
    """What a run asks for. path 'auto' | 'optimized' | 'reference'; cuda_graphs 'auto' | 'off'; fused_kernels,
    fused_qkv, ops, keep_slower, linear: the optimized path's ``FastOptions``; compile: CompileSettings (or their
    dict) of the blocks, None (eager) or KEEP (the model's own: a handle without compile settings keeps the model
    as it is); swap: SwapSettings, None (no swap) or KEEP; plan: a VRAM plan whose swap applies when ``swap`` is
    None; doctor: apply the doctor's verdicts (off only where a run checks the accelerated paths themselves);
    oom_retry 'auto' | 'on' | 'off' (``memory.sampling_guard``); the first ones and the last ones: the chunk loop's
    settings (``sampling.sampler.build_request``: refresh_t the timestep of the cache-refresh pass,
    independent_first_frame a first chunk of one frame, partial_last_block a shorter last chunk, recache 'switch' |
    'none' at a prompt switch), the noise seeded by ``seed``."""
    frames_per_block: int = 3
    kv_window: int = -1
    sink: int = 0
    skip_last_refresh: bool = False
    seed: int = 0
    batch: int = 1
    schedule: Any = "self_forcing"
    path: str = "auto"
    cuda_graphs: str = "auto"
    fused_kernels: bool = True
    fused_qkv: bool = True
    ops: str = "auto"
    keep_slower: bool = False
    linear: str = "exact"
    compile: Any = KEEP
    swap: Any = KEEP
    plan: Any = None
    doctor: bool = True
    oom_retry: str = "auto"
    refresh_t: float = 0.0
    independent_first_frame: bool = False
    partial_last_block: bool = False
    recache: str = "switch"

    def __post_init__(self):
        check_spec(self)

    @classmethod
    def for_handle(cls, handle, **fields) -> "RunSpec":
        """The spec of a run on a model handle: its block swap (or its VRAM plan's) and its compile settings."""
        from ..memory.block_swap import handle_swap_settings
        fields.setdefault("swap", handle_swap_settings(handle))
        fields.setdefault("plan", getattr(handle, "plan", None))
        fields.setdefault("compile", getattr(handle, "compile_settings", None) or KEEP)
        return cls(**fields)

    def fast_options(self) -> FastOptions:
        return FastOptions(cuda_graphs=self.cuda_graphs, fused_kernels=bool(self.fused_kernels),
                           fused_qkv=bool(self.fused_qkv), ops=self.ops, keep_slower=bool(self.keep_slower),
                           linear=self.linear)

    def plain(self) -> dict:
        """The loop's settings as plain data (what another process rebuilds the spec from, with its own handle)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("compile", "swap", "plan")}


SPEC_FLAGS = ("fused_kernels", "fused_qkv", "keep_slower", "skip_last_refresh", "doctor", "independent_first_frame",
              "partial_last_block")
# field: (least, most) value
SPEC_INTS = {"frames_per_block": (1, MAX_FRAMES_PER_BLOCK), "batch": (1, None), "sink": (0, None),
             "kv_window": (-1, None), "seed": (None, None)}


def _spec_error(name: str, value, wanted: str) -> ValueError:
    return ValueError(f"RunSpec {name} must be {wanted}, got {value!r} ({type(value).__name__})")


def check_spec(spec: RunSpec) -> None:
    """Every field of a ``RunSpec`` checked once, where the spec is made (ValueError naming the field, what it takes
    and the value given): the switches are True or False (the text 'false' would turn a feature on), the counts
    are whole numbers, the modes are among theirs, and ``swap`` / ``plan`` / ``compile`` are what ``prepare_model``
    reads (a value of another kind would run as if absent)."""
    for name in SPEC_FLAGS:
        if not isinstance(getattr(spec, name), bool):
            raise _spec_error(name, getattr(spec, name), "True or False")
    for name, (least, most) in SPEC_INTS.items():
        v = getattr(spec, name)
        if isinstance(v, bool) or not isinstance(v, int):
            raise _spec_error(name, v, "a whole number")
        check_int(f"RunSpec {name}", v, least, most)        # the range, worded as every command's and node's check
    if spec.path not in PATHS:
        raise ValueError(f"RunSpec path: sampler must be one of {PATHS}, got {spec.path!r}")
    if isinstance(spec.refresh_t, bool) or not isinstance(spec.refresh_t, (int, float)) or \
            not 0.0 <= spec.refresh_t <= 1000.0:
        raise _spec_error("refresh_t", spec.refresh_t, "a timestep from 0 to 1000")
    for name, modes in (("cuda_graphs", CUDA_GRAPH_MODES), ("oom_retry", OOM_RETRY_MODES),
                        ("recache", RECACHE_MODES)):
        if getattr(spec, name) not in modes:
            raise _spec_error(name, getattr(spec, name), f"one of {', '.join(map(repr, modes))}")
    check_ops_mode(spec.ops)
    check_linear_mode(spec.linear)
    kinds = {"swap": (SwapSettings,), "compile": (CompileSettings, dict)}
    for name, types in kinds.items():
        v = getattr(spec, name)
        if not (v is None or (isinstance(v, str) and v == KEEP) or isinstance(v, types)):
            raise _spec_error(name, v, f"None, {KEEP!r} or {' or a '.join(t.__name__ for t in types)}")
    plan = spec.plan
    if not (plan is None or hasattr(plan, "swap_settings") or isinstance(plan, dict)):
        raise _spec_error("plan", plan, "None, a MemoryPlan or its dict")
    if isinstance(plan, dict):
        n = plan.get("blocks_to_swap", 0)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise _spec_error("plan's blocks_to_swap", n, "a whole number >= 0")


@dataclasses.dataclass
class Setup:
    """What ``prepare_model`` did: the path to run (the spec's, after the run rules), the options of the optimized
    path (None on the reference path), the lines said about the doctor's verdicts and its record (``gate.new_record``:
    ``switched_off`` / ``failed_fallbacks`` {feature: why})."""
    path: str
    options: FastOptions | None
    notes: list
    record: dict

    @property
    def switched_off(self) -> dict:
        return dict(self.record.get("switched_off", {}))


class Run:
    """A run prepared once (made by ``app.prepare.prepare``, or here where ``setup`` says how the model was prepared:
    the doctor's probes; ``prepare``'s arguments): ``latents()`` samples it, chunk after chunk, and returns the new
    latent frames [B, F, C, H, W]; a continuable run then holds ``state`` (``continuation.SamplerState``: the KV
    caches, the generator, the position) and ``extend(num_frames, ...)`` samples the frames after it up to
    ``num_frames`` latent frames in all, with new inputs where given (a prompt, actions), without preparing again.
    ``request`` / ``inputs`` / ``hooks``: what the loop runs next."""

    def __init__(self, model, spec, setup: Setup, inputs: RunInputs, hooks: SamplingHooks | None = None, *,
                 keep_state: bool = False, continuable: bool = False, state_device=None):
        if not isinstance(inputs, RunInputs):
            raise TypeError(f"prepare takes the run's RunInputs, got {type(inputs).__name__}")
        self.model, self.spec, self.setup = model, spec, setup
        self.hooks = hooks if hooks is not None else SamplingHooks()
        self.continuable = bool(continuable or keep_state or inputs.state is not None)
        self.keep_state, self.state_device = bool(keep_state), state_device
        self.state = inputs.state
        self._build(inputs)

    def _build(self, inputs: RunInputs) -> None:
        from ..memory.sampling_guard import oom_guard
        shape = check_noise(inputs.noise)
        spec, self._state_after = self.spec, None
        if self.continuable:
            inputs, self._state_after = continued(self.model, spec, inputs, self.keep_state, self.state_device)
            spec = spec.replace(skip_last_refresh=False)       # the run's last chunk stays in its kept cache
        self._inputs = inputs
        self.request, self.inputs = build_request(self.model, spec, inputs, self.setup.path, self.setup.options,
                                                  self.hooks.tracer)
        if self.hooks.chunk_guard is None:
            self.hooks = self.hooks.replace(chunk_guard=oom_guard(self.model, shape, spec.frames_per_block,
                                                                  mode=spec.oom_retry))

    def latents(self) -> torch.Tensor:
        if self.hooks.report is not None:                # the verdicts applied: {feature: why}
            self.hooks.report["switched_off"] = self.setup.switched_off
        out = sample_causal(self.model, self.request, self.inputs, self.hooks)
        if self.continuable:
            self.state = None               # (none either when keeping it fails)
            if self.keep_state:
                self.state = self._state_after(out)
        return out

    def again(self, inputs: RunInputs) -> torch.Tensor:
        """``latents()`` of this prepared run over other inputs (a continuation built by hand: a Matrix-Game-2 play
        chunk), its request built again and nothing prepared again."""
        self._build(inputs)
        return self.latents()

    def extend(self, num_frames: int, **changes) -> torch.Tensor:
        """The frames after this run's up to ``num_frames`` latent frames in all: ``latents()`` of the same run
        continued from its state, with the ``RunInputs`` fields in ``changes`` (context, prompt_schedule, ...)."""
        if not (self.continuable and self.keep_state and self.state is not None):
            raise ValueError("only a continuable run that keeps its state goes on: prepare it with keep_state=True "
                             "and sample it first")
        b, _, c, h, w = self.request.shape
        self._build(self._inputs.replace(noise=(b, int(num_frames), c, h, w), state=self.state, kv_cache=None,
                                         generator=None, start_frame=0, previous_context=None, history=None,
                                         **changes))
        return self.latents()


def check_noise(noise) -> tuple:
    """The shape [B, F, C, H, W] of the initial noise (a tensor, or its shape), every size at least 1 (zero latent
    frames would sample an empty video); a noise tensor of NaN or inf is refused here, before anything is sampled
    (``model.finite``: one host sync), naming the noise rather than the weights. ValueError otherwise."""
    tensor = isinstance(noise, torch.Tensor)
    try:
        shape = tuple(noise.shape) if tensor else tuple(int(v) for v in noise)
    except (TypeError, ValueError):
        raise ValueError(f"noise must be a tensor [B, F, C, H, W] or its shape, got {noise!r}") from None
    if len(shape) != 5 or min(shape) < 1:
        raise ValueError(f"noise must be [batch, latent frames, channels, height, width] with every size at least 1, "
                         f"got {list(shape)}: a run of no latent frames is no video; give at least one latent frame")
    if tensor:
        check_conditioning(noise, "the initial noise", "give finite noise, or its shape to draw it from the seed")
    return shape
