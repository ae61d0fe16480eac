"""``bench native``: ComfyUI's MODEL sampled by core's SamplerARVideo and the Wan Accel AR Sampler beside the pack's
own path. Without ComfyUI it says so in one line and exits 0 (always tested); with ComfyUI importable (here, or
through COMFYUI_DIR and COMFYUI_VENV, ComfyUI's folder and its virtual environment) it runs end to end at the
tiny shape on the CPU. The checkpoint writer is tested without ComfyUI, against the pack's own loader."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from wan_accel.bench.native import SKIP_LINE, SHAPES, parse_weights, shape_config
from wan_accel.app.validate import UsageError
from wan_accel.model.checkpoint import core_causal_metadata
from wan_accel.model.checkpoint import expected_shapes
from wan_accel.model.random_checkpoint import fp8_scaled, random_lora, write_file
from wan_accel.model.tiny import draw_weights

from .cli_run import run_cli_in

REPO = Path(__file__).resolve().parent.parent
COMFY_DIR = os.environ.get("COMFYUI_DIR")
COMFY_VENV = os.environ.get("COMFYUI_VENV")


def _comfy() -> tuple:
    """(ComfyUI's Python, ComfyUI's folder): COMFYUI_VENV's and COMFYUI_DIR, or this Python and the folder ComfyUI
    imports from here; (None, None) without ComfyUI."""
    if COMFY_DIR and COMFY_VENV:
        return str(Path(COMFY_VENV) / "bin" / "python"), COMFY_DIR
    try:
        spec = importlib.util.find_spec("comfy.sd")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        return sys.executable, str(Path(spec.origin).resolve().parent.parent)
    return None, None


def _bench(tmp_path, python: str, comfy_dir: str, *args) -> subprocess.CompletedProcess:
    (tmp_path / "pkg").mkdir(exist_ok=True)
    link = tmp_path / "pkg" / "wan_accel"
    if not link.exists():
        link.symlink_to(REPO, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k not in ("COMFYUI_DIR", "PYTHONPATH")}
    env.update(WAN_ACCEL_CACHE=str(tmp_path / "limits.json"),
               PYTHONPATH=os.pathsep.join([str(tmp_path / "pkg"), comfy_dir]))
    return subprocess.run([python, "-m", "wan_accel", "bench", "native", *args], cwd=comfy_dir,
                          env=env, capture_output=True, text=True, timeout=900)


def test_without_comfyui_one_line_and_a_skipped_json(tmp_path, monkeypatch):
    """Where ComfyUI does not import (this suite's Python, no ComfyUI folder given): the one line, exit 0, and a
    JSON saying skipped with the import's own error beside it."""
    monkeypatch.setattr(sys, "path", list(sys.path))        # the bench may put a ComfyUI folder first
    code, out, err = run_cli_in(tmp_path, "bench", "native", "--json", env={"COMFYUI_DIR": str(tmp_path)})
    if importlib.util.find_spec("comfy") is not None:
        pytest.skip("ComfyUI imports in this Python: the skip line cannot show here")
    assert code == 0, err
    assert err.strip() == SKIP_LINE
    res = json.loads(out)
    assert res["skipped"] is True and res["reason"] == SKIP_LINE and res["bench"] == "native"
    assert "comfy" in res["detail"]                 # the import error, and that the folder holds no comfy/
    code, out, _err = run_cli_in(tmp_path, "bench", "native", env={"COMFYUI_DIR": None})
    assert code == 0 and out.splitlines()[0] == SKIP_LINE and json.loads(out.splitlines()[1])["skipped"]


def test_weights_variants_are_checked_before_anything_runs():
    assert parse_weights("bf16, fp8_scaled+lora,bf16") == ["bf16", "fp8_scaled+lora"]
    with pytest.raises(UsageError, match="unknown 'fp16'"):
        parse_weights("fp16")
    with pytest.raises(UsageError, match="at least one"):
        parse_weights(" , ")


@pytest.mark.parametrize("legacy", [False, True])
def test_scaled_fp8_file_loads_in_the_packs_loader_as_comfyui_stores_it(tmp_path, legacy):
    """The writer's layouts: current (``weight_scale`` + ``_quantization_metadata``) and legacy (``scale_weight`` +
    the ``scaled_fp8`` marker); the pack's loader reads either as the same causal config, and the fp8 weights times
    their scales are the bf16 weights within e4m3's rounding."""
    from safetensors import safe_open

    from wan_accel.model.loader import load_wan_checkpoint
    config = shape_config("tiny")
    base = dict(draw_weights(expected_shapes(config), 0, torch.device("cpu"), torch.bfloat16))
    tensors, meta = fp8_scaled(base, legacy=legacy)
    path = tmp_path / "m.safetensors"
    write_file(path, tensors, dict(core_causal_metadata(config), **meta))
    with safe_open(str(path), framework="pt") as f:
        keys, header = set(f.keys()), f.metadata()
    scale_key = "scale_weight" if legacy else "weight_scale"
    q = "blocks.0.self_attn.q"
    assert tensors[f"{q}.weight"].dtype == torch.float8_e4m3fn and f"{q}.{scale_key}" in keys
    assert ("scaled_fp8" in keys) == legacy and ("_quantization_metadata" in header) == (not legacy)
    if not legacy:
        layers = json.loads(header["_quantization_metadata"])["layers"]
        assert len(layers) == 10 * config.num_layers and layers[q] == {"format": "float8_e4m3fn"}
    assert tensors["blocks.0.norm3.weight"].dtype == torch.bfloat16           # only block linears in fp8
    deq = tensors[f"{q}.weight"].float() * tensors[f"{q}.{scale_key}"]
    assert torch.allclose(deq, base[f"{q}.weight"].float(), rtol=0.07, atol=1e-3)
    model = load_wan_checkpoint(str(path), dtype=torch.float32)
    assert model.config.num_heads == config.num_heads and model.config.dim == config.dim


def test_lora_file_is_in_comfyuis_wan_keys_and_merges_in_the_packs_loader(tmp_path):
    from wan_accel.model.loader import load_wan_checkpoint
    config = shape_config("tiny")
    base = dict(draw_weights(expected_shapes(config), 0, torch.device("cpu"), torch.bfloat16))
    lora = random_lora(base, 4, 0)
    assert "diffusion_model.blocks.1.ffn.2.lora_A.weight" in lora and \
        float(lora["diffusion_model.blocks.1.ffn.2.alpha"]) == 4.0
    write_file(tmp_path / "m.safetensors", base, core_causal_metadata(config))
    write_file(tmp_path / "l.safetensors", lora, {})
    plain = load_wan_checkpoint(str(tmp_path / "m.safetensors"), dtype=torch.float32)
    merged = load_wan_checkpoint(str(tmp_path / "m.safetensors"), dtype=torch.float32,
                                 lora=str(tmp_path / "l.safetensors"))
    a, b = plain.state_dict(), merged.state_dict()
    changed = [k for k in a if not torch.equal(a[k], b[k])]
    assert changed and all(".blocks." in f".{k}" for k in changed)


def test_shapes_state_their_sizes():
    assert {"tiny", "mid", "1.3b"} <= set(SHAPES)
    big = shape_config("1.3b")
    assert (big.dim, big.num_layers, big.num_heads, big.ffn_dim) == (1536, 30, 12, 8960)
    assert SHAPES["1.3b"][1:4] == (21, 60, 104)          # 480x832, 81 frames


def test_runs_end_to_end_at_the_tiny_shape_with_comfyui(tmp_path):
    """With ComfyUI: bf16, fp8 scaled and a LoRA on ComfyUI's own MODEL through both samplers, and the pack's own
    path on the same file. The figures are a benchmark's (never asserted); what is asserted: every row ran, the
    native path equals the own path (same weights and draws) and core's output when fed core's draws, ComfyUI
    holds the fp8 layers quantized and the LoRA as patches, and the native path dispatches what the own one does."""
    python, comfy_dir = _comfy()
    if python is None:
        pytest.skip("ComfyUI is not importable here (set COMFYUI_DIR and COMFYUI_VENV to ComfyUI's folder and its "
                    "virtual environment to run the native bench end to end)")
    out = _bench(tmp_path, python, comfy_dir, "--shape", "tiny", "--repeat", "1", "--weights", "bf16,fp8_scaled,bf16+lora",
                 "--json")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads(out.stdout[out.stdout.index("{"):])
    print("bench native, tiny:", json.dumps(res))
    assert res["skipped"] is False and res["device"] == "cpu" and res["versions"]["comfyui"]
    by = {v["weights"]: v for v in res["variants"]}
    assert set(by) == {"bf16", "fp8_scaled", "bf16+lora"}
    for name, v in by.items():
        assert "error" not in v, v
        assert v["comfy_model"] == "WAN21_CausalAR", v
        for key in ("core", "native", "own"):
            row = v["rows"][key]
            assert row["seconds_per_video"] > 0 and row["first_chunk_s"] > 0 and row["peak_memory_mb"] is None, row
        assert v["parity"]["native_vs_own_max_abs"] < 1e-5, (name, v["parity"])
        assert v["parity"]["native_vs_core_max_abs"] < 1e-4, (name, v["parity"])
    assert by["fp8_scaled"]["comfy_quantized_layers"] == 20 and by["bf16"]["comfy_quantized_layers"] == 0
    assert by["bf16+lora"]["lora_patches"] > 0 and by["bf16"]["lora_patches"] == 0
    native, own = by["bf16"]["structure"]["native"], by["bf16"]["structure"]["own"]
    # the noise checked before the first chunk (NaN noise is refused before sampling), the sigmas read once, the
    # finite check at the video's end
    assert native["syncs_per_video"] <= 3, native
    assert abs(native["ops_per_step"] - own["ops_per_step"]) <= 0.05 * own["ops_per_step"], by["bf16"]["structure"]
