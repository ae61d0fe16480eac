"""The engine over ComfyUI's own model against core's forward and core's SamplerARVideo, with ComfyUI's Python
(skipped unless COMFYUI_DIR and COMFYUI_VENV are set): one chunk forward each way on the public causal fixture, and
both samplers at the tiny shape through the pack's bench (``python -m wan_accel bench native``, bench/native.py;
the mid shape, dim 512, 8 layers, 21 latent frames of 16x16, takes minutes on a CPU: ``bench native --shape mid``,
figures in docs/benchmarks.md)."""
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
    """A script of this folder, or ``-m wan_accel`` with its arguments, run by ComfyUI's Python in its folder."""
    (tmp_path / "pkg").mkdir(exist_ok=True)
    link = tmp_path / "pkg" / "wan_accel"
    if not link.exists():
        link.symlink_to(REPO, target_is_directory=True)
    env = dict(os.environ, WAN_ACCEL_CACHE=str(tmp_path / "limits.json"),
               PYTHONPATH=os.pathsep.join([str(tmp_path / "pkg"), COMFY_DIR]))
    target = ["-m", script] if script == "wan_accel" else [str(HERE / script)]
    out = subprocess.run([str(Path(COMFY_VENV) / "bin" / "python"), *target, *args], cwd=COMFY_DIR,
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
    res = _run(tmp_path, "wan_accel", "bench", "native", "--shape", "tiny", "--repeat", "1", "--json")
    print("tiny shape:", json.dumps(res))
    (variant,) = res["variants"]
    assert variant["comfy_model"] == "WAN21_CausalAR"
    assert all(variant["rows"][k]["seconds_per_video"] > 0 for k in ("core", "native", "own")), variant["rows"]
    native, own = variant["structure"]["native"], variant["structure"]["own"]
    # the noise checked before the first chunk (NaN noise is refused before sampling), the sigmas read once, the
    # finite check at the video's end
    assert native["syncs_per_video"] <= 3, native
    assert abs(native["ops_per_step"] - own["ops_per_step"]) <= 0.05 * own["ops_per_step"], variant["structure"]
