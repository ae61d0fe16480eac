"""'Apply Compile (native Wan)' on ComfyUI's own Wan 2.1 model (skipped unless COMFYUI_DIR and COMFYUI_VENV are set).

    COMFYUI_DIR=<ComfyUI work tree> COMFYUI_VENV=<its venv> python -m pytest -q tests/e2e/test_native_wan_compile.py

Runs a script with ComfyUI's Python (cwd = COMFYUI_DIR, the pack importable as ``wan_accel`` through a link in a
temporary folder, all caches in that folder). The script loads a tiny random Wan 2.1 T2V state dict with official
key names through ``comfy.sd.load_diffusion_model_state_dict`` (ComfyUI's own detection and ModelPatcher),
samples it with ``comfy.sample.sample`` (KSampler, euler, 2 steps) unpatched, through the pack's node with
backend=eager and with backend=inductor, and reports outputs, module identities and Dynamo counters as JSON.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COMFY_DIR = os.environ.get("COMFYUI_DIR")
COMFY_VENV = os.environ.get("COMFYUI_VENV")

pytestmark = pytest.mark.skipif(not (COMFY_DIR and COMFY_VENV),
                                reason="set COMFYUI_DIR and COMFYUI_VENV to run the native Wan compile check")

SCRIPT = r'''
import json, os, sys
import torch
from comfy.cli_args import args
args.cpu = True
import comfy.model_management
import comfy.patcher_extension
import comfy.sample
import comfy.sd
from torch._dynamo.utils import counters
from wan_accel.cache import LimitCache
from wan_accel.nodes.compile_nodes import ApplyCompileNativeWan, WanCompileSettings

DIM, FFN, TEXT_DIM, LAYERS, FREQ = 128, 256, 4096, 2, 256  # ComfyUI derives num_heads = dim // 128


def wan_state_dict():
    g = torch.Generator().manual_seed(0)
    shapes = {
        "patch_embedding.weight": (DIM, 16, 1, 2, 2), "patch_embedding.bias": (DIM,),
        "text_embedding.0.weight": (DIM, TEXT_DIM), "text_embedding.0.bias": (DIM,),
        "text_embedding.2.weight": (DIM, DIM), "text_embedding.2.bias": (DIM,),
        "time_embedding.0.weight": (DIM, FREQ), "time_embedding.0.bias": (DIM,),
        "time_embedding.2.weight": (DIM, DIM), "time_embedding.2.bias": (DIM,),
        "time_projection.1.weight": (DIM * 6, DIM), "time_projection.1.bias": (DIM * 6,),
        "head.modulation": (1, 2, DIM), "head.head.weight": (16 * 4, DIM), "head.head.bias": (16 * 4,),
    }
    for i in range(LAYERS):
        b = f"blocks.{i}."
        for att in ("self_attn", "cross_attn"):
            for p in ("q", "k", "v", "o"):
                shapes[f"{b}{att}.{p}.weight"] = (DIM, DIM)
                shapes[f"{b}{att}.{p}.bias"] = (DIM,)
            shapes[f"{b}{att}.norm_q.weight"] = (DIM,)
            shapes[f"{b}{att}.norm_k.weight"] = (DIM,)
        shapes.update({f"{b}norm3.weight": (DIM,), f"{b}norm3.bias": (DIM,), f"{b}ffn.0.weight": (FFN, DIM),
                       f"{b}ffn.0.bias": (FFN,), f"{b}ffn.2.weight": (DIM, FFN), f"{b}ffn.2.bias": (DIM,),
                       f"{b}modulation": (1, 6, DIM)})
    sd = {}
    for k, shape in shapes.items():
        if k.endswith("norm_q.weight") or k.endswith("norm_k.weight") or k.endswith("norm3.weight"):
            sd[k] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            sd[k] = torch.randn(shape, generator=g) / (shape[-1] if len(shape) > 1 else 8) ** 0.5 * 0.5
    return sd


def sample(model):
    g = torch.Generator().manual_seed(1)
    latent = torch.zeros(1, 16, 3, 8, 8)
    noise = torch.randn(latent.shape, generator=g)
    pos = [[torch.randn(1, 7, TEXT_DIM, generator=g), {}]]
    neg = [[torch.randn(1, 5, TEXT_DIM, generator=g), {}]]
    return comfy.sample.sample(model, noise, 2, 3.0, "euler", "simple", pos, neg, latent, disable_pbar=True,
                               seed=1)


def handle_of(model):
    wrappers = model.get_all_wrappers(comfy.patcher_extension.WrappersMP.APPLY_MODEL)
    return next(w.handle for w in wrappers if hasattr(w, "handle"))


def graphs():
    return int(counters["stats"]["unique_graphs"])


cache_path = sys.argv[1]
patcher = comfy.sd.load_diffusion_model_state_dict(wan_state_dict(), model_options={"dtype": torch.float32})
dm = patcher.model.diffusion_model
originals = [id(b) for b in dm.blocks]
orig_forwards = [("forward" in b.__dict__) for b in dm.blocks]
res = {"model_class": type(patcher.model).__name__, "dm_class": type(dm).__name__, "blocks": len(dm.blocks),
       "num_heads": dm.num_heads, "dtype": str(next(dm.parameters()).dtype)}

base = sample(patcher)
res["base_finite"] = bool(torch.isfinite(base).all())
res["base_std"] = float(base.std())

settings = dict(backend="eager", mode="default", lock_global_ops=True, tiling_preset="default", fullgraph=False,
                dynamic="auto", scope="blocks", recompile_limit=8, warm_start=False,
                stance_after_warmup="eager_on_recompile")
node = ApplyCompileNativeWan()
eager_model = node.apply(patcher, WanCompileSettings().build(**settings)[0])[0]
res["eager_is_clone"] = eager_model is not patcher
g0 = graphs()
out_eager = sample(eager_model)
h = handle_of(eager_model)
res["eager_graphs"] = graphs() - g0
res["eager_handle"] = {"calls": h.calls, "compiles": h.compiles, "warm": h.warm}
res["eager_max_abs"] = float((out_eager - base).abs().max())
res["eager_equal"] = bool(torch.equal(out_eager, base))
res["after_eager_same_blocks"] = [id(b) for b in patcher.model.diffusion_model.blocks] == originals

settings.update(backend="inductor", warm_start=True, stance_after_warmup="fail_on_recompile")
ind_model = node.apply(patcher, WanCompileSettings().build(**settings)[0])[0]
g0 = graphs()
out_ind = sample(ind_model)
h = handle_of(ind_model)
res["ind_graphs_run1"] = graphs() - g0
res["ind_handle_run1"] = {"calls": h.calls, "compiles": h.compiles, "warm": h.warm}
res["ind_max_abs"] = float((out_ind - base).abs().max())
g1 = graphs()
out_ind2 = sample(ind_model)
res["ind_graphs_run2"] = graphs() - g1
res["ind_handle_run2"] = {"calls": h.calls, "compiles": h.compiles, "warm": h.warm}
res["ind_run2_equal_run1"] = bool(torch.equal(out_ind, out_ind2))
res["ind_run2_max_abs"] = float((out_ind2 - base).abs().max())

res["after_all_same_blocks"] = [id(b) for b in patcher.model.diffusion_model.blocks] == originals
res["block_forwards_untouched"] = [("forward" in b.__dict__) for b in dm.blocks] == orig_forwards
res["patcher_has_no_wrappers"] = not patcher.get_all_wrappers(comfy.patcher_extension.WrappersMP.APPLY_MODEL)
base2 = sample(patcher)
res["unpatched_again_equal"] = bool(torch.equal(base2, base))
res["compile_entries"] = [e["key"] for e in LimitCache(cache_path).entries("compile")]
res["inductor_dir"] = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
print("WAN_ACCEL_RESULT " + json.dumps(res))
'''


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    comfy_dir = Path(COMFY_DIR)
    python = Path(COMFY_VENV) / "bin" / "python"
    assert (comfy_dir / "comfy" / "sd.py").is_file(), f"COMFYUI_DIR={comfy_dir} is not a ComfyUI work tree"
    assert python.is_file(), f"COMFYUI_VENV={COMFY_VENV} has no bin/python"
    work = tmp_path_factory.mktemp("native_compile")
    (work / "pkg").mkdir()
    (work / "pkg" / "wan_accel").symlink_to(REPO, target_is_directory=True)
    script = work / "run_native_compile.py"
    script.write_text(SCRIPT)
    cache_path = work / "wan_accel" / "limits.json"
    env = dict(os.environ, WAN_ACCEL_CACHE=str(cache_path),
               PYTHONPATH=os.pathsep.join([str(work / "pkg"), str(comfy_dir)]), OMP_NUM_THREADS="2")
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # warm start points it beside the limit cache
    out = subprocess.run([str(python), str(script), str(cache_path)], cwd=comfy_dir, env=env, capture_output=True,
                         text=True, timeout=900)
    lines = [l for l in out.stdout.splitlines() if l.startswith("WAN_ACCEL_RESULT ")]
    assert out.returncode == 0 and lines, f"rc={out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    res = json.loads(lines[-1].split(" ", 1)[1])
    res["cache_dir"] = str(cache_path.parent)
    return res


def test_comfyui_builds_a_native_wan21_model(result):
    assert result["model_class"] == "WAN21" and result["dm_class"] == "WanModel", result
    assert result["blocks"] == 2 and result["dtype"] == "torch.float32", result
    assert result["base_finite"] and result["base_std"] > 0, result


def test_eager_backend_is_bit_identical(result):
    assert result["eager_is_clone"]
    assert result["eager_handle"]["calls"] > 0 and result["eager_handle"]["warm"], result["eager_handle"]
    assert result["eager_graphs"] >= 1, result  # the blocks really went through Dynamo
    assert result["eager_equal"], f"max abs difference {result['eager_max_abs']}"


def test_inductor_backend_is_close(result):
    assert result["ind_graphs_run1"] >= 1, result
    assert result["ind_max_abs"] <= 1e-4, result["ind_max_abs"]


def test_second_run_of_the_compiled_clone_does_not_recompile(result):
    # the stance after warm-up is fail_on_recompile: a recompile would have raised in the script
    assert result["ind_graphs_run2"] == 0, result
    assert result["ind_handle_run2"]["compiles"] == result["ind_handle_run1"]["compiles"], result
    assert result["ind_handle_run2"]["calls"] > result["ind_handle_run1"]["calls"], result
    assert result["ind_run2_equal_run1"], result["ind_run2_max_abs"]


def test_original_patcher_is_never_mutated(result):
    assert result["after_eager_same_blocks"] and result["after_all_same_blocks"], result
    assert result["block_forwards_untouched"], result
    assert result["patcher_has_no_wrappers"], result
    assert result["unpatched_again_equal"], result


def test_warm_start_indexes_compile_artifacts(result):
    assert result["compile_entries"], result
    assert all(key.startswith("WanModel-2b-") for key in result["compile_entries"]), result["compile_entries"]
    inductor_dir = Path(result["inductor_dir"])
    assert inductor_dir == Path(result["cache_dir"]) / "inductor" and inductor_dir.is_dir(), result["inductor_dir"]
    artifacts = list((Path(result["cache_dir"]) / "compile_artifacts").glob("*.bin"))
    assert artifacts and all(a.stat().st_size > 0 for a in artifacts), artifacts
