"""The doctor's kernel probes under Triton's CPU interpreter: the three fused kernels pass against their torch
references; a kernel made to give wrong numbers is detected, switched off alone (the other kernels stay on), and
the run afterwards equals a run with that kernel's torch fallback. Even before the doctor's verdict, the operator
store verifies each implementation on the call's shapes before its first use (kernels/candidates.py), so the wrong
kernel never reaches a run.

TRITON_INTERPRET must be set before triton is first imported, so the check runs in a child process.
"""
import json
import sys
from pathlib import Path

import pytest

MARK = "DOCTOR_INTERPRET_RESULT "
HERE = Path(__file__).resolve()


def _child() -> None:
    import torch

    from wan_accel.app.doctor.core import doctor_for
    from wan_accel.app.doctor.gate import gate_options
    from wan_accel.kernels import norm_modulate
    from wan_accel.model.tiny import tiny_causal_model
    from wan_accel.sampling.request import RunInputs, SamplingRequest
    from wan_accel.sampling.runner import FastOptions, get_runner
    from run_helpers import generate_latents

    small = dict(tokens=32, heads=2)
    names = ("kernel.layernorm_modulate", "kernel.rmsnorm_rope", "kernel.gated_residual", "kernel.rms_norm",
             "kernel.residual_norm")
    d = doctor_for("cpu", torch.float32, 16, **small)
    healthy = {n: d.check(n)["status"] for n in names}

    real = norm_modulate._launcher

    def broken(*args):
        launch, key, out = real(*args)

        def wrong(cfg):
            launch(cfg)
            out.mul_(1.25)
        return wrong, key, out
    norm_modulate._launcher = broken
    model = tiny_causal_model()
    base = FastOptions(cuda_graphs="off", fused_qkv=False)
    ctx = torch.randn(1, model.config.text_len, model.config.text_dim, generator=torch.Generator().manual_seed(3))

    def run(options):
        return generate_latents(model, ctx, 3, 8, 8, seed=1, path="optimized", fast_options=options,
                                schedule={"preset": "custom", "steps": [1000, 500]})
    unchecked = run(base)
    d2 = doctor_for("cpu", torch.float32, 16, **small)
    d2.check("kernel.layernorm_modulate", recheck=True)
    gated, lines = gate_options(model, base, doctor=d2)
    req = SamplingRequest((1, 3, model.config.out_dim, 8, 8), None, ((0, 3),), (4, 4), path="optimized",
                          options=gated)
    parts = get_runner(model).start(req, RunInputs(model_kwargs={}), None).parts
    checked = run(gated)
    norm_modulate._launcher = real
    fallback = run(base.replace(switched_off=frozenset({"kernel.layernorm_modulate"})))
    print(MARK + json.dumps({
        "healthy": healthy, "switched_off": sorted(gated.switched_off), "lines": lines,
        "parts": list(parts.fused_kernels) if isinstance(parts.fused_kernels, tuple) else parts.fused_kernels,
        "checked_equals_fallback": bool(torch.equal(checked, fallback)),
        "unchecked_equals_fallback": bool(torch.equal(unchecked, fallback))}), flush=True)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    pytest.importorskip("triton")
    from interpret_child import run_interpreted_child
    return run_interpreted_child(HERE, tmp_path_factory.mktemp("doctor_interp"), MARK)


def test_kernel_probes_pass_under_the_interpreter(result):
    assert result["healthy"] == {"kernel.layernorm_modulate": "passed", "kernel.rmsnorm_rope": "passed",
                                 "kernel.gated_residual": "passed", "kernel.rms_norm": "passed",
                                 "kernel.residual_norm": "passed"}


def test_wrong_kernel_is_switched_off_alone_and_the_run_equals_the_fallback(result):
    assert result["switched_off"] == ["kernel.layernorm_modulate"]
    assert len(result["lines"]) == 1 and "wrong numbers" in result["lines"][0]
    assert result["parts"] == ["rmsnorm_rope", "gated_residual", "rms_norm", "ffn_gelu",   # the others stay on
                               "residual_norm"]
    assert result["checked_equals_fallback"]
    assert result["unchecked_equals_fallback"]      # the store's own check refused the wrong kernel before the doctor


if __name__ == "__main__" and "--child" in sys.argv:
    _child()
