"""The engine over ComfyUI's own model against core's forward and core's SamplerARVideo, with ComfyUI's Python
(skipped unless COMFYUI_DIR and COMFYUI_VENV are set): one chunk forward each way on the public causal fixture, and
wall time per video of both samplers at the tiny shape, measured in one run (the mid shape, dim 512, 8 layers,
21 latent frames of 16x16, takes minutes on a CPU: ``bench_native_vs_core.py --shape mid``, figures in
docs/benchmarks.md)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
COMFY_DIR = os.environ.get("COMFYUI_DIR")
COMFY_VENV = os.environ.get("COMFYUI_VENV")

pytestmark = pytest.mark.skipif(not (COMFY_DIR and COMFY_VENV),
                                reason="set COMFYUI_DIR and COMFYUI_VENV to compare with ComfyUI's own sampler")


def _run(tmp_path, script: str, *args) -> dict:
    (tmp_path / "pkg").mkdir(exist_ok=True)
    link = tmp_path / "pkg" / "wan_accel"
    if not link.exists():
        link.symlink_to(REPO, target_is_directory=True)
    env = dict(os.environ, WAN_ACCEL_CACHE=str(tmp_path / "limits.json"),
               PYTHONPATH=os.pathsep.join([str(tmp_path / "pkg"), COMFY_DIR]))
    out = subprocess.run([str(Path(COMFY_VENV) / "bin" / "python"), str(HERE / script), *args], cwd=COMFY_DIR,
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout[out.stdout.index("{"):])


def test_engine_forward_matches_cores_own_forward(tmp_path):
    res = _run(tmp_path, "native_forward_parity.py", str(REPO / "tests" / "fixtures" / "wan_reference"))
    assert res["model"] == "WAN21_CausalAR" and res["diffusion_model"] == "CausalWanModel"
    assert max(res["max_abs_diff_per_chunk"]) < 1e-4, res


def test_both_samplers_run_side_by_side_on_one_model(tmp_path):
    """The side-by-side benchmark runs both samplers on the same MODEL (its figures are a benchmark's, printed and
    recorded in docs/benchmarks.md, never asserted: speed is not a test)."""
    res = _run(tmp_path, "bench_native_vs_core.py", "--shape", "tiny", "--repeats", "1")
    print("tiny shape:", json.dumps(res))
    assert res["model"] == "WAN21_CausalAR"
    assert set(res["min_s"]) == {"wan_accel", "core_ar_video"} and all(v > 0 for v in res["min_s"].values())
    native, own = res["structure"]["wan_accel"], res["structure"]["pack_optimized"]
    assert native["syncs_per_video"] <= 2, native    # the sigmas, read once; the finite check at the video's end
    assert abs(native["ops_per_step"] - own["ops_per_step"]) <= 0.05 * own["ops_per_step"], res["structure"]
