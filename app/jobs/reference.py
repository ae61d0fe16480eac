"""Parity check against reference fixtures (outputs of the official implementations).

A fixture directory holds ``*_config.json`` files; each names its weights and io safetensors files.
``FORMATS`` maps a format name to (detect(config) -> bool, run(directory, config, device) -> rows);
a new fixture kind (e.g. Matrix-Game-2) is added with ``register_format``. Every number (widths, heads,
frames, latent size, padding, step list, shift, ...) is read from the fixture's config.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from ...cache.finite_flags import non_finite
from ...cache.owned_files import loads_json, read_regular

TOLERANCE = 1e-4
FORMATS: dict = {}
INF = float("inf")


def register_format(name: str, detect, run) -> None:
    FORMATS[name] = (detect, run)


class FixtureError(ValueError):
    """A fixture the check cannot use (a file that is missing or damaged, a config key or recorded tensor that is
    not there); the message names the file and the fix."""


class Row(tuple):
    """One compared tensor: ``(name, max_abs_diff)`` (a 2-tuple, so ``dict(rows)`` and ``for n, d in rows``
    work), with ``note`` saying why a row failed without a number (a tensor missing from the fixture, a fixture
    that could not run)."""

    def __new__(cls, name: str, diff, note: str | None = None):
        row = tuple.__new__(cls, (str(name), float(diff)))
        row.note = note
        return row


class Rows(list):
    """The rows of a check, with ``notes``: inputs of the folder that were not checked, and why."""

    def __init__(self, rows=(), notes=()):
        super().__init__(rows)
        self.notes = list(notes)


def row_ok(diff: float, tol: float = TOLERANCE) -> bool:
    """Whether one row passes: a number within the tolerance (NaN and inf fail)."""
    return isinstance(diff, (int, float)) and math.isfinite(diff) and diff <= tol


def verdict(rows, tol: float = TOLERANCE) -> dict:
    """The one verdict of a check, computed from every row: it passes when there is at least one row and every
    row passes (``row_ok``). worst: NaN when any row is NaN, else the largest difference."""
    diffs = [d for _, d in rows]
    failed = [n for n, d in rows if not row_ok(d, tol)]
    worst = float("nan") if any(math.isnan(d) for d in diffs) else max(diffs, default=0.0)
    return {"tensors": len(diffs), "worst": worst, "failed": failed, "pass": bool(diffs) and not failed}


class FixtureConfig(dict):
    """A fixture's config JSON: a key that is not there names the config file and the key (never a bare
    KeyError)."""

    def __init__(self, data: dict, path: Path, where: str = ""):
        super().__init__({k: _config_value(v, path, f"{where}{k}.") for k, v in data.items()})
        self.path, self.where = Path(path), where

    def __missing__(self, key):
        section = f" in '{self.where[:-1]}'" if self.where else ""
        raise FixtureError(f"{self.path.name}: no '{key}'{section}; this fixture config is incomplete: copy it again "
                           f"from the fixture's source (or produce it again)")


def _config_value(value, path: Path, where: str):
    if isinstance(value, dict):
        return FixtureConfig(value, path, where)
    if isinstance(value, list):
        return [_config_value(v, path, where) for v in value]
    return value


class Recorded(dict):
    """The tensors of a fixture's io file: an input the run needs (``io[key]``) that is not there, or that holds
    NaN or inf, names the file and the key (``FixtureError``); ``compare(key, ours)`` is the row of one expected
    recorded tensor (inf, with a note, when the file lacks it or the run made nothing to compare; a recorded tensor
    of NaN or inf fails its row, with a note naming it); ``reference(key)`` is a recorded tensor as it is."""

    def __init__(self, tensors: dict, path: Path):
        super().__init__(tensors)
        self.path = Path(path)
        self.nonfinite = set(non_finite(tensors))          # one host sync for the whole file

    def __missing__(self, key):
        raise FixtureError(f"{self.path.name}: no tensor '{key}', which the run needs; the fixture is incomplete: "
                           f"copy or produce it again")

    def __getitem__(self, key):
        tensor = super().__getitem__(key)
        if key in self.nonfinite:
            raise FixtureError(f"{self.path.name}: tensor '{key}', which the run needs, holds NaN or inf; the "
                               f"fixture is damaged: copy or produce it again")
        return tensor

    def reference(self, key: str) -> torch.Tensor:
        """A recorded tensor to compare with (kept when it holds NaN or inf: its row fails)."""
        return dict.__getitem__(self, key) if key in self else self.__missing__(key)

    def compare(self, key: str, ours, diff=None, name: str | None = None) -> Row:
        name = key if name is None else name
        if key not in self:
            return Row(name, INF, f"expected, but missing from {self.path.name}")
        if ours is None:
            return Row(name, INF, "recorded, but the run made nothing to compare it with")
        value = (diff or max_abs_diff)(ours, self.reference(key))
        note = f"the recorded tensor holds NaN or inf in {self.path.name}" if key in self.nonfinite else None
        return Row(name, value if note is None or not row_ok(value) else INF, note)


def max_abs_diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours = ours.detach().to("cpu", torch.float64)
    ref = ref.detach().to("cpu", torch.float64)
    if ours.shape != ref.shape:
        if ours.numel() != ref.numel():
            return float("inf")
        ours = ours.reshape(ref.shape)
    if ref.numel() == 0:
        return 0.0
    return float((ours - ref).abs().max())


def load_recorded(path) -> Recorded:
    """The tensors of a fixture's io file: one that is missing, damaged or truncated (the checkpoints' header check,
    ``read_header``, before anything is loaded) is a ``FixtureError`` naming it; a recorded tensor of NaN or inf is
    kept (its rows fail, naming it; as an input it is refused naming the file and key)."""
    from safetensors.torch import load_file

    from ...model.checkpoint import read_header
    path = Path(path)
    if not path.is_file():
        raise FixtureError(f"{path.name}: {'not a regular file' if path.exists() else 'not found'} (the recorded "
                           f"tensors of the fixture, in {path.parent}); copy or produce the fixture again")
    try:
        read_header(path)          # the checkpoints' header check: every tensor's bytes in the file, before loading
        return Recorded(load_file(str(path)), path)
    except Exception as exc:  # noqa: BLE001 - safetensors' own error types: a damaged file, said as one
        reason = " ".join(str(exc).split("; pickle checkpoints")[0].split())[:200] or type(exc).__name__
        raise FixtureError(f"{path.name}: not a readable safetensors file ({reason}): it is damaged or truncated; "
                           f"copy or produce the fixture again") from None


def _load_io(directory: Path, cfg: dict) -> Recorded:
    return load_recorded(Path(directory) / cfg["io_file"])


def _load_model(directory: Path, cfg: dict, device):
    from ...model.config import WanConfig
    from ...model.loader import load_wan_checkpoint
    config = WanConfig.from_dict(cfg["config"])
    return load_wan_checkpoint(directory / cfg["weights_file"], device=device, dtype=torch.float32,
                               precision="float32", config=config, attention="sdpa")


# --------------------------------------------------------------------- fixture A: full sequence
def _detect_full(cfg: dict) -> bool:
    return cfg.get("fixture") == "wan_t2v_full_sequence_forward"


def _capture(model) -> tuple[dict, list]:
    """Forward hooks recording the fixture's intermediate activations."""
    seen, handles = {}, []
    modules = {"patch_embedding": model.patch_embedding, "time_embedding": model.time_embedding,
               "time_projection": model.time_projection, "text_embedding": model.text_embedding,
               "head": model.head}
    modules.update({f"block{i}": b for i, b in enumerate(model.blocks)})
    for name, module in modules.items():
        handles.append(module.register_forward_hook(
            lambda _m, _i, out, name=name: seen.__setitem__(name, out.detach().clone())))
    return seen, handles


def _as_list(t: torch.Tensor, dims: int) -> list:
    return [t] if t.dim() == dims else list(t.unbind(0))


def _run_full(directory: Path, cfg: dict, device) -> list:
    model = _load_model(directory, cfg, device)
    io = _load_io(directory, cfg)
    xs = [u.to(device) for u in _as_list(io["x"], 4)]
    ctx = [u.to(device) for u in _as_list(io["context"], 2)]
    seen, handles = _capture(model)
    try:
        with torch.no_grad():
            out = model.forward_full(xs, io["t"].to(device), ctx, seq_len=cfg["inputs"].get("seq_len"))
    finally:
        for h in handles:
            h.remove()
    output = out[0] if "output" not in io or io.reference("output").dim() == 4 else torch.stack(out)
    rows = [io.compare("output", output)]
    expected = {str(k) for k in cfg.get("intermediates", {})} | {k for k in io if k.startswith("inter.")}
    for key in sorted(expected):                  # every intermediate the config lists, and every one recorded
        rows.append(io.compare(key, seen.get(key[len("inter."):])))
    return rows


# --------------------------------------------------------------------- fixture B: causal sampler
def _detect_causal(cfg: dict) -> bool:
    return cfg.get("fixture") == "causal_wan_kv_cached_sampling"


def _schedule_from_steps(steps, shift, warp=True, num_train_timesteps=1000):
    from ...sampling.scheduler import resolve_schedule
    return resolve_schedule("custom", steps=steps, shift=shift, warp=warp, num_train_timesteps=num_train_timesteps)


def _schedule_from(cfg: dict):
    s = cfg["sampler"]
    return _schedule_from_steps(s["denoising_step_list_config"], s["timestep_shift"],
                                s.get("warp_denoising_step", True),
                                s.get("scheduler", {}).get("num_train_timesteps", 1000))


def _schedule_rows(sched, io: dict, cfg: dict | None = None) -> list:
    """The step list and the scheduler tables. With ``cfg`` (a config whose ``sampler`` names the step list, and
    its ``scheduler`` the tables) each one the config implies is expected: missing from the io file, a failing
    row; without it, the ones recorded."""
    pairs = {"scheduler.sigmas": sched.scheduler.sigmas, "scheduler.timesteps": sched.scheduler.timesteps,
             "denoising_step_list": torch.tensor(sched.timesteps, dtype=torch.float32)}
    expected = set()
    if cfg is not None:
        expected = {"denoising_step_list"} | ({"scheduler.sigmas", "scheduler.timesteps"}
                                              if "scheduler" in cfg.get("sampler", {}) else set())
    compare = getattr(io, "compare", None)
    rows = []
    for key, ours in pairs.items():
        if key in expected and compare is not None:
            rows.append(compare(key, ours))
        elif key in io:
            rows.append((key, max_abs_diff(ours, io.reference(key) if hasattr(io, "reference") else io[key])))
    return rows


def _call_name(rec: dict) -> str:
    step = "context" if rec["kind"] == "context" else f"step{rec['step']}"
    return f"block{rec['chunk']}.{step}"


def _calls_row(records: list, cfg: dict, ends: list | None = None) -> tuple:
    """Structural check of the call sequence: kinds, starts and timesteps in order, and, when ``ends`` (our
    cache end indices after each call, by cache kind) is given, the recorded ``cache_ends_after_call``.
    inf on a structural mismatch."""
    ref = cfg.get("calls")
    if ref is None:
        return ("calls", 0.0)
    if len(ref) != len(records):
        return ("calls", float("inf"))
    worst = 0.0
    for i, (ours, theirs) in enumerate(zip(records, ref)):
        if ours["kind"] != theirs["kind"] or ours["current_start"] != theirs["current_start"]:
            return ("calls", float("inf"))
        if ends is not None:
            for kind, per_layer in theirs.get("cache_ends_after_call", {}).items():
                if any(list(e) != ends[i].get(kind) for e in per_layer):
                    return ("calls", float("inf"))
        worst = max(worst, abs(ours["t"] - float(theirs["timestep"])))
    return ("calls", worst)


def _kv_rows(kv, io: dict) -> list:
    """The final cache of every layer, expected when the fixture records any of them."""
    rows = []
    if not any(key.startswith("kv_final.") for key in io):
        return rows
    for i in range(len(kv.layers)):
        k, v = kv.ordered(i)
        for name, ours in (("k", k), ("v", v)):
            key = f"kv_final.layer{i}.{name}"
            if key not in io:
                rows.append(io.compare(key, ours))
                continue
            ref = io.reference(key)
            padded = torch.zeros(ref.shape, dtype=torch.float64)
            n = min(ours.shape[1], ref.shape[1])
            padded[:, :n] = ours[:, :n].to("cpu", torch.float64)
            rows.append((key, max_abs_diff(padded, ref)))
    return rows


def _run_causal(directory: Path, cfg: dict, device) -> list:
    from ...model.kv_cache import KVCache
    from ...sampling.sampler import sample_causal
    model = _load_model(directory, cfg, device)
    io = _load_io(directory, cfg)
    s, c = cfg["sampler"], model.config
    sched = _schedule_from(cfg)
    noise = io["initial_noise"]
    b, f, _, h, w = noise.shape
    frame_tokens = cfg.get("frame_seq_length") or (h // c.patch_size[1]) * (w // c.patch_size[2])
    kv = KVCache.for_model(model, b, frame_tokens, f, cfg["config"].get("local_attn_size", -1),
                           cfg["config"].get("sink_size", 0))
    records = []

    def provide(ci, k, shape, dtype, dev):
        return io[f"extra_noise.block{ci}.step{k}"].reshape(shape).to(dev, dtype)

    out = sample_causal(model, io["context"].to(device), noise, sched, s["num_frame_per_block"],
                        noise_provider=provide, refresh_t=float(s.get("context_noise", 0)),
                        independent_first_frame=bool(s.get("independent_first_frame", False)),
                        tracer=records.append, kv_cache=kv)
    rows = _schedule_rows(sched, io, cfg) + [_calls_row(records, cfg)]
    for key, ours in call_tensors(records, cfg, _call_name, io):
        rows.append(io.compare(key, ours))
    rows.append(io.compare("output", out))
    return rows + _kv_rows(kv, io)


def call_tensors(records: list, cfg: dict, call_name, io=(), transpose: bool = False) -> list:
    """[(recorded tensor name, our tensor or None)] of every model call: the tensors the config's ``calls`` list
    for each call (``tensors``; else every call's xt, flow and x0), and every other one of them ``io`` records; a
    call the run did not make gives None."""
    official = cfg.get("calls") or []
    ours = {}
    for rec in records:
        for part in ("xt", "flow", "x0"):
            ours[f"{call_name(rec)}.{part}"] = rec[part].transpose(1, 2) if transpose else rec[part]
    names = []
    for call in official:
        names += [str(t) for t in call.get("tensors", ())] if isinstance(call, dict) else []
    if not any(isinstance(call, dict) and "tensors" in call for call in official):
        names = list(ours)
    names += [n for n in ours if n in io]
    return [(n, ours.get(n)) for n in dict.fromkeys(names)]


register_format("wan_t2v_full", _detect_full, _run_full)
register_format("causal_wan", _detect_causal, _run_causal)


def _register_optional(name: str, module: str) -> None:
    """Register a format whose module (exposing detect(cfg) and run(directory, cfg, device)) may be absent."""
    import importlib
    try:
        mod = importlib.import_module(module, __package__)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.endswith(module.lstrip(".")):
            return
        raise
    register_format(name, mod.detect, mod.run)


_register_optional("matrix_game2", ".mg2_reference")
_register_optional("longlive", ".longlive_reference")
_register_optional("krea_realtime", ".krea_reference")


# --------------------------------------------------------------------- entry point
def survey(directory) -> tuple:
    """(recognised, unusable, notes) of the JSON files in ``directory``: recognised [(format name, config path,
    config)] with each config a ``FixtureConfig``; unusable [(config path, why)] for every ``*_config.json`` that
    cannot be read or is no format's (a fixture config the check cannot use is said, never skipped); notes for
    other JSON files that name a fixture kind the check does not run."""
    recognised, unusable, notes = [], [], []
    for path in sorted(Path(directory).glob("*.json")):
        is_config = path.name.endswith("_config.json")
        try:
            cfg = loads_json(read_regular(path).decode("utf-8"))   # a pipe named *.json never blocks
        except (OSError, ValueError) as exc:
            if is_config:
                unusable.append((path, f"cannot be read as JSON ({' '.join(str(exc).split())[:160]})"))
            continue
        name = next((n for n, (detect, _run) in FORMATS.items() if isinstance(cfg, dict) and detect(cfg)), None)
        if name is not None:
            recognised.append((name, path, FixtureConfig(cfg, path)))
            continue
        kind = cfg.get("fixture") if isinstance(cfg, dict) else None
        if is_config:
            unusable.append((path, (f"fixture kind {str(kind)[:60]!r} is not one check-reference runs" if kind
                                    else _why_no_format(cfg)) + f" (known: {', '.join(FORMATS)})"))
        elif kind:
            notes.append(f"{path.name}: fixture kind {str(kind)[:60]!r} is not one check-reference runs; not checked")
    return recognised, unusable, notes


def _why_no_format(cfg) -> str:
    """Why a ``*_config.json`` is no format's: not a JSON object, or an object without its 'fixture' key (the key
    every format's config names its kind with)."""
    if not isinstance(cfg, dict):
        return f"not a fixture config: a JSON {type(cfg).__name__}, not an object"
    if "fixture" not in cfg:
        return ("no 'fixture' key (the key that names the fixture's kind); this fixture config is incomplete: copy "
                "it again from the fixture's source (or produce it again)")
    return "not a fixture config of a known format"


def discover(directory) -> list:
    """[(format name, config path, config dict)] for every recognised fixture config in ``directory``."""
    return survey(directory)[0]


FIXTURE_FAILURES = (ValueError, OSError, RuntimeError, KeyError, IndexError, TypeError)


def check_reference(directory, device="cpu", formats=None) -> Rows:
    """Run every recognised fixture in ``directory``; returns [(name, max_abs_diff)] where name is
    '<config stem>/<tensor>' (``Row``s; ``notes`` lists JSON files that were not checked). A fixture config that
    cannot be used (unreadable, of no known format, naming a missing or damaged file or key, a run that fails on
    it) is a failing row '<config stem>/fixture' with the reason as its note. Raises FileNotFoundError when no
    fixture is recognised (naming the configs that could not be used)."""
    directory = Path(directory)
    fixtures, unusable, notes = survey(directory)
    if formats:
        fixtures = [fx for fx in fixtures if fx[0] in formats]
        unusable = []
    if not fixtures:
        said = "; ".join(f"{path.name}: {why}" for path, why in unusable[:3])
        raise FileNotFoundError(f"no recognised fixture config (*.json) in {directory}; known formats: "
                                f"{', '.join(FORMATS)}" + (f" ({said})" if said else ""))
    rows = Rows(notes=notes)
    for path, why in unusable:
        rows.append(Row(f"{path.stem.replace('_config', '')}/fixture", INF, f"{path.name}: {why}"))
    for name, path, cfg in fixtures:
        stem = path.stem.replace("_config", "")
        try:
            with torch.no_grad():
                got = list(FORMATS[name][1](directory, cfg, device))
        except FIXTURE_FAILURES as exc:
            reason = " ".join(str(exc).split())[:400] or type(exc).__name__
            if not isinstance(exc, ValueError):
                reason = f"{type(exc).__name__}: {reason}"
            if not reason.startswith(path.name) and not isinstance(exc, FixtureError):
                reason = f"{path.name}: {reason}"
            rows.append(Row(f"{stem}/fixture", INF, f"could not run ({reason})"))
            continue
        if not got:
            rows.append(Row(f"{stem}/fixture", INF, f"{path.name}: no recorded tensor was compared"))
        rows += [Row(f"{stem}/{r[0]}", r[1], getattr(r, "note", None)) for r in got]
    return rows


def format_table(rows, tol: float = TOLERANCE) -> str:
    width = max([len(n) for n, _ in rows] + [6])
    lines = [f"{'tensor':<{width}}  {'max_abs_diff':>12}  status"]
    for row in rows:
        name, diff = row
        note = getattr(row, "note", None)
        lines.append(f"{name:<{width}}  {diff:>12.3e}  {'ok' if row_ok(diff, tol) else 'FAIL'}"
                     + (f"  ({note})" if note else ""))
    v = verdict(rows, tol)
    failed = f", {len(v['failed'])} failed" if v["failed"] else ""
    lines.append(f"{v['tensors']} tensors{failed}, worst {v['worst']:.3e}, tolerance {tol:.0e}: "
                 f"{'PASS' if v['pass'] else 'FAIL'}")
    return "\n".join(lines)
