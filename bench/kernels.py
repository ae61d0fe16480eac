"""``bench kernels``: each fused kernel vs its torch reference, and autotune time cold vs warm (GPU figures); the fp8
linear mode's fused input quantize and the fp8 attention mode's fused KV-cache write vs their torch ops and, on GPUs
with fp8 tensor cores (SM 8.9+), a 1.3B block's linear layers in fp8 (torch and fused quantize) vs exact.

Without a GPU it says so and runs a tiny interpreter sanity pass (TRITON_INTERPRET=1) of every kernel
against its reference instead (the fp8 quantize and KV write: bit equality with their torch ops at small shapes); exit status
0 when they match, 1 when one does not.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

from ..cache.autotune import get_autotuner, reset_autotuners
from ..cache.json_out import to_json
from ..kernels import (fp8_quant, gated_residual, gated_residual_reference, kv_quant, layernorm_modulate,
                       layernorm_modulate_reference, residual_norm, residual_norm_reference, rmsnorm_rope,
                       rmsnorm_rope_reference, vae_norm)
from ..kernels import candidates as op_candidates
from ..kernels import fp8_linear as fp8
from ..kernels._common import interpret_enabled, triton_module, use_triton
from ..kernels.candidates import tolerance
from ..model.kv_cache import Fp8Shadow
from ..profiling.child import child_argv, run_for_json
from ..vae.wan21 import CACHE_FRAMES, RMSNorm
from . import bench_timer
from .options import kernels as add_arguments  # noqa: F401  (defined without torch: --help answers at once)

# (label, B, L, D, heads): a causal chunk of 3 latent frames at 480x832 for Wan 1.3B and 14B
GPU_SHAPES = (("1.3B chunk", 1, 4680, 1536, 12), ("14B chunk", 1, 4680, 5120, 40))


def _inputs(name, b, l, d, heads, frames, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)

    def r(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dt)

    hd = d // heads
    if name == "layernorm_modulate":
        return (r(b, l, d), r(b, frames, d, dt=torch.float32), r(b, frames, d, dt=torch.float32), 1e-6)
    if name == "rmsnorm_rope":
        ang = r(l, hd // 2, dt=torch.float32)
        return (r(b, l, d), r(d), ang.cos(), ang.sin(), heads, 1e-6)
    if name == "residual_norm3":           # self-attention's gated residual + the cross-attention's LayerNorm
        return (r(b, l, d), r(b, l, d), r(b, frames, d, dt=torch.float32), 1 + 0.1 * r(d), 0.1 * r(d))
    if name == "residual_norm2":           # cross-attention's residual add + the FFN's LayerNorm + modulation
        return (r(b, l, d), r(b, l, d), r(b, frames, d, dt=torch.float32), r(b, frames, d, dt=torch.float32))
    return (r(b, l, d), r(b, l, d), r(b, frames, d, dt=torch.float32))


def _joined(out):
    """A kernel's output as one tensor for its error: the fused residual + LayerNorm's (x_new, h) side by side (joined
    only here, outside what is timed)."""
    return torch.cat(out, dim=1) if isinstance(out, tuple) else out


def _kernels():
    return (("layernorm_modulate", layernorm_modulate, layernorm_modulate_reference),
            ("rmsnorm_rope", rmsnorm_rope, rmsnorm_rope_reference),
            ("gated_residual", gated_residual, gated_residual_reference),
            ("residual_norm3", residual_norm, residual_norm_reference),
            ("residual_norm2", lambda x, y, sh, sc: residual_norm(x, y, shift=sh, scale=sc),
             lambda x, y, sh, sc: residual_norm_reference(x, y, shift=sh, scale=sc)))


def _unfused(name):
    """What a fused residual + LayerNorm replaces: the pack's kernels and torch ops one after another (None for the
    other kernels)."""
    if name == "residual_norm3":
        def norm3(x, y, g, w, b):
            xn = gated_residual(x, y, g)
            return xn, F.layer_norm(xn, (x.shape[-1],), w, b, 1e-6)
        return norm3
    if name == "residual_norm2":
        def norm2(x, y, sh, sc):
            xn = x + y
            return xn, layernorm_modulate(xn, sh, sc)
        return norm2
    return None


def _errors(out, ref) -> tuple[float, float]:
    diff = (_joined(out).float() - _joined(ref).float()).abs()
    return float(diff.max()), float(diff.mean())


def _do_bench(fn) -> float:
    """Milliseconds of ``fn`` on the GPU: ``triton.testing.do_bench`` with one setting for every row."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50)


def _fused_vs_torch(row: dict, torch_fn, fused_fn, moved: int) -> None:
    """The GPU columns of a fused fp8 pass against its torch ops: both times, the ratio and the kernel's rate over the
    ``moved`` bytes."""
    t_ref, t_tri = _do_bench(torch_fn), _do_bench(fused_fn)
    row.update(torch_ms=t_ref, triton_ms=t_tri, speedup=t_ref / t_tri, triton_gb_s=moved / t_tri / 1e6)


# ----------------------------------------------------------------------------- fp8 linear rows
# the input quantize of ``--linear fp8`` at a 1.3B chunk (4680 tokens): a block's input width and the FFN's hidden
# width; on a CPU (interpreter) a small shape of each kind, for bit equality only
FP8_QUANT_SHAPES = (("1.3B block in", 4680, 1536), ("1.3B FFN hid", 4680, 8960))
CPU_FP8_QUANT_SHAPES = (("small", 24, 1536), ("small odd", 9, 17))
# the fp8 attention mode's KV-cache write (k and v [B, rows, H, D] into a cache copy of ``capacity`` slots): a 1.3B
# chunk into a cache of 21 latent frames; on a CPU (interpreter) a small one, for bit equality only
KV_WRITE_SHAPE = ("1.3B chunk", 1, 4680, 12, 128, 21 * 1560)
CPU_KV_WRITE_SHAPE = ("small", 1, 37, 2, 16, 48)
# (label, N, K) of a 1.3B block's linear layers, timed at FP8_TOKENS tokens
FP8_LAYERS = (("q/k/v", 4608, 1536), ("o", 1536, 1536), ("cross q", 1536, 1536), ("cross o", 1536, 1536),
              ("ffn up", 8960, 1536), ("ffn down", 1536, 8960))
FP8_TOKENS = 4680


def fp8_quant_rows(device: str, dtype_name: str) -> list[dict]:
    """The fused fp8 quantize (``kernels/fp8_quant.py``) against the torch ops of ``quantize_rows``: bit equality
    of codes and scales everywhere, times only on a GPU (bytes moved by the kernel: the input once, the codes,
    the scales)."""
    dtype = getattr(torch, dtype_name)
    rows = []
    for label, m, k in FP8_QUANT_SHAPES if device == "cuda" else CPU_FP8_QUANT_SHAPES:
        row = {"kernel": "fp8_quantize", "shape": label, "dims": [m, k], "dtype": dtype_name}
        g = torch.Generator().manual_seed(k)
        x = (torch.randn(m, k, generator=g) * 4).to(device=device, dtype=dtype)
        why = fp8_quant.problem(x)
        if why is not None:
            rows.append(dict(row, skipped=why))
            continue
        out = fp8_quant.run_triton(x, fp8.FP8_MAX, fp8.TINY)
        if out is None:
            rows.append(dict(row, ok=False, error="every config of the kernel failed"))
            continue
        ref = fp8.quantize_rows(x)
        codes_off = (out[0].float() - ref[0].float()).abs()
        equal = torch.equal(out[0].view(torch.uint8), ref[0].view(torch.uint8)) and torch.equal(out[1], ref[1])
        row.update(max_err=float(codes_off.max()), mean_err=float(codes_off.mean()), bit_equal=equal, ok=equal)
        if device == "cuda":
            _fused_vs_torch(row, lambda: fp8.quantize_rows(x), lambda: fp8_quant.run_triton(x, fp8.FP8_MAX, fp8.TINY),
                            m * k * (x.element_size() + 1) + m * 4)
        rows.append(row)
    return rows


def fp8_kv_write_rows(device: str, dtype_name: str) -> list[dict]:
    """The fused KV-cache write of the fp8 attention mode (``kernels/kv_quant.py``) against its torch ops
    (``Fp8Shadow.put_torch``): bit equality of the whole cache copy everywhere, times only on a GPU (bytes moved by
    the kernel: k and v once, their codes, steps and scales)."""
    label, b, rows, h, d, cap = KV_WRITE_SHAPE if device == "cuda" else CPU_KV_WRITE_SHAPE
    dtype = getattr(torch, dtype_name)
    row = {"kernel": "fp8_kv_write", "shape": label, "dims": [b, rows, h, d, cap], "dtype": dtype_name}
    g = torch.Generator().manual_seed(rows)
    k, v = ((torch.randn(b, rows, h, d, generator=g) * 2 + 0.5).to(device=device, dtype=dtype) for _ in range(2))
    why = kv_quant.problem(k, v)
    if why is not None:
        return [dict(row, skipped=why)]
    cache = torch.zeros((b, cap, h, d), dtype=dtype, device=device)
    index = (torch.arange(rows, device=device) + cap - rows // 2) % cap          # wraps around the ring's end
    fused, ref = Fp8Shadow(cache, cache), Fp8Shadow(cache, cache)
    ref.fix_means(k, v)
    fused.fix_means(k, v)

    def run_fused():
        return kv_quant.write(k, v, fused.k_mean, fused.v_mean, index, fused.k, fused.k_scale, fused.v,
                              fused.v_scale)

    if not run_fused():
        return [dict(row, ok=False, error="every config of the kernel failed")]
    ref.put_torch(index, k, v)
    equal = all(torch.equal(a.view(torch.uint8), c.view(torch.uint8)) for a, c in (
        (fused.k, ref.k), (fused.k_scale, ref.k_scale), (fused.v, ref.v), (fused.v_scale, ref.v_scale)))
    row.update(bit_equal=equal, ok=equal)
    if device == "cuda":
        _fused_vs_torch(row, lambda: ref.put_torch(index, k, v), run_fused,
                        2 * k.numel() * (k.element_size() + 1) + 2 * b * rows * h * 4)
    return [row]


def fp8_linear_rows(dtype_name: str) -> list[dict]:
    """A 1.3B block's linear layers on a CUDA GPU with fp8 tensor cores: ``F.linear`` in the run's dtype, the fp8
    linear with the torch quantize (``quantize_rows`` + ``torch._scaled_mm``) and with the fused one, per layer
    and for the block; [] where the scaled matmul does not run (the reason in one row)."""
    why = fp8.mm_problem("cuda", 1536, 1536)
    if why is not None:
        return [{"kernel": "fp8_linear", "shape": "1.3B block", "skipped": why}]
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(1)
    rows = []
    for label, n, k in FP8_LAYERS:
        x = torch.randn(FP8_TOKENS, k, generator=g).to("cuda", dtype)
        w = (torch.randn(n, k, generator=g) / k ** 0.5).to("cuda", dtype)
        wq, ws = fp8.quantize_weight(w)
        fp8.scaled_mm(x, wq, ws)                        # tunes the fused quantize before it is timed
        times = {"exact_ms": _do_bench(lambda: F.linear(x, w)),
                 "fp8_torch_quant_ms": _do_bench(lambda: fp8.scaled_mm(x, wq, ws, None, fp8.quantize_rows(x))),
                 "fp8_fused_ms": _do_bench(lambda: fp8.scaled_mm(x, wq, ws))}
        rows.append({"kernel": "fp8_linear", "shape": label, "dims": [FP8_TOKENS, n, k], "dtype": dtype_name, **times,
                     "speedup": times["exact_ms"] / times["fp8_fused_ms"]})
        del x, w, wq, ws
    total = {key: sum(r[key] for r in rows) for key in ("exact_ms", "fp8_torch_quant_ms", "fp8_fused_ms")}
    rows.append({"kernel": "fp8_linear", "shape": "1.3B block", "dims": [FP8_TOKENS], "dtype": dtype_name, **total,
                 "speedup": total["exact_ms"] / total["fp8_fused_ms"]})
    return rows


def _print_fp8(rows: list[dict]) -> None:
    print("fp8 modes (quantize, KV write: fused vs torch ops; linear: bf16 F.linear vs fp8 with torch / fused "
          "quantize):")
    for r in rows:
        name = f"  {r['kernel']:<14}{r['shape']:<15}"
        if "skipped" in r or "error" in r:
            print(name + (r.get("skipped") or f"FAILED: {r['error']}"))
        elif r["kernel"] in ("fp8_quantize", "fp8_kv_write"):
            times = (f"  torch {r['torch_ms']:.3f} ms  fused {r['triton_ms']:.3f} ms  x{r['speedup']:.2f}  "
                     f"{r['triton_gb_s']:.0f} GB/s" if "torch_ms" in r else "")
            print(name + f"{'bit-equal' if r['bit_equal'] else 'MISMATCH'}{times}")
        else:
            print(name + f"exact {r['exact_ms']:.3f} ms  fp8+torch quantize {r['fp8_torch_quant_ms']:.3f} ms  "
                         f"fp8+fused {r['fp8_fused_ms']:.3f} ms  x{r['speedup']:.2f}")


SANITY_MARK = "WAN_ACCEL_SANITY "


def _sanity_child() -> None:
    """Runs in a process started with TRITON_INTERPRET=1: every kernel vs its reference, one JSON line."""
    if triton_module() is None:
        rows = [{"kernel": name, "skipped": "triton not importable"} for name, _, _ in _kernels()]
    elif not use_triton(torch.zeros(1)):
        rows = [{"kernel": name, "skipped": "triton interpreter unusable"} for name, _, _ in _kernels()]
    else:
        rows = []
        for name, fn, ref in _kernels():
            for dtype in (torch.float32, torch.bfloat16):
                args = _inputs(name, 1, 6, 40, 2, 3, dtype, "cpu")  # odd width 40 = 2 heads x 20
                out, expect = fn(*args), ref(*args)
                mx, mean = _errors(out, expect)
                scale = float(_joined(expect).float().abs().max()) or 1.0
                ok = (mx / scale <= 1e-5) if dtype == torch.float32 else (mx <= 1e-2 and mean <= 1e-3)
                rows.append({"kernel": name, "dtype": str(dtype).replace("torch.", ""), "max_err": mx,
                             "mean_err": mean, "ok": bool(ok)})
        rows += fp8_quant_rows("cpu", "float32") + fp8_quant_rows("cpu", "bfloat16")
        rows += fp8_kv_write_rows("cpu", "float32") + fp8_kv_write_rows("cpu", "bfloat16")
    if rows and "skipped" not in rows[0]:
        rows += vae_sanity_rows()
    print(SANITY_MARK + json.dumps(rows), flush=True)


def sanity_pass() -> list[dict]:
    """Every kernel under the Triton interpreter on tiny shapes vs its reference, in a fresh process
    (the interpreter must be enabled before triton is imported)."""
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    with tempfile.TemporaryDirectory(prefix="wan_accel_bench_kernels_") as tmp:
        env["WAN_ACCEL_CACHE"] = str(Path(tmp) / "limits.json")
        try:
            return run_for_json(child_argv("bench.kernels:_sanity_child"), mark=SANITY_MARK,
                                what="sanity child failed", env=env)
        except RuntimeError as exc:
            return [{"kernel": "all", "ok": False, "error": str(exc)}]


# the Wan 2.1 VAE decoder's RMS norm + SiLU before a causal convolution: (label, channels, frames, height, width)
VAE_GPU_SHAPE = ("96ch 4f 480x832", 96, 4, 480, 832)       # its widest stage at full resolution
VAE_CPU_SHAPE = ("96ch 4f 30x52", 96, 4, 30, 52)


def _vae_inputs(channels: int, frames: int, height: int, width: int, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    norm = RMSNorm(channels).requires_grad_(False)
    norm.gamma.copy_(1.0 + 0.1 * torch.randn(norm.gamma.shape, generator=g))
    norm = norm.to(device=device, dtype=dtype)
    x = torch.randn(1, channels, frames, height, width, generator=g).to(device=device, dtype=dtype)
    history = torch.randn(1, channels, CACHE_FRAMES, height, width, generator=g).to(device=device, dtype=dtype)
    return norm, x, history


def _vae_fused(norm, x, history):
    """What the decoder runs: the causal convolution's input buffer, history in front, norm + SiLU after it."""
    buf = torch.empty(x.shape[:2] + (history.shape[2] + x.shape[2],) + x.shape[3:], dtype=x.dtype, device=x.device)
    buf[:, :, :history.shape[2]].copy_(history)
    norm.silu_into(x, buf[:, :, history.shape[2]:])
    return buf


def _vae_torch(norm, x, history):
    """The layers one by one: the norm's torch ops, SiLU, then the concatenation with the history."""
    return torch.cat([history, F.silu(norm(x))], 2)


def vae_rows(device: str, dtype_name: str, shape=None) -> list[dict]:
    """The ``vae norm+silu`` row: the decoder's fused norm + SiLU into the convolution's buffer against the torch
    layers and the concatenation, at the real shape on a GPU (a small one on a CPU: only the ratio means anything
    there, and without Triton the fused side is the same torch math written in place, no concatenation)."""
    label, c, t, h, w = shape or (VAE_GPU_SHAPE if device == "cuda" else VAE_CPU_SHAPE)
    dtype = getattr(torch, dtype_name)
    timer = bench_timer(device, 5)
    with torch.no_grad():
        norm, x, history = _vae_inputs(c, t, h, w, dtype, device)
        fused = _vae_fused(norm, x, history)            # the first call tunes the kernel's tile (if it runs)
        ref = _vae_torch(norm, x, history)
        err = float((fused.float() - ref.float()).abs().max())
        t_torch = timer(lambda: _vae_torch(norm, x, history))
        t_fused = timer(lambda: _vae_fused(norm, x, history))
        scale = float(ref.float().abs().max())
        path = "triton" if norm.kernel_runs(x, fused[:, :, history.shape[2]:]) else "torch, no concatenation"
    # the torch layers round in the run dtype at every step, the kernel once from float32: a few units apart
    return [{"kernel": "vae norm+silu", "shape": label, "dims": [1, c, t, h, w], "dtype": dtype_name, "fused": path,
             "torch_ms": t_torch, "fused_ms": t_fused, "ratio": t_torch / t_fused if t_fused else None,
             "absolute": device == "cuda", "max_err": err, "ok": err <= tolerance(dtype, scale, 4)}]


def vae_sanity_rows() -> list[dict]:
    """The VAE norm + SiLU kernel under the interpreter against its float32 torch definition, written into a
    history buffer (an odd width and position count)."""
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        norm, x, history = _vae_inputs(37, 3, 5, 7, dtype, "cpu")
        with torch.no_grad():
            buf = _vae_fused(norm, x, history)
            expect = vae_norm.norm_silu_reference(x, norm.gamma)
        mx, mean = _errors(buf[:, :, history.shape[2]:], expect)
        ok = mx <= tolerance(dtype, float(expect.float().abs().max()), 2) and torch.equal(buf[:, :, :2], history)
        rows.append({"kernel": vae_norm.NAME, "dtype": str(dtype).replace("torch.", ""), "max_err": mx,
                     "mean_err": mean, "ok": bool(ok)})
    return rows


def _print_vae(rows: list[dict]) -> None:
    print("vae norm+silu (the decoder's norm + SiLU into the convolution's buffer vs the torch layers + cat; ratio = "
          "torch time / fused time):")
    for r in rows:
        print(f"  {r['shape']:<18}{r['dtype']:<10}{r['fused']:<26}x{r['ratio']:.2f}" +
              (f"  torch {r['torch_ms']:.3f} ms, fused {r['fused_ms']:.3f} ms" if r["absolute"] else "") +
              f"  max_err {r['max_err']:.1e}{'' if r['ok'] else '  MISMATCH'}")


def _tuned_call(fn, args) -> tuple:
    """(output, seconds, the tuner's benchmarks) of one synchronized call of ``fn`` on a new autotuner."""
    reset_autotuners()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(*args)
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0, get_autotuner().stats["benchmarks"]


def gpu_rows(dtype_name: str, frames: int) -> list[dict]:
    dtype = getattr(torch, dtype_name)
    rows = []
    with (tempfile.TemporaryDirectory(prefix="wan_accel_bench_kernels_") as tmp,     # the store put back on the way out
          mock.patch.dict(os.environ, {"WAN_ACCEL_CACHE": str(Path(tmp) / "limits.json")})):
        try:
            for label, b, l, d, heads in GPU_SHAPES:
                for name, fn, ref in _kernels():
                    args = _inputs(name, b, l, d, heads, frames, dtype, "cuda")
                    out, cold_s, cold_bench = _tuned_call(fn, args)    # cold: empty store
                    # warm: a new tuner on the same store, as in a new process
                    _out, warm_s, warm_bench = _tuned_call(fn, args)
                    mx, mean = _errors(out, ref(*args))
                    t_ref = _do_bench(lambda: ref(*args))
                    t_tri = _do_bench(lambda: fn(*args))
                    rows.append({"kernel": name, "shape": label, "dims": [b, l, d], "dtype": dtype_name,
                                 "torch_ms": t_ref, "triton_ms": t_tri, "speedup": t_ref / t_tri,
                                 "tune_cold_s": cold_s, "tune_warm_s": warm_s, "benchmarks_cold": cold_bench,
                                 "benchmarks_warm": warm_bench, "max_err": mx, "mean_err": mean})
                    apart = _unfused(name)
                    if apart is not None:      # the fused kernel against the steps it replaces (the pack's own)
                        t_apart = _do_bench(lambda: apart(*args))
                        rows[-1].update(unfused_ms=t_apart, fused_vs_unfused=t_apart / t_tri)
        finally:
            reset_autotuners()
    return rows


# (label, B, L, D, heads) of the side-by-side rows on a CPU: Wan 1.3B's head layout, a few frames' worth of tokens
CPU_CANDIDATE_SHAPES = (("1.3B heads", 1, 96, 1536, 12),)
# where this process itself runs Triton's interpreter (TRITON_INTERPRET=1), its kernels are candidates on the CPU
# at seconds a call: the side-by-side rows then check them on small shapes (times mean nothing there)
INTERPRETED_CANDIDATE_SHAPES = (("interpreted", 1, 24, 40, 2),)
VAE_INTERPRETED_SHAPE = ("37ch 3f 5x7 interpreted", 37, 3, 5, 7)


def candidate_rows(device: str, dtype_name: str, frames: int, shapes=None) -> list[dict]:
    """Every implementation of each op (kernels/candidates.py) side by side on ``shapes``: its error against the
    torch reference, its time and its ratio to plain torch (on a CPU only the ratio means anything), or why it
    cannot run here."""
    dtype = getattr(torch, dtype_name)
    timer = bench_timer(device, 5)
    rows = []
    for label, b, l, d, heads in shapes or (GPU_SHAPES if device == "cuda" else CPU_CANDIDATE_SHAPES):
        l -= l % frames
        for op in op_candidates.OPS:
            args = _inputs(op, b, l, d, heads, frames, dtype, device)
            ref = op_candidates.REFERENCES[op](*args)
            t_ref = timer(lambda: op_candidates.REFERENCES[op](*args))
            for cand, why in op_candidates.listing(op, torch.device(device)):
                row = {"op": op, "candidate": cand.name, "shape": label, "dims": [b, l, d], "dtype": dtype_name}
                if why is not None:
                    rows.append(dict(row, skipped=why))
                    continue
                try:
                    diff = op_candidates.verify(cand, args)
                    ms = timer(lambda: cand.fn(*args))
                    rows.append(dict(row, ok=True, max_err=diff, ms=ms, ratio_to_torch=t_ref / ms if ms else None,
                                     absolute=device == "cuda"))
                except Exception as exc:  # noqa: BLE001 - a failing candidate is a row, not a crash
                    rows.append(dict(row, ok=False, error=f"{type(exc).__name__}: {exc}"[:300]))
            del ref
    return rows


def _print_candidates(rows: list[dict]) -> None:
    print("implementations side by side (ratio = torch time / its time; absolute times only on a GPU):")
    for r in rows:
        what = r.get("skipped") or (f"FAILED: {r['error']}" if not r.get("ok") else
                                    f"max_err {r['max_err']:.2e}  x{r['ratio_to_torch']:.2f} vs torch" +
                                    (f"  {r['ms']:.3f} ms" if r.get("absolute") else ""))
        print(f"  {r['op']:<20}{r['candidate']:<16}{r['shape']:<12}{what}")


def run(args) -> int:
    from ..app.progress import Progress
    from ..app.validate import TORCH_NAMES
    progress = Progress("bench kernels")
    if not torch.cuda.is_available() or triton_module() is None:
        progress("no CUDA GPU with triton: the interpreter sanity pass (a process of its own)")
        rows = sanity_pass()
        interpreted = interpret_enabled()          # Triton's kernels interpreted here too: small shapes
        progress("the candidates of every fused op on the CPU" + (" (interpreted: small shapes)" if interpreted else ""))
        cands = candidate_rows("cpu", "float32", args.frames, INTERPRETED_CANDIDATE_SHAPES if interpreted else None)
        progress("the VAE norm + SiLU against the torch layers")
        vae = vae_rows("cpu", "float32", VAE_INTERPRETED_SHAPE if interpreted else None)
        ok = all(r.get("ok", True) for r in rows + cands + vae)
        if args.json:
            print(to_json({"gpu": False, "message": "kernel benchmarks need a CUDA GPU",
                              "sanity": rows, "candidates": cands, "vae": vae, "ok": ok}, indent=2))
        else:
            print("bench kernels: timings need a CUDA GPU with triton; ran the interpreter sanity pass instead")
            for r in rows:
                if "skipped" in r or "error" in r:
                    print(f"  {r['kernel']:<20} {r.get('skipped') or 'FAILED: ' + r['error']}")
                elif r["kernel"] in ("fp8_quantize", "fp8_kv_write"):
                    ref = "quantize_rows" if r["kernel"] == "fp8_quantize" else "its torch ops"
                    print(f"  {r['kernel']:<20} {r['dtype']:<9} {r['shape']:<10} "
                          f"{'bit-equal to ' + ref if r['bit_equal'] else 'MISMATCH'}")
                else:
                    print(f"  {r['kernel']:<20} {r['dtype']:<9} max_err {r['max_err']:.2e} "
                          f"mean_err {r['mean_err']:.2e}  {'ok' if r['ok'] else 'MISMATCH'}")
            _print_candidates(cands)
            _print_vae(vae)
        return 0 if ok else 1
    args.dtype = TORCH_NAMES[args.dtype]        # the torch spelling from here on: the rows name it so
    progress(f"timing the fused kernels against torch, autotune cold and warm ({args.dtype})")
    rows = gpu_rows(args.dtype, args.frames)
    progress("timing the candidates of every fused op")
    cands = candidate_rows("cuda", args.dtype, args.frames)
    progress("timing the VAE norm + SiLU against the torch layers")
    vae = vae_rows("cuda", args.dtype)
    progress("timing the fp8 quantize, the fp8 KV write and the fp8 linear layers")
    fp8_rows = fp8_quant_rows("cuda", args.dtype) + fp8_kv_write_rows("cuda", args.dtype) + \
        fp8_linear_rows(args.dtype)
    if args.json:
        print(to_json({"gpu": torch.cuda.get_device_name(), "rows": rows, "candidates": cands, "vae": vae,
                       "fp8": fp8_rows}, indent=2))
        return 0
    print(f"bench kernels on {torch.cuda.get_device_name()} ({args.dtype}, F={args.frames})")
    head = f"{'kernel':<20}{'shape':<12}{'torch ms':>10}{'triton ms':>11}{'x':>7}{'tune cold s':>13}" \
           f"{'tune warm s':>13}{'bench c/w':>11}{'max err':>10}"
    print(head)
    for r in rows:
        print(f"{r['kernel']:<20}{r['shape']:<12}{r['torch_ms']:>10.3f}{r['triton_ms']:>11.3f}{r['speedup']:>7.2f}"
              f"{r['tune_cold_s']:>13.3f}{r['tune_warm_s']:>13.4f}"
              f"{str(r['benchmarks_cold']) + '/' + str(r['benchmarks_warm']):>11}{r['max_err']:>10.1e}"
              + (f"  unfused {r['unfused_ms']:.3f} ms: fused x{r['fused_vs_unfused']:.2f}" if "unfused_ms" in r else ""))
    _print_candidates(cands)
    _print_vae(vae)
    _print_fp8(fp8_rows)
    return 0
