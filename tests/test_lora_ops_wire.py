"""LoRA and operator choice reachable by users (CLI, loader and sampler nodes, bench rows), and the fp8 matmul
dispatch of model/quant.py (comfy-kitchen's scaled matmul, torch._scaled_mm, or the dequantized weight)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from cli_run import run_cli
from wan_accel.app.jobs.handle import load_model_handle
from wan_accel.kernels import candidates as C
from wan_accel.kernels import kitchen
from wan_accel.model import quant
from wan_accel.model.lora import LoraError, read_lora
from wan_accel.model.quant import FP8Linear, fp8_matmul_path
from wan_accel.sampling.continuation import weight_fingerprint

FIX = Path(__file__).resolve().parent / "fixtures"
CKPT = FIX / "wan_reference" / "causal_weights.safetensors"      # dim 64, 4 heads, ffn 128: the LoRA's model
LORA = FIX / "longlive" / "lora_peft.safetensors"
SMALL = ["--device", "cpu", "--frames", "9", "--height", "32", "--width", "32"]
E4M3_UNIT = 2.0 ** -4        # unit roundoff of float8 e4m3 (3 mantissa bits)
BF16_UNIT = 2.0 ** -8        # unit roundoff of bfloat16 (7 mantissa bits)


# ----------------------------------------------------------------------------- fp8 matmul dispatch
def _fp8_layer(n_in=32, n_out=48, weight_dtype=torch.float8_e4m3fn, per_row=False, input_scale=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    layer = FP8Linear(n_in, n_out, bias=True, dtype=weight_dtype)
    w = torch.randn(n_out, n_in, generator=g)
    scale = w.abs().amax(dim=1, keepdim=True) / 200 if per_row else w.abs().max() / 200
    with torch.no_grad():
        layer.weight.data = (w / scale).to(weight_dtype)
        layer.scale_weight.data = scale.float() if per_row else scale.reshape(()).float()
        layer.bias.data = 0.1 * torch.randn(n_out, generator=g)
    if input_scale:
        layer.scale_input = torch.nn.Parameter(torch.tensor(4.0 / 448), requires_grad=False)
    return layer.requires_grad_(False)


def _x(rows=(2, 5), n_in=32, seed=1):
    return torch.randn(*rows, n_in, generator=torch.Generator().manual_seed(seed))


def test_fp8_dispatch_order_with_availability_monkeypatched(monkeypatch):
    layer, x = _fp8_layer(), _x()
    path, why = fp8_matmul_path(layer, x)
    assert path == "dequantize" and "cpu" in why               # no fp8 matmul units on a CPU
    monkeypatch.setattr(quant, "fp8_mm_device_problem", lambda device: None)      # a device with fp8 matmuls
    monkeypatch.setattr(quant, "kitchen_scaled_mm", lambda: (lambda *a: None))
    assert fp8_matmul_path(layer, x)[0] == "kitchen"
    monkeypatch.setattr(quant, "kitchen_scaled_mm", lambda: None)                  # comfy-kitchen absent
    assert fp8_matmul_path(layer, x)[0] == "torch"
    monkeypatch.delattr(torch, "_scaled_mm")                                        # an old torch
    assert fp8_matmul_path(layer, x)[0] == "dequantize"


@pytest.mark.parametrize("kind,word", [("no_input_scale", "input scale"), ("e5m2", "float8_e5m2"),
                                       ("per_row", "per row"), ("odd_size", "multiple of 16")])
def test_fp8_layers_a_scaled_matmul_cannot_take_dequantize(monkeypatch, kind, word):
    monkeypatch.setattr(quant, "fp8_mm_device_problem", lambda device: None)
    monkeypatch.setattr(quant, "kitchen_scaled_mm", lambda: (lambda *a: None))
    layer = _fp8_layer(n_in=24 if kind == "odd_size" else 32, input_scale=kind != "no_input_scale",
                       weight_dtype=torch.float8_e5m2 if kind == "e5m2" else torch.float8_e4m3fn,
                       per_row=kind == "per_row")
    path, why = fp8_matmul_path(layer, _x(n_in=layer.in_features))
    assert path == "dequantize" and word in why


def test_fp8_forward_runs_the_chosen_path_and_falls_back_in_order(monkeypatch):
    layer, x = _fp8_layer(), _x()
    calls = []

    def spy(name, real):
        def call(*a):
            calls.append(name)
            return real(*a)
        return call

    def broken(*a):
        calls.append("kitchen")
        raise RuntimeError("no kernel for this shape")

    dequantized = F.linear(x, layer.dequantized(x.dtype), layer.bias)
    real = quant.torch_scaled_mm
    monkeypatch.setattr(quant, "torch_scaled_mm", spy("torch", real))
    monkeypatch.setattr(quant, "kitchen_scaled_mm", lambda: spy("kitchen", real))
    assert torch.equal(layer(x), dequantized) and calls == []          # a CPU: the dequantized weight runs
    monkeypatch.setattr(quant, "fp8_mm_device_problem", lambda device: None)
    fast = layer(x)
    assert calls == ["kitchen"] and fast.shape == dequantized.shape and fast.dtype == x.dtype
    calls.clear()
    monkeypatch.setattr(quant, "kitchen_scaled_mm", lambda: broken)
    assert torch.equal(layer(x), fast) and calls == ["kitchen", "torch"]    # the next path, same numbers


def _fp8_bound(layer, x, ref):
    """Per element: the input's e4m3 rounding (relative E4M3_UNIT per product) and the bf16 result's rounding."""
    w = layer.dequantized(torch.float32)
    return E4M3_UNIT * (x.abs().reshape(-1, x.shape[-1]) @ w.abs().t()).reshape(ref.shape) \
        + BF16_UNIT * ref.abs() + 1e-6


@pytest.mark.skipif(quant.kitchen_scaled_mm() is None, reason="comfy-kitchen (with scaled_mm_v2) is not installed")
def test_comfy_kitchen_scaled_mm_on_the_cpu_matches_the_dequantized_matmul(monkeypatch):
    layer, x = _fp8_layer(n_in=64, n_out=32), _x(n_in=64)
    try:
        quant.kitchen_scaled_mm()(quant.quantize_input(x.reshape(-1, 64), layer.scale_input), layer.weight.t(),
                                  layer.scale_input.reshape(()), layer.scale_weight.reshape(()), None, torch.bfloat16)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"comfy-kitchen's fp8 scaled matmul does not run on this CPU ({exc})")
    ref = F.linear(x, layer.dequantized(torch.float32), layer.bias)
    monkeypatch.setattr(quant, "fp8_mm_device_problem", lambda device: None)     # take the fp8 path on the CPU
    assert fp8_matmul_path(layer, x)[0] == "kitchen"
    got = layer(x)
    err = (got - ref).abs()
    assert bool((err <= _fp8_bound(layer, x, ref)).all()), float(err.max())
    assert float(err.max()) > 0                   # the fp8 matmul ran (the dequantized weight would be exact)


# ----------------------------------------------------------------------------- LoRA for users
def test_handle_merges_the_lora_and_keys_on_it():
    plain = load_model_handle(str(CKPT), "fp32", "float32", device="cpu", num_heads=4)
    full = load_model_handle(str(CKPT), "fp32", "float32", device="cpu", num_heads=4, lora=str(LORA))
    half = load_model_handle(str(CKPT), "fp32", "float32", device="cpu", num_heads=4, lora=str(LORA),
                             lora_strength=0.5)
    assert (plain.lora, full.lora, half.lora_strength) == (None, str(LORA), 0.5)
    layer = "blocks.1.self_attn.q"
    e = read_lora(LORA)[layer]
    delta = e["up"] @ e["down"]                   # LongLive: alpha = rank, scale 1
    base = dict(plain.model.named_parameters())[f"{layer}.weight"]
    for handle, s in ((full, 1.0), (half, 0.5)):
        got = dict(handle.model.named_parameters())[f"{layer}.weight"]
        assert torch.allclose(got, base + s * delta, atol=1e-6)
    prints = {weight_fingerprint(h.model) for h in (plain, full, half)}
    assert len(prints) == 3                       # a continued state never crosses LoRA settings


def test_tiny_model_takes_a_lora_too(tmp_path):
    plain = load_model_handle(None, "fp32", device="cpu")
    name = "blocks.0.self_attn.o"
    path = tmp_path / "tiny_lora.safetensors"
    save_file({f"diffusion_model.{name}.lora_A.weight": torch.ones(2, 64),
               f"diffusion_model.{name}.lora_B.weight": torch.full((64, 2), 0.01)}, str(path))
    merged = load_model_handle(None, "fp32", device="cpu", lora=str(path), lora_strength=2.0)
    diff = dict(merged.model.named_parameters())[f"{name}.weight"] - dict(plain.model.named_parameters())[f"{name}.weight"]
    assert torch.allclose(diff, torch.full_like(diff, 2.0 * 0.02), atol=1e-6)


def test_a_lora_that_does_not_fit_fails_before_any_weight_is_read(monkeypatch, tmp_path):
    from wan_accel.model import loader

    def no_reads(*a, **k):
        raise AssertionError("the checkpoint's weights were read before the LoRA was checked")
    monkeypatch.setattr(loader, "_read_scales", no_reads)
    wide = tmp_path / "wide_ffn_lora.safetensors"             # made for an ffn of 256 (the checkpoint's is 128)
    save_file({"diffusion_model.blocks.0.ffn.0.lora_A.weight": torch.zeros(2, 64),
               "diffusion_model.blocks.0.ffn.0.lora_B.weight": torch.zeros(256, 2)}, str(wide))
    with pytest.raises(LoraError, match=r"makes a \[256, 64\] update but 'blocks\.0\.ffn\.0\.weight' is \[128, 64\]"):
        load_model_handle(str(CKPT), "fp32", device="cpu", num_heads=4, lora=str(wide))
    with pytest.raises(LoraError, match="finite"):
        loader.load_wan_checkpoint(CKPT, num_heads=4, lora=LORA, lora_strength=float("inf"))
    with pytest.raises(LoraError, match=r"makes a \[128, 64\] update but 'blocks\.0\.ffn\.0\.weight' is \[256, 64\]"):
        load_model_handle(None, "fp32", device="cpu", lora=str(LORA))            # the tiny model: ffn 256


def test_loader_node_lora_widget(tmp_path):
    from checkpoint_files import save_wan_checkpoint
    from wan_accel.nodes.model_nodes import NO_LORA, CausalWanModelLoader
    ckpt = save_wan_checkpoint(load_model_handle(str(CKPT), "fp32", device="cpu", num_heads=4).model,
                               tmp_path / "causal.safetensors")           # its config in the metadata
    spec = CausalWanModelLoader.INPUT_TYPES()["optional"]
    assert "lora" in spec and spec["lora_strength"][1]["default"] == 1.0
    node = CausalWanModelLoader()
    (none,) = node.load(str(ckpt), "fp32", "float32", lora=NO_LORA)
    (with_lora,) = node.load(str(ckpt), "fp32", "float32", lora=str(LORA), lora_strength=0.25)
    assert none.lora is None and (with_lora.lora, with_lora.lora_strength) == (str(LORA), 0.25)
    assert weight_fingerprint(none.model) != weight_fingerprint(with_lora.model)
    with pytest.raises(ValueError, match="lora_strength must be a finite number"):
        node.load(str(ckpt), "fp32", "float32", lora=str(LORA), lora_strength=float("nan"))
    with pytest.raises(ValueError, match=r"LoRA file lora_peft\.safetensors: .*use a LoRA trained for this model"):
        node.load("(built-in tiny model)", "fp32", "float32", lora=str(LORA))


def test_generate_lora_on_the_command_line(tmp_path):
    base = ["generate", "--no-preview", "--json", "--checkpoint", str(CKPT), "--num-heads", "4", *SMALL]
    outs = {}
    for tag, extra in (("none", []), ("lora", ["--lora", str(LORA)]),
                       ("half", ["--lora", str(LORA), "--lora-strength", "0.5"])):
        code, out, err = run_cli(*base, "--out", str(tmp_path / tag), *extra)
        assert code == 0, err
        report = json.loads(out)
        assert report["settings"]["lora"] == (str(LORA) if extra else None)
        outs[tag] = load_file(report["files"]["latents"])["latents"]
    assert not torch.equal(outs["none"], outs["lora"]) and not torch.equal(outs["lora"], outs["half"])


@pytest.mark.parametrize("extra,message", [
    (["--lora-strength", "0.5"], "--lora-strength needs --lora"),
    (["--lora", "missing.safetensors"], "--lora missing.safetensors"),
    (["--lora", str(LORA), "--lora-strength", "1000"], "--lora-strength"),
    (["--lora", str(LORA)], "LoRA file lora_peft.safetensors: key"),          # trained for another model
    (["--lora", str(LORA), "--model-kind", "matrix-game2"], "--lora"),
])
def test_generate_lora_errors_are_one_line(tmp_path, extra, message):
    code, _out, err = run_cli("generate", "--out", str(tmp_path / "o"), "--no-preview", *SMALL, *extra)
    assert code == 2 and "Traceback" not in err
    assert err.startswith("error: ") and message in err, err


# ----------------------------------------------------------------------------- operator choice for users
def _spy_kitchen(monkeypatch) -> dict:
    from tests.test_kitchen_candidates import spy_kitchen
    return spy_kitchen(monkeypatch)


@pytest.mark.skipif(not kitchen.available(), reason="comfy-kitchen is not installed")
@pytest.mark.parametrize("ops,used", [("kitchen", True), ("torch", False)])
def test_generate_ops_reaches_the_blocks(tmp_path, monkeypatch, ops, used):
    calls = _spy_kitchen(monkeypatch)
    code, out, err = run_cli("generate", "--out", str(tmp_path / "o"), "--no-preview", "--json", "--sampler",
                          "optimized", "--ops", ops, *SMALL)
    assert code == 0, err
    assert json.loads(out)["settings"]["ops"] == ops
    assert (calls["adaln"] > 0 and calls["norm_rope"] > 0) == used, calls


def _no_interpreter(monkeypatch):
    """A CPU without Triton's interpreter, whatever this process's TRITON_INTERPRET says (under it the pack's kernels
    run on a CPU, so 'pack' is not refused there)."""
    from wan_accel.kernels import _common
    monkeypatch.setattr(_common, "interpreter_usable", lambda: False)


@pytest.mark.parametrize("extra,message", [
    (["--ops", "kitchen"], "add --sampler optimized"),                # auto on a CPU: the reference sampler
    (["--ops", "torch", "--sampler", "reference"], "--sampler reference"),
    (["--ops", "pack", "--sampler", "optimized"], "--ops: ops='pack' cannot run here"),
    (["--ops", "attention.fp9=torch", "--sampler", "optimized"], "unknown op family 'attention.fp9'; families:"),
    (["--ops", "attention.fp8=fa4", "--sampler", "optimized"], "has no candidate 'fa4'; its candidates: fa3,"),
])
def test_generate_ops_errors_name_the_fix(tmp_path, extra, message, monkeypatch):
    _no_interpreter(monkeypatch)            # 'pack' cannot run on a CPU without it
    code, _out, err = run_cli("generate", "--out", str(tmp_path / "o"), "--no-preview", *SMALL, *extra)
    assert code == 2 and err.startswith("error: ") and message in err, err


@pytest.mark.skipif(not kitchen.available(), reason="comfy-kitchen is not installed")
def test_sampler_node_ops_widget(monkeypatch):
    from wan_accel.nodes.model_nodes import CausalWanSampler
    spec = CausalWanSampler.INPUT_TYPES()["optional"]["ops"]
    assert tuple(spec[0]) == C.MODES and "kitchen" in spec[1]["tooltip"]
    handle = load_model_handle(None, "fp32", device="cpu")
    node = CausalWanSampler()
    args = (handle, 32, 32, 9, 0, "self_forcing", 3, -1, 0)
    calls = _spy_kitchen(monkeypatch)
    node.sample(*args, sampler="optimized", ops="kitchen")
    assert calls["adaln"] > 0 and calls["norm_rope"] > 0
    with pytest.raises(ValueError, match="set sampler to optimized"):
        node.sample(*args, sampler="reference", ops="kitchen")
    with pytest.raises(ValueError, match="ops must be one of"):
        node.sample(*args, sampler="optimized", ops="fastest")


def test_bench_sampler_rows_per_ops_mode(tmp_path):
    from wan_accel.bench.sampler import VARIANTS
    assert {f"optimized-ops-{m}" for m in ("pack", "kitchen", "torch")} <= set(VARIANTS)
    code, out, err = run_cli("bench", "sampler", "--repeat", "1", "--variants", "optimized,optimized-ops-torch",
                          "--json", *SMALL)
    assert code == 0, err
    rows = {r["variant"]: r for r in json.loads(out)["rows"]}
    assert rows["optimized"]["ops"] == "auto" and rows["optimized-ops-torch"]["ops"] == "torch"
    assert rows["optimized-ops-torch"]["parity_max_abs"] <= 1e-4
    with pytest.MonkeyPatch.context() as mp:
        _no_interpreter(mp)                 # 'pack' cannot run on a CPU without it
        code, _out, err = run_cli("bench", "sampler", "--repeat", "1", "--variants", "optimized-ops-pack", *SMALL)
    assert code == 2 and "--variants optimized-ops-pack: ops='pack' cannot run here" in err, err
