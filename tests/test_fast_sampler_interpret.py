"""The fused Triton kernels inside the optimized path, run by Triton's CPU interpreter on the causal fixture.

TRITON_INTERPRET must be set before triton is first imported, so the check runs in a child process.
"""
import json
import sys
from pathlib import Path

import pytest

MARK = "FAST_SAMPLER_INTERPRET_RESULT "
HERE = Path(__file__).resolve()


def _child() -> None:
    import torch

    from wan_accel.cache.autotune import get_autotuner
    from wan_accel.kernels._common import interpreter_usable
    from wan_accel.model.config import WanConfig
    from wan_accel.model.loader import load_wan_checkpoint
    from wan_accel.app.jobs.replay import Fixture
    from run_helpers import run_causal
    from wan_accel.sampling.scheduler import resolve_schedule

    fixtures = HERE.parent / "fixtures" / "wan_reference"
    cfg = json.loads((fixtures / "causal_config.json").read_text())
    io = Fixture(fixtures, cfg).io
    sched = resolve_schedule("custom", [1000, 500], shift=cfg["sampler"]["timestep_shift"])   # two steps: fast
    model = load_wan_checkpoint(fixtures / cfg["weights_file"], dtype=torch.float32, precision="float32",
                                config=WanConfig.from_dict(cfg["config"]), attention="sdpa")
    noise = io["initial_noise"][:, :3]

    def provide(ci, k, shape, dtype, dev):
        return io[f"extra_noise.block{ci}.step{k}"].reshape(shape).to(dev, dtype)

    kw = dict(noise_provider=provide)
    ref = run_causal(model, io["context"], noise, sched, 3, path="reference", **kw)
    from wan_accel.kernels import rms_norm
    q_norms, real = [], rms_norm.run_triton
    rms_norm.run_triton = lambda *a, **k: q_norms.append(1) or real(*a, **k)    # the cross-attention q norm
    before = dict(get_autotuner().stats)
    opt = run_causal(model, io["context"], noise, sched, 3, path="optimized", **kw)
    stats = get_autotuner().stats
    print(MARK + json.dumps({"interpreter_usable": interpreter_usable(),
                             "triton_launches": stats["benchmarks"] + stats["memo_hits"] - before["benchmarks"]
                             - before["memo_hits"],
                             "cross_q_norm_kernels": len(q_norms),
                             "max": float((opt - ref).abs().max()), "ref_max": float(ref.abs().max())}), flush=True)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    from interpret_child import run_interpreted_child
    return run_interpreted_child(HERE, tmp_path_factory.mktemp("interp"), MARK)


def test_optimized_path_with_interpreted_kernels_matches_reference(result):
    assert result["interpreter_usable"] is True
    assert result["triton_launches"] > 0                 # the kernels really ran through Triton
    assert result["cross_q_norm_kernels"] > 0            # the cross-attention's q RMSNorm among them
    assert result["max"] <= 1e-4, result


if __name__ == "__main__" and "--child" in sys.argv:
    _child()
