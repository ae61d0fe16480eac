"""Doctor: every accelerated path proves itself on this machine before it is trusted, and says so.

Each accelerated feature (an attention backend, a fused kernel, fused q/k/v, CUDA-graph replay, a compiled block,
block swap) has a probe (``app/doctor/probes.py``): the feature and its plain fallback on a small input shaped like
the real call (head size, dtype, layout), compared in the real dtype with a tolerance derived from that dtype, and
timed. The verdict (passed / failed / slower) is stored in the limit cache under the ``doctor`` namespace, keyed by
the feature and dtype on the cache's machine fingerprint (GPU, capability, driver, CUDA, torch, Triton); the
feature's own library version (e.g. flash-attn), the probe's version, the pack's version and a digest of the code
the probe exercised (``kernels._common.code_digest``; a kernel's operator-store source hash) are stored with it, and a
verdict for another version or other code is probed again: an update that changes a kernel re-checks it without
``--recheck``. A verdict of the wrong shape (``verdict.verdict_problem``) is ignored and probed again. A failed or slower feature is switched off for this machine (``gate_options``)
with one clear line; everything else stays on. A damaged or unwritable cache never stops a run: the verdict is
then kept for this process only and probed again next time. A probe never runs inside a CUDA-graph capture or a
compile.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ...cache.fingerprint import package_version
from ...kernels._common import code_digest
from ...kernels.candidates import tolerance
from ...profiling.runner import sync_device
from . import probes as doctor_probes  # noqa: F401 - registers the pack's features
from .verdict import NAMESPACE, pack_version, verdict_problem
from .vocabulary import FEATURES, Feature, NotAvailable, Probe, ProbeContext, register_feature

__all__ = ["Doctor", "Feature", "NotAvailable", "Probe", "ProbeContext", "register_feature", "FEATURES",
           "doctor_for", "default_context", "tolerance"]
log = logging.getLogger("wan_accel")

PROBE_VERSION = 2           # 2: speed is never judged at the probe's own shape (verdicts of 1 are probed again)
SLOWER_MARGIN = 1.10         # "slower" when the feature takes more than 110 % of the fallback's time
SLOWER_MIN_S = 20e-6         # ... and at least this much longer (below it, timings are noise)
_UNSAVED: dict = {}     # (cache path, fingerprint id, key) -> verdicts the cache could not store (this process)


def library_version(feature: Feature) -> str:
    for dist in feature.library:
        version = package_version(dist)
        if version != "none":
            return f"{dist} {version}"
    return "none"


def feature_source(feature: Feature) -> str:
    """Digest of the code a feature's verdict judged: its check, its availability test and its ``sources``."""
    sources = feature.sources() if feature.sources is not None else ()
    return code_digest(feature.check, feature.requires or "", *sources)


def verdict_identity(feature: Feature) -> dict:
    """What a verdict holds for: the feature's library, the probe, the pack's version and the code's digest."""
    return {"library": library_version(feature), "probe": PROBE_VERSION, "pack": pack_version(),
            "source": feature_source(feature)}


def default_timer(fn: Callable, device, repeats: int = 5, warmup: bool = True) -> float:
    """Median wall time of ``fn()`` in seconds, after one warm-up call, device-synchronised."""
    if warmup:
        fn()
        sync_device(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync_device(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def probing_forbidden() -> str | None:
    """Why no probe may run now (inside a CUDA-graph capture or a compile), or None."""
    try:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return "inside a CUDA-graph capture"
    except Exception:  # noqa: BLE001 - no CUDA state to ask
        pass
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if is_compiling is not None and is_compiling():
        return "inside a torch.compile trace"
    return None


def _error_text(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:300]


def _finite_max(t: torch.Tensor) -> float:
    return float(t.detach().float().abs().nan_to_num(nan=float("inf")).max()) if t.numel() else 0.0


@dataclass
class Doctor:
    """Runs and remembers the checks of one device and dtype. ``timer(fn, device) -> seconds`` is pluggable."""
    cache: object = None                 # a LimitCache; None: the pack's default cache
    context: ProbeContext | None = None
    timer: Callable = default_timer
    features: dict | None = None         # None: the registered FEATURES
    probes: int = 0                      # probes run by this doctor (tests count them)
    judge_speed: bool | None = None      # None: as the probe says (never at a probe shape); True/False: always/never

    def __post_init__(self):
        if self.cache is None:
            from ...cache import LimitCache
            self.cache = LimitCache()
        if self.context is None:
            self.context = default_context()

    @property
    def catalogue(self) -> dict:
        if self.features is None:
            return FEATURES
        return self.features

    def key(self, name: str) -> str:
        return f"{name}:{str(self.context.dtype).replace('torch.', '')}:{self.context.head_dim}"

    # ------------------------------------------------------------------ stored verdicts
    def stored(self, name: str) -> dict | None:
        """The verdict recorded for this machine, library, probe, pack version and code, or None (then the
        feature is probed again; so is a verdict of the wrong shape, with one warning)."""
        key = self.key(name)
        try:
            value = self.cache.get(NAMESPACE, key)
        except Exception as exc:  # noqa: BLE001 - an unreadable cache only means: check again
            log.warning("wan_accel doctor: cannot read the limit cache (%s); checking again", _error_text(exc))
            value = None
        if value is None:
            value = _UNSAVED.get(self._unsaved_key(key))
        if value is None:
            return None
        problem = verdict_problem(value)
        if problem:
            log.warning("wan_accel doctor: ignoring the damaged verdict of %s (%s); checking again", name, problem)
            return None
        feature = self.catalogue.get(name)
        if feature is None:
            return value if value.get("probe") == PROBE_VERSION else None
        identity = verdict_identity(feature)
        if any(value.get(k) != v for k, v in identity.items()):
            return None
        return value

    def _unsaved_key(self, key: str) -> tuple:
        try:
            return (str(getattr(self.cache, "path", "")), self.cache.fingerprint_id, key)
        except Exception:  # noqa: BLE001 - a cache without identity: this doctor's key only
            return (id(self.cache), key)

    def _record(self, key: str, value: dict) -> None:
        try:
            self.cache.put(NAMESPACE, key, value)       # an unwritable cache keeps it in memory and warns once
            problem = getattr(self.cache, "writable_problem", None)
        except Exception as exc:  # noqa: BLE001 - unwritable cache: the verdict holds for this process only
            problem = _error_text(exc)
        if problem:
            _UNSAVED[self._unsaved_key(key)] = value
            log.warning("wan_accel doctor: cannot write the limit cache (%s); the check runs again next time",
                        problem)
        else:
            _UNSAVED.pop(self._unsaved_key(key), None)

    # ------------------------------------------------------------------ checking
    def unavailable(self, name: str) -> tuple[str | None, str]:
        """(reason the feature cannot run here or None, what would turn it on or ''; cheap: no probe is run)."""
        feature = self.catalogue.get(name)
        try:
            if feature is None:
                raise NotAvailable(f"not available in this build (no feature '{name}')")
            (feature.requires or feature.check)(self.context)
        except NotAvailable as exc:
            return exc.reason, exc.hint
        return None, ""

    def check(self, name: str, recheck: bool = False) -> dict | None:
        """The verdict of ``name`` on this machine, probing once when none is recorded (or ``recheck``).

        None when the feature is not available here or no probe may run now."""
        if not recheck:
            value = self.stored(name)
            if value is not None:
                return value
        feature = self.catalogue.get(name)
        if probing_forbidden() or feature is None:
            return None
        try:
            probe = feature.check(self.context)
        except NotAvailable:
            return None
        from ...cache.warmup import spent
        with spent("doctor"):
            value = self._run(feature, probe)
        self._record(self.key(name), value)
        return value

    def _run(self, feature: Feature, probe: Probe) -> dict:
        self.probes += 1
        ctx = self.context
        value = {"status": "failed", "difference": None, "tolerance": None, "feature_ms": None,
                 "fallback_ms": None, "error": None, **verdict_identity(feature),
                 "dtype": str(probe.dtype).replace("torch.", ""), "checked": time.time(), "note": probe.note,
                 "shape": f"{ctx.tokens} tokens, {ctx.heads} heads x {ctx.head_dim}, "     # the table shows it
                          f"{str(ctx.dtype).replace('torch.', '')}"}
        try:
            with torch.no_grad():
                reference = probe.fallback()
        except Exception as exc:  # noqa: BLE001 - the fallback failing is reported, never raised
            value["error"] = f"the fallback itself failed: {_error_text(exc)}"
            return value
        try:
            with torch.no_grad():
                out = probe.feature()
            sync_device(ctx.device)
        except Exception as exc:  # noqa: BLE001 - whatever fails here would fail in the model
            value["error"] = _error_text(exc)
            return value
        if tuple(out.shape) != tuple(reference.shape):
            value["error"] = f"wrong shape {tuple(out.shape)}, expected {tuple(reference.shape)}"
            return value
        diff = _finite_max(out.to(probe.dtype).float() - reference.to(probe.dtype).float())
        tol = tolerance(probe.dtype, _finite_max(reference), probe.ulps)
        if probe.bound is not None and diff != float("inf"):      # units of the feature's stated error bound
            with torch.no_grad():
                gap = (out.to(probe.dtype).float() - reference.to(probe.dtype).float()).abs()
                diff, tol = float((gap / probe.bound().to(gap.device)).max()), 1.0
        value.update(difference=diff if diff != float("inf") else None, tolerance=tol)
        if not diff <= tol:
            value["error"] = (f"wrong numbers: max difference {diff:.3g} against the fallback exceeds "
                              f"{tol:.3g} ({value['dtype']})" if diff != float("inf") else
                              "wrong numbers: non-finite values where the fallback has none")
            return value
        # A speed verdict from the probe's small shape says nothing about the run's (fused q/k/v was slower at 256
        # tokens and equal at 4680): speed is decided at the call's own shapes by the operator store, so the
        # doctor judges it only where the probe says it runs the real shape (or a caller insists).
        judge = self.judge_speed if self.judge_speed is not None else bool(probe.judge_speed)
        # a speed that is not judged is shown from one timed call (the interpreter makes repeats costly)
        once = {} if judge or self.timer is not default_timer else {"repeats": 1, "warmup": False}
        try:
            with torch.no_grad():
                t_feat = float(self.timer(probe.feature, ctx.device, **once))
                t_fb = float(self.timer(probe.fallback, ctx.device, **once))
        except Exception as exc:  # noqa: BLE001 - a feature that fails when repeated is not trusted
            value["error"] = f"failed when repeated: {_error_text(exc)}"
            return value
        value.update(feature_ms=round(t_feat * 1e3, 4), fallback_ms=round(t_fb * 1e3, 4))
        value["speed_judged"] = bool(judge)
        if judge and t_feat > SLOWER_MARGIN * t_fb and t_feat - t_fb > SLOWER_MIN_S:
            value["status"] = "slower"
            value["error"] = f"slower than the fallback ({t_feat * 1e3:.3f} ms against {t_fb * 1e3:.3f} ms)"
            return value
        value["status"] = "passed"
        return value

    def why_off(self, name: str, recheck: bool = False) -> str | None:
        """None when ``name`` may be used; else the reason it is switched off on this machine."""
        value = self.check(name, recheck=recheck)
        if value is None or value["status"] == "passed":
            return None
        return value.get("error") or value["status"]


def default_context(device=None, dtype=None, head_dim: int = 128, **kw) -> ProbeContext:
    """Probe shape for a device (default: CUDA when present, else the CPU) and its usual dtype."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return ProbeContext(device=device, dtype=dtype, head_dim=int(head_dim), **kw)


def doctor_for(device, dtype, head_dim: int = 128, cache=None, timer: Callable | None = None,
               **context_kw) -> Doctor:
    """A Doctor whose verdicts live under the fingerprint of ``device`` (the GPU the model runs on);
    ``context_kw``: further ProbeContext fields (with_compile, tokens, ...)."""
    from ...cache import LimitCache, fingerprint
    context = default_context(device, dtype, head_dim, **context_kw)
    if cache is None:
        cache = LimitCache(fingerprint=fingerprint(context.device))
    return Doctor(cache=cache, context=context, timer=timer or default_timer)
