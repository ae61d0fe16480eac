"""Compile a model with CompileSettings: per-block (regional) or whole, scoped options, stance, warm start.

``compile_model(model, settings, cache)`` compiles in place without changing the state dict: each target
module gets an instance-level ``forward`` that calls ``torch.compile(<the class's forward bound to it>)``
inside a small scope (kernel tile caps, recompile limit where torch has no per-call argument, the stance after
warm-up). Identical blocks share one code object, so Dynamo compiles one graph for all of them.

``compile_regions(model, settings, cache)`` + ``swapped_in(root, regions)`` do the same for a shared model that
must not change outside one call (ComfyUI's own Wan models: ``nodes/comfy/comfy_compile.py`` swaps the compiled blocks
in only while ComfyUI's ``apply_model`` runs). This module is plain torch: no ComfyUI vocabulary.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import time

import torch

from ..cache.autotune import optional_types
from ..cache.open import open_cache
from ..model.attachments import COMPILE_ATTR, compile_handle_of, end_compile_warmup, model_signature
from . import compat
from .presets import preset_options, resolve_inductor_options
from .settings import CompileSettings, coerce_settings
from .warm_start import WarmStart, ensure_inductor_cache_dir

log = logging.getLogger("wan_accel.compile")

WHOLE_METHODS = ("forward", "forward_full", "forward_chunk")


class CompileHandle:
    """What was compiled and how; steers warm-up, stance and artifact saving for all its regions."""

    def __init__(self, settings: CompileSettings, inductor_options: dict, kernel_caps: dict,
                 warm_start: WarmStart | None):
        self.settings = settings
        self.inductor_options = inductor_options
        self.kernel_caps = kernel_caps
        self.warm_start = warm_start
        self.warm = False
        self.targets: list[tuple[object, str]] = []  # (module, attribute) given an instance forward
        self.calls = 0
        self.compiles = 0
        self.loaded_artifacts: dict = {}
        self._scoped_limit: dict = {}
        self._global_limit_set: tuple | None = None
        self.failed: str | None = None      # why compiling failed: every region runs eagerly from then on

    # ------------------------------------------------------------------ torch.compile kwargs
    def compile_fn(self, fn):
        """``torch.compile(fn)`` with this handle's settings and options."""
        s = self.settings
        kw: dict = {"backend": s.backend, "fullgraph": s.fullgraph, "dynamic": s.dynamic_arg}
        if s.backend == "inductor" and self.inductor_options:
            kw["options"] = dict(self.inductor_options)  # torch.compile pops keys from it: give a copy
        if compat.per_call_recompile_limit():
            kw["recompile_limit"] = s.recompile_limit
        return torch.compile(fn, **kw)

    def _setup_recompile_limit(self) -> None:
        if compat.per_call_recompile_limit():
            return  # per compiled region, nothing global
        name = compat.dynamo_limit_name()
        if name is None:
            return
        if self.settings.lock_global_ops:
            self._scoped_limit = {name: self.settings.recompile_limit}  # patched around each call only
        else:
            import torch._dynamo.config as dc

            self._global_limit_set = (name, getattr(dc, name))
            setattr(dc, name, self.settings.recompile_limit)

    # ------------------------------------------------------------------ calls
    def call(self, fn, args, kwargs, eager=None):
        """Run a compiled region inside this model's scope. A compile that fails (Dynamo or Inductor cannot
        handle something in the region) is not the user's error: the region and every other one of this handle
        run ``eager`` from then on, with one line saying why (``failed`` in the report)."""
        from ..kernels._common import is_compiling

        if is_compiling():
            return fn(*args, **kwargs)
        if self.failed is not None and eager is not None:
            return eager(*args, **kwargs)
        try:
            if self.warm:
                return self._call(fn, args, kwargs)
            from ..cache.warmup import spent
            with spent("compile"):
                return self._call(fn, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - the first compiled call: any failure falls back (one line)
            first = self.calls == 0
            oom = type(exc).__name__ == "OutOfMemoryError"        # memory is the run's to plan, not the compiler's
            if eager is None or not (isinstance(exc, compile_errors()) or (first and not oom)):
                raise
            self.failed = compile_failure_text(exc)
            log.warning("wan_accel: compiling the %s failed, running them eagerly (%s)",
                        "blocks" if self.settings.scope == "blocks" else "model", self.failed)
            return eager(*args, **kwargs)

    def _call(self, fn, args, kwargs):
        from ..kernels._common import use_kernel_caps

        track = not self.warm
        before = compat.graph_count() if track else None
        with contextlib.ExitStack() as stack:
            stack.enter_context(use_kernel_caps(self.kernel_caps))
            if self._scoped_limit:              # Dynamo's config patched for this call only (restored on exit)
                import torch._dynamo.config as dc

                stack.enter_context(dc.patch(**self._scoped_limit))
            if self.warm:
                stack.enter_context(compat.stance(self.settings.stance_after_warmup))
            out = fn(*args, **kwargs)
        self.calls += 1
        if track:
            after = compat.graph_count()
            if before is None or after is None:
                new = 1 if self.calls == 1 else 0
            else:
                new = after - before
            if new > 0:
                self.compiles += new
                if self.warm_start is not None:
                    self.warm_start.save()
        return out

    # ------------------------------------------------------------------ lifecycle
    def end_warmup(self) -> None:
        """Warm-up is over: from now on calls run under ``stance_after_warmup`` (e.g. eager on recompile)."""
        if not self.warm:
            self.warm = True
            log.info("wan_accel: compile warm-up ended after %d call(s), %d graph(s); stance now %s",
                     self.calls, self.compiles, self.settings.stance_after_warmup)

    def restore_globals(self) -> None:
        if self._global_limit_set is not None:
            import torch._dynamo.config as dc

            name, value = self._global_limit_set
            setattr(dc, name, value)
            self._global_limit_set = None


def compile_errors() -> tuple:
    """The exception types of a failed compile (Dynamo cannot trace, a backend or Inductor fails), not of the
    region's own computation."""
    return optional_types("torch._dynamo.exc.TorchDynamoException", "torch._inductor.exc.InductorError")


def compile_failure_text(exc: BaseException) -> str:
    """One line about a failed compile: the exception's type, its first line, Dynamo's explanation and where in
    the model's code it happened."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    parts = [f"{type(exc).__name__}: {lines[0] if lines else ''}"]
    explanation = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Explanation:")), "")
    if explanation:
        parts.append(explanation[:220])
    where = [ln for ln in lines if ln.startswith("File \"") and ", line " in ln]
    if where:
        file, _, rest = where[-1][len("File \""):].partition("\"")
        parts.append(f"at {file.replace(chr(92), '/').rsplit('/', 1)[-1]}{rest.split(',')[1] if ',' in rest else ''}")
    return " - ".join(parts)[:400]


class _ScopedForward:
    """Instance-level ``forward`` of a compiled module: the compiled bound forward inside the handle's scope
    (``eager``, the plain bound forward, runs where compiling failed)."""

    def __init__(self, compiled, handle: CompileHandle, contiguous_input: bool = False, eager=None):
        self.compiled = compiled
        self.handle = handle
        self.contiguous_input = contiguous_input
        self.eager = eager

    def __call__(self, *args, **kwargs):
        if self.contiguous_input and args and hasattr(args[0], "is_contiguous") and not args[0].is_contiguous():
            # A block's residual input with other strides (the first block gets a view from the patch embedding)
            # would fail the stride guard of the graph the other identical blocks share, and recompile.
            args = (args[0].contiguous(),) + tuple(args[1:])
        return self.handle.call(self.compiled, args, kwargs, self.eager)


def _scoped_forward(handle: CompileHandle, module, name: str = "forward", contiguous_input: bool = False):
    """The compiled ``name`` method of ``module`` in the handle's scope (the plain method where compiling fails)."""
    bound = getattr(type(module), name).__get__(module)
    return _ScopedForward(handle.compile_fn(bound), handle, contiguous_input, eager=bound)


def _prepare(model, settings, cache) -> CompileHandle:
    s = coerce_settings(settings)
    options, caps = preset_options(s)
    options = resolve_inductor_options(options) if s.backend == "inductor" else {}
    warm = None
    if s.warm_start:
        cache = open_cache(cache, "compiling without warm start")
        if cache is not None:
            ensure_inductor_cache_dir(cache)
            warm = WarmStart(cache, f"{model_signature(model)}|{s.codegen_hash()}")
    handle = CompileHandle(s, options, caps, warm)
    if warm is not None:
        handle.loaded_artifacts = warm.load()
    handle._setup_recompile_limit()
    return handle


def _blocks_of(model):
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, torch.nn.ModuleList) or len(blocks) == 0:
        raise ValueError(f"compile scope 'blocks' needs model.blocks to be a non-empty nn.ModuleList; "
                         f"{type(model).__name__} has none: use scope 'whole'")
    return blocks


def compile_model(model, settings: CompileSettings | dict | None = None, cache=None):
    """Compile ``model`` in place (state dict unchanged) and return it.

    scope 'blocks': every block of ``model.blocks`` (nn.ModuleList) is compiled, sharing one artifact;
    scope 'whole': the model's ``forward`` (and ``forward_full`` / ``forward_chunk`` where defined).
    ``cache`` is the LimitCache for warm start (None -> the default one). Compiling happens lazily at the
    first call; call ``end_warmup(model)`` once the first full run is done to switch the stance.
    Re-compiling an already compiled model first restores it.
    """
    if getattr(model, COMPILE_ATTR, None) is not None:
        uncompile_model(model)
    t0 = time.perf_counter()
    handle = _prepare(model, settings, cache)
    if handle.settings.scope == "blocks":
        for block in _blocks_of(model):
            block.forward = _scoped_forward(handle, block)
            handle.targets.append((block, "forward"))
    else:
        for name in WHOLE_METHODS:
            if callable(getattr(type(model), name, None)):
                setattr(model, name, _scoped_forward(handle, model, name))
                handle.targets.append((model, name))
    model.__dict__[COMPILE_ATTR] = handle
    log.info("wan_accel: prepared %d compiled region(s) (%s, %s) in %.2f s", len(handle.targets),
             handle.settings.scope, handle.settings.backend, time.perf_counter() - t0)
    return model


compile_handle = compile_handle_of     # the handle this module hangs on a model (read at the model floor)
end_warmup = end_compile_warmup        # mark warm-up of a compiled model as done; True when the pack compiled it


def uncompile_model(model) -> bool:
    """Undo compile_model: remove the instance forwards and restore any global limit it set."""
    handle = model.__dict__.pop(COMPILE_ATTR, None)
    if handle is None:
        return False
    for module, name in handle.targets:
        module.__dict__.pop(name, None)
    handle.restore_globals()
    return True


# ----------------------------------------------------------------------------- regions swapped in per call
def call_with_module_hooks(module, fn, args, kwargs):
    """``fn(*args, **kwargs)`` run the way ``module(*args, **kwargs)`` runs its forward: the module's forward
    pre-hooks and forward hooks fire around it (the block swap's prefetch / drop hooks, for example).

    Needed wherever a compiled forward of ``module`` is called without going through ``module.__call__``."""
    pre, pre_kw = module._forward_pre_hooks, getattr(module, "_forward_pre_hooks_with_kwargs", {})
    for hook_id, hook in list(pre.items()):
        if hook_id in pre_kw:
            res = hook(module, args, kwargs)
            if res is not None:
                args, kwargs = res
        else:
            res = hook(module, args)
            if res is not None:
                args = res if isinstance(res, tuple) else (res,)
    post, post_kw = module._forward_hooks, getattr(module, "_forward_hooks_with_kwargs", {})
    always = getattr(module, "_forward_hooks_always_called", {})
    try:
        out = fn(*args, **kwargs)
    except BaseException:
        for hook_id, hook in list(post.items()):
            if hook_id in always:
                try:
                    hook(module, args, kwargs, None) if hook_id in post_kw else hook(module, args, None)
                except Exception:  # noqa: BLE001 - the original error matters more
                    log.debug("wan_accel: an always-called forward hook failed after an error", exc_info=True)
        raise
    for hook_id, hook in list(post.items()):
        res = hook(module, args, kwargs, out) if hook_id in post_kw else hook(module, args, out)
        if res is not None:
            out = res
    return out


class CompiledRegion(torch.nn.Module):
    """Stands in for a block while a caller's forward runs: holds the original block as ``_orig_mod`` and runs its
    compiled forward in the handle's scope.

    The original's forward hooks fire around the compiled call (they sit on the original, which is no longer
    called): a block swap installed before or after compiling keeps streaming the weights."""

    def __init__(self, original, handle: CompileHandle, contiguous_input: bool = False):
        super().__init__()
        self._orig_mod = original
        self.__dict__["_scoped"] = _scoped_forward(handle, original, contiguous_input=contiguous_input)

    def forward(self, *args, **kwargs):
        return call_with_module_hooks(self._orig_mod, self.__dict__["_scoped"], args, kwargs)


def compile_regions(model, settings: CompileSettings | dict | None = None, cache=None, *, prefix: str = ""):
    """(handle, regions) for a model that must stay unchanged outside the caller's forward (a shared model).

    ``regions`` maps an attribute path below the caller's root object (``prefix`` + ``blocks.<i>``, or ``prefix``
    itself for scope 'whole') to ``(original module, compiled stand-in)``; ``swapped_in(root, regions)`` puts the
    stand-ins in place for the duration of one call."""
    handle = _prepare(model, settings, cache)
    dot = f"{prefix}." if prefix else ""
    if handle.settings.scope == "blocks":
        blocks = _blocks_of(model)
        regions = {f"{dot}blocks.{i}": (blocks[i], CompiledRegion(blocks[i], handle, True))
                   for i in range(len(blocks))}
    else:
        regions = {prefix: (model, CompiledRegion(model, handle))}
    handle.targets = [(r, "forward") for _, r in regions.values()]
    return handle, regions


@contextlib.contextmanager
def swapped_in(root, regions: dict):
    """Put each compiled stand-in where its original sits below ``root`` (only where the original still sits
    there), and put the originals back on exit, whatever happens."""
    swapped = []
    try:
        for path, (original, region) in regions.items():
            parent_path, _, attr = path.rpartition(".")
            parent = functools.reduce(getattr, parent_path.split(".") if parent_path else (), root)
            if getattr(parent, attr) is original:
                setattr(parent, attr, region)
                swapped.append((parent, attr, original))
        yield
    finally:
        for parent, attr, original in reversed(swapped):
            setattr(parent, attr, original)
