"""The one attention entry point of the model, and the choice of attention backend.

Layout everywhere is ``[B, L, heads, head_dim]``. Backends:

* ``fa3``: FlashAttention 3, Hopper GPUs (compute capability 9.x): upstream's 'hopper' build
  (``flash_attn_interface``) or PyPI's forward-only wheel ``fa3-fwd`` (``fa3_fwd_interface``; bf16 only there);
  ``fa3.split2`` / ``fa3.split3`` are the same kernels with the keys split (``num_splits``), candidates of 'auto';
* ``fa2``: FlashAttention 2 (``flash_attn``), compute capability 8.0 or newer *and* kernels for this GPU in the
  installed build: wheels built without sm_100 / sm_120 code fail with "no kernel image is available", so a tiny
  probe call decides once per device (and a kernel-image error at run time falls back to SDPA for good);
* ``sdpa``: torch's scaled_dot_product_attention (always available; it picks its own fused kernel);
* ``int8`` / ``fp8``: opt-in, approximate, never chosen by ``auto``: the op registry's families 'attention.int8'
  (comfy-kitchen's kernel, else the pack's torch version) and 'attention.fp8' (FlashAttention 3's e4m3 kernels,
  the pack's Triton kernel, its torch version; a KV cache's fp8 copy is read where it keeps one); their bounds
  and speed verdicts are ``model/attention_approx.py``'s. Every other backend is exact.

``auto`` is the operator store's choice (``kernels/candidates.pick``) among the op registry's family 'attention':
the exact candidates that run here (fa3, fa2, sdpa and ``torch``, plain softmax math, the reference), each verified
on the call's shapes and timed, the fastest verified one per (heads, head size, dtype, query/key length bucket) and
GPU fingerprint; a wrong one is failed alone; chosen once per process and shape, never measured inside a CUDA-graph
capture or a torch.compile trace (there the store's choice, else the availability order fa3 > fa2 > sdpa). On a CPU
where only SDPA and plain math run, SDPA without timing. int8 and fp8 are never candidates (approximate; opt-in
only). ``fa3_hub`` and ``fa3_xformers`` are FlashAttention 3 from prebuilt packages (the Hugging Face kernel hub,
opt-in by ``WAN_ACCEL_HUB_KERNELS=1``; xformers' FA3 operator), listed after fa3/fa2 and before SDPA
(``kernels/fa3_packages.py``). ``triton`` is one more exact candidate: the pack's Triton flash-attention forward
on CUDA GPUs of SM 8.0+ (``kernels/flash_attention.py``), listed after SDPA, so never the availability order's
pick.
An explicit request (``flash_attn``, ``fa3``, ``fa2``, ``sdpa``) is resolved by capability detection: the package
imports, the GPU's compute capability, the dtype (half precision) and the head size. GPU names are never looked
at. ``resolve_backend`` does this once (the optimized sampler calls it when a run starts); ``attention`` also
accepts an unresolved request and resolves it per call (cached), which is what the reference path does.
FlashAttention's return type differs between releases (a tensor, or a tuple whose first item is the output):
both are handled.

``kernel_of`` names the exact kernel a call runs (``model/cached_attention.py`` asks it whether the cache's write
can go inside FA3's kernel).
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from ..kernels import _common, fa3_fp8, fp8_attention as fp8, int8_attention as int8
from ..cache.guarded_import import ImportProblem, try_import
from ..kernels import fa3_packages, flash_attention as triton_flash
from ..kernels import candidates as op_candidates, registry
from ..kernels.registry import SWITCHED_OFF, Candidate as C
from .kv_cache import fp8_copy

log = logging.getLogger("wan_accel")

BACKENDS = ("auto", "sdpa", "flash_attn", "fa3", "fa2", "int8", "fp8")
RESOLVED = ("fa3", "fa2", "sdpa", "int8", "fp8")
APPROXIMATE = ("int8", "fp8")   # the opt-in modes that change the numerics (never chosen by 'auto')
# The modules each FlashAttention generation is found under, first that imports wins: FA3 as upstream's 'hopper'
# build (flash_attn_interface) or as PyPI's forward-only wheel fa3-fwd (fa3_fwd_interface: the same kernels and
# signatures, torch's stable ABI, no fp16 / windowed / paged kernels built).
_IMPORTS = {"fa3": ("flash_attn_interface", "fa3_fwd_interface"), "fa2": ("flash_attn",)}
_MODULES = {name: " or ".join(mods) for name, mods in _IMPORTS.items()}   # in messages
_FUNCS: dict = {}          # "fa3"/"fa2" -> flash_attn_func or None (import attempted once)
_FROM: dict = {}           # "fa3"/"fa2" -> the module it was found in
_NO_FP16: dict = {}        # "fa3"/"fa2" -> True where the loaded build has no fp16 kernels
_PROBLEMS: dict = {}       # "fa3"/"fa2" -> the ImportProblem of each module that did not give flash_attn_func
# the FlashAttention generations each request tries, in order, before SDPA
GENERATIONS = {"auto": ("fa3", "fa2"), "flash_attn": ("fa3", "fa2"), "fa3": ("fa3",), "fa2": ("fa2",), "sdpa": ()}
FA3_SPLITS = (2, 3)        # key splits (FA3's num_splits) offered to the operator store as candidates of their own


def _build_lacks_fp16(module) -> bool:
    """Whether a FlashAttention build says it was compiled without fp16 kernels (fa3-fwd's config: bf16 only)."""
    try:
        config = __import__(module.__name__.replace("_interface", "_config"), fromlist=["CONFIG"]).CONFIG
        return bool(config["build_flags"].get("FLASHATTENTION_DISABLE_FP16"))
    except Exception:  # noqa: BLE001 - no config module: assume the build of record (fa3-fwd ships without fp16)
        return module.__name__ == "fa3_fwd_interface"


def _load(name: str):
    """flash_attn_func of FA3 / FA2, or None when no package of it imports (never required); why each module did
    not is kept for the message (``_PROBLEMS``: an installed module that fails to import is named with its error)."""
    if name not in _FUNCS:
        fn, problems = None, []
        for module_name in _IMPORTS[name]:
            module, problem = try_import(module_name)        # any failure, sys.exit included: not available
            fn = getattr(module, "flash_attn_func", None) if module is not None else None
            if problem is not None:
                problems.append(problem)
            elif fn is None:
                problems.append(ImportProblem(module_name, True, "it has no flash_attn_func"))
            if fn is not None:
                _FROM[name], _NO_FP16[name] = module_name, _build_lacks_fp16(module)
                break
        _FUNCS[name], _PROBLEMS[name] = fn, problems
    return _FUNCS[name]


def loaded_from(name: str) -> str | None:
    """The module FlashAttention ``name`` was found in ('flash_attn_interface', 'fa3_fwd_interface', ...)."""
    return _FROM.get(name) if _load(name) is not None else None


def fa_dtype_problem(name: str, dtype: torch.dtype) -> str | None:
    """Why the installed FlashAttention ``name`` cannot take ``dtype`` calls (fp16 on fa3-fwd), or None."""
    if dtype not in (torch.float16, torch.bfloat16):
        return f"needs fp16/bf16 (got {str(dtype).replace('torch.', '')})"
    if dtype == torch.float16 and _load(name) is not None and _NO_FP16.get(name):
        return f"{_FROM[name]} is built without fp16 kernels (bf16 only)"
    return None


def fa_available(name: str) -> bool:
    """True when FlashAttention ``name`` ('fa3' or 'fa2') imports."""
    return _load(name) is not None


def check_backend(backend: str) -> str:
    """Validate a backend request; raise a clear error when a FlashAttention package it needs is missing."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "flash_attn" and not (fa_available("fa3") or fa_available("fa2")):
        raise BackendUnavailable("attention backend 'flash_attn' was requested but the flash-attn package "
                           "is not installed; install flash-attn or choose 'auto' / 'sdpa'.")
    if backend in _MODULES and not fa_available(backend):
        broken = [p for p in _PROBLEMS.get(backend, ()) if p.installed]
        if broken:          # installed but failing: its own error, never advice to install what is installed
            raise BackendUnavailable(
                f"attention backend {backend!r} was requested but {_MODULES[backend]} does not import: "
                + "; ".join(f"{p.module} is installed but fails ({p.reason})" for p in broken)
                + "; repair or reinstall that package for this torch, or choose 'auto' / 'sdpa'.")
        raise BackendUnavailable(
            f"attention backend {backend!r} was requested but {_MODULES[backend]} does not import (not installed); "
            f"install {'fa3-fwd (pip install fa3-fwd) or FlashAttention 3 (hopper build)' if backend == 'fa3' else 'flash-attn 2'} "
            f"or choose 'auto' / 'sdpa'.")
    return backend


class BackendUnavailable(ValueError, RuntimeError):
    """A FlashAttention backend that was asked for by name and cannot run here: the user's to change (a usage
    error, exit 2), and a RuntimeError for callers that catch the run's failures."""


_BUILD: dict = {}          # (name, device index) -> None (ok) or the probe's error


NO_KERNEL_MESSAGES = ("no kernel image", "invalid device function", "not compiled for", "unsupported gpu",
                      "sm_", "only supports ampere")


def _probe_inputs(device, dtype):
    """Tiny q/k/v for the build probe on ``device``, or None where they cannot be made (no CUDA here)."""
    try:
        q = torch.zeros(1, 1, 1, 64, dtype=dtype, device=device)
    except Exception:  # noqa: BLE001 - no CUDA in this process: nothing to probe
        return None
    return q, q, q


def build_supports(name: str, device, dtype=torch.float16) -> str | None:
    """None when the installed FlashAttention ``name`` runs on ``device`` (one tiny call, cached per device);
    else the error it gave (e.g. "no kernel image is available")."""
    device = torch.device(device)
    key = (name, device.index)
    if key not in _BUILD and fa3_packages.capturing():
        return "not probed inside a CUDA-graph capture (a call there would break it); the run's plans probe it first"
    if key not in _BUILD:
        fn = _FUNCS.get(name) or _load(name)
        inputs = _probe_inputs(device, dtype) if fn is not None else None
        error = None
        if inputs is not None:
            try:
                fn(*inputs)
            except Exception as exc:  # noqa: BLE001 - whatever fails here would fail in the model
                error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:200]
        _BUILD[key] = error
    return _BUILD[key]


def flash_problem(name: str, device, dtype: torch.dtype, head_dim: int, capability: tuple | None = None) -> str | None:
    """Why FlashAttention ``name`` ('fa3' | 'fa2') cannot run this call on ``device``, or None when it can."""
    device = torch.device(device)
    if device.type != "cuda":
        return "needs a CUDA device"
    why = fa_dtype_problem(name, dtype)
    if why or not fa_available(name):
        return why or f"{_MODULES[name]} not installed"
    cap = capability or registry.capability(device)
    if cap[0] != 9 if name == "fa3" else cap[0] < 8:      # FA3: Hopper only; FA2: SM 8.0+
        return f"compute capability {cap[0]}.{cap[1]} not supported"
    if head_dim % 8 or not 0 < head_dim <= 256:
        return f"head size {head_dim} not supported"
    failed = build_supports(name, device, dtype)
    if failed:
        return f"the installed build does not run on SM {cap[0]}.{cap[1]} ({failed})"
    return None


def explain_backend(requested: str, device, dtype: torch.dtype, head_dim: int, capability: tuple | None = None,
                    off=frozenset()) -> tuple[str, str]:
    """(resolved backend, reason in words) for a request on this device, dtype and head size; ``off``: doctor
    features switched off here ('attention.fa3', ...), skipped."""
    if requested not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {requested!r}")
    device = torch.device(device)
    if requested == "int8":
        return "int8", int8.implementation(device, dtype, head_dim)[1]
    if requested == "fp8":
        return "fp8", fp8_implementation(device, dtype, head_dim)[1]
    why = []
    for name in GENERATIONS[requested]:
        problem = SWITCHED_OFF if f"attention.{name}" in off else flash_problem(name, device, dtype, head_dim,
                                                                                  capability)
        if problem:
            why.append(f"{name}: {problem}")
            continue
        skipped = f" (skipped {'; '.join(why)})" if why else ""
        return name, f"{name} ({_FROM.get(name, _MODULES[name])}) for requested '{requested}'{skipped}"
    reason = "torch SDPA" + (f" ({'; '.join(why)})" if why else "")
    if requested in ("fa3", "fa2", "flash_attn") and why:
        log.warning("wan_accel: attention '%s' is not usable here, using SDPA: %s", requested, "; ".join(why))
    return "sdpa", reason


@functools.lru_cache(maxsize=64)
def resolve_backend(requested: str, device, dtype: torch.dtype, head_dim: int) -> str:
    """'fa3' | 'fa2' | 'sdpa' | 'int8' | 'fp8' for a request (cached per device, dtype and head size)."""
    return explain_backend(requested, device, dtype, head_dim)[0]


def flash_function(name: str):
    """``flash_attn_func`` of the installed FlashAttention ``name``; RuntimeError where it does not import."""
    fn = _FUNCS.get(name) or _load(name)
    if fn is None:
        raise RuntimeError(f"attention backend {name!r} needs {_MODULES[name]}, which does not import")
    return fn


def _flash(name: str, q, k, v, splits: int = 1):
    """FlashAttention ``name`` on [B, L, H, D] q/k/v (non-causal, no window, scale 1/sqrt(D)); ``splits`` > 1
    splits the keys into that many parts combined by their log-sum-exp inside the kernel (FA3's num_splits: more
    tiles than multiprocessors when the query tiles alone leave the last wave part-empty). Runs without autograd
    (FA3's autograd wrapper would keep q, k, v alive for a backward that never comes)."""
    fn = flash_function(name)
    if _BUILD.get((name, q.device.index)):
        return _sdpa(q, k, v)       # this build has no kernels for this GPU (found at run time)
    try:
        if splits > 1 or torch.is_grad_enabled():
            with torch.no_grad():
                out = fn(q, k, v, num_splits=splits) if splits > 1 else fn(q, k, v)
        else:
            out = fn(q, k, v)
    except RuntimeError as exc:
        if not any(m in str(exc).lower() for m in NO_KERNEL_MESSAGES):
            raise
        _BUILD[(name, q.device.index)] = f"{type(exc).__name__}: {str(exc).strip()[:200]}"    # SDPA from now on
        resolve_backend.cache_clear()
        log.warning("wan_accel: %s has no kernels for this GPU in the installed build (%s); using SDPA from now on",
                    _MODULES[name], str(exc).strip()[:200])
        return _sdpa(q, k, v)
    return out[0] if isinstance(out, (tuple, list)) else out


def _sdpa(q, k, v, mask=None):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


# ----------------------------------------------------------------------------- 'auto': the operator store's choice
STORE_OP = "attention"            # kernel 'ops.attention@<version>' in the operator store (kernels/candidates.store_kernel)
STORE_ULPS = 4 * op_candidates.VERIFY_ULPS   # two accumulations (q.k over head_dim, p.v over keys) whose order
#                                               differs between an implementation and the reference
REFERENCE_BLOCK_BYTES = 1 << 28   # the reference's float32 score block per query slice (memory stays bounded)


def attention_reference(q, k, v):
    """Plain softmax math in float32 (queries in slices so the score block stays bounded), in q's dtype."""
    scale = q.shape[-1] ** -0.5
    kf, vf = k.float().transpose(1, 2), v.float().transpose(1, 2)
    step = max(1, REFERENCE_BLOCK_BYTES // max(1, 4 * q.shape[0] * q.shape[2] * k.shape[1]))
    out = q.new_empty(q.shape[:-1] + (v.shape[-1],))
    for i in range(0, q.shape[1], step):
        qf = q[:, i:i + step].float().transpose(1, 2)
        out[:, i:i + step] = (torch.softmax((qf @ kf.transpose(-1, -2)) * scale, dim=-1) @ vf).transpose(1, 2)
    return out


# SDPA's own fused kernels, each a candidate of its own: SDPA alone picks by a fixed priority (and inside ComfyUI an
# outer ``sdpa_kernel`` priority puts flash first), while cuDNN ran the official loop's shape in 3.0 ms against
# flash's 5.3 ms on an H200. Each runs inside ``sdpa_kernel([its backend])``, so no outer priority overrides it.
SDPA_KERNELS = {"sdpa.cudnn": "CUDNN_ATTENTION", "sdpa.flash": "FLASH_ATTENTION",
                "sdpa.efficient": "EFFICIENT_ATTENTION"}


def _sdpa_backend(name: str):
    try:
        from torch.nn.attention import SDPBackend
        return getattr(SDPBackend, SDPA_KERNELS[name], None)
    except Exception:  # noqa: BLE001 - an older torch without torch.nn.attention
        return None


def _sdpa_with(name: str, q, k, v):
    """SDPA restricted to one kernel (it raises where that kernel cannot take the call: the store records it)."""
    from torch.nn.attention import sdpa_kernel
    with sdpa_kernel([_sdpa_backend(name)]):
        return _sdpa(q, k, v)


def _flash_candidate(name: str, splits: int, summary: str) -> C:
    return C(STORE_OP, name if splits == 1 else f"{name}.split{splits}", "flash",
             lambda q, k, v: _flash(name, q, k, v, splits=splits), lambda d, dt, hd: flash_problem(name, d, dt, hd),
             summary)


# in availability order: without a stored choice (nothing measured yet and no measuring allowed) the first usable
AUTO_CANDIDATES: dict[str, C] = registry.register(STORE_OP, "exact attention (the 'auto' backend)", [
    _flash_candidate("fa3", 1, "FlashAttention 3"), _flash_candidate("fa2", 1, "FlashAttention 2"),
    # FlashAttention 3 from prebuilt packages (kernels/fa3_packages.py): the kernel hub (opt-in), xformers' operator
    *(C(STORE_OP, name, "flash", lambda q, k, v, n=name: fa3_packages.attention(n, q, k, v),
        lambda d, dt, hd, n=name: fa3_packages.PROBLEMS[n](d, dt, hd), fa3_packages.SUMMARIES[name])
      for name in fa3_packages.NAMES),
    *(C(STORE_OP, name, "sdpa", lambda q, k, v, n=name: _sdpa_with(n, q, k, v),
        lambda d, dt, hd, n=name: None if _sdpa_backend(n) else f"torch {torch.__version__} has no {SDPA_KERNELS[n]}",
        f"torch SDPA, {SDPA_KERNELS[name].lower().replace('_', ' ')} kernel only", devices=("cuda",),
        dtypes=() if name == "sdpa.efficient" else (torch.float16, torch.bfloat16)) for name in SDPA_KERNELS),
    C(STORE_OP, "sdpa", "sdpa", lambda q, k, v: _sdpa(q, k, v), None,
      "torch scaled_dot_product_attention (its own pick)"),
    # FA3 with its keys split (num_splits): the store keeps one where it measures it faster at a call's shape
    *(_flash_candidate("fa3", n, f"FlashAttention 3, keys split in {n} (num_splits={n})") for n in FA3_SPLITS),
    # after SDPA: never the availability order's pick, only the store's where it is verified and fastest
    C(STORE_OP, "triton", "triton", lambda q, k, v: _triton_attention(q, k, v),
      lambda d, dt, hd: triton_flash.kernel_problem(d, dt, hd),
      "the pack's Triton flash-attention kernel"),
    C(STORE_OP, "torch", "torch", lambda q, k, v: attention_reference(q, k, v), None,
      "plain softmax math (the reference)")], timed=True)


SWITCHABLE = ("attention.fa3", "attention.fa2", "attention.triton",   # doctor features that are 'auto' candidates
              "attention.fa3_hub", "attention.fa3_xformers")


def feature_of(candidate: str) -> str:
    """The doctor feature's candidate name a candidate is switched off with: FA3's key splits go with 'fa3'."""
    return candidate.split(".split", 1)[0]


def auto_request(switched_off=()) -> str | tuple:
    """The 'auto' request of a run: 'auto', or ('auto', *names) without the candidates whose self-check failed
    here (any of ``SWITCHABLE`` in ``switched_off``)."""
    off = tuple(sorted(n.split(".", 1)[1] for n in switched_off if n in SWITCHABLE))
    return ("auto", *off) if off else "auto"


length_bucket = _common.next_pow2      # the store's length bucket of a query or key length


def store_key(q, k) -> str:
    """The operator-store key of an attention call: device type, heads, head size, dtype, length buckets."""
    return (f"{q.device.type}|h{q.shape[2]}|d{q.shape[3]}|{str(q.dtype).replace('torch.', '')}"
            f"|q{length_bucket(q.shape[1])}|k{length_bucket(k.shape[1])}")


def auto_listing(device, dtype, head_dim: int, off: tuple = ()) -> list:
    """(candidate, why it is not used or None) for every exact candidate of 'auto' on this device/dtype/head size."""
    _, reasons = registry.walk(STORE_OP, device, dtype, head_dim, off=[n for n in AUTO_CANDIDATES
                                                                       if feature_of(n) in off])
    return [(AUTO_CANDIDATES[n], why) for n, why in reasons.items()]


def choose_auto(q, k, v, off: tuple = (), tuner=None, benchmark: bool = True) -> tuple[str, str]:
    """(candidate, why) for an 'auto' call: the operator store's fastest verified exact implementation for its
    (heads, head size, dtype, length buckets). On a CPU where only SDPA and plain math run, SDPA without timing
    (unless the store's timer was replaced). Nothing known and no measuring allowed: the availability order."""
    from ..cache.autotune import default_timer, get_autotuner

    rows = auto_listing(q.device, q.dtype, q.shape[-1], off)
    usable = [c for c, why in rows if why is None]
    skipped = [f"{c.name}: {why}" for c, why in rows if why is not None]
    tuner = tuner or get_autotuner()
    if q.device.type == "cpu" and [c.name for c in usable] == ["sdpa", "torch"] and tuner.timer is default_timer:
        return "sdpa", "torch SDPA (a CPU: SDPA and plain math only, not timed)"
    best, why = op_candidates.pick(STORE_OP, usable, skipped, (q, k, v), key=store_key(q, k),
                                   reference=attention_reference, ulps=STORE_ULPS, tuner=tuner, benchmark=benchmark)
    if best is None:
        best = next(c.name for c in usable if c.group != "torch" and c.name not in SDPA_KERNELS)
        why = f"{best} by availability ({why})"
    return best, why


_no_compile = getattr(getattr(torch, "compiler", None), "disable", lambda fn: fn)   # runs eagerly under compile
_triton_attention = _no_compile(triton_flash.flash_attention)   # its tile choice (the store) is no graph's business
_AUTO: dict[tuple, str] = {}          # (off, device, dtype, heads, head size, buckets) -> measured choice
_AUTO_UNMEASURED: dict[tuple, str] = {}   # the same, chosen while measuring was not allowed (capture, compile)


@_no_compile
def _choose_once(q, k, v, key: tuple, measuring: bool) -> str:
    name, why = choose_auto(q, k, v, key[0], benchmark=measuring)
    (_AUTO if measuring else _AUTO_UNMEASURED)[key] = name
    log.info("wan_accel: attention (heads %s, head size %s, %s, lengths to %s/%s) uses %s (%s)", key[3], key[4],
             key[2], key[5], key[6], name, why)
    return name


def _off(request) -> tuple:
    """The candidates a request switches off, and the registry's override of 'auto' (part of each memo's key)."""
    forced = registry.override(STORE_OP)
    return (request[1:] if isinstance(request, tuple) else ()) + ((f"={forced}",) if forced else ())


def auto_name(q, k, v, request) -> str:
    """The exact candidate an 'auto' request runs for this call (the store's choice, made once per shape bucket)."""
    off = _off(request)
    key = (off, q.device, q.dtype, q.shape[2], q.shape[3], length_bucket(q.shape[1]), length_bucket(k.shape[1]))
    name = _AUTO.get(key)
    if name is None:
        measuring = not (_common.is_compiling() or _common.capturing(q))
        name = (None if measuring else _AUTO_UNMEASURED.get(key)) or _choose_once(q, k, v, key, measuring)
    return name


def kernel_of(q, k, v, backend) -> str | None:
    """The exact kernel an ``attention(q, k, v, backend=backend)`` call without a key mask runs: a candidate name
    of 'auto' ('fa3', 'fa3.split2', 'sdpa.cudnn', ...), 'fa3' / 'fa2' for an explicit request that resolves to it,
    else None (SDPA's own choice, an approximate mode, a CPU)."""
    if backend in APPROXIMATE or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    if backend == "auto" or isinstance(backend, tuple):
        return auto_name(q, k, v, backend)
    if backend == "sdpa":
        return None
    name = backend if backend in RESOLVED else resolve_backend(backend, q.device, q.dtype, q.shape[-1])
    return None if name == "sdpa" or _BUILD.get((name, q.device.index)) else name


def plan_shapes(frame_tokens: int, chunks, kv_window: int, num_frames: int, text_len: int | None = None) -> list:
    """The (query length, key length) of every attention call a run over ``chunks`` [(first frame, frames)] meets:
    self-attention reads the cache up to the chunk's end (a rolling cache at most ``kv_window`` frames), and
    cross-attention reads ``text_len`` tokens; one per store bucket, the largest call of each (the one a choice
    or a speed verdict must hold for)."""
    largest: dict = {}
    cap = kv_window if 0 < kv_window < num_frames else num_frames
    for f0, n in chunks:
        q = n * frame_tokens
        for k in (min(f0 + n, cap) * frame_tokens, text_len):
            if not k:
                continue
            bucket = (length_bucket(q), length_bucket(k))
            if bucket not in largest or q * k > largest[bucket][0] * largest[bucket][1]:
                largest[bucket] = (q, k)
    return list(largest.values())


def warm_plans(shapes, batch: int, heads: int, head_dim: int, dtype, device, request="auto") -> list:
    """Make the operator store's choice for every (query length, key length) in ``shapes`` now, on seeded inputs
    of those shapes, so no chunk of the run pays for measuring; [(key bucket, chosen)]."""
    if not (request == "auto" or isinstance(request, tuple)) or _common.is_compiling():
        return []
    off = _off(request)
    where = torch.device(device)      # as a tensor on it reports it (cuda -> cuda:<current>): the store's keys' form
    if where.type == "cuda" and where.index is None:
        where = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(0)
    out = []
    for lq, lk in shapes:
        key = (off, where, dtype, heads, head_dim, length_bucket(lq), length_bucket(lk))
        if key in _AUTO:                 # chosen earlier in this process: nothing to make, nothing to copy
            out.append((key[5:], _AUTO[key]))
            continue
        q = torch.randn(batch, lq, heads, head_dim, generator=gen).to(device, dtype)
        k = torch.randn(batch, lk, heads, head_dim, generator=gen).to(device, dtype)
        out.append((key[5:], _choose_once(q, k, k, key, True)))
        del q, k
    return out


def fp8_implementation(device, dtype: torch.dtype, head_dim: int) -> tuple[str, str]:
    """(kind, why in words) of the opt-in fp8 mode here: the op registry's walk of 'attention.fp8' (FA3's e4m3
    kernels, the pack's Triton kernel, its torch version); ``fp8_numerics`` overrides it."""
    kind, why = registry.choice(fp8.FAMILY, device, dtype, head_dim)
    return kind, (f"{why}, {loaded_from('fa3')}" if kind == "fa3" else why)


def fp8_numerics(kind: str | None):
    """``with fp8_numerics('fa3-torch'):`` every fp8 attention call (and a KV cache's fp8 copy made meanwhile) takes
    that implementation: the registry's override of 'attention.fp8' (``bench fidelity --fp8-numerics``, tests)."""
    return registry.use({fp8.FAMILY: kind})


@_no_compile
def _fp8_attention(q, k, v, key_padding_mask):
    """fp8 attention by this machine's implementation (``fp8_implementation``), reading the KV cache's fp8 copy of
    k, v where it keeps one in that implementation's form (eagerly under compile)."""
    kind = fp8_implementation(q.device, q.dtype, q.shape[-1])[0]
    copy = fp8_copy(k, v)
    if kind in fa3_fp8.KINDS:
        kv = copy if isinstance(copy, fa3_fp8.Fa3KV) else None
        if kind == "fa3" and key_padding_mask is None:
            return fa3_fp8.attention(flash_function("fa3"), q, kv if kv is not None else fa3_fp8.quantize_kv(k, v))
        return fa3_fp8.fa3_fp8_torch(q, k, v, key_padding_mask, kv=kv)
    return fp8.fp8_attention(q, k, v, key_padding_mask, kv8=copy if isinstance(copy, fp8.Fp8KV) else None)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              key_padding_mask: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """Softmax attention, scale 1/sqrt(head_dim), no dropout, dense (every query sees every key).

    q [B, Lq, H, D], k/v [B, Lk, H, D]; key_padding_mask [B, Lk] bool, True = real key (attended).
    backend: a resolved name ('fa3', 'fa2', 'sdpa', 'int8', 'fp8': dispatched directly) or a request ('auto',
    'flash_attn'). Returns [B, Lq, H, D] in q's dtype.
    """
    if backend == "int8":
        return int8.int8_attention(q, k, v, key_padding_mask)
    if backend == "fp8":
        return _fp8_attention(q, k, v, key_padding_mask)
    if key_padding_mask is not None:
        return _sdpa(q, k, v, key_padding_mask[:, None, None, :])
    if backend == "auto" or isinstance(backend, tuple):
        return AUTO_CANDIDATES[auto_name(q, k, v, backend)].fn(q, k, v)
    if backend == "sdpa" or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return _sdpa(q, k, v)
    if backend not in RESOLVED:
        backend = resolve_backend(backend, q.device, q.dtype, q.shape[-1])
        if backend == "sdpa":
            return _sdpa(q, k, v)
    return _flash(backend, q, k, v)
