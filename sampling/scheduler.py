"""Flow-matching scheduler of the causal Wan samplers (shifted sigmas, warped step lists).

sigmas = shift*s / (1 + (shift-1)*s) over s = linspace(1, 0, N+1)[:-1] (float32), timesteps = N*sigmas.
sigma(t) = sigmas[argmin |timesteps - t|]. All lookups are done once on the host when a schedule is
resolved, so the sampling loop never synchronises with the device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

NUM_TRAIN_TIMESTEPS = 1000
SCHEDULE_ROUNDING = 1e-3   # relative slack of the computed timesteps over N (float32 arithmetic of small shifts)
MAX_SHIFT = 100.0          # shifts beyond this squeeze every step against sigma 1; the released models use 3-8

PRESETS = {
    "self_forcing": {"steps": [1000, 750, 500, 250], "shift": 5.0, "warp": True},
    "causvid": {"steps": [1000, 757, 522], "shift": 8.0, "warp": False},
    "longlive": {"steps": [1000, 750, 500, 250], "shift": 5.0, "warp": True},
    # Krea Realtime: int(linspace(1000, 0, 4)) warped, ending with a call at timestep 0 (krea.krea_schedule)
    "krea": {"steps": [1000, 666, 333, 0], "shift": 5.0, "warp": True},
}
PRESET_NAMES = ("self_forcing", "causvid", "longlive", "krea", "custom")
# the chunking a preset's model was made for (latent frames): LongLive v1.0 (configs/longlive_*inference.yaml)
# samples 3-frame blocks with a local attention window of 12 frames, 3 of them sink frames
# Krea Realtime samples 3-frame blocks after a rebuilt context of K = 3 frames: a window of K + 3 (recache krea)
PRESET_CHUNKING = {"longlive": {"frames_per_block": 3, "kv_window": 12, "sink": 3},
                   "krea": {"frames_per_block": 3, "kv_window": 6, "sink": 0, "recache": "krea"}}


class FlowMatchScheduler:
    def __init__(self, shift: float = 5.0, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS):
        self.shift = float(shift)
        self.num_train_timesteps = n = int(num_train_timesteps)
        s = torch.linspace(1.0, 0.0, n + 1, dtype=torch.float32)[:-1]
        self.sigmas = self.shift * s / (1 + (self.shift - 1) * s)
        self.timesteps = self.sigmas * n

    def warp(self, steps) -> torch.Tensor:
        """Warped step list: [timesteps..., 0][N - step] (float32)."""
        ext = torch.cat([self.timesteps, torch.zeros(1, dtype=torch.float32)])
        idx = self.num_train_timesteps - torch.tensor([int(s) for s in steps], dtype=torch.long)
        if (idx < 0).any() or (idx > self.num_train_timesteps).any():
            raise ValueError(f"warped steps must lie in [0, {self.num_train_timesteps}], got {list(steps)}")
        return ext[idx]

    def sigma_index(self, t: float, dtype=torch.float64) -> int:
        """argmin |timesteps - t| compared in ``dtype`` (float64 for flow->x0, float32 for re-noising)."""
        tt = torch.tensor(t, dtype=torch.float32).to(dtype)
        return int(torch.argmin((self.timesteps.to(dtype) - tt).abs()))

    def sigma(self, t: float, dtype=torch.float64) -> float:
        return float(self.sigmas[self.sigma_index(t, dtype)])

    @staticmethod
    def to_x0(xt: torch.Tensor, flow: torch.Tensor, sigma: float) -> torch.Tensor:
        """x0 = xt - sigma * flow, in float64, cast back to xt's dtype."""
        return (xt.double() - sigma * flow.double()).to(xt.dtype)

    @staticmethod
    def renoise(x0: torch.Tensor, eps: torch.Tensor, one_minus_sigma: float, sigma: float,
                dtype=None) -> torch.Tensor:
        """(1 - sigma) * x0 + sigma * eps in float32, cast to ``dtype`` (x0's dtype by default)."""
        out = one_minus_sigma * x0.float() + sigma * eps.float()
        return out.to(dtype or x0.dtype)


@dataclass
class Schedule:
    """A resolved step list: model timesteps and the sigmas the sampler needs, as host floats."""
    name: str
    shift: float
    steps_config: list
    warp: bool
    timesteps: list = field(default_factory=list)       # float32 values fed to the model
    x0_sigmas: list = field(default_factory=list)       # sigma(t_k) for flow->x0 (float64 argmin)
    renoise: list = field(default_factory=list)         # (1 - sigma, sigma) of t_k, float32 argmin
    scheduler: FlowMatchScheduler | None = None

    def x0_sigma_at(self, t: float) -> float:
        if self.scheduler is None:                      # a schedule given as sigmas: sigma = t / N
            return float(t) / NUM_TRAIN_TIMESTEPS
        return self.scheduler.sigma(t, torch.float64)

    def sigmas(self) -> list:
        """The step list as sigmas, one per step plus the final 0 (what ComfyUI's SIGMAS carry)."""
        return [float(s) for s in self.x0_sigmas] + [0.0]


class ScheduleError(ValueError):
    """A shift, step list or sigma list that gives no usable schedule; the message names the value at fault."""


def _number(name: str, value) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ScheduleError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(v):
        raise ScheduleError(f"{name} must be a finite number, got {value!r}")
    return v


def check_steps(steps, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS, name: str = "steps") -> list:
    """A non-empty list of finite timesteps in [0, num_train_timesteps]."""
    if isinstance(steps, str):
        steps = parse_steps(steps)
    out = [_number(f"{name} item {i + 1}", v) for i, v in enumerate(steps)]
    if not out:
        raise ScheduleError(f"{name} is empty: give timesteps in (0, {num_train_timesteps}], e.g. 1000,750,500,250")
    for i, v in enumerate(out):
        if not 0 <= v <= num_train_timesteps:
            raise ScheduleError(f"{name} item {i + 1} ({v:g}) is outside [0, {num_train_timesteps}]; e.g. "
                                f"1000,750,500,250")
    return out


def check_sigmas(sigmas, name: str = "sigmas") -> list:
    """A sigma list as the samplers take it: finite, decreasing within (0, 1], then a final 0."""
    try:
        values = [float(v) for v in torch.as_tensor(sigmas, dtype=torch.float64).flatten().cpu().tolist()]
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ScheduleError(f"{name} must be a list of numbers, got {sigmas!r} ({exc})") from None
    if len(values) < 2:
        raise ScheduleError(f"{name} need at least one step and the final 0, got {values}")
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise ScheduleError(f"{name} item {bad[0] + 1} is {values[bad[0]]}: every sigma must be a finite number "
                            f"in [0, 1]")
    if values[-1] != 0.0:
        raise ScheduleError(f"the last sigma must be 0 (the clean output), got {values[-1]}; use the Wan Causal "
                            f"Sigmas node or end the list with 0")
    steps = values[:-1]
    if any(not 0 < v <= 1 for v in steps) or any(b >= a for a, b in zip(steps, steps[1:])):
        raise ScheduleError(f"{name} before the final 0 must decrease within (0, 1], got {values}")
    return values


def check_schedule(schedule: "Schedule", num_train_timesteps: int = NUM_TRAIN_TIMESTEPS) -> "Schedule":
    """The computed schedule itself: timesteps finite in [0, N], sigmas finite in [0, 1] (a tiny shift can turn
    an input that looks fine into inf or NaN)."""
    where = f"shift {schedule.shift:g}" if schedule.scheduler is not None else "these sigmas"
    for label, values, hi in (("timestep", schedule.timesteps, float(num_train_timesteps)),
                              ("sigma", schedule.x0_sigmas, 1.0),
                              ("sigma", [v for pair in schedule.renoise for v in pair], 1.0)):
        for v in values:     # a hair above hi is float32 rounding of the shift formula, not a broken schedule
            if not math.isfinite(v) or not 0.0 <= v <= hi * (1 + SCHEDULE_ROUNDING):
                raise ScheduleError(f"{where} gives the {label} {v} (outside [0, {hi:g}]); the schedule would "
                                    f"produce a NaN video: use a shift between 1 and 10 (the released models use "
                                    f"3-8) or other steps")
    return schedule


def parse_steps(text: str) -> list:
    try:
        steps = [float(s) for s in text.replace(",", " ").split()]
    except ValueError:
        raise ScheduleError(f"steps must be numbers separated by commas, got {text!r}") from None
    if not steps:
        raise ScheduleError("the step list is empty")
    return steps


def resolve_schedule(preset: str = "self_forcing", steps=None, shift=None, warp=None,
                     num_train_timesteps: int = NUM_TRAIN_TIMESTEPS) -> Schedule:
    """Preset 'self_forcing' / 'causvid' (steps/shift/warp override it when given) or 'custom'."""
    if preset not in PRESET_NAMES:
        raise ValueError(f"preset must be one of {PRESET_NAMES}, got {preset!r}")
    base = PRESETS.get(preset, {"steps": None, "shift": 5.0, "warp": True})
    steps = base["steps"] if steps is None else (parse_steps(steps) if isinstance(steps, str) else list(steps))
    if steps is None:
        raise ValueError("preset 'custom' needs a step list, e.g. '1000,750,500,250'")
    steps = check_steps(steps, num_train_timesteps)
    shift = base["shift"] if shift is None else _number("shift", shift)
    if not 0 < shift <= MAX_SHIFT:
        raise ScheduleError(f"shift must be greater than 0 and at most {MAX_SHIFT:g}, got {shift:g}")
    warp = base["warp"] if warp is None else bool(warp)
    sched = FlowMatchScheduler(shift, num_train_timesteps)
    if warp:
        t = sched.warp(steps)
    else:
        t = torch.tensor([float(s) for s in steps], dtype=torch.float32)
    timesteps = [float(v) for v in t]
    s32 = [sched.sigmas[sched.sigma_index(v, torch.float32)] for v in timesteps]
    renoise = [(float(1 - s), float(s)) for s in s32]
    return check_schedule(Schedule(preset, shift, list(steps), warp, timesteps,
                                   [sched.sigma(v, torch.float64) for v in timesteps], renoise, sched),
                          num_train_timesteps)


def schedule_from_sigmas(sigmas, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS) -> Schedule:
    """A Schedule from a descending sigma list ending in 0 (one step per sigma before it): timesteps
    sigma * N in float32, flow -> x0 with sigma, re-noising to sigma with (1 - sigma, sigma) in float32. Sigmas of
    a preset (``Schedule.sigmas``) give back the preset's timesteps and sigmas exactly."""
    check_sigmas(sigmas)
    s32 = torch.as_tensor(sigmas, dtype=torch.float32).flatten().cpu()
    steps = s32[:-1]
    if bool((steps <= 0).any()) or bool((steps[1:] >= steps[:-1]).any()):   # distinct in float64, not float32
        raise ScheduleError(f"sigmas before the final 0 must decrease within (0, 1] in float32, got {s32.tolist()}")
    t = steps * num_train_timesteps
    return check_schedule(Schedule("sigmas", 1.0, [float(v) for v in t], False, [float(v) for v in t],
                                   [float(v) for v in steps], [(float(1 - v), float(v)) for v in steps], None),
                          num_train_timesteps)
