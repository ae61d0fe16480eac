"""Shared plumbing of the pack's Triton kernels: when to use Triton, lazy ``triton.jit``, tile caps,
candidate configs, tuned launch with a torch fallback, and the custom-op wrappers used under torch.compile.

Triton (3.x) decides between compiling and interpreting (``TRITON_INTERPRET=1``) when a function is decorated:
its own library helpers (tl.sum, tl.zeros, ...) are decorated when ``triton.language`` is imported, so the
variable must be set before triton's first import in the process (tests run interpreter checks in a
subprocess). The pack's kernels are plain functions decorated at first launch (``jit``), once per mode.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import inspect
import logging
import os
import sys
import types
from typing import Callable

import torch

log = logging.getLogger("wan_accel.kernels")

# Tile caps: the most our kernels may use. Set per compiled model by the compile preset (compile/presets.py).
# ROW: whether the row kernels may hold a whole row in one tile (1) or only loop over it (0); a one-pass tile's
# RBLOCK is the row's width, bounded by ROW_WIDTH_LIMIT instead of the RBLOCK cap.
DEFAULT_CAPS = {"XBLOCK": 64, "RBLOCK": 64, "YBLOCK": 8, "num_warps": 8, "ROW": 1, "autotune_policy": "default"}
CAP_KEYS = ("XBLOCK", "RBLOCK", "YBLOCK", "num_warps", "ROW")

_CAPS: contextvars.ContextVar = contextvars.ContextVar("wan_accel_kernel_caps", default=None)


def current_caps() -> dict:
    """The tile caps in effect (set with ``use_kernel_caps``; conservative defaults otherwise)."""
    caps = _CAPS.get()
    return DEFAULT_CAPS if caps is None else caps


@contextlib.contextmanager
def use_kernel_caps(caps: dict | None):
    """Run a block of code with these tile caps (context-local: threads and other models are unaffected)."""
    if caps is None:
        yield
        return
    merged = dict(DEFAULT_CAPS)
    merged.update({k: v for k, v in caps.items() if k in DEFAULT_CAPS})
    token = _CAPS.set(merged)
    try:
        yield
    finally:
        _CAPS.reset(token)


# ----------------------------------------------------------------------------- triton availability
_TRITON = {"checked": False, "module": None}


def triton_module():
    """The triton module, or None when it is not importable (checked once)."""
    if not _TRITON["checked"]:
        _TRITON["checked"] = True
        from ..cache.guarded_import import try_import
        language, problem = try_import("triton.language")      # any failure (sys.exit too) means: use torch
        if language is not None:
            _TRITON["module"] = sys.modules["triton"]
        else:
            log.info("wan_accel: triton not usable (%s); fused kernels fall back to torch", problem)
    return _TRITON["module"]


def interpret_enabled() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1), read now."""
    triton = triton_module()
    knobs = getattr(triton, "knobs", None) if triton is not None else None
    if knobs is not None:
        try:
            return bool(knobs.runtime.interpret)
        except Exception:  # noqa: BLE001 - knob layout changed: read the variable ourselves
            pass
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


_INTERP_STATE = {"usable": None}


def interpreter_usable() -> bool:
    """TRITON_INTERPRET=1 is set and took effect.

    Triton decorates its own library functions (tl.sum, tl.zeros, ...) when ``triton.language`` is imported,
    so the interpreter only works when the variable was set before triton was first imported in the process.
    Otherwise CPU tensors use the torch path and one warning says what to do.
    """
    if not interpret_enabled():
        return False
    if _INTERP_STATE["usable"] is None:
        import triton.language as tl

        helper = getattr(tl, "zeros", None)
        usable = helper is None or type(helper).__name__ != "JITFunction"
        if not usable:
            log.warning("wan_accel: TRITON_INTERPRET=1 was set after triton was imported; Triton's interpreter "
                        "needs it before the first `import triton` (set it in the environment of the process). "
                        "CPU tensors use the torch implementation.")
        _INTERP_STATE["usable"] = usable
    return bool(_INTERP_STATE["usable"])


def use_triton(*tensors) -> bool:
    """Triton for CUDA tensors (triton importable) or, under TRITON_INTERPRET=1, for CPU tensors."""
    devices = {t.device.type for t in tensors}
    return len(devices) == 1 and triton_problem(devices.pop()) is None


def check_qkv(q, k, v, what: str) -> None:
    """q [B, Lq, H, D] and k, v [B, Lk, H, D] of one batch and head layout; else ValueError naming ``what``."""
    if q.ndim != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"{what} takes q [B, Lq, H, D] and k, v [B, Lk, H, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")


def per_frame(op: str, x, **tensors) -> tuple:
    """``tensors`` (a row kernel's per-frame gate / shift / scale; None where absent) as [B or 1, F, D] for x
    [B, L, D]: a [B, D] one is F=1, batch 1 broadcasts, F divides L, all of one shape; else ValueError naming
    ``op`` and what is wrong."""
    b, l, d = x.shape
    out, frames = [], None
    for name, t in tensors.items():
        t = t.unsqueeze(1) if t is not None and t.dim() == 2 else t
        out.append(t)
        if t is None:
            continue
        if t.dim() != 3 or t.shape[-1] != d or t.shape[0] not in (1, b):
            raise ValueError(f"{op}: {name} must be [B, F, D] = [{b}, F, {d}] (batch 1 broadcasts), "
                             f"got {tuple(t.shape)}")
        if frames is not None and tuple(t.shape) != frames:
            names = " and ".join(", ".join(tensors).rsplit(", ", 1))
            raise ValueError(f"{op}: {names} must have one shape, got {tuple(t.shape)} and {frames}")
        frames = tuple(t.shape)
        if t.shape[1] < 1 or l % t.shape[1]:
            raise ValueError(f"{op}: the frame count F={t.shape[1]} of {name} must divide L={l}")
    return tuple(out)


def unit_last(t):
    """``t`` when its last dimension is contiguous (the pack's views are), else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def divide(x, divisor: float):
    """``x / divisor`` correctly rounded on every device, as a kernel's ``div_rn`` computes it: CUDA torch divides by
    a Python number by multiplying with its rounded reciprocal (one bit off for some values), so there the divisor
    is a 0-dim tensor on x's device."""
    return x / (x.new_full((), divisor) if x.is_cuda else divisor)


def needs_autograd(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def is_compiling() -> bool:
    return bool(torch.compiler.is_compiling())


def round_bf16(out) -> bool:
    """True when a kernel must round float32 -> bfloat16 itself (round-to-nearest-even).

    Compiled Triton converts with RTNE; the interpreter truncates. Kernels take this as a constexpr flag so
    interpreter results match the GPU's; on GPU the flag is False and costs nothing.
    """
    return out.dtype == torch.bfloat16 and interpret_enabled()


_JITTED: dict[tuple, object] = {}


def jit(fn: Callable):
    """``triton.jit(fn)`` for the current mode (compiled or interpreted), made once per mode."""
    key = (fn, interpret_enabled())
    kernel = _JITTED.get(key)
    if kernel is None:
        kernel = triton_module().jit(fn)
        _JITTED[key] = kernel
    return kernel


def kernel_name(name: str, fn: Callable) -> str:
    """Stable name for the operator store: the kernel's name plus a hash of its source and of the shared device
    functions every kernel may call (``_tiles``), so an edited kernel never reuses timings or failures recorded
    for an older version."""
    from . import _tiles
    try:
        src = inspect.getsource(fn) + inspect.getsource(_tiles)
    except (OSError, TypeError):
        src = name
    return f"{name}@{hashlib.sha256(src.encode()).hexdigest()[:8]}"


# ----------------------------------------------------------------------------- code digest
# ``kernel_name`` hashes a kernel's source as read when its module loads; ``code_digest`` hashes the code loaded in
# this process (bytecode, names, plain constants) of whole modules, functions and classes, stable across processes
# (no addresses, sets sorted), so a verdict about that code (the doctor's) never outlives it.
def _plain(value) -> str | None:
    """A stable text of a plain constant (numbers, strings, their tuples/dicts), None for anything else."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        parts = [_plain(v) for v in value]
        return None if None in parts else "(" + ",".join(parts) + ")"
    if isinstance(value, (set, frozenset)):
        parts = [_plain(v) for v in value]
        return None if None in parts else "{" + ",".join(sorted(parts)) + "}"
    if isinstance(value, dict):
        parts = [(_plain(k), _plain(v)) for k, v in value.items()]
        if any(k is None or v is None for k, v in parts):
            return None
        return "{" + ",".join(sorted(f"{k}:{v}" for k, v in parts)) + "}"
    return None


def _code(h, code: types.CodeType) -> None:
    h.update(code.co_code)
    h.update(repr((code.co_names, code.co_varnames, code.co_freevars, code.co_argcount,
                   code.co_kwonlyargcount)).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _code(h, const)
        else:
            h.update((_plain(const) or type(const).__name__).encode())


def _digest(h, obj, seen: set) -> None:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    inner = getattr(obj, "fn", None)                    # a triton.jit function wraps the Python one
    if isinstance(obj, str):
        h.update(obj.encode())
    elif inspect.ismodule(obj):
        h.update(obj.__name__.encode())
        for name, value in sorted(vars(obj).items()):
            if name.startswith("__") or (name.startswith("_") and isinstance(value, (dict, list, set))):
                continue        # a private mutable global is the module's run-time state (memos), not its code
            if (inspect.isfunction(value) or inspect.isclass(value)) and \
                    getattr(value, "__module__", None) == obj.__name__:
                h.update(name.encode())
                _digest(h, value, seen)
            elif _plain(value) is not None:
                h.update(f"{name}={_plain(value)}".encode())
    elif inspect.isfunction(obj):
        _code(h, obj.__code__)
        h.update((_plain(obj.__defaults__) or "").encode())
        h.update((_plain(obj.__kwdefaults__) or "").encode())
    elif isinstance(obj, (staticmethod, classmethod)):
        _digest(h, obj.__func__, seen)
    elif isinstance(obj, property):
        for fn in (obj.fget, obj.fset):
            if fn is not None:
                _digest(h, fn, seen)
    elif inspect.isclass(obj):
        h.update(obj.__qualname__.encode())
        for name, value in sorted(vars(obj).items()):
            if name.startswith("__") and name not in ("__init__", "__call__", "__post_init__"):
                continue
            h.update(name.encode())
            if _plain(value) is not None:
                h.update(_plain(value).encode())
            else:
                _digest(h, value, seen)
    elif inspect.isfunction(inner):
        _digest(h, inner, seen)
    elif callable(obj) and inspect.isfunction(getattr(obj, "__call__", None)):
        _digest(h, type(obj), seen)


def code_digest(*objects) -> str:
    """A short digest of the loaded code of ``objects`` (modules, functions, classes, or strings taken as they
    are, such as a kernel's operator-store name ``name@sourcehash``)."""
    h = hashlib.sha256()
    seen: set = set()
    for obj in objects:
        _digest(h, obj, seen)
        h.update(b"\x00")
    return h.hexdigest()[:16]


# ----------------------------------------------------------------------------- configs
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def rows_bucket(rows: int) -> int:
    """Tuning keys use power-of-two row buckets so nearby sizes share one entry."""
    return min(next_pow2(rows), 1 << 22)


_FILTERED: dict[tuple, tuple] = {}


def capped_configs(candidates: tuple, caps: dict) -> tuple[dict, ...]:
    """Candidates within the caps (tile sizes and num_warps); never empty: the smallest candidate stays.

    ``candidates`` should be a module-level tuple (results are memoised per tuple and caps).
    """
    sig = (id(candidates), tuple(caps.get(k) for k in CAP_KEYS))
    hit = _FILTERED.get(sig)
    if hit is not None and hit[0] is candidates:
        return hit[1]
    def within(c: dict) -> bool:
        return all(c.get(k, 0) <= caps.get(k, c.get(k, 0)) for k in CAP_KEYS
                   if not (k == "RBLOCK" and c.get("ROW")))      # a one-pass tile's RBLOCK is its row's width

    kept = tuple(c for c in candidates if within(c))
    if not kept:        # the smallest looped tile before any one-pass one
        kept = (min(candidates, key=lambda c: (c.get("ROW", 0),) + tuple(c.get(k, 0) for k in CAP_KEYS)),)
    _FILTERED[sig] = (candidates, kept)
    return kept


def dtype_name(t) -> str:
    """The dtype of tensor ``t`` (or the dtype ``t``) without its module: 'bfloat16'."""
    return str(getattr(t, "dtype", t)).replace("torch.", "")


# ----------------------------------------------------------------------------- device
def run_kernel(fn: Callable, grid: tuple, t, *args, **meta) -> None:
    """One launch of kernel ``fn`` (``jit`` for the current mode) on ``grid`` with ``args`` and ``meta`` (constexprs,
    warps, stages), ``t``'s GPU the current device: Triton launches on the current device, so a model on ``cuda:1``
    while device 0 is current would otherwise run on (and read the memory of) the wrong GPU."""
    with torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext():
        jit(fn)[grid](*args, **meta)


def run_rows(fn: Callable, cfg: dict, rows: int, width: int, t, *args, **meta) -> None:
    """One launch of row kernel ``fn`` over ``rows`` rows of ``width`` channels with ``cfg``: a program per YBLOCK
    rows, the tile constexprs of ``row_tile`` and cfg's warps (``run_kernel``)."""
    run_kernel(fn, (cdiv(rows, cfg["YBLOCK"]),), t, *args, **row_tile(cfg, width), **meta, num_warps=cfg["num_warps"])


def fused(run: Callable, reference: Callable, *args):
    """``run(*args)``, a kernel's Triton path, where Triton takes the call's tensors and autograd does not track
    them; else ``reference(*args)``, its torch definition."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if use_triton(*tensors) and not needs_autograd(*tensors):
        return run(*args)
    return reference(*args)


def call_op(op, eager: Callable, *args):
    """A fused kernel's public call: its custom op ``op`` (``register_op``) inside torch.compile where autograd does
    not track the tensors, else ``eager(*args)``."""
    if op is not None and is_compiling() and not needs_autograd(*[a for a in args if isinstance(a, torch.Tensor)]):
        return op(*args)
    return eager(*args)


# ----------------------------------------------------------------------------- tuned launch
def capturing(t=None) -> bool:
    """True while a CUDA graph is being captured on the current stream (no benchmarking possible then); False for
    ``t`` not on a GPU, or where this process has no CUDA."""
    if (t is not None and t.device.type != "cuda") or not torch.cuda.is_available():
        return False
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except Exception:  # noqa: BLE001
        return False


def launched(kernel: str, key: str, candidates: tuple, launch: Callable[[dict], object], config: dict | None,
             probe, smem: Callable[[dict], int] | None = None) -> bool:
    """A kernel's one launch: ``config`` as given (tests), else the config the operator store picks (only configs
    already measured while ``probe``'s stream captures a CUDA graph: no benchmarking possible then). False: every
    config failed, the caller runs its torch fallback.

    Never raises for kernel failures: a config that fails at its real launch is recorded and skipped.
    """
    if config is not None:
        launch(config)
        return True
    from ..cache.autotune import get_autotuner, tuning_errors

    caps = current_caps()
    configs = capped_configs(candidates, caps)
    tuner = get_autotuner()
    policy = "extreme" if caps.get("autotune_policy") == "extreme" else "default"
    config = tuner.tune(kernel, key, configs, launch, smem=smem, policy=policy, benchmark=not capturing(probe))
    if config is None:
        return False
    try:
        launch(config)
    except tuning_errors() + (RuntimeError, ValueError) as exc:
        log.warning("wan_accel: kernel %s failed with config %s for key %s (%s); recorded, using torch",
                    kernel, config, key, exc)
        tuner.record_failure(kernel, key, config, exc)
        return False
    return True


# ----------------------------------------------------------------------------- custom ops
def register_op(name: str, impl: Callable, fake: Callable | None = None):
    """Expose ``impl`` as ``torch.ops.wan_accel.<name>`` so torch.compile treats the kernel as one opaque op
    (no graph break, no tracing into the autotuner); ``fake`` gives its outputs' shapes (None: one contiguous tensor
    like the first argument). Returns the op, or None where unsupported."""
    qualname = f"wan_accel::{name}"

    def like_first(x, *args):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @functools.wraps(impl)
    def laid_out(*args, **kwargs):      # the real output in the layout the fake declares: contiguous, whatever the
        out = impl(*args, **kwargs)     # implementation the operator store chose returns (a compiled graph's
        if isinstance(out, torch.Tensor):                       # stride assertion holds)
            return out.contiguous()
        if isinstance(out, (tuple, list)):
            return type(out)(o.contiguous() if isinstance(o, torch.Tensor) else o for o in out)
        return out

    try:                                # the schema from ``impl`` itself (its annotations, in its module)
        schema = torch.library.infer_schema(impl, mutates_args=())
        op = torch.library.custom_op(qualname, laid_out, mutates_args=(), schema=schema)
        op.register_fake(fake or like_first)
        return op
    except Exception:  # noqa: BLE001 - already registered (module imported twice) or old torch
        try:
            return getattr(torch.ops.wan_accel, name)
        except Exception:  # noqa: BLE001
            return None


# Candidate tiles of the row kernels (LayerNorm+modulate, RMSNorm+RoPE, RMSNorm): YBLOCK rows per program, RBLOCK
# channels per step, warps; each row is read twice (statistics, then output). The compile preset's caps remove the
# larger ones. These loop over rows of any width.
ROW_CANDIDATES = tuple({"YBLOCK": y, "RBLOCK": r, "num_warps": w} for y, r, w in (
    (1, 64, 2), (2, 64, 2), (4, 64, 4), (8, 64, 4), (8, 64, 8),
    (1, 128, 4), (4, 128, 4), (8, 128, 8), (16, 128, 8), (16, 128, 16)))

# One-pass ("ROW") tiles: the whole row is one [YBLOCK, RBLOCK] tile, RBLOCK the next power of two >= the width,
# read once into registers, its statistics reduced once and the output written from the registers. Only for rows
# up to ROW_WIDTH_LIMIT channels, and only (YBLOCK, num_warps) pairs holding at most ROW_VALUES_PER_THREAD float32
# values of the tile per thread (more would spill registers).
ROW_WIDTH_LIMIT = 8192
ROW_VALUES_PER_THREAD = 64
ROW_MIN_BLOCK = 16
ONE_PASS_TILES = ((1, 4), (2, 4), (1, 8), (2, 8), (4, 8), (1, 16))      # (YBLOCK, num_warps)


def row_block(width: int) -> int:
    """RBLOCK of a one-pass tile over rows of ``width`` channels."""
    return max(ROW_MIN_BLOCK, next_pow2(width))


def _one_pass_class(block: int) -> tuple:
    return ROW_CANDIDATES + tuple({"ROW": 1, "YBLOCK": y, "RBLOCK": block, "num_warps": w}
                                  for y, w in ONE_PASS_TILES if y * block <= ROW_VALUES_PER_THREAD * 32 * w)


# one module-level tuple per width class (capped_configs and the operator store recognise tuples by identity)
_ROW_CLASSES = {block: _one_pass_class(block) for block in
                (1 << p for p in range(ROW_MIN_BLOCK.bit_length() - 1, ROW_WIDTH_LIMIT.bit_length()))}


def row_candidates(width: int) -> tuple[dict, ...]:
    """The row kernels' candidates for rows of ``width`` channels: the looped tiles, plus the one-pass tiles of
    the row's width class where the width is at most ROW_WIDTH_LIMIT."""
    return ROW_CANDIDATES if width > ROW_WIDTH_LIMIT else _ROW_CLASSES[row_block(width)]


def row_tile(cfg: dict, width: int) -> dict:
    """The tile constexprs (YBLOCK, RBLOCK, ROW) a row kernel launches with for ``cfg``: a one-pass config's RBLOCK
    is computed from the width here. ValueError for a one-pass config over a row wider than ROW_WIDTH_LIMIT."""
    if not cfg.get("ROW"):
        return {"YBLOCK": cfg["YBLOCK"], "RBLOCK": cfg["RBLOCK"], "ROW": False}
    if width > ROW_WIDTH_LIMIT:
        raise ValueError(f"a one-pass row tile holds rows of at most {ROW_WIDTH_LIMIT} channels, not {width}; "
                         f"use a looped config (no ROW)")
    return {"YBLOCK": cfg["YBLOCK"], "RBLOCK": row_block(width), "ROW": True}


def row_smem(cfg: dict, tiles: int) -> int:
    """Upper estimate of a row kernel's shared memory: layout changes of ``tiles`` [YBLOCK, RBLOCK] float32 tiles
    and the cross-warp reductions (per row and warp, doubled)."""
    return cfg["YBLOCK"] * cfg["RBLOCK"] * 4 * tiles + cfg["YBLOCK"] * cfg["num_warps"] * 4 * 2


def frame_batch_stride(mod, batch: int, width: int) -> int:
    """Batch stride (in elements) of a contiguous per-frame modulation ``[B or 1, F, D]``: 0 broadcasts one row
    set over the batch."""
    return 0 if mod.shape[0] == 1 and batch > 1 else mod.shape[1] * width


def triton_problem(device, dtype=None, head_dim=None) -> str | None:
    """Why the pack's Triton kernels cannot run on ``device`` (an op registry probe), or None."""
    if triton_module() is None:
        return "triton does not import"
    kind = getattr(device, "type", str(device).split(":")[0])
    ok = kind == "cuda" or (kind == "cpu" and interpreter_usable())
    return None if ok else "Triton needs CUDA (or TRITON_INTERPRET=1)"
