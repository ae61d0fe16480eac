"""The Triton kernels under TRITON_INTERPRET=1 match their torch references.

Triton's interpreter must be enabled before triton is first imported in a process, so the kernels run in one
child process (this file executed as a script) and the tests below check its results case by case.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tolerances import step

PKG_PARENT = Path(__file__).resolve().parent.parent.parent
MARK = "KERNEL_CASES "

# (kernel, B, L, D, heads_or_F (rmsnorm: x is the first D of n*D channels), dtype, config) -- small shapes, odd and non-power-of-two widths included
CASES = [
    ("layernorm_modulate", 2, 6, 48, 3, "float32", {"YBLOCK": 1, "RBLOCK": 32, "num_warps": 1}),
    ("layernorm_modulate", 1, 5, 100, 1, "float32", {"YBLOCK": 4, "RBLOCK": 64, "num_warps": 4}),
    ("layernorm_modulate", 2, 8, 37, 2, "float32", {"YBLOCK": 8, "RBLOCK": 16, "num_warps": 2}),
    ("layernorm_modulate", 2, 6, 72, 3, "bfloat16", {"YBLOCK": 2, "RBLOCK": 64, "num_warps": 2}),
    ("rmsnorm_rope", 2, 6, 48, 3, "float32", {"YBLOCK": 1, "RBLOCK": 32, "num_warps": 1}),
    ("rmsnorm_rope", 1, 5, 50, 5, "float32", {"YBLOCK": 4, "RBLOCK": 64, "num_warps": 4}),
    ("rmsnorm_rope", 2, 4, 68, 2, "bfloat16", {"YBLOCK": 2, "RBLOCK": 16, "num_warps": 2}),
    ("rmsnorm", 2, 6, 48, 1, "float32", {"YBLOCK": 1, "RBLOCK": 32, "num_warps": 1}),
    ("rmsnorm", 1, 5, 50, 3, "float32", {"YBLOCK": 4, "RBLOCK": 64, "num_warps": 4}),     # a strided q view
    ("rmsnorm", 2, 4, 68, 2, "bfloat16", {"YBLOCK": 2, "RBLOCK": 16, "num_warps": 2}),
    ("gated_residual", 2, 6, 48, 3, "float32", {"YBLOCK": 1, "XBLOCK": 32, "num_warps": 1}),
    ("gated_residual", 1, 7, 99, 1, "float32", {"YBLOCK": 4, "XBLOCK": 64, "num_warps": 2}),
    ("gated_residual", 2, 4, 40, 2, "bfloat16", {"YBLOCK": 8, "XBLOCK": 16, "num_warps": 4}),
]


def _inputs(torch, kernel, b, l, d, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)

    def r(*shape, scale=1.0, offset=0.0, to=dt):
        return (torch.randn(*shape, generator=g) * scale + offset).to(to)

    if kernel == "layernorm_modulate":  # n = frames
        return (r(b, l, d, scale=3.0, offset=1.0), r(b, n, d, to=torch.float32), r(b, n, d, to=torch.float32), 1e-6)
    if kernel == "rmsnorm_rope":  # n = heads
        ang = torch.randn(l, d // n // 2, generator=g, dtype=torch.float64) * 3
        return (r(b, l, d, scale=2.0), r(d), ang.cos(), ang.sin(), n, 1e-6)
    if kernel == "rmsnorm":  # n > 1: the query's columns of a wider projection output, read in place
        return (r(b, l, n * d, scale=2.0)[..., :d], r(d), 1e-6)
    return (r(b, l, d), r(b, l, d), r(b, n, d, to=torch.float32))


def _child() -> None:
    import torch

    from wan_accel.kernels import _common, norm_modulate, qk_norm_rope, residual, rms_norm

    mods = {"layernorm_modulate": norm_modulate, "rmsnorm_rope": qk_norm_rope, "gated_residual": residual,
            "rmsnorm": rms_norm}
    public = {"layernorm_modulate": norm_modulate.layernorm_modulate, "rmsnorm_rope": qk_norm_rope.rmsnorm_rope,
              "gated_residual": residual.gated_residual, "rmsnorm": rms_norm.rmsnorm}
    results = {"interpreter_usable": _common.use_triton(torch.zeros(1)), "cases": []}
    for i, (kernel, b, l, d, n, dtype, cfg) in enumerate(CASES):
        args = _inputs(torch, kernel, b, l, d, n, dtype, seed=i)
        ref = getattr(mods[kernel], f"{kernel}_reference")(*args)
        out = mods[kernel].run_triton(*args, config=cfg)
        via_dispatch = public[kernel](*args)  # tuned through the operator store
        diff = (out.float() - ref.float()).abs()
        diff_d = (via_dispatch.float() - ref.float()).abs()
        results["cases"].append({
            "shape_ok": tuple(out.shape) == tuple(ref.shape) and out.dtype == ref.dtype,
            "max": float(diff.max()), "mean": float(diff.mean()), "ref_max": float(ref.float().abs().max()),
            "dispatch_max": float(diff_d.max()), "dispatch_mean": float(diff_d.mean()),
        })
    from wan_accel.cache.autotune import get_autotuner

    results["stats"] = get_autotuner().stats
    print(MARK + json.dumps(results), flush=True)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from interpret_child import PASS_VAR
    if os.environ.get(PASS_VAR):        # tests/test_interpret_pass.py's run: this child ran in the plain one
        pytest.skip("the TRITON_INTERPRET=1 pass: this interpreter child already ran in the plain pass")
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    env["WAN_ACCEL_CACHE"] = str(tmp_path_factory.mktemp("kernels") / "limits.json")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PKG_PARENT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child"], env=env,
                          capture_output=True, text=True, timeout=300)
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    pytest.fail(f"kernel child process failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def test_interpreter_runs_the_triton_path(results):
    assert results["interpreter_usable"] is True
    assert results["stats"]["benchmarks"] > 0  # dispatch tuned real Triton launches


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{c[0]}-D{c[3]}-{c[5]}" for c in CASES])
def test_kernel_matches_reference(results, index):
    case, dtype = results["cases"][index], CASES[index][5]
    assert case["shape_ok"]
    if dtype == "float32":
        assert case["max"] <= 1e-5 * case["ref_max"], case
        assert case["dispatch_max"] <= 1e-5 * case["ref_max"], case
    else:       # one rounding to bf16 each: at most a step apart at the largest value, most elements equal
        one = step(getattr(torch, dtype), case["ref_max"])
        assert case["max"] <= one and case["mean"] <= one / 8, case
        assert case["dispatch_max"] <= one and case["dispatch_mean"] <= one / 8, case


if __name__ == "__main__" and "--child" in sys.argv:
    _child()
