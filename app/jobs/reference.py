"""Parity check against reference fixtures (outputs of the official implementations).

A fixture directory holds ``*_config.json`` files; each names its weights and io safetensors files.
``FORMATS`` maps a format name to (detect(config) -> bool, run(directory, config, device) -> rows);
a new fixture kind (e.g. Matrix-Game-2) is added with ``register_format``. Every number (widths, heads,
frames, latent size, padding, step list, shift, ...) is read from the fixture's config.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ...cache.owned_files import loads_json, read_regular

TOLERANCE = 1e-4
FORMATS: dict = {}


def register_format(name: str, detect, run) -> None:
    FORMATS[name] = (detect, run)


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


def _load_io(directory: Path, cfg: dict) -> dict:
    from safetensors.torch import load_file
    return load_file(str(directory / cfg["io_file"]))


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
    output = out[0] if io["output"].dim() == 4 else torch.stack(out)
    rows = [("output", max_abs_diff(output, io["output"]))]
    for key in sorted(k for k in io if k.startswith("inter.")):
        name = key[len("inter."):]
        rows.append((key, max_abs_diff(seen[name], io[key]) if name in seen else float("inf")))
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


def _schedule_rows(sched, io: dict) -> list:
    rows = []
    pairs = {"scheduler.sigmas": sched.scheduler.sigmas, "scheduler.timesteps": sched.scheduler.timesteps,
             "denoising_step_list": torch.tensor(sched.timesteps, dtype=torch.float32)}
    for key, ours in pairs.items():
        if key in io:
            rows.append((key, max_abs_diff(ours, io[key])))
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
    rows = []
    for i in range(len(kv.layers)):
        k, v = kv.ordered(i)
        for name, ours in (("k", k), ("v", v)):
            key = f"kv_final.layer{i}.{name}"
            if key not in io:
                continue
            ref = io[key]
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
    rows = _schedule_rows(sched, io) + [_calls_row(records, cfg)]
    for rec in records:
        for part in ("xt", "flow", "x0"):
            key = f"{_call_name(rec)}.{part}"
            if key in io:
                rows.append((key, max_abs_diff(rec[part], io[key])))
    rows.append(("output", max_abs_diff(out, io["output"])))
    return rows + _kv_rows(kv, io)


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
def discover(directory) -> list:
    """[(format name, config path, config dict)] for every recognised fixture config in ``directory``."""
    found = []
    for path in sorted(Path(directory).glob("*.json")):
        try:
            cfg = loads_json(read_regular(path).decode("utf-8"))   # a pipe named *.json never blocks
        except (OSError, ValueError):
            continue
        for name, (detect, _run) in FORMATS.items():
            if isinstance(cfg, dict) and detect(cfg):
                found.append((name, path, cfg))
                break
    return found


def check_reference(directory, device="cpu", formats=None) -> list:
    """Run every recognised fixture in ``directory``; returns [(name, max_abs_diff)] where name is
    '<config stem>/<tensor>'. Raises FileNotFoundError when no fixture is recognised."""
    directory = Path(directory)
    fixtures = discover(directory)
    if formats:
        fixtures = [fx for fx in fixtures if fx[0] in formats]
    if not fixtures:
        raise FileNotFoundError(f"no recognised fixture config (*.json) in {directory}; known formats: "
                                f"{', '.join(FORMATS)}")
    rows = []
    for name, path, cfg in fixtures:
        stem = path.stem.replace("_config", "")
        with torch.no_grad():
            rows += [(f"{stem}/{key}", diff) for key, diff in FORMATS[name][1](directory, cfg, device)]
    return rows


def format_table(rows, tol: float = TOLERANCE) -> str:
    width = max([len(n) for n, _ in rows] + [6])
    lines = [f"{'tensor':<{width}}  {'max_abs_diff':>12}  status"]
    for name, diff in rows:
        lines.append(f"{name:<{width}}  {diff:>12.3e}  {'ok' if diff <= tol else 'FAIL'}")
    worst = max((d for _, d in rows), default=0.0)
    lines.append(f"{len(rows)} tensors, worst {worst:.3e}, tolerance {tol:.0e}: "
                 f"{'PASS' if worst <= tol else 'FAIL'}")
    return "\n".join(lines)
