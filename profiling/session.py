"""Profile requests: "profile the next N runs of this model", attached to a model handle and honoured by whoever
runs the model.

Protocol for code that runs a model (the sampler node, the generate job)::

    from .session import maybe_profile
    latents = maybe_profile(handle, sample_causal, model, context, noise, ...)   # same return value

``maybe_profile`` calls the function directly when the handle carries no pending request (zero overhead), and
otherwise profiles that one call into its own trace and keeps the report on the request
(``request.latest``). A ComfyUI-native MODEL uses the window form instead (``request.step``): the next N model
calls go into one trace, closed after the N-th call or by ``request.finish()``.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import threading
from typing import Any, Callable

log = logging.getLogger("wan_accel.profiling")

PROFILE_ATTR = "profile"  # attribute (or dict key) of a model handle that holds its ProfileRequest
MAX_KEPT_REPORTS = 16


class ProfileRequest:
    """Profile the next ``runs`` calls made through this request.

    out_dir: where traces go (None: ComfyUI's output folder inside ComfyUI, else ./wan_accel_profiles).
    name: trace file prefix. history: append a 'profile' record per report to the metrics history.
    settings: free-form dict stored with the history record (what was being profiled).
    """

    def __init__(self, runs: int = 1, out_dir=None, *, name: str = "wan_sampler", record_shapes: bool = False,
                 history: bool = True, settings: dict | None = None, device=None):
        if int(runs) < 1:
            raise ValueError(f"runs must be >= 1, got {runs}")
        self.runs = int(runs)
        self.out_dir = out_dir
        self.name = str(name)
        self.record_shapes = bool(record_shapes)
        self.history = bool(history)
        self.settings = dict(settings or {})
        self.device = device
        self.remaining = self.runs
        self.reports: list = []
        self.skipped: list[str] = []
        self._window = None          # open ProfileSession in window mode
        self._lock = threading.RLock()

    # A request is shared, never duplicated: ComfyUI deep-copies model options when it clones a patcher.
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        return f"ProfileRequest(runs={self.runs}, remaining={self.remaining}, reports={len(self.reports)})"

    # ---------------------------------------------------------------- state
    @property
    def pending(self) -> bool:
        """True while calls are still to be profiled (or a window is open)."""
        return self.remaining > 0 or self._window is not None

    @property
    def latest(self):
        """The most recent ProfileReport, or None."""
        return self.reports[-1] if self.reports else None

    def text(self) -> str:
        """Report text for the UI: the latest report, or why there is none yet."""
        with self._lock:
            if self.latest is not None:
                earlier = [f"earlier run {i}: {r.mean_run_s or 0.0:.3f} s, trace {r.trace_path}"
                           for i, r in enumerate(self.reports[:-1], 1)]
                return "\n".join(earlier + [self.latest.to_text()])
            if self._window is not None:
                return (f"profiling window open: {len(self._window.run_times)} of {self.runs} call(s) recorded; "
                        "the report is written when the window closes.")
            why = ("\n".join(self.skipped[-3:]) + "\n") if self.skipped else ""
            return (why + f"no profiled run yet: the next {self.remaining} run(s) of this model will be profiled. "
                    "Run the sampler first (connect its output to the report node's 'after' input so the "
                    "report runs after it).")

    def _new_session(self):
        from .runner import ProfileSession, default_out_dir

        out_dir = self.out_dir if self.out_dir is not None else default_out_dir()
        return ProfileSession(out_dir=out_dir, trace_name=self.name, device=self.device,
                              record_shapes=self.record_shapes)

    def _skip(self, msg: str) -> None:
        log.warning("wan_accel profile: %s", msg)
        self.skipped.append(msg)

    def _busy(self) -> bool:
        from .runner import profiler_busy

        if profiler_busy():
            self._skip("skipped a run: another profiler was already recording (profilers cannot nest).")
            return True
        return False

    def _finish_session(self, session):
        """Write the trace and keep the report; a failure here (disk full, ...) is logged, never raised:
        the profiled work already succeeded and its result must reach the caller."""
        try:
            report = session.finish()
        except Exception as exc:  # noqa: BLE001
            session.abort()
            self._skip(f"profiling finished the run but could not write its report: {exc}")
            return None
        report.result = None  # do not keep outputs (latents) alive through the report
        self._keep(report)
        return report

    def _keep(self, report) -> None:
        self.reports.append(report)
        del self.reports[:-MAX_KEPT_REPORTS]
        log.info("wan_accel profile report:\n%s", report.to_text())
        if self.history:
            try:
                from .history import append

                append(report.history_record(self.settings))
            except Exception as exc:  # noqa: BLE001 - history is a bonus, never fail the run for it
                log.warning("wan_accel profile: could not append to the metrics history: %s", exc)

    # ---------------------------------------------------------------- per-call form
    def run(self, fn: Callable, *args, **kwargs) -> Any:
        """Call ``fn(*args, **kwargs)``; profiled into its own trace while runs remain. Returns fn's result."""
        with self._lock:
            if self.remaining <= 0 or self._busy():
                return fn(*args, **kwargs)
            self.remaining -= 1
            session = self._new_session()
            out = session.run(fn, *args, **kwargs)  # stops the profiler and re-raises if fn raises
            self._finish_session(session)
            return out

    # ---------------------------------------------------------------- window form
    def step(self, fn: Callable, *args, **kwargs) -> Any:
        """Window form: the next ``runs`` calls go into ONE trace; it closes after the last of them."""
        with self._lock:
            if self._window is None:
                if self.remaining <= 0 or self._busy():
                    return fn(*args, **kwargs)
                self._window = self._new_session().begin()
            self.remaining -= 1
            try:
                out = self._window.run(fn, *args, **kwargs)
            except BaseException:
                self._window = None  # run() stopped the profiler already
                self.remaining = 0
                raise
            if self.remaining <= 0:
                self.finish()
            return out

    def finish(self):
        """Close an open window (fewer calls came than asked for) and keep its report. Returns it or None."""
        with self._lock:
            session, self._window = self._window, None
            if session is None:
                return None
            self.remaining = 0
            return self._finish_session(session)


# -------------------------------------------------------------------- handles
def get_profile_request(handle) -> ProfileRequest | None:
    """The ProfileRequest attached to a model handle, or None. Looked up as the dict key / attribute
    ``profile``, then in the handle's ``extra`` dict (which survives ``dataclasses.replace``)."""
    if isinstance(handle, dict):
        req = handle.get(PROFILE_ATTR)
    else:
        req = getattr(handle, PROFILE_ATTR, None)
        extra = getattr(handle, "extra", None)
        if req is None and isinstance(extra, dict):
            req = extra.get(PROFILE_ATTR)
    return req if isinstance(req, ProfileRequest) else None


def attach_profile_request(handle, request: ProfileRequest | None):
    """A shallow copy of ``handle`` that carries ``request`` (None removes it). The input is never mutated,
    so a handle cached upstream by ComfyUI stays clean; the copy shares the model and everything else.

    Where it goes: a dict handle gets the key ``profile``; a dataclass with a ``profile`` field gets it via
    ``dataclasses.replace``; a handle with an ``extra`` dict gets a new ``extra`` holding ``profile`` (so later
    ``dataclasses.replace`` calls by other nodes keep it); anything else gets a ``profile`` attribute."""
    if isinstance(handle, dict):
        return {**handle, PROFILE_ATTR: request}
    if dataclasses.is_dataclass(handle) and not isinstance(handle, type) and \
            PROFILE_ATTR in {f.name for f in dataclasses.fields(handle)}:
        return dataclasses.replace(handle, **{PROFILE_ATTR: request})
    new = copy.copy(handle)
    try:
        extra = getattr(handle, "extra", None)
        if isinstance(extra, dict):
            extra = {k: v for k, v in extra.items() if k != PROFILE_ATTR}
            if request is not None:
                extra[PROFILE_ATTR] = request
            object.__setattr__(new, "extra", extra)
        else:
            object.__setattr__(new, PROFILE_ATTR, request)
    except (AttributeError, TypeError) as exc:
        raise TypeError(f"cannot attach a profile request to a {type(handle).__name__}: give it a '{PROFILE_ATTR}' "
                        f"field (dataclass) or an 'extra' dict, or use a dict handle") from exc
    return new


def maybe_profile(handle, fn: Callable, *args, **kwargs) -> Any:
    """Call ``fn(*args, **kwargs)``, profiled when ``handle`` carries a pending ProfileRequest."""
    req = get_profile_request(handle)
    if req is None or req.remaining <= 0:
        return fn(*args, **kwargs)
    if req.device is None:  # sync and read peak memory on the model's device
        req.device = handle.get("device") if isinstance(handle, dict) else getattr(handle, "device", None)
    return req.run(fn, *args, **kwargs)
