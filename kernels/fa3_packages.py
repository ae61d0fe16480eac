"""FlashAttention 3 from prebuilt packages: two more exact candidates of the operator store's 'auto' attention.

FlashAttention 3 is the fastest exact forward on Hopper GPUs, but building flash-attn from source takes hours, so
it reaches users as compiled code from a package. Besides a ``flash_attn_interface`` wheel (candidate ``fa3`` of
``model/attention.py``) two packages carry it; nothing is compiled on the user's machine by either:

* ``fa3_hub``: the ``kernels`` package (Hugging Face's kernel hub). ``get_kernel(HUB_REPO)`` downloads a compiled
  FlashAttention 3 from the hub the first time, so it is **opt-in**: attempted only where ``HUB_ENV`` is set to
  ``1`` (``pip install kernels``, then ``WAN_ACCEL_HUB_KERNELS=1``); otherwise its problem says how to turn it on.
  Its ``flash_attn_func(q, k, v, causal=False)`` returns the output or (output, log-sum-exp), depending on the
  build: the output is taken either way.
* ``fa3_xformers``: xformers' FlashAttention 3 operator (``fmha.flash3.FwOp``), through
  ``fmha.memory_efficient_attention_forward(q, k, v, op=FwOp)``; available where xformers imports and its wheel
  was built with that operator for this GPU.

Both take and return the pack's layout ``[B, L, heads, head size]`` (no transpose), half precision, the softmax
scale 1/sqrt(head size). Each ``*_problem(device, dtype, head_dim)`` says why it is not a candidate here (a CPU;
not fp16/bf16; a head size over 256 or no multiple of 8; the package missing; the hub not opted in; a compute
capability other than SM 9.x, the only one FlashAttention 3 is built for; the load or a tiny probe call failing),
or None. Nothing is attempted on a CPU. Loading is attempted once per process and cached; a failure becomes the
problem string (one log line), never an exception out of 'auto'. The store verifies each against plain softmax
math before timing it, so a package that computes something else is failed alone. Their speed is not measured
until ``bench attention`` runs on a GPU.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import os
import sys

import torch

from ..cache.guarded_import import ImportProblem, guarded_import
from . import registry
from ._common import capturing, dtype_name

log = logging.getLogger("wan_accel")

HUB_ENV = "WAN_ACCEL_HUB_KERNELS"           # "1": the kernel hub may download its compiled FlashAttention 3
HUB_REPO = "kernels-community/flash-attn3"
NAMES = ("fa3_hub", "fa3_xformers")
DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
HINTS = {
    "fa3_hub": f"pip install kernels and set {HUB_ENV}=1 (a prebuilt FlashAttention 3 from the Hugging Face "
               f"kernel hub, downloaded once); SM 9.x GPUs only",
    "fa3_xformers": "install an xformers wheel built with FlashAttention 3 for the installed torch; SM 9.x GPUs only",
}
_LOADED: dict = {}          # name -> (attention function or None, why not or None): attempted once per process
_PROBED: dict = {}          # (name, device index, dtype) -> None (runs) or the probe call's error
_HERE = os.path.dirname(os.path.abspath(__file__))


def _error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def _import(module: str):
    """The module, or raise ImportError; never the pack's own ``kernels`` folder (found as a top-level ``kernels``
    where the pack's folder is on sys.path, e.g. tests run from the repository root: it is not imported twice)."""
    if module not in sys.modules and "." not in module:
        spec = importlib.util.find_spec(module)
        if spec is None:
            raise ImportError(f"{module} is not installed")
        if spec.origin and os.path.dirname(os.path.abspath(spec.origin)) == _HERE:
            raise ImportError(f"{module} is not installed (only this pack's own folder of that name)")
    return guarded_import(module)       # ImportProblem for whatever it raised, sys.exit included


def _hub_loader():
    get_kernel = getattr(_import("kernels"), "get_kernel", None)
    if get_kernel is None:
        raise ImportError("the installed 'kernels' package has no get_kernel")
    fn = getattr(get_kernel(HUB_REPO), "flash_attn_func", None)
    if fn is None:
        raise ImportError(f"{HUB_REPO} has no flash_attn_func")
    return lambda q, k, v: fn(q, k, v, causal=False)


def _xformers_loader():
    fmha = _import("xformers.ops.fmha")
    op = getattr(_import("xformers.ops.fmha.flash3"), "FwOp", None)
    if op is None:
        raise ImportError("xformers has no flash3.FwOp")
    available = getattr(op, "is_available", None)
    if callable(available) and not available():
        raise ImportError("xformers was built without its FlashAttention 3 operator")
    return lambda q, k, v: fmha.memory_efficient_attention_forward(q, k, v, op=op)


_LOADERS = {"fa3_hub": _hub_loader, "fa3_xformers": _xformers_loader}


def _adapter(fn):
    """The package's call in the pack's terms: the output alone (some hub builds return (output, lse)), q's dtype."""
    def run(q, k, v):
        out = fn(q, k, v)
        out = out[0] if isinstance(out, (tuple, list)) else out
        return out.to(q.dtype)
    return run


def load(name: str) -> tuple:
    """(the package's attention function, None) or (None, why it did not load): attempted once per process."""
    if name not in _LOADED:
        try:
            _LOADED[name] = (_adapter(_LOADERS[name]()), None)
        except Exception as exc:  # noqa: BLE001 - whatever fails here means: not a candidate
            why = _error(exc)
            broken = isinstance(exc, ImportProblem) and exc.installed        # installed, failing: always said
            quiet = name != "fa3_hub" and isinstance(exc, ImportError) and not broken   # absent: common, no warning
            (log.info if quiet else log.warning)("wan_accel: %s is not available: %s", name, why)
            _LOADED[name] = (None, why)
    return _LOADED[name]


def _probe_input(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(1, 1, 1, 64, dtype=dtype, device=device)


def _probe(name: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """None when one tiny call of ``name`` runs on ``device`` (cached per device and dtype), else its error."""
    key = (name, device.index, dtype)
    if key not in _PROBED and capturing():       # no probe call may run then
        return "not probed inside a CUDA-graph capture (a call there would break it); the run's plans probe it first"
    if key not in _PROBED:
        error = None
        try:
            q = _probe_input(device, dtype)
            load(name)[0](q, q, q)
        except Exception as exc:  # noqa: BLE001 - what fails here ("not supported", no kernel image) would fail later
            error = _error(exc)
            log.info("wan_accel: %s does not run here: %s", name, error)
        _PROBED[key] = error
    return _PROBED[key]


def problem(name: str, device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the packaged FlashAttention 3 ``name`` is no candidate for this call, or None (module doc)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "needs a CUDA GPU"
    if dtype not in DTYPES:
        return f"needs fp16/bf16 (got {dtype_name(dtype)})"
    if not (0 < head_dim <= MAX_HEAD_DIM and head_dim % 8 == 0):
        return f"head size {head_dim} not supported (a multiple of 8 up to {MAX_HEAD_DIM})"
    if name == "fa3_hub" and os.environ.get(HUB_ENV, "").strip() != "1":      # the user allowed the download
        return f"not opted in: set {HUB_ENV}=1 to let the kernels package download FlashAttention 3 from the hub"
    cap = registry.capability(device)
    if cap[0] != 9:
        return f"FlashAttention 3 is built for SM 9.x (Hopper); this GPU is SM {cap[0]}.{cap[1]}"
    fn, why = load(name)
    if fn is None:
        return f"did not load ({why}); {HINTS[name]}"
    failed = _probe(name, device, dtype)
    if failed:
        return f"the installed build does not run on SM {cap[0]}.{cap[1]} ({failed})"
    return None


PROBLEMS = {name: functools.partial(problem, name) for name in NAMES}     # the 'auto' candidates' probes
SUMMARIES = {"fa3_hub": "FlashAttention 3 from the Hugging Face kernel hub (kernels package, opt-in)",
             "fa3_xformers": "FlashAttention 3 through xformers' flash3 operator"}


def attention(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v by the packaged FlashAttention 3 ``name``: q [B, Lq, H, D], k/v [B, Lk, H, D],
    [B, Lq, H, D] in q's dtype. Raises where the package did not load (the store lists it with its problem first)."""
    fn, why = load(name)
    if fn is None:
        raise RuntimeError(f"{name} is not available: {why}")
    return fn(q, k, v)
