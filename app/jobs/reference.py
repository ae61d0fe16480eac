"""Parity check against reference fixtures (outputs of the official implementations).

A fixture directory holds ``*_config.json`` files; each names its weights and io safetensors files. The fixture
is loaded and its official run replayed by ``replay.py``; ``FORMATS`` maps a format name to its check(fixture,
device) -> rows, which compares every tensor the config implies (a missing one is a failing row). Every number
(widths, heads, frames, latent size, padding, step list, shift, ...) is read from the fixture's config.
"""
from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch

from ...cache.owned_files import loads_json, read_regular
from .replay import (INF, TOLERANCE, Fixture, FixtureConfig, FixtureError, Row, kind_of, max_abs_diff, replay,
                     row_ok)

PATHS = ("reference", "optimized")


class Rows(list):
    """The rows of a check, with ``notes``: inputs of the folder that were not checked, and why."""

    def __init__(self, rows=(), notes=()):
        super().__init__(rows)
        self.notes = list(notes)


def verdict(rows, tol: float = TOLERANCE) -> dict:
    """The one verdict of a check, computed from every row: it passes when there is at least one row and every
    row passes (``row_ok``). worst: NaN when any row is NaN, else the largest difference."""
    diffs = [d for _, d in rows]
    failed = [n for n, d in rows if not row_ok(d, tol)]
    worst = float("nan") if any(math.isnan(d) for d in diffs) else max(diffs, default=0.0)
    return {"tensors": len(diffs), "worst": worst, "failed": failed, "pass": bool(diffs) and not failed}


# --------------------------------------------------------------------- Wan T2V: full sequence forward
def _keep(module, store: dict, name: str, handles: list) -> None:
    """A forward hook that keeps a copy of ``module``'s output as ``store[name]``."""
    handles.append(module.register_forward_hook(lambda _m, _i, out: store.__setitem__(name, out.detach().clone())))


def _capture(model) -> tuple[dict, list]:
    """Forward hooks recording the fixture's intermediate activations."""
    seen, handles = {}, []
    for name in ("patch_embedding", "time_embedding", "time_projection", "text_embedding", "head"):
        _keep(getattr(model, name), seen, name, handles)
    for i, block in enumerate(model.blocks):
        _keep(block, seen, f"block{i}", handles)
    return seen, handles


def _as_list(t: torch.Tensor, dims: int) -> list:
    return [t] if t.dim() == dims else list(t.unbind(0))


def _check_full(fx: Fixture, device) -> list:
    model, io = fx.model(device), fx.io
    xs = [u.to(device) for u in _as_list(io["x"], 4)]
    ctx = [u.to(device) for u in _as_list(io["context"], 2)]
    seen, handles = _capture(model)
    try:
        with torch.no_grad():
            out = model.forward_full(xs, io["t"].to(device), ctx, seq_len=fx.cfg["inputs"].get("seq_len"))
    finally:
        for h in handles:
            h.remove()
    output = out[0] if "output" not in io or io.reference("output").dim() == 4 else torch.stack(out)
    rows = [io.compare("output", output)]
    expected = {str(k) for k in fx.cfg.get("intermediates", {})} | {k for k in io if k.startswith("inter.")}
    for key in sorted(expected):                  # every intermediate the config lists, and every one recorded
        rows.append(io.compare(key, seen.get(key[len("inter."):])))
    return rows


# --------------------------------------------------------------------- what the sampling formats share
def calls_row(name: str, ours: list, official: list, same, t_key: str = "timestep") -> tuple:
    """Structural check of the call sequence: inf when the calls differ in number or ``same(index, ours, theirs)``
    is false for one; else the largest timestep gap."""
    if len(ours) != len(official) or not all(same(i, o, t) for i, (o, t) in enumerate(zip(ours, official))):
        return (name, INF)
    worst = 0.0
    for o, t in zip(ours, official):
        worst = max(worst, abs(float(o["t"]) - float(t[t_key])))
    return (name, worst)


def _schedule_rows(sched, io, cfg: dict) -> list:
    """The step list and the scheduler tables: each one the config implies (its ``sampler`` names the step list,
    and its ``scheduler`` the tables) is expected, missing from the io file a failing row; the others, if recorded."""
    pairs = {"scheduler.sigmas": sched.scheduler.sigmas, "scheduler.timesteps": sched.scheduler.timesteps,
             "denoising_step_list": torch.tensor(sched.timesteps, dtype=torch.float32)}
    expected = {"denoising_step_list"} | ({"scheduler.sigmas", "scheduler.timesteps"}
                                          if "scheduler" in cfg.get("sampler", {}) else set())
    return [io.compare(key, ours) if key in expected else (key, max_abs_diff(ours, io.reference(key)))
            for key, ours in pairs.items() if key in expected or key in io]


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


# --------------------------------------------------------------------- causal Wan and Matrix-Game-2
class _Recorder:
    """Matrix-Game-2: forward hooks that keep the intermediates of the calls named in the fixture."""

    def __init__(self, model, wanted: dict):
        self.wanted = {int(v): k for k, v in wanted.items()}        # call index -> 'callN'
        self.current, self.saved, self.once, self.calls = {}, {}, {}, 0
        self.handles = []
        _keep(model.patch_embedding, self.current, "patch_embedding", self.handles)
        _keep(model.img_emb, self.once, "img_emb", self.handles)
        for i, block in enumerate(model.blocks):
            _keep(block, self.current, f"block{i}", self.handles)
        for b in model.action_config.blocks:
            act = model.blocks[b].action_model
            self.handles.append(act.register_forward_hook(
                lambda _m, inp, out, b=b: self.current.update({f"block{b}.action_in": inp[0].detach().clone(),
                                                                f"block{b}.action_out": out.detach().clone()})))
            for name in ("proj_mouse", "proj_keyboard"):
                if hasattr(act, name):
                    _keep(getattr(act, name), self.current, f"block{b}.{name}", self.handles)

    def after_call(self) -> None:
        tag = self.wanted.get(self.calls)
        if tag is not None:
            self.saved[tag] = dict(self.current, **self.once)
        self.current.clear()
        self.calls += 1

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def cache_ends(kv, actions) -> dict:
    """[global_end, local_end] of every cache (self-attention; Matrix-Game-2's mouse and keyboard)."""
    def pair(cache):
        return [cache.end, min(cache.end, cache.capacity)]
    out = {"self_attn": pair(kv)}
    if actions is not None and actions.mouse_cache is not None:
        out["mouse"] = pair(actions.mouse_cache)
    if actions is not None and actions.keyboard_cache is not None:
        out["keyboard"] = pair(actions.keyboard_cache)
    return out


def _check_sampled(fx: Fixture, device, path: str = "auto") -> list:
    """Causal Wan and Matrix-Game-2: the scheduler tables, the call sequence (kinds, starts, timesteps and, when
    recorded, every cache's [global_end, local_end] after each call), ``xt``/``flow``/``x0`` of every call,
    Matrix-Game-2's intermediates of the recorded calls (patch embedding, img_emb, each block's output, the action
    modules' input/output and branch contributions), ``output``, and the final caches (oldest entry first). path:
    the replay's sampler path (default 'auto': the reference path, as its tracer asks)."""
    mg2, cfg = fx.kind == "matrix_game2", fx.cfg
    model = fx.model(device)
    io, kv = fx.io, fx.kv_cache(model)
    actions = fx.actions(model) if mg2 else None
    recorder = _Recorder(model, cfg.get("intermediates", {}).get("calls", {})) if mg2 else None
    records, ends = [], []

    def trace(rec):
        if recorder is not None:
            recorder.after_call()
        records.append(rec)
        ends.append(cache_ends(kv, actions))

    try:
        out = replay(fx, model, path=path, tracer=trace, kv_cache=kv, **({"actions": actions} if mg2 else {}))
    finally:
        if recorder is not None:
            recorder.close()
    rows = _schedule_rows(fx.schedule(), io, cfg)
    official = cfg.get("calls")
    rows.append(("calls", 0.0) if official is None else calls_row("calls", records, official, lambda i, o, t: (
        o["kind"] == t["kind"] and o["current_start"] == t["current_start"] and (not mg2 or all(
            list(e) == ends[i].get(kind) for kind, per_layer in t.get("cache_ends_after_call", {}).items()
            for e in per_layer)))))
    prefix = "chunk" if mg2 else "block"
    name = lambda rec: f"{prefix}{rec['chunk']}." + ("context" if rec["kind"] == "context" else f"step{rec['step']}")
    rows += [io.compare(key, ours) for key, ours in call_tensors(records, cfg, name, io, transpose=mg2)]
    for key in expected_intermediates(cfg, io) if mg2 else ():
        tag, _, part = key[len("inter."):].partition(".")
        rows.append(io.compare(key, recorder.saved.get(tag, {}).get(part)))
    rows.append(io.compare("output", out))
    return rows + _cache_rows(fx, model, kv, actions)


def expected_intermediates(cfg: dict, io=()) -> list:
    """Matrix-Game-2: the intermediates the config implies (for each call ``intermediates.calls`` names: the patch
    embedding, img_emb, every block's output, and for each action block its input, output and the branch
    contribution of each enabled branch), then every other one ``io`` records."""
    c, a = cfg["config"], cfg["config"].get("action_config", {})
    names = ["patch_embedding", "img_emb"] + [f"block{i}" for i in range(int(c["num_layers"]))]
    for b in a.get("blocks", ()):
        names += [f"block{b}.action_in", f"block{b}.action_out"]
        names += [f"block{b}.proj_mouse"] if a.get("enable_mouse", True) else []
        names += [f"block{b}.proj_keyboard"] if a.get("enable_keyboard", True) else []
    keys = [f"inter.{tag}.{n}" for tag in cfg.get("intermediates", {}).get("calls", {}) for n in names]
    return list(dict.fromkeys(keys + sorted(k for k in io if k.startswith("inter."))))


def _cache_rows(fx: Fixture, model, kv, actions) -> list:
    """The final self-attention caches (Matrix-Game-2: and mouse and keyboard caches), oldest entry first. Every one
    is expected when the config describes them (Matrix-Game-2: ``final_caches``; causal Wan: when any is recorded,
    ours zero-padded to the recorded length), else the ones recorded."""
    io, mg2 = fx.io, actions is not None
    expected = "final_caches" in fx.cfg if mg2 else any(key.startswith("kv_final.") for key in io)
    pairs = [(f"kv_final.layer{i}", kv, i) for i in range(len(kv.layers))]
    for slot, b in enumerate(model.action_config.blocks if mg2 else ()):
        if actions.mouse_cache is not None:
            pairs.append((f"mouse_kv_final.layer{b}", actions.mouse_cache, slot))
        if actions.keyboard_cache is not None:
            pairs.append((f"keyboard_kv_final.layer{b}", actions.keyboard_cache, slot))
    rows = []
    for prefix, cache, layer in pairs:
        for name, ours in zip(("k", "v"), cache.ordered(layer)):
            key = f"{prefix}.{name}"
            if key in io and not mg2:
                ref = io.reference(key)
                padded = torch.zeros(ref.shape, dtype=torch.float64)
                n = min(ours.shape[1], ref.shape[1])
                padded[:, :n] = ours[:, :n].to("cpu", torch.float64)
                rows.append((key, max_abs_diff(padded, ref)))
            elif expected or key in io:
                rows.append(io.compare(key, ours))
    return rows


# --------------------------------------------------------------------- LongLive v1.0
def _check_longlive(fx: Fixture, device) -> list:
    """Each variant (window, sink, prompt switches, with or without the generator LoRA) on both sampler paths, the
    LoRA variant also on the merged weights file: its warped step list, its call sequence (the re-cache passes left
    out), the x0 of every step of every chunk (``x0_steps``, expected without the LoRA) and the final latents."""
    cfg, _ = fx.cfg, fx.io                                          # the io file is read first
    base = (fx.directory / cfg["base_weights"]).resolve()
    rows = []
    if "base_weights_sha256" in cfg:
        same = hashlib.sha256(base.read_bytes()).hexdigest() == cfg["base_weights_sha256"]
        rows.append(("base_weights_sha256", 0.0 if same else float("inf")))
    steps = torch.tensor(fx.schedule().timesteps, dtype=torch.float32)
    for variant, v in cfg["variants"].items():
        if "denoising_step_list" in v:
            rows.append((f"{variant}.denoising_step_list", max_abs_diff(steps, torch.tensor(v["denoising_step_list"]))))
    plain, lora_model = fx.model(device), None
    for variant, v in cfg["variants"].items():
        if v.get("lora"):
            lora_model = lora_model or fx.model(device, lora=fx.file("lora_file"))
        for path in PATHS:
            rows += _longlive_rows(fx, lora_model if v.get("lora") else plain, variant, path, f"{path}.{variant}")
    merged = fx.file("merged_file")
    lora_variants = [name for name, v in cfg["variants"].items() if v.get("lora")]
    if merged.is_file() and lora_variants:
        model = fx.model(device, weights=merged)
        for path in PATHS:
            rows += _longlive_rows(fx, model, lora_variants[0], path, f"{path}.{lora_variants[0]}.merged")
    return rows


def _longlive_rows(fx: Fixture, model, variant: str, path: str, tag: str) -> list:
    fpb, io, p = int(fx.cfg["frames_per_block"]), fx.io, model.config.patch_size
    noise = io["initial_noise"]
    frame_tokens = (noise.shape[-2] // p[1]) * (noise.shape[-1] // p[2])
    records = []
    out = replay(fx, model, variant, path=path, tracer=records.append)
    official = [c for c in fx.cfg["variants"][variant]["calls"]      # the re-cache passes are not traced
                if not (float(c["t"]) == 0 and int(c["frames"]) > fpb)]
    rows = [calls_row(f"{tag}.calls", records, official, lambda _i, o, t: (
        o["current_start"] == int(t["start_frame"]) * frame_tokens and int(t["frames"]) == fpb), "t")]
    key = f"{variant}.x0_steps"
    if x0_steps_expected(fx.cfg, variant) and key not in io:
        rows.append(io.compare(key, None, name=f"{tag}.x0_steps"))
    elif key in io:
        ref = io.reference(key)
        seen = torch.full(ref.shape, float("nan"), dtype=torch.float64)
        for rec in records:
            if rec["kind"] == "denoise" and rec["step"] < ref.shape[0]:
                c = rec["chunk"]
                seen[rec["step"], :, c * fpb:(c + 1) * fpb] = rec["x0"].detach().to("cpu", torch.float64)
        made = bool(torch.isfinite(seen).all())
        rows.append(Row(f"{tag}.x0_steps", max_abs_diff(seen, ref) if made else float("inf"),
                        None if made else "the run made no x0 for some recorded steps"))
    rows.append(io.compare(f"{variant}.latents", out, name=f"{tag}.latents"))
    return rows


def x0_steps_expected(cfg: dict, variant: str) -> bool:
    """Whether the io file must record ``<variant>.x0_steps``: the producer records every step's x0 of each
    variant run without the LoRA adapter (the adapter run's steps are not traced; its latents are)."""
    return not cfg["variants"][variant].get("lora")


# --------------------------------------------------------------------- Krea Realtime
def reencoded_blocks(cfg: dict) -> int:
    """How many blocks re-encode a stand-in first frame (each hands one frame to the encoder)."""
    from ...sampling.krea import context_frames
    s = cfg["session"]
    k, fpb = int(s["kv_cache_num_frames"]), int(s["num_frame_per_block"])
    return sum(any(i < 0 for i in context_frames(b * fpb, k, fpb, bool(s.get("keep_first_frame", False))))
               for b in range(int(s["num_blocks"])))


def outside_float16_cell(ours: torch.Tensor, ref16: torch.Tensor) -> float:
    """How far the float32 frame ``ours`` lies outside the float16 rounding cell of the recorded (float16-valued)
    frame ``ref16``: 0 when ``ours`` rounds to it; a frame that differs from the official one by a few float32
    ulps may round to the neighbouring float16, which is no disagreement. Cell half-width: half the float16
    spacing at |ref16| (2^(floor(log2|ref16|) - 10), at least 2^-24)."""
    ours = ours.detach().to("cpu", torch.float64).reshape(ref16.shape)
    ref = ref16.detach().to("cpu", torch.float64)
    mag = ref.abs().clamp_min(2.0 ** -14)
    half_width = torch.exp2(torch.floor(torch.log2(mag)) - 10).clamp_min(2.0 ** -24) / 2
    if ref.numel() == 0:
        return 0.0
    return float(((ours - ref).abs() - half_width).clamp_min(0).max())


def _check_krea(fx: Fixture, device) -> list:
    """The official session (KV cache rebuilt from a short clean context before every block, prompt changes as
    Krea's interpolations, the stand-in VAE round trip) on both sampler paths: the step list, the prompt embedding
    in effect per block, the call sequence (the context recompute passes are the policy's, not traced), the frames
    handed to the re-encoder, every denoising call's x0 and the output."""
    from ...sampling.prompts import PromptSchedule
    io, s = fx.io, fx.cfg["session"]
    rows = [io.compare("denoising_step_list", torch.tensor(fx.schedule().timesteps, dtype=torch.float32))]
    contexts = PromptSchedule.parse(fx.prompt_schedule()).contexts(fx.prompts(), int(s["num_blocks"]))
    rows += [io.compare(f"block{b}.prompt_embeds", ctx) for b, ctx in enumerate(contexts)]
    model = fx.model(device)
    for path in PATHS:
        handed, records = [], []
        out = replay(fx, model, path=path, handed=handed, tracer=records.append,
                     options={"cuda_graphs": "off"} if path == "optimized" else None)
        denoise = [rec for rec in records if rec["kind"] == "denoise"]
        rows.append(calls_row(f"{path}.calls", denoise, [c for c in fx.cfg["calls"] if not c["context"]],
                              lambda _i, o, t: o["chunk"] == int(t["block"]) and o["current_start"] == int(
                                  t["current_start"])))
        expected = reencoded_blocks(fx.cfg)
        recorded = [key for key in io if key.startswith("reencode_input.")]
        counted = len(handed) == expected == len(recorded)
        rows.append(Row(f"{path}.reencode_count", 0.0 if counted else float("inf"), None if counted else
                        f"the run re-encoded {len(handed)} frames and the config implies {expected}; {io.path.name} "
                        f"records {len(recorded)}"))
        for i in range(max(expected, len(recorded))):
            key = f"reencode_input.{i}"
            rows.append(io.compare(key, handed[i] if i < len(handed) else None, outside_float16_cell, f"{path}.{key}"))
        ours = {(rec["chunk"], rec["step"]): rec["x0"] for rec in denoise}
        for b in range(int(s["num_blocks"])):
            for step in range(int(s["num_denoising_steps"])):
                key = f"block{b}.step{step}.x0"
                rows.append(io.compare(key, ours.get((b, step)), name=f"{path}.{key}"))
        rows.append(io.compare("output", out, name=f"{path}.output"))
    return rows


FORMATS = {"wan_t2v_full": _check_full, "causal_wan": _check_sampled, "matrix_game2": _check_sampled,
           "longlive": _check_longlive, "krea_realtime": _check_krea}     # check(fixture, device) -> rows


# --------------------------------------------------------------------- entry point
def _refuse_constant(name: str):
    raise ValueError(f"it holds {name}, which is not a number a fixture records")


def survey(directory) -> tuple:
    """(recognised, unusable, notes) of the JSON files in ``directory``: recognised [(format name, config path,
    config)] with each config a ``FixtureConfig``; unusable [(config path, why)] for every ``*_config.json`` that
    cannot be read (NaN / Infinity in it refused) or is no format's (a fixture config the check cannot use is said,
    never skipped); notes for other JSON files that name a fixture kind the check does not run."""
    recognised, unusable, notes = [], [], []
    for path in sorted(Path(directory).glob("*.json")):
        is_config = path.name.endswith("_config.json")
        try:
            cfg = loads_json(read_regular(path).decode("utf-8"),   # a pipe named *.json never blocks
                             parse_constant=_refuse_constant)
        except (OSError, ValueError) as exc:
            if is_config:
                unusable.append((path, f"cannot be read as JSON ({' '.join(str(exc).split())[:160]})"))
            continue
        name = kind_of(cfg)
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


FIXTURE_FAILURES = (ValueError, OSError, RuntimeError, KeyError, IndexError, TypeError)


def check_reference(directory, device="cpu") -> Rows:
    """Run every recognised fixture in ``directory``; returns [(name, max_abs_diff)] where name is
    '<config stem>/<tensor>' (``Row``s; ``notes`` lists JSON files that were not checked). A fixture config that
    cannot be used (unreadable, of no known format, naming a missing or damaged file or key, a run that fails on
    it) is a failing row '<config stem>/fixture' with the reason as its note. Raises FileNotFoundError when no
    fixture is recognised (naming the configs that could not be used)."""
    directory = Path(directory)
    fixtures, unusable, notes = survey(directory)
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
                got = list(FORMATS[name](Fixture(directory, cfg), device))
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
