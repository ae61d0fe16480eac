"""``bench compile``: cold vs warm compile of a tiny model, each in a fresh subprocess.

The model is the tiny causal Wan model (``wan.tiny``, sampling two chunks) or, with ``--model standin``, a
small stack of transformer-like blocks.

Cold runs get their own fresh cache folder (limit cache, Inductor cache, Triton cache); the warm run is a new
process on the folder of the first cold run, so only on-disk caches (and the saved compile artifacts) carry
over. Prints both times, the ratio and the cache counters (Inductor FX graph cache, AOTAutograd cache).
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from ..cache.json_out import to_json
from ..profiling.child import child_argv, run_for_json

CHILD_MARK = "WAN_ACCEL_BENCH_RESULT "


# ----------------------------------------------------------------------------- the workload
STANDIN_HEADS = 2                  # attention heads of the stand-in's blocks: its width is split among them
MAX_STANDIN_DIM = 8192


def check_standin_dim(dim: int) -> int:
    """``--dim`` of the stand-in model: a multiple of its STANDIN_HEADS heads, up to MAX_STANDIN_DIM; else
    UsageError saying which values work."""
    from ..app.validate import UsageError, check_int
    dim = check_int("--dim", dim, STANDIN_HEADS, MAX_STANDIN_DIM)
    if dim % STANDIN_HEADS:
        raise UsageError(f"--dim {dim}: the stand-in model splits its width among {STANDIN_HEADS} attention heads, "
                         f"so --dim must be a multiple of {STANDIN_HEADS} from {STANDIN_HEADS} to {MAX_STANDIN_DIM} "
                         f"(e.g. {dim - 1} or {dim + 1})")
    return dim


def tiny_workload(device: str = "cpu", blocks: int = 2, dim: int = 32, tokens: int = 16, seed: int = 0):
    """(model, run) of the stand-in: ``run(model)`` performs one forward of repeated transformer-like blocks
    (per-frame modulated LayerNorm, attention, MLP, gated residuals through the pack's kernels)."""
    import torch

    from ..kernels import gated_residual, layernorm_modulate

    class Block(torch.nn.Module):
        def __init__(self, d: int, heads: int = STANDIN_HEADS):
            super().__init__()
            self.heads = heads
            self.modulation = torch.nn.Parameter(torch.randn(1, 4, d) / d ** 0.5)
            self.qkv = torch.nn.Linear(d, 3 * d)
            self.proj = torch.nn.Linear(d, d)
            self.ffn = torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(approximate="tanh"),
                                           torch.nn.Linear(2 * d, d))

        def forward(self, x, e):
            b, l, d = x.shape
            m = (self.modulation + e).unsqueeze(2)  # [B, 4, 1, D] -> per-frame F=1
            shift, scale, gate, gate2 = (m[:, i] for i in range(4))
            h = layernorm_modulate(x, shift, scale, 1e-6)
            q, k, v = self.qkv(h).view(b, l, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, l, d)
            x = gated_residual(x, self.proj(a), gate)
            return gated_residual(x, self.ffn(layernorm_modulate(x, shift, scale, 1e-6)), gate2)

    class StandIn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(dim, dim)
            self.blocks = torch.nn.ModuleList(Block(dim) for _ in range(blocks))

        def forward(self, x, e):
            x = self.embed(x)
            for block in self.blocks:
                x = block(x, e)
            return x

    torch.manual_seed(seed)
    model = StandIn().to(device).eval()
    x = torch.randn(1, tokens, dim, device=device)
    e = torch.randn(1, 4, dim, device=device)

    def run(m):
        with torch.no_grad():
            return m(x, e)

    return model, run


def wan_workload(device: str = "cpu", seed: int = 0, frames: int = 6):
    """(model, run) with the built-in tiny causal Wan model: ``run(model)`` samples ``frames`` latent frames
    in chunks of 3 (KV cache, cross-attention cache and all)."""
    import torch

    from ..app.prepare import RunInputs, RunSpec, Setup, prepare
    from ..model.tiny import tiny_causal_model

    model = tiny_causal_model(seed=seed, device=device)
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    context = torch.randn(1, cfg.text_len, cfg.text_dim, generator=g).to(device)
    noise = torch.randn(1, frames, cfg.in_dim, 8, 8, generator=g).to(device)

    spec = RunSpec(seed=seed, doctor=False, oom_retry="off")

    def run(m):             # the setup given: the compile under test stays as the bench made it
        with torch.no_grad():
            return prepare(m, spec, RunInputs(context=context, noise=noise),
                           setup=Setup("auto", None, [], {})).latents()

    return model, run


# ----------------------------------------------------------------------------- one process
def _child() -> None:
    """Run inside a fresh process: compile, time the first call, print one JSON result line."""
    cfg = json.loads(os.environ["WAN_ACCEL_BENCH_CHILD"])
    t_import = time.perf_counter()
    import torch  # noqa: F401

    from ..cache import LimitCache
    from ..compile import compat
    from ..compile.apply import compile_handle, compile_model
    from ..compile.settings import CompileSettings

    cache = LimitCache(Path(cfg["cache_dir"]) / "limits.json")
    model, run = (wan_workload(cfg["device"]) if cfg.get("model") == "wan"
                  else tiny_workload(cfg["device"], cfg["blocks"], cfg["dim"]))
    settings = CompileSettings.from_dict(cfg.get("settings") or {})
    t0 = time.perf_counter()
    compile_model(model, settings, cache)
    run(model)
    first = time.perf_counter() - t0
    t1 = time.perf_counter()
    run(model)
    second = time.perf_counter() - t1
    handle = compile_handle(model)
    result = {"compile_s": first, "steady_call_s": second, "import_s": t0 - t_import,
              "counters": compat.cache_counters(), "loaded_artifacts": handle.loaded_artifacts,
              "artifact_saves": handle.warm_start.saves if handle.warm_start else 0,
              "inductor_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}
    print(CHILD_MARK + json.dumps(result), flush=True)


def run_child(cache_dir: str | os.PathLike, device: str = "cpu", blocks: int = 2, dim: int = 32,
              settings: dict | None = None, timeout: float = 600, model: str = "standin") -> dict:
    """Compile the tiny workload in a new Python process using ``cache_dir``; returns its result dict."""
    env = dict(os.environ)
    env.pop("WAN_ACCEL_CACHE", None)        # the compiler caches: set below, in the run's folder
    env["TRITON_CACHE_DIR"] = str(Path(cache_dir) / "triton")
    # every compiler cache and temporary file of the child inside the run's folder, which the benchmark removes
    # (torch's default Inductor cache is a folder under $TMPDIR that nothing removes)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(cache_dir) / "inductor")
    tmp = Path(cache_dir) / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env["TMPDIR"] = env["TEMP"] = env["TMP"] = str(tmp)
    env["WAN_ACCEL_BENCH_CHILD"] = json.dumps({"cache_dir": str(cache_dir), "device": device, "blocks": blocks,
                                               "dim": dim, "settings": settings or {}, "model": model})
    return run_for_json(child_argv("bench.compile:_child"), mark=CHILD_MARK, what="compile benchmark child failed",
                        env=env, timeout=timeout)


# ----------------------------------------------------------------------------- CLI
def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--model", default=None, choices=("wan", "standin"),
                        help="wan: the tiny causal Wan model sampling 2 chunks (default when present); "
                             "standin: a small stack of transformer-like blocks")
    parser.add_argument("--blocks", type=int, default=None, help="blocks of the stand-in model (default 2; "
                        "--model standin only)")
    parser.add_argument("--dim", type=int, default=None, help="width of the stand-in model (default 32; --model "
                        "standin only)")
    parser.add_argument("--repeat", type=int, default=1, help="cold and warm runs each (median reported)")
    parser.add_argument("--preset", default="default", choices=("default", "EXTREME-PLUS"),
                        help="tiling preset to compile with")


def run(args) -> int:
    from ..app.jobs.handle import default_device
    device = args.device or str(default_device())
    settings = {"tiling_preset": args.preset}
    model = args.model
    if model is None:
        import importlib.util

        model = "wan" if importlib.util.find_spec("..model.tiny", __package__) else "standin"
    given = [opt for opt, value in (("--blocks", args.blocks), ("--dim", args.dim)) if value is not None]
    if model == "wan" and given:        # the tiny Wan model has its own size: these would be ignored
        from ..app.validate import UsageError
        raise UsageError(f"{' and '.join(given)} size the stand-in model, but the tiny causal Wan model runs "
                         f"({'--model wan' if args.model else 'the default'}), which has its own size: add --model "
                         f"standin, or leave {'it' if len(given) == 1 else 'them'} out")
    args.blocks = 2 if args.blocks is None else args.blocks
    args.dim = 32 if args.dim is None else args.dim
    check_standin_dim(args.dim)          # before any child starts: its compiler would only say a shape is invalid
    colds, warms = [], []
    from ..app.progress import Progress
    progress, n = Progress("bench compile"), max(1, args.repeat)
    with tempfile.TemporaryDirectory(prefix="wan_accel_bench_compile_") as root:
        first_dir = None
        for i in range(n):
            d = Path(root) / f"cold{i}"
            first_dir = first_dir or d
            progress(f"cold compile {i + 1}/{n} (a new process, empty compile caches: can take minutes)")
            colds.append(run_child(d, device, args.blocks, args.dim, settings, model=model))
        for i in range(n):
            progress(f"warm compile {i + 1}/{n} (a new process reading the first cold run's caches)")
            warms.append(run_child(first_dir, device, args.blocks, args.dim, settings, model=model))
    cold_s = statistics.median(r["compile_s"] for r in colds)
    warm_s = statistics.median(r["compile_s"] for r in warms)
    summary = {"device": device, "model": model, "blocks": args.blocks if model == "standin" else None,
               "dim": args.dim if model == "standin" else None, "preset": args.preset,
               "cold_compile_s": cold_s, "warm_compile_s": warm_s,
               "speedup": cold_s / warm_s if warm_s > 0 else None,
               "cold_counters": colds[0]["counters"], "warm_counters": warms[-1]["counters"],
               "warm_loaded_artifacts": warms[-1]["loaded_artifacts"], "runs": {"cold": colds, "warm": warms}}
    if args.json:
        print(to_json(summary))
        return 0
    what = "tiny causal Wan, 2 chunks" if model == "wan" else f"stand-in, {args.blocks} blocks, dim {args.dim}"
    print(f"compile benchmark: {what}, {device}, preset {args.preset}")
    print(f"{'run':<6}{'first run (compile) s':>24}{'steady run ms':>16}")
    print(f"{'cold':<6}{cold_s:>24.2f}{colds[0]['steady_call_s'] * 1e3:>16.2f}")
    print(f"{'warm':<6}{warm_s:>24.2f}{warms[-1]['steady_call_s'] * 1e3:>16.2f}")
    print(f"cold / warm = {summary['speedup']:.2f}x" if summary["speedup"] else "cold / warm = n/a")
    hits = {k: v for k, v in warms[-1]["counters"].items() if v}
    print("warm cache counters: " + (", ".join(f"{k}={v}" for k, v in sorted(hits.items())) or "none"))
    if warms[-1]["loaded_artifacts"]:
        print(f"warm loaded compile artifacts: {warms[-1]['loaded_artifacts']}")
    return 0
