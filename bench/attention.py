"""``python -m wan_accel bench attention``: every attention implementation at a run's own calls, side by side.

The self-attention calls of a causal video are few and large (the 1.3B shape's largest: 4680 queries against 32760
keys, 12 heads of 128), so their rate decides half of a video's GPU time. For the calls of a run (``--calls largest``:
the largest one; ``all``: the largest of every length bucket the operator store keys on, ``plan_shapes``) this bench
runs every exact candidate of the store's ``auto`` choice that this machine has (FlashAttention 3 / 2, FlashAttention 3
from the kernel hub or xformers, SDPA's cuDNN,
flash and efficient kernels one by one, SDPA's own pick, the pack's Triton flash-attention kernel) and the opt-in
approximate modes (``--approximate``), each on the same seeded inputs:

  ms            median time of one call (CUDA: ``triton.testing.do_bench``; a CPU: wall time, no GPU meaning)
  tflops        4 x batch x heads x queries x keys x head size / time (the two matmuls; softmax not counted)
  of_ceiling    tflops / this GPU's measured bf16 matmul rate (``profiling.ceilings``; CUDA only)
  max_abs       against the float32 softmax reference on the same inputs; ``exact`` rows must stay within the
                store's tolerance (``within``), approximate rows state theirs (their bound is the doctor's and
                ``bench fidelity``'s)
  store         the operator store's choice for that call's bucket (stored verdict, else availability order)

A candidate that cannot run here is listed with the reason; one that raises is listed with its error (the others
still run). ``--lq/--lk`` time one call of any size instead of a run's.
"""
from __future__ import annotations

import math
import time

import torch

from ..cache.finite_flags import non_finite
from ..cache.json_out import to_json
from . import bench_timer, print_columns
from ..kernels import registry
from ..app.validate import UsageError, check_int

# shape -> (tokens per latent frame, latent frames, frames per chunk, heads, head size, text tokens)
from .options import APPROXIMATE, ATTENTION_SHAPES as SHAPES  # noqa: E402,F401  (defined without torch)
from .options import attention as add_arguments  # noqa: E402,F401
GOAL_TFLOPS = 550.0               # issue 30: attention at the largest call on an H100/H200


def calls(shape: str, which: str) -> list:
    """[(query length, key length)] of a run of ``shape``: its largest self-attention call, or every bucket's."""
    from ..model.attention import plan_shapes
    ft, frames, per_chunk, _h, _d, text = SHAPES[shape]
    chunks = [(f0, min(per_chunk, frames - f0)) for f0 in range(0, frames, per_chunk)]
    found = plan_shapes(ft, chunks, -1, frames, text if which == "all" else None)
    return sorted(found, key=lambda s: s[0] * s[1], reverse=True)[:None if which == "all" else 1]


def _row(name: str, kind: str, fn, q, k, v, ref, timer, ceiling) -> dict:
    from ..kernels.candidates import tolerance
    from ..model.attention import STORE_ULPS
    b, lq, h, d = q.shape
    row = {"lq": lq, "lk": k.shape[1], "candidate": name, "kind": kind}
    try:
        with torch.no_grad():
            out = fn(q, k, v)
            if non_finite({"output": out}):             # a figure for wrong numbers would be no figure
                return dict(row, status="failed", why="non-finite output (NaN or inf): not timed")
            diff = (out.float() - ref.float()).abs()
            ms = timer(lambda: fn(q, k, v))
    except Exception as exc:  # noqa: BLE001 - one candidate's failure is a row, the others still run
        return dict(row, status="failed", why=f"{type(exc).__name__}: {str(exc).strip()[:160]}")
    flops = 4.0 * b * h * lq * k.shape[1] * d
    tflops = flops / (ms / 1e3) / 1e12 if ms > 0 else None
    row.update(status="ran", ms=round(ms, 4), tflops=None if tflops is None else float(f"{tflops:.4g}"),
               of_ceiling=round(tflops / ceiling, 3) if tflops and ceiling else None,
               max_abs=float(diff.max()), mean_abs=float(diff.mean()))
    if kind == "exact":
        row["within"] = bool(row["max_abs"] <= tolerance(q.dtype, float(ref.float().abs().max()), STORE_ULPS))
    return row


def _approximate_call(name: str, k, v):
    """The call of an opt-in mode as a run makes it: fp8 reads keys/values quantized beforehand (a run's KV cache
    keeps them so), int8 quantizes them itself."""
    from ..kernels import fa3_fp8, fp8_attention
    from ..model import attention as attn
    if name == "fp8":
        kv8 = fp8_attention.quantize_kv(k, v)
        return lambda a, b_, c: fp8_attention.fp8_attention(a, b_, c, kv8=kv8)
    if name == "fa3_fp8":          # keys and values quantized once (as a cache would keep them), queries per call
        kv = fa3_fp8.quantize_kv(k, v)
        return lambda a, b_, c: fa3_fp8.attention(attn.flash_function("fa3"), a, kv)
    return lambda a, b_, c: attn.attention(a, b_, c, backend=name)


def measure(lq: int, lk: int, batch: int, heads: int, head_dim: int, dtype, device, approximate=(),
            seed: int = 0, ceiling: float | None = None, progress=None) -> list:
    """Rows of every candidate at one call of [batch, lq|lk, heads, head_dim] (module doc); ``progress(text)`` is
    told which candidate is being timed."""
    from ..model import attention as attn
    tell = progress or (lambda _text: None)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, lq, heads, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(batch, lk, heads, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(batch, lk, heads, head_dim, generator=gen).to(device, dtype)
    ref = attn.attention_reference(q.float(), k.float(), v.float())
    timer = bench_timer(device, 1)      # the store's own timer on a GPU: the table ranks candidates as it does
    rows = []
    todo = [(cand.name, "exact", cand.fn, why)        # "torch" is the reference itself
            for cand, why in attn.auto_listing(device, dtype, head_dim) if cand.name != "torch"]
    fa3 = registry.candidate("attention.fp8", "fa3")
    todo += [(name, "approximate", None, fa3.rejected(device, dtype, head_dim) if name == "fa3_fp8" else None)
             for name in approximate]       # their call made when it is timed (fp8 quantizes the keys first)
    for name, kind, fn, why in todo:
        if why is not None:
            rows.append({"lq": lq, "lk": lk, "candidate": name, "kind": kind, "status": "unavailable", "why": why})
            continue
        tell(f"timing {name}" + (" (approximate)" if kind == "approximate" else ""))
        call = fn if kind == "exact" else _approximate_call(name, k, v)
        rows.append(_row(name, kind, call, q, k, v, ref, timer, ceiling))
    try:
        store, why = attn.choose_auto(q, k, v, benchmark=False)
    except Exception as exc:  # noqa: BLE001 - the store's view is a bonus column
        store, why = None, f"{type(exc).__name__}: {exc}"
    for r in rows:
        r["store"] = store
    del q, k, v, ref
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return rows


def run(args) -> int:
    from ..cache.fingerprint import cpu_name
    from ..profiling.ceilings import measure_ceilings
    from ..app.jobs.handle import default_device, parse_dtype
    if (args.lq is None) != (args.lk is None):
        raise UsageError("--lq and --lk go together (one call of that size); give both or neither")
    if args.lq is not None and getattr(args, "calls", None) is not None:
        raise UsageError(f"--calls {args.calls} picks a run's calls, and --lq/--lk time one call of their own size "
                         f"instead: give --calls, or --lq and --lk, not both")
    for name in ("lq", "lk", "batch"):
        if getattr(args, name) is not None:
            check_int("--" + name, getattr(args, name), 1, 1 << 20)
    approximate = [n.strip() for n in (args.approximate or "").split(",") if n.strip()]
    approximate = [] if approximate == ["none"] else approximate
    bad = [n for n in approximate if n not in APPROXIMATE]
    if bad:
        raise UsageError(f"--approximate: unknown {', '.join(bad)}; choose from {', '.join(APPROXIMATE)} or none")
    device = torch.device(args.device) if args.device else default_device()
    shape = args.shape or ("1.3b" if device.type == "cuda" else "tiny")
    dtype = parse_dtype(args.dtype or ("bf16" if device.type == "cuda" else "fp32"))
    _ft, _frames, _chunk, heads, head_dim, _text = SHAPES[shape]
    todo = [(args.lq, args.lk)] if args.lq is not None else calls(shape, args.calls or "largest")
    from ..app.progress import Progress
    progress = Progress("bench attention")
    if not args.no_ceiling:
        progress(f"measuring the matmul ceiling of {device}")
    ceil = None if args.no_ceiling else measure_ceilings(device)
    ceiling = (ceil or {}).get("bf16_matmul_tflops")
    t0 = time.perf_counter()
    rows = [r for i, (lq, lk) in enumerate(todo)
            for r in measure(lq, lk, args.batch, heads, head_dim, dtype, device, approximate, args.seed, ceiling,
                             lambda text, i=i, lq=lq, lk=lk: progress(f"call {i + 1}/{len(todo)} ({lq} x {lk}): "
                                                                      f"{text}"))]
    best = {}
    for r in rows:
        if r.get("status") == "ran" and r["kind"] == "exact" and r.get("within"):
            key = (r["lq"], r["lk"])
            if key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
    for r in rows:
        b = best.get((r["lq"], r["lk"]))
        r["vs_fastest_exact"] = round(b["ms"] / r["ms"], 3) if b and r.get("ms") else None
    largest = max(todo, key=lambda s: s[0] * s[1])
    top = best.get(largest)
    result = {"device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
              else cpu_name(), "torch": torch.__version__, "shape": shape, "batch": args.batch, "heads": heads,
              "head_dim": head_dim, "dtype": str(dtype).replace("torch.", ""), "ceilings": ceil,
              "largest_call": list(largest), "fastest_exact": top and top["candidate"],
              "fastest_exact_tflops": top and top["tflops"], "goal_tflops": GOAL_TFLOPS,
              "seconds": round(time.perf_counter() - t0, 2), "rows": rows}
    if args.json:
        print(to_json(result))
        return 0
    print(f"attention bench on {result['device_name']} ({device}), {shape} run: batch {args.batch}, {heads} heads of "
          f"{head_dim}, {result['dtype']}" + (f"; bf16 matmul ceiling {ceiling} TFLOP/s" if ceiling else ""))
    cols = ["lq", "lk", "candidate", "kind", "status", "ms", "tflops", "of_ceiling", "vs_fastest_exact", "max_abs",
            "within", "store"]
    print_columns(cols, [[_cell(r.get(c)) for c in cols] for r in rows],
                  [f"  ({r['why']})" if r.get("why") else "" for r in rows])
    if top is not None and device.type == "cuda":
        print(f"largest call {largest[0]} x {largest[1]}: fastest exact {top['candidate']} at {top['tflops']} "
              f"TFLOP/s (goal {GOAL_TFLOPS:g})")
    return 0


def _cell(value):
    if isinstance(value, float):
        return f"{value:.3g}" if (value and (abs(value) < 1e-2 or math.isinf(value))) else f"{value:g}"
    return value
