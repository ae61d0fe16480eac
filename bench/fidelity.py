"""`python -m wan_accel bench fidelity`: how far an opt-in approximate mode moves a video from the exact one.

On the recorded fixtures (``tests/fixtures/wan_reference``: causal Wan with its recorded re-noising draws, and
``tests/fixtures/matrix_game2``), float32 weights, the same inputs and draws: each sampler path (reference and
optimized) runs once exact (SDPA, exact linear layers) and once with ``--attention`` (int8 by default; fp8 too) and
``--linear`` (``fp8``: fp8 linear layers, SDPA unless ``--attention`` says otherwise; the optimized path only, the
reference path has no fp8 mode). Per run: the largest and mean absolute difference of every chunk's denoised
prediction x0 after each step, and of the final latents. A measurement, not a test of the bounds (those are
``kernels.int8_attention.error_bound``, ``kernels.fp8_attention.error_bound``, ``kernels.fa3_fp8.error_bound`` and
``kernels.fp8_linear.error_bound``
per call): the differences compound over blocks, steps and chunks. ``--fp8-numerics fa3`` runs fp8 attention with FlashAttention 3's
math (``kernels/fa3_fp8.py``: its kernels where they run, else the same math in torch), ``pack`` with the pack's
own; the default, what a run on this machine takes. Speed is not measured here: ``bench sampler
--attention int8`` / ``--attention fp8`` / ``--linear fp8`` times each beside exact (the gains need comfy-kitchen's
int8 kernel, and fp8 tensor cores, on a CUDA GPU).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..cache.finite_flags import non_finite
from ..cache.json_out import to_json
from ..app.jobs.reference import PATHS
from ..app.validate import UsageError
from .options import fidelity as add_arguments  # noqa: F401  (defined without torch)

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
DEFAULT_FIXTURES = ("wan_reference", "matrix_game2")


def _fixture(directory: Path):
    """(kind, config path, config) of a fixture folder: its causal Wan ('wan') or Matrix-Game-2 ('matrix-game2')
    config, found and read as check-reference finds and reads it (``app/jobs/reference.survey``)."""
    from ..app.jobs.reference import survey
    recognised, unusable, _notes = survey(directory)
    for fmt, path, cfg in recognised:
        if fmt in MODEL_KINDS:
            return MODEL_KINDS[fmt], path, cfg
    if unusable:
        path, why = unusable[0]
        raise UsageError(f"--fixture {directory}: {path.name} is not a usable fixture config ({why}); record the "
                         f"fixture again")
    raise UsageError(f"--fixture {directory}: no causal_config.json or mg2_config.json there; give a folder of "
                     f"a recorded causal fixture (tests/fixtures/wan_reference or tests/fixtures/matrix_game2)")


MODEL_KINDS = {"causal_wan": "wan", "matrix_game2": "matrix-game2"}    # fixture format -> the rows' model_kind
RUNS_HELD = 2                   # the exact run's model and the other one's may both be alive at once


def check_fixture_fits(path: Path, cfg: dict, device) -> None:
    """Refuse a fixture whose config describes a model that cannot fit before anything is built: its float32
    weights (``memory.weights.config_parameters``, arithmetic on the config's sizes) for the two runs against the
    device's memory, naming the config file and its largest size field. A config whose sizes are not numbers is
    left to the loader, which names what is wrong with it."""
    from ..app.validate import device_memory
    from ..memory.system import gib
    from ..memory.weights import config_parameters, largest_size_field
    model = cfg.get("config")
    if not isinstance(model, dict):
        return
    model = dict(model, **({"clip_dim": cfg["clip_dim"]} if "clip_dim" in cfg else {}))
    try:
        need = RUNS_HELD * 4 * config_parameters(model)
    except (TypeError, ValueError, OverflowError):
        return
    budget, where = device_memory(device)
    if need > budget:
        field = largest_size_field(model)
        raise UsageError(f"--fixture {path.parent}: {path.name} describes a model of about {gib(need)} of "
                         f"float32 weights for its two runs (config.{field} is {model.get(field)}), but {where}; "
                         f"nothing was built: check config.{field} in {path.name}, or record the fixture "
                         f"again")


def _substitute(attention: str, device, model) -> str | None:
    """Why the run's attention is not ``attention`` (another implementation runs in its place: FlashAttention
    requested where it cannot run, or found unusable during the run), or None when it is what runs."""
    from ..model import attention as attn
    if attention not in ("fa3", "fa2", "flash_attn"):
        return None                 # sdpa itself; int8 / fp8: their math, in a kernel or in torch (fp8_numerics)
    c = model.config
    ran, why = attn.explain_backend(attention, device, model.compute_dtype, c.dim // c.num_heads)
    return None if ran != "sdpa" else f"{ran} ran in place of '{attention}' ({why})"


def _failed(row: dict, why: str) -> dict:
    """A row with no figures: what ran instead, or why its figures are no measurement."""
    return {k: v for k, v in row.items() if k not in ("final", "steps")} | {"status": "failed", "why": why}


def _run(fx, attention: str, path: str, device, linear: str = "exact") -> tuple:
    """(final latents, {(chunk, step): x0}, None) of one replay of the fixture; (None, None, why) when another
    attention than ``attention`` would run or ran (``_substitute``): nothing of it is a measurement of it."""
    from ..app.jobs.replay import replay
    steps = {}

    def callback(ci, k, _chunks, _steps, x0):
        steps[(ci, k)] = x0.detach().float().cpu().clone()

    with torch.no_grad():
        model = fx.model(device).set_attention_backend(attention)
        if (instead := _substitute(attention, device, model)):
            return None, None, instead
        out = replay(fx, model, path=path, options={"linear": linear} if path == "optimized" else None,
                     callback=callback)
    return out.float().cpu(), steps, _substitute(attention, device, model)     # a build found unusable meanwhile


def _diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (a - b).abs()
    return {"max_abs": float(d.max()), "mean_abs": float(d.mean())}


def paths_for(linear: str) -> tuple:
    """The sampler paths a comparison runs on: both, or the optimized one alone for fp8 linear layers."""
    return PATHS if linear == "exact" else ("optimized",)


def measure(directory, attention: str = "int8", device="cpu", linear: str = "exact", progress=None) -> list:
    """Rows {fixture, path, attention, linear, status 'ok', final: {max_abs, mean_abs}, steps: [{chunk, step,
    max_abs, mean_abs}]}, or status 'failed' and ``why`` (no figures) for a run whose attention was another
    implementation (``_substitute``: what ran is named) or whose tensors are not finite (one finite check of every
    tensor compared); ``progress(text)`` is told of each run as it starts."""
    from ..app.jobs.replay import Fixture
    directory = Path(directory)
    kind, cfg_path, cfg = _fixture(directory)
    check_fixture_fits(cfg_path, cfg, device)
    fx = Fixture(directory, cfg)
    tell = progress or (lambda _text: None)
    rows = []
    for path in paths_for(linear):
        tell(f"{directory.name}, {path} path: the exact run (sdpa, exact linear layers)")
        exact, exact_steps, _ = _run(fx, "sdpa", path, device)
        tell(f"{directory.name}, {path} path: the run with attention {attention}, linear {linear}")
        other, other_steps, instead = _run(fx, attention, path, device, linear)
        row = {"fixture": directory.name, "model_kind": kind, "path": path, "attention": attention, "linear": linear}
        if instead:
            rows.append(_failed(row, instead))
            continue
        pairs = [(c, k) for c, k in sorted(exact_steps) if (c, k) in other_steps]
        bad = non_finite([("final latents", other), ("exact final latents", exact)]
                         + [(f"x0 of chunk {c} step {k}", other_steps[(c, k)]) for c, k in pairs]
                         + [(f"exact x0 of chunk {c} step {k}", exact_steps[(c, k)]) for c, k in pairs])
        if bad:
            rows.append(_failed(row, f"the runs gave NaN or infinite values ({bad[0]}), so no difference can be "
                                     f"measured; check the fixture's config and weights (record it again)"))
            continue
        steps = [dict(chunk=c, step=k, **_diff(other_steps[(c, k)], exact_steps[(c, k)])) for c, k in pairs]
        rows.append(dict(row, status="ok", final=_diff(other, exact), steps=steps))
    return rows


def fp8_kind(numerics: str, device) -> str:
    """The fp8 attention implementation ``--fp8-numerics`` names for the fixtures' float32 runs on this device:
    'here' what a run takes; 'fa3' FlashAttention 3's math in torch (its kernels take bf16 runs only); 'pack' the
    pack's Triton kernel where it runs, else its torch version."""
    from ..kernels import fp8_attention
    from ..model import attention as attn
    if numerics == "here":
        return attn.fp8_implementation(device, torch.float32, 128)[0]
    if numerics == "fa3":
        return "fa3-torch"
    return fp8_attention.implementation(device, torch.float32, 128)[0]


def run(args) -> int:
    from ..model.attention import BACKENDS
    linear = getattr(args, "linear", "exact")
    attention = args.attention or ("int8" if linear == "exact" else "sdpa")
    if attention not in BACKENDS:
        raise UsageError(f"--attention must be one of {', '.join(BACKENDS)}, got {attention!r}")
    if linear == "exact" and attention == "sdpa":
        raise UsageError("--attention sdpa with exact linear layers is the baseline itself: nothing to compare; "
                         "give --attention int8, --attention fp8 or --linear fp8")
    numerics = getattr(args, "fp8_numerics", "here")
    if numerics != "here" and attention != "fp8":
        raise UsageError(f"--fp8-numerics {numerics} chooses the math of fp8 attention: give --attention fp8 with it "
                         f"(or leave it out)")
    device = torch.device(args.device or "cpu")
    folders = [Path(f) for f in args.fixture] if args.fixture else [FIXTURES / n for n in DEFAULT_FIXTURES]
    for f in folders:
        if not f.is_dir():
            raise UsageError(f"--fixture {f}: not a folder; give a recorded fixture's folder")
    from ..app.progress import Progress
    from ..model import attention as attn
    progress = Progress("bench fidelity")
    kind = fp8_kind(numerics, device) if attention == "fp8" else None
    with attn.fp8_numerics(kind if numerics != "here" else None):
        rows = [r for f in folders for r in measure(f, attention, device, linear, progress)]
    failed = [r for r in rows if r["status"] != "ok"]
    speed = ("bench sampler --linear fp8 times it (a gain needs fp8 tensor cores: a CUDA GPU of SM 8.9+)"
             if linear == "fp8" else "bench sampler --attention fp8 times it (a gain needs the pack's fp8 kernel: a "
                                     "CUDA GPU of SM 8.9+, or FlashAttention 3 on a Hopper GPU)" if attention == "fp8" else
             "bench sampler --attention int8 times it (a gain needs comfy-kitchen's int8 kernel on a CUDA GPU)")
    result = {"device": str(device), "attention": attention, "linear": linear, "baseline": "sdpa, exact linear",
              "paths": list(paths_for(linear)), "rows": rows, "speed": f"not measured here: {speed}"}
    if kind is not None:
        result["fp8_numerics"] = kind
    if linear == "fp8":
        result["note"] = "the reference path has no fp8 linear mode: the optimized path alone is compared"
    if args.json:
        print(to_json(result))
        return 1 if failed else 0
    print(f"fidelity of attention '{attention}'{f' ({kind})' if kind else ''}, linear '{linear}' against exact (SDPA, "
          f"exact linear layers) on {device} (float32 weights)")
    if result.get("note"):
        print(result["note"])
    print(f"{'fixture':<16}{'path':<11}{'final max':>11}{'final mean':>12}{'worst step max':>16}{'at':>12}")
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['fixture']:<16}{r['path']:<11}FAILED: {r['why']}")
            continue
        worst = max(r["steps"], key=lambda s: s["max_abs"]) if r["steps"] else None
        at = f"c{worst['chunk']} s{worst['step']}" if worst else "-"
        print(f"{r['fixture']:<16}{r['path']:<11}{r['final']['max_abs']:>11.2e}{r['final']['mean_abs']:>12.2e}"
              f"{(worst['max_abs'] if worst else 0):>16.2e}{at:>12}")
    print(result["speed"])
    return 1 if failed else 0
