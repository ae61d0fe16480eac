"""The Wan Accel AR Sampler on ComfyUI's own causal Wan MODEL, in a real ComfyUI through ``/prompt``
(skipped unless COMFYUI_DIR and COMFYUI_VENV are set).

The public causal fixture's weights, as a training-style .pt converted by the pack's ``convert``, make a file
``UNETLoader`` (Load Diffusion Model) loads as ``WAN21_CausalAR`` (the converter writes core's ``config.transformer``
metadata: causal_ar, and the tiny model's heads, text length, frequency and text widths), its recorded inputs go to the input folder (``Wan Recorded Run``), and the graph
UNETLoader -> [LoraLoaderModelOnly] -> Wan Recorded Run -> BasicGuider / Wan Causal Sigmas / Wan Accel AR Sampler ->
SamplerCustomAdvanced -> SaveLatent runs. The saved latent (VAE space) is mapped back to the model's space with
ComfyUI's Wan 2.1 latent format and compared with the official output, the pack's own loader and engine, or another
run of the same graph.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from e2e.test_comfyui_e2e import COMFY_DIR, COMFY_VENV, comfy_server, http

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "wan_reference"
UNET = "wan_accel_causal_fixture.safetensors"

pytestmark = pytest.mark.skipif(not (COMFY_DIR and COMFY_VENV),
                                reason="set COMFYUI_DIR and COMFYUI_VENV to run the native causal sampler check")


def _fixture_config() -> dict:
    return json.loads((FIXTURE / "causal_config.json").read_text())


def core_metadata(cfg: dict) -> dict:
    """What makes core detect the fixture's tiny model as WAN21_CausalAR (its sizes differ from core's defaults)."""
    from wan_accel.model.checkpoint import core_causal_metadata
    from wan_accel.model.config import WanConfig
    return core_causal_metadata(WanConfig.from_dict(cfg["config"]))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    for sub in ("diffusion_models", "loras"):
        (root / sub).mkdir()
    (root / "extra_model_paths.yaml").write_text(
        f"wan_accel_e2e:\n  diffusion_models: {root / 'diffusion_models'}\n  loras: {root / 'loras'}\n")
    # the file core loads is written by the pack's converter from a training-style .pt
    from wan_accel.model.convert import convert_pt_to_safetensors
    c = _fixture_config()["config"]
    pt = root / "fixture_dmd.pt"
    torch.save({"generator": {f"model.{k}": v for k, v in load_file(str(FIXTURE / "causal_weights.safetensors")).items()}},
               str(pt))
    convert_pt_to_safetensors(pt, root / "diffusion_models" / UNET, num_heads=c["num_heads"],
                              config={"text_len": c["text_len"]})
    return root


@pytest.fixture(scope="module")
def comfy(tmp_path_factory, models):
    yield from comfy_server(tmp_path_factory, ("--extra-model-paths-config", str(models / "extra_model_paths.yaml")))


@pytest.fixture(scope="module")
def latent_format():
    """(mean, std, scale) of ComfyUI's Wan 2.1 latent format, read with ComfyUI's Python."""
    code = ("import json, comfy.latent_formats as f; w = f.Wan21(); print(json.dumps([w.latents_mean.flatten()"
            ".tolist(), w.latents_std.flatten().tolist(), w.scale_factor]))")
    out = subprocess.run([str(Path(COMFY_VENV) / "bin" / "python"), "-c", code], cwd=COMFY_DIR, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    mean, std, scale = json.loads(out.stdout.strip().splitlines()[-1])
    return torch.tensor(mean).view(1, -1, 1, 1, 1), torch.tensor(std).view(1, -1, 1, 1, 1), scale


def recorded_io(comfy, name: str, tensors: dict) -> str:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(comfy["work"] / "input" / name))
    return name


def graph(io_file: str, prefix: str, unet=UNET, lora=None, weight_dtype="default", sampler=None) -> dict:
    g = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": weight_dtype}},
        "2": {"class_type": "WanRecordedRun", "inputs": {"model": ["1", 0], "file": io_file}},
        "3": sampler or {"class_type": "WanAccelARSampler", "inputs": {
            "frames_per_block": 3, "kv_window": -1, "sink": 0, "path": "reference", "cuda_graphs": False}},
        "4": {"class_type": "WanCausalSigmas", "inputs": {"preset": "self_forcing", "steps": "1000,750,500,250",
                                                           "shift": 5.0, "warp": True}},
        "5": {"class_type": "BasicGuider", "inputs": {"model": ["2", 0], "conditioning": ["2", 2]}},
        "6": {"class_type": "SamplerCustomAdvanced", "inputs": {
            "noise": ["2", 1], "guider": ["5", 0], "sampler": ["3", 0], "sigmas": ["4", 0],
            "latent_image": ["2", 3]}},
        "7": {"class_type": "SaveLatent", "inputs": {"samples": ["6", 0], "filename_prefix": f"wan_accel_e2e/{prefix}"}},
    }
    if lora is not None:
        g["8"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "lora_name": lora,
                                                                  "strength_model": 1.0}}
        g["2"]["inputs"]["model"] = ["8", 0]
    return g


def run(comfy, prompt: dict, timeout: float = 300) -> dict:
    status, resp = http(comfy["url"] + "/prompt", {"prompt": prompt, "client_id": "wan_accel_native_e2e"})
    assert status == 200, resp
    pid = resp["prompt_id"]
    deadline = time.time() + timeout
    while time.time() < deadline:
        hist = http(comfy["url"] + f"/history/{pid}")[1]
        if pid in hist and hist[pid].get("status", {}).get("status_str") in ("success", "error"):
            entry = hist[pid]
            errors = [m[1] for m in entry["status"].get("messages", []) if m[0] == "execution_error"]
            assert entry["status"]["status_str"] == "success", errors
            return entry
        time.sleep(0.2)
    raise AssertionError(f"the prompt did not finish in {timeout} s")


def model_space(comfy, prefix: str, latent_format) -> torch.Tensor:
    """The newest saved latent of ``prefix`` in the model's space, as [B, F, C, H, W]."""
    files = sorted((comfy["work"] / "output" / "wan_accel_e2e").glob(f"{prefix}_*.latent"), key=os.path.getmtime)
    assert files, f"no latent saved for {prefix}"
    mean, std, scale = latent_format
    vae = load_file(str(files[-1]))["latent_tensor"].float()
    return ((vae - mean) * scale / std).movedim(1, 2)


def test_native_model_reproduces_the_official_causal_output(comfy, latent_format):
    io = load_file(str(FIXTURE / "causal_io.safetensors"))
    run(comfy, graph(recorded_io(comfy, "causal_io.safetensors", io), "global"))
    out = model_space(comfy, "global", latent_format)
    assert (out - io["output"]).abs().max() < 1e-4
    log = comfy["log"].read_text(errors="replace")
    assert "WAN21_CausalAR" in log, "core did not load the file as WAN21_CausalAR"


def test_rolling_window_with_sink_matches_the_pack_loader(comfy, latent_format):
    from wan_accel.app.jobs.replay import Fixture
    from run_helpers import run_causal
    cfg = _fixture_config()
    io = load_file(str(FIXTURE / "causal_io.safetensors"))
    g = torch.Generator().manual_seed(11)
    noise = io["initial_noise"]
    b, f, c, h, w = noise.shape
    rec = {f"extra_noise.block{ci}.step{k}": torch.randn(b, c, h, w, generator=g) for ci in range(f) for k in range(3)}
    name = recorded_io(comfy, "window_io.safetensors", dict(rec, initial_noise=noise, context=io["context"]))
    sampler = {"class_type": "WanAccelARSampler", "inputs": {"frames_per_block": 1, "kv_window": 3, "sink": 1,
                                                              "path": "reference", "cuda_graphs": False}}
    run(comfy, graph(name, "window", sampler=sampler))
    out = model_space(comfy, "window", latent_format)
    fx = Fixture(FIXTURE, cfg)
    model = fx.model("cpu")
    want = run_causal(model, io["context"], noise, fx.schedule(), 1, kv_window=3, sink=1, path="reference",
                         noise_provider=lambda ci, k, shape, dt, dev: rec[f"extra_noise.block{ci}.step{k}"].reshape(shape))
    assert (out - want).abs().max() < 1e-5
    unwindowed = run_causal(model, io["context"], noise, fx.schedule(), 1, path="reference",
                               noise_provider=lambda ci, k, shape, dt, dev: rec[f"extra_noise.block{ci}.step{k}"].reshape(shape))
    assert (out - unwindowed).abs().max() > 1e-3      # the window and sink were used


def _pack_run(state_dict: dict, tmp_path, io: dict, rec: dict | None = None) -> torch.Tensor:
    """The pack's own loader and engine on a state dict (float32), with the fixture's recorded noise."""
    from wan_accel.app.jobs.replay import Fixture
    from run_helpers import run_causal
    cfg = _fixture_config()
    (tmp_path / "w").mkdir(exist_ok=True)
    save_file(state_dict, str(tmp_path / "w" / cfg["weights_file"]))
    fx = Fixture(tmp_path / "w", cfg)
    model = fx.model("cpu")
    rec = rec or io
    return run_causal(model, io["context"], io["initial_noise"], fx.schedule(), 3, path="reference",
                         noise_provider=lambda ci, k, shape, dt, dev: rec[f"extra_noise.block{ci}.step{k}"].reshape(shape))


def test_lora_matches_the_pack_loader_on_merged_weights(comfy, models, latent_format, tmp_path):
    io = load_file(str(FIXTURE / "causal_io.safetensors"))
    weights = load_file(str(FIXTURE / "causal_weights.safetensors"))
    g = torch.Generator().manual_seed(21)
    rank, alpha, lora, merged = 4, 2.0, {}, dict(weights)
    for name, w in weights.items():
        if w.dim() == 2 and name.startswith("blocks.") and ("attn." in name or "ffn." in name):
            layer = name[:-len(".weight")]
            down = 0.1 * torch.randn(rank, w.shape[1], generator=g)
            up = 0.1 * torch.randn(w.shape[0], rank, generator=g)
            lora[f"diffusion_model.{layer}.lora_down.weight"] = down
            lora[f"diffusion_model.{layer}.lora_up.weight"] = up
            lora[f"diffusion_model.{layer}.alpha"] = torch.tensor(alpha)
            merged[name] = w + (alpha / rank) * (up @ down)
    save_file(lora, str(models / "loras" / "wan_accel_random_lora.safetensors"))
    run(comfy, graph(recorded_io(comfy, "causal_io.safetensors", io), "lora", lora="wan_accel_random_lora.safetensors"))
    out = model_space(comfy, "lora", latent_format)
    want = _pack_run(merged, tmp_path, io)
    assert (out - want).abs().max() < 1e-5
    assert (out - io["output"]).abs().max() > 1e-3           # the LoRA changed the result: it was applied


def _fp8_files(models) -> dict:
    """The fixture's weights as float8_e4m3fn (plain; and scaled: per-layer scale_weight, Linear weights divided by
    it) with their dequantized float32 copies; every tensor holds float8 values, so a copy is exact."""
    weights = load_file(str(FIXTURE / "causal_weights.safetensors"))
    meta = core_metadata(_fixture_config())
    fp8 = torch.float8_e4m3fn
    plain = {k: v.to(fp8) for k, v in weights.items()}
    scaled, scaled_deq = {"scaled_fp8": torch.empty(0, dtype=fp8)}, {}
    for k, v in weights.items():
        if v.dim() == 2 and k.endswith(".weight"):
            scale = (v.abs().max() / 448.0).float()
            q = (v / scale).to(fp8)
            scaled[k], scaled[k[:-len(".weight")] + ".scale_weight"] = q, scale.reshape(())
            scaled_deq[k] = q.float() * scale
        else:
            scaled[k] = v.to(fp8)
            scaled_deq[k] = scaled[k].float()
    files = {"fp8": plain, "fp8_deq": {k: v.float() for k, v in plain.items()}, "fp8s": scaled,
             "fp8s_deq": scaled_deq}
    for name, sd in files.items():
        save_file(sd, str(models / "diffusion_models" / f"wan_accel_{name}.safetensors"), metadata=meta)
    return files


def test_fp8_weights_match_their_dequantized_copy(comfy, models, latent_format):
    io = load_file(str(FIXTURE / "causal_io.safetensors"))
    _fp8_files(models)
    name = recorded_io(comfy, "causal_io.safetensors", io)
    outs = {}
    for kind in ("fp8", "fp8_deq", "fp8s", "fp8s_deq"):
        # plain float8 is kept as float8 only when asked (on a CPU core upcasts it by default); scaled float8 is
        # kept quantized by core's mixed-precision ops
        dtype = "fp8_e4m3fn" if kind == "fp8" else "default"
        run(comfy, graph(name, kind, unet=f"wan_accel_{kind}.safetensors", weight_dtype=dtype))
        outs[kind] = model_space(comfy, kind, latent_format)
    assert (outs["fp8"] - outs["fp8_deq"]).abs().max() < 1e-5
    assert (outs["fp8s"] - outs["fp8s_deq"]).abs().max() < 1e-5
    assert (outs["fp8s"] - outs["fp8"]).abs().max() > 1e-4    # the scales were used (not the raw float8 values)
    log = comfy["log"].read_text(errors="replace")
    assert "model weight dtype torch.float8_e4m3fn, manual cast: torch.float32" in log, "plain fp8 was not kept"
    assert "Detected mixed precision quantization" in log, "core did not read the scaled fp8 file as quantized"


def test_core_ar_video_on_the_same_model_side_by_side(comfy, latent_format):
    """Core's SamplerARVideo in the same graph: it runs on the same MODEL; its difference from the official output
    (its re-noising draws come from the global RNG, not the recording, and it does not pad the prompt) is reported
    in docs/benchmarks.md (run with -s to see it)."""
    io = load_file(str(FIXTURE / "causal_io.safetensors"))
    core = {"class_type": "SamplerARVideo", "inputs": {"num_frame_per_block": 3}}
    name = recorded_io(comfy, "causal_io.safetensors", io)
    walls = {}
    for label, sampler in (("core", core), ("ours", None)):
        entry = run(comfy, graph(name, f"side_{label}", sampler=sampler))
        stamps = {m[0]: m[1].get("timestamp") for m in entry["status"]["messages"]}
        walls[label] = (stamps["execution_success"] - stamps["execution_start"]) / 1000.0
    core_out = model_space(comfy, "side_core", latent_format)
    ours = model_space(comfy, "side_ours", latent_format)
    report = {"core_max_abs_diff_from_official": float((core_out - io["output"]).abs().max()),
              "ours_max_abs_diff_from_official": float((ours - io["output"]).abs().max()),
              "prompt_wall_s": walls}
    print("native side by side:", json.dumps(report))
    assert report["ours_max_abs_diff_from_official"] < 1e-4
    assert torch.isfinite(core_out).all()


def test_apply_compile_native_reaches_the_engine(comfy, latent_format):
    """Apply Compile (native Wan) on the MODEL: the optimized path compiles the engine's blocks with its settings
    (eager backend here: what is checked is that the settings arrive and the result stays the official one)."""
    io = load_file(str(FIXTURE / "causal_io.safetensors"))
    g = graph(recorded_io(comfy, "causal_io.safetensors", io), "compiled", sampler={
        "class_type": "WanAccelARSampler", "inputs": {"frames_per_block": 3, "kv_window": -1, "sink": 0,
                                                      "path": "optimized", "cuda_graphs": False}})
    g["9"] = {"class_type": "WanAccelCompileSettings", "inputs": {
        "backend": "eager", "mode": "default", "lock_global_ops": True, "tiling_preset": "default", "fullgraph": False,
        "dynamic": "auto", "scope": "blocks", "recompile_limit": 8, "warm_start": False,
        "stance_after_warmup": "eager_on_recompile"}}
    g["10"] = {"class_type": "WanAccelApplyCompileNative", "inputs": {"model": ["1", 0], "compile_settings": ["9", 0]}}
    g["2"]["inputs"]["model"] = ["10", 0]
    before = comfy["log"].read_text(errors="replace").count("compiled region(s) (blocks, eager)")
    run(comfy, g)
    out = model_space(comfy, "compiled", latent_format)
    assert (out - io["output"]).abs().max() < 1e-4
    log = comfy["log"].read_text(errors="replace")
    assert log.count("compiled region(s) (blocks, eager)") > before, log[-3000:]
