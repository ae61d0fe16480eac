"""Compile settings: one dataclass, validated once, hashable for cache keys. No torch import here."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

BACKENDS = ("inductor", "cudagraphs", "eager")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
TILING_PRESETS = ("default", "EXTREME-PLUS")
DYNAMIC = ("auto", "true", "false")
SCOPES = ("blocks", "whole")
STANCES = ("eager_on_recompile", "default", "fail_on_recompile")

# Fields that change generated code (and so the warm-start artifact key); the others only steer runtime.
CODEGEN_FIELDS = ("backend", "mode", "lock_global_ops", "tiling_preset", "fullgraph", "dynamic", "scope")


@dataclass(frozen=True)
class CompileSettings:
    """How the pack compiles a model.

    backend:             "inductor" (generated kernels), "cudagraphs" (graph replay, no codegen) or "eager"
                         (Dynamo capture only: for finding graph breaks).
    mode:                torch.compile mode; translated into Inductor options when options are also needed.
    lock_global_ops:     never change process-global Dynamo/Inductor config: every option is scoped to this
                         model, with conservative caps (max_fusion_size 64, kernel tiles <= 64, <= 8 warps).
    tiling_preset:       "default" or "EXTREME-PLUS" (max-autotune GEMM + pointwise, coordinate descent,
                         3-D tiles, larger fusions, larger kernel tiles; caps stay conservative when locked).
    fullgraph:           fail on graph breaks instead of splitting the graph.
    dynamic:             "auto" (Dynamo decides after a shape change), "true" or "false".
    scope:               "blocks" (compile each block of model.blocks; identical blocks share one artifact)
                         or "whole" (compile the model's forward).
    recompile_limit:     recompiles allowed per compiled region before it falls back to eager.
    warm_start:          keep Inductor's caches beside the limit cache and save/load compile artifacts.
    stance_after_warmup: Dynamo stance once warm-up ended: "eager_on_recompile" runs eager instead of
                         recompiling, "fail_on_recompile" raises, "default" recompiles.
    """

    backend: str = "inductor"
    mode: str = "default"
    lock_global_ops: bool = True
    tiling_preset: str = "default"
    fullgraph: bool = False
    dynamic: str = "auto"
    scope: str = "blocks"
    recompile_limit: int = 8
    warm_start: bool = True
    stance_after_warmup: str = "eager_on_recompile"

    def __post_init__(self):
        # accept bools for dynamic (torch.compile style) and normalise to the string form
        if isinstance(self.dynamic, bool) or self.dynamic is None:
            object.__setattr__(self, "dynamic", {True: "true", False: "false", None: "auto"}[self.dynamic])
        for name, allowed in (("backend", BACKENDS), ("mode", MODES), ("tiling_preset", TILING_PRESETS),
                              ("dynamic", DYNAMIC), ("scope", SCOPES), ("stance_after_warmup", STANCES)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"compile setting {name}={value!r} is not one of {', '.join(map(repr, allowed))}")
        for name in ("lock_global_ops", "fullgraph", "warm_start"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"compile setting {name} must be true or false, got {getattr(self, name)!r}")
        if isinstance(self.recompile_limit, bool) or not isinstance(self.recompile_limit, int) \
                or not 1 <= self.recompile_limit <= 1024:
            raise ValueError(f"compile setting recompile_limit must be an integer in 1..1024, "
                             f"got {self.recompile_limit!r}")

    # ------------------------------------------------------------------ conversions
    @classmethod
    def from_dict(cls, data: dict | None) -> "CompileSettings":
        """Build from a dict (e.g. a node's widget values); unknown keys raise a clear error."""
        data = dict(data or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown compile setting(s) {unknown}; known: {sorted(known)}")
        return cls(**data)

    def replace(self, **changes) -> "CompileSettings":
        return dataclasses.replace(self, **changes)

    @property
    def dynamic_arg(self) -> bool | None:
        """The value for torch.compile(dynamic=...)."""
        return {"auto": None, "true": True, "false": False}[self.dynamic]

    def codegen_hash(self) -> str:
        """Short hash of the fields that change generated code (warm-start artifact key)."""
        blob = json.dumps({k: getattr(self, k) for k in CODEGEN_FIELDS}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def coerce_settings(settings) -> CompileSettings:
    """CompileSettings from None (defaults), a CompileSettings or a dict."""
    if settings is None:
        return CompileSettings()
    if isinstance(settings, CompileSettings):
        return settings
    if isinstance(settings, dict):
        return CompileSettings.from_dict(settings)
    raise TypeError(f"compile settings must be a CompileSettings or dict, got {type(settings).__name__}")
