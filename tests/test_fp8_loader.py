"""fp8 checkpoints on the pack's loader: plain and scaled fp8 files load with their linear weights kept in fp8, and
generate the same video as the dequantized copy loaded in float32."""
import json

import pytest
import torch
from safetensors.torch import save_file

from wan_accel.memory.weights import weights_from_checkpoint, weights_from_module
from wan_accel.model.checkpoint import METADATA_KEY, CheckpointError, keeps_fp8
from wan_accel.model.loader import load_wan_checkpoint
from wan_accel.model.quant import FP8Linear
from wan_accel.model.tiny import TINY_CONFIG, tiny_causal_model
from run_helpers import run_causal

E4M3 = torch.float8_e4m3fn
F32_EPS = torch.finfo(torch.float32).eps
# e4m3: 3 mantissa bits, so neighbouring normal values are 2^-3 apart relative to the value: rounding moves a weight
# by at most half of that, 2^-4 of its size; below the smallest normal (2^-6) the step is the subnormal one, 2^-9
E4M3_REL = 2.0 ** -4
E4M3_SUBNORMAL_HALF_STEP = 2.0 ** -10
META = {METADATA_KEY: json.dumps(TINY_CONFIG.to_dict())}


def _float_state():
    return {n: t.detach().clone().contiguous() for n, t in tiny_causal_model(seed=3).state_dict().items()}


def _quantize(state, scaled: bool, dtype=E4M3, scale_key="scale_weight"):
    """(file tensors, dequantized float32 copy): each block linear weight in ``dtype``, with a per-tensor scale
    (amax / the dtype's largest value) when ``scaled``."""
    out, deq = {}, {}
    for name, t in state.items():
        if not keeps_fp8(name, "F8_E4M3", t.shape):
            out[name] = deq[name] = t
            continue
        scale = t.abs().max() / torch.finfo(dtype).max if scaled else torch.tensor(1.0)
        q = (t / scale).to(dtype)
        out[name] = q
        deq[name] = q.float() * scale
        if scaled:
            out[f"{name[:-len('.weight')]}.{scale_key}"] = scale.reshape(())
    if scaled and scale_key == "scale_weight":
        out["scaled_fp8"] = torch.empty(0, dtype=dtype)     # ComfyUI's marker of a scaled fp8 file
    return out, deq


def _write(path, tensors, meta=None):
    save_file(tensors, str(path), metadata={**META, **(meta or {})})
    return path


def _generate(model):
    g = torch.Generator().manual_seed(0)
    ctx = torch.randn(1, 7, TINY_CONFIG.text_dim, generator=g)
    noise = torch.randn(1, 6, TINY_CONFIG.in_dim, 4, 6, generator=g)
    return run_causal(model, ctx, noise, "self_forcing", 3, generator=torch.Generator().manual_seed(1))


def _assert_float32_rounding(got, want):
    # the same weights through the same ops: at most float32 rounding apart
    tol = 8 * F32_EPS * want.abs().max().item()
    assert (got - want).abs().max().item() <= tol


@pytest.mark.parametrize("case", ["plain", "scaled", "comfy_format_e5m2"])
def test_fp8_file_generates_like_its_dequantized_copy(tmp_path, case):
    state = _float_state()
    if case == "comfy_format_e5m2":
        tensors, deq = _quantize(state, True, torch.float8_e5m2, scale_key="weight_scale")
        layers = {n[:-len(".weight")]: {"format": "float8_e5m2"} for n, t in tensors.items()
                  if t.dtype == torch.float8_e5m2}
        meta = {"_quantization_metadata": json.dumps({"layers": layers})}
    else:
        tensors, deq = _quantize(state, case == "scaled")
        meta = {}
    fp8 = load_wan_checkpoint(_write(tmp_path / "fp8.safetensors", tensors, meta))
    ref = load_wan_checkpoint(_write(tmp_path / "deq.safetensors", deq))
    quantized = [m for m in fp8.modules() if isinstance(m, FP8Linear)]
    assert len(quantized) == 10 * TINY_CONFIG.num_layers           # q k v o (self, cross) and the FFN's two
    assert all(m.weight.element_size() == 1 and m.weight.dtype.is_floating_point for m in quantized)
    _assert_float32_rounding(_generate(fp8), _generate(ref))
    # the optimized path (fused q/k/v when the layers allow it) gives the same video
    opt = run_causal(fp8, *_inputs(), "self_forcing", 3, generator=torch.Generator().manual_seed(1),
                        path="optimized")
    _assert_float32_rounding(opt, run_causal(ref, *_inputs(), "self_forcing", 3,
                                                generator=torch.Generator().manual_seed(1), path="optimized"))


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 7, TINY_CONFIG.text_dim, generator=g), torch.randn(1, 6, TINY_CONFIG.in_dim, 4, 6, generator=g)


def test_scaled_fp8_layers_stay_within_e4m3_rounding_of_the_float32_weights(tmp_path):
    state = _float_state()
    tensors, _ = _quantize(state, True)
    fp8 = load_wan_checkpoint(_write(tmp_path / "fp8.safetensors", tensors))
    orig = tiny_causal_model(seed=3)
    x = torch.randn(5, TINY_CONFIG.dim, generator=torch.Generator().manual_seed(2))
    checked = 0
    for name, layer in fp8.named_modules():
        if not isinstance(layer, FP8Linear) or layer.in_features != TINY_CONFIG.dim:
            continue
        w = orig.get_submodule(name).weight
        # each weight moves by <= 2^-4 of itself (normal range) or half a subnormal step (times the scale), so
        # each output moves by at most that bound summed over the row, plus float32 rounding of the two GEMMs
        per_weight = E4M3_REL * w.abs() + E4M3_SUBNORMAL_HALF_STEP * layer.scale_weight
        bound = x.abs() @ per_weight.t() + 4 * F32_EPS * (x.abs() @ w.abs().t()) * TINY_CONFIG.dim
        err = (layer(x) - orig.get_submodule(name)(x)).abs()
        assert bool((err <= bound).all()), name
        checked += 1
    assert checked >= 8 * TINY_CONFIG.num_layers
    # the whole generation stays within the size of one e4m3 step of the float32 model's video
    got, want = _generate(fp8), _generate(orig)
    assert ((got - want).norm() / want.norm()).item() < 2.0 ** -3


@pytest.mark.parametrize("bad, says", [
    (float("nan"), "non-finite"), (float("inf"), "non-finite"), (0.0, "zero or negative"), ("shape", "[2, 3]")])
def test_corrupt_scale_is_named(tmp_path, bad, says):
    tensors, _ = _quantize(_float_state(), True)
    key = "blocks.1.ffn.2.scale_weight"
    tensors[key] = torch.ones(2, 3) if bad == "shape" else torch.tensor(bad)
    with pytest.raises(CheckpointError) as err:
        load_wan_checkpoint(_write(tmp_path / "bad.safetensors", tensors))
    assert key in str(err.value) and says in str(err.value)


def test_every_scale_of_a_file_is_checked_in_one_host_sync(tmp_path, monkeypatch):
    """The scales' finite and positive checks are read together (one sync per device), and the first bad one in
    the file's order is still the one named."""
    import wan_accel.model.loader as loader
    from wan_accel.cache.finite_flags import read_flags
    reads = []
    monkeypatch.setattr(loader, "read_flags", lambda flags: reads.append(len(flags)) or read_flags(flags))
    tensors, _ = _quantize(_float_state(), True)
    load_wan_checkpoint(_write(tmp_path / "ok.safetensors", tensors))
    n_scales = sum(k.endswith("scale_weight") for k in tensors)
    assert reads == [2 * n_scales] and n_scales >= 8
    tensors["blocks.1.ffn.2.scale_weight"] = torch.tensor(0.0)
    tensors["blocks.1.ffn.0.scale_weight"] = torch.tensor(float("inf"))
    with pytest.raises(CheckpointError, match=r"'blocks\.1\.ffn\.0\.scale_weight' holds non-finite"):
        load_wan_checkpoint(_write(tmp_path / "bad.safetensors", tensors))


def test_formats_the_loader_does_not_read_are_refused_with_the_way_to_load_them(tmp_path):
    tensors, _ = _quantize(_float_state(), True, scale_key="weight_scale")
    layers = {"blocks.0.ffn.0": {"format": "nvfp4"}}
    with pytest.raises(CheckpointError, match="blocks.0.ffn.0: nvfp4.*Load Diffusion Model"):
        load_wan_checkpoint(_write(tmp_path / "q.safetensors", tensors,
                                   {"_quantization_metadata": json.dumps({"layers": layers})}))
    tensors["blocks.0.ffn.0.comfy_quant"] = torch.tensor(list(json.dumps({"format": "mxfp8"}).encode()),
                                                         dtype=torch.uint8)
    with pytest.raises(CheckpointError, match="blocks.0.ffn.0: mxfp8"):
        load_wan_checkpoint(_write(tmp_path / "q2.safetensors", tensors))
    tensors.pop("blocks.0.ffn.0.comfy_quant")
    tensors["blocks.0.nothing.scale_weight"] = torch.tensor(1.0)
    with pytest.raises(CheckpointError, match="'blocks.0.nothing.scale_weight' belongs to no layer weight"):
        load_wan_checkpoint(_write(tmp_path / "q3.safetensors", tensors))


@pytest.mark.parametrize("dtype, elem", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_estimate_counts_fp8_weights_at_one_byte(tmp_path, dtype, elem):
    tensors, _ = _quantize(_float_state(), True)
    path = _write(tmp_path / "fp8.safetensors", tensors)
    table = weights_from_checkpoint(path)
    live = weights_from_module(load_wan_checkpoint(path, dtype=dtype))
    # the file's table held at the run's dtype is byte for byte what the loaded model holds
    assert table.block_bytes_at(elem) == live.block_bytes
    assert table.other_bytes_at(elem) == live.other_bytes
    plain = weights_from_module(tiny_causal_model(seed=3, dtype=dtype))
    assert sum(live.block_bytes) < sum(plain.block_bytes)
