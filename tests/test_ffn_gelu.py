"""The FFN's bias + GELU in the first GEMM's epilogue (``model/blocks.py`` ``ffn_epilogue`` / ``linear_gelu``) and
its doctor feature ``kernel.ffn_gelu``.

The epilogue runs on CUDA in bf16/fp16 only; on a CPU ``torch._addmm_activation`` computes the erf GELU, not the
model's tanh GELU. So here the path is forced: the CUDA condition is faked for CPU tensors and, where numbers are
compared, ``torch._addmm_activation`` is replaced by a tanh-GELU stand-in. The probe's comparison is shown to
refuse the CPU's own call (the wrong function) and a dropped bias, and to accept a correct tanh implementation.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from wan_accel.app.doctor.core import Doctor, Feature, default_context, doctor_for, tolerance
from wan_accel.app.doctor.gate import features_summary, gate_options
from wan_accel.app.doctor.probes import _ffn_gelu_inputs, ffn_gelu_probe
from wan_accel.cache import LimitCache
from wan_accel.model import blocks
from wan_accel.model.blocks import KERNEL_NAMES, BlockParts, LayerCall, WanBlock, epilogue_gelu_runs_on
from wan_accel.sampling import runner

CTX = default_context("cpu", torch.float32, head_dim=16)
OTHERS = tuple(k for k in KERNEL_NAMES if k != "ffn_gelu")


def _tanh_addmm_activation(calls: list | None = None, bias_used: bool = True):
    """A stand-in for ``torch._addmm_activation`` computing what cuBLASLt's GELU epilogue computes (the tanh GELU);
    ``bias_used=False`` drops the bias (a broken epilogue)."""
    def run(bias, mat1, mat2, beta=1, alpha=1, use_gelu=False):
        if calls is not None:
            calls.append(mat1)
        out = torch.addmm(bias, mat1, mat2, beta=beta, alpha=alpha) if bias_used else mat1 @ mat2
        return F.gelu(out, approximate="tanh") if use_gelu else F.relu(out)
    return run


@pytest.fixture
def cpu_as_cuda(monkeypatch):
    """The epilogue's device condition answered as for a CUDA tensor (its dtype rule kept)."""
    real = blocks.epilogue_gelu_runs_on
    monkeypatch.setattr(blocks, "epilogue_gelu_runs_on", lambda device, dtype: real(torch.device("cuda"), dtype))


def _ffn(dim=32, hidden=64, dtype=torch.float32, bias=True, approximate="tanh"):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(dim, hidden, bias=bias), nn.GELU(approximate=approximate),
                         nn.Linear(hidden, dim)).to(dtype)


# ------------------------------------------------------------------------------------------- the decision
def test_the_epilogue_runs_on_cuda_in_bf16_and_fp16_only():
    cuda = torch.device("cuda")
    assert epilogue_gelu_runs_on(cuda, torch.bfloat16) and epilogue_gelu_runs_on("cuda:1", torch.float16)
    assert not epilogue_gelu_runs_on(cuda, torch.float32)           # torch's addmm + GELU: nothing saved
    assert not epilogue_gelu_runs_on("cpu", torch.bfloat16)          # the CPU's call is the erf GELU


def test_ffn_picks_the_epilogue_only_under_its_conditions(cpu_as_cuda):
    ffn, h = _ffn(dtype=torch.bfloat16), torch.randn(2, 5, 32).to(torch.bfloat16)
    assert blocks.ffn_epilogue(ffn, h, True) and blocks.ffn_epilogue(ffn, h, ("ffn_gelu",))
    assert not blocks.ffn_epilogue(ffn, h, False) and not blocks.ffn_epilogue(ffn, h, OTHERS)
    assert not blocks.ffn_epilogue(ffn.float(), h.float(), True)              # float32: not this path
    assert not blocks.ffn_epilogue(ffn.float(), h, True)                       # weights in another dtype
    assert not blocks.ffn_epilogue(_ffn(dtype=torch.bfloat16, bias=False), h, True)
    assert not blocks.ffn_epilogue(_ffn(dtype=torch.bfloat16, approximate="none"), h, True)   # the erf GELU

    class Patched(nn.Linear):         # a layer that does more when called than a GEMM on its stored weight
        pass
    other = _ffn(dtype=torch.bfloat16)
    other[0] = Patched(32, 64).to(torch.bfloat16)
    assert not blocks.ffn_epilogue(other, h, True)
    hooked = _ffn(dtype=torch.bfloat16)
    hooked[0].register_forward_hook(lambda m, i, o: o)
    assert not blocks.ffn_epilogue(hooked, h, True)
    assert not blocks.ffn_epilogue(nn.Sequential(*ffn, nn.Identity()), h, True)


def test_the_epilogue_takes_a_2d_view_of_the_input_and_equals_the_module(cpu_as_cuda, monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "_addmm_activation", _tanh_addmm_activation(calls))
    monkeypatch.setattr(blocks, "EPILOGUE_DTYPES", (torch.float32,))     # forced on a CPU, in float32
    ffn, h = _ffn(), torch.randn(2, 5, 32)
    with torch.no_grad():
        out, ref = blocks._ffn(ffn, h, "exact", ("ffn_gelu",)), ffn(h)
    assert len(calls) == 1 and calls[0].shape == (10, 32) and calls[0].data_ptr() == h.data_ptr()   # no copy
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() <= tolerance(torch.float32, ref.abs().max().item())
    with torch.no_grad():
        blocks._ffn(ffn, h, "exact", OTHERS)
    assert len(calls) == 1                                                    # ffn_gelu not in use: the module


# ------------------------------------------------------------------------------------------- in the block
def _block_inputs():
    torch.manual_seed(1)
    block = WanBlock(64, 256, 4, qk_norm=True, cross_attn_norm=True, eps=1e-6).requires_grad_(False)
    with torch.no_grad():
        block.modulation.normal_(std=0.1)
    g = torch.Generator().manual_seed(2)
    x, e0 = torch.randn(2, 12, 64, generator=g), 0.1 * torch.randn(2, 1, 6, 64, generator=g)
    angles = torch.arange(12.0)[:, None] * torch.rand(8, generator=g)
    cross = block.cross_attn.context_kv(torch.randn(2, 5, 64, generator=g))
    return block, x, e0, (angles.cos(), angles.sin()), cross


def _run_block(block, x, e0, rope, cross, fused):
    with torch.no_grad():
        return block(x, e0, rope, LayerCall(cross=cross, parts=BlockParts(fused_kernels=fused)))


def test_block_with_the_epilogue_equals_the_module_and_a_failed_verdict_removes_it(cpu_as_cuda, monkeypatch,
                                                                                     cache_path):
    from wan_accel.model.tiny import tiny_causal_model
    monkeypatch.setattr(runner, "kernels_run_on", lambda device: True)
    # a failed verdict (here the CPU's own call: the erf GELU) switches ffn_gelu off alone
    doctor = Doctor(cache=LimitCache(cache_path), context=CTX, timer=lambda fn, dev: 0.01, features={
        "kernel.ffn_gelu": Feature("kernel.ffn_gelu", "epilogue", lambda ctx: ffn_gelu_probe(*_ffn_gelu_inputs(ctx)))})
    options, lines = gate_options(tiny_causal_model(), runner.FastOptions(cuda_graphs="off"), doctor=doctor)
    assert options.switched_off == {"kernel.ffn_gelu"}
    assert len(lines) == 1 and "kernel.ffn_gelu is switched off" in lines[0] and "wrong numbers" in lines[0]
    part = runner.kernels_part(options, "cpu")
    assert part == OTHERS and runner.kernels_part(runner.FastOptions(), "cpu") is True

    calls = []
    monkeypatch.setattr(torch, "_addmm_activation", _tanh_addmm_activation(calls))
    monkeypatch.setattr(blocks, "EPILOGUE_DTYPES", (torch.float32,))
    args = _block_inputs()
    ref = _run_block(*args, fused=False)
    bound = tolerance(torch.float32, ref.abs().max().item())
    out = _run_block(*args, fused=("ffn_gelu",))
    assert len(calls) == 1 and (out - ref).abs().max().item() <= bound
    _run_block(*args, fused=True)                     # every fused kernel in use (torch fallbacks on the CPU)
    assert len(calls) == 2
    kept = _run_block(*args, fused=part)              # switched off: the block calls the module
    assert len(calls) == 2 and (kept - ref).abs().max().item() <= bound


def test_the_epilogue_traces_under_compile(cpu_as_cuda, monkeypatch):
    """The real ``torch._addmm_activation`` (erf on a CPU: only the trace is checked here) is one aten op in the
    compiled block's graph, and the compiled block equals the eager one on the same path."""
    import torch._dynamo
    monkeypatch.setattr(blocks, "EPILOGUE_DTYPES", (torch.float32,))
    args = _block_inputs()
    eager = _run_block(*args, fused=("ffn_gelu",))
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward
    torch._dynamo.reset()
    try:
        block = args[0]
        compiled = torch.compile(block, backend=recording)
        with torch.no_grad():
            out = compiled(*args[1:4], LayerCall(cross=args[4], parts=BlockParts(fused_kernels=("ffn_gelu",))))
        ffn = torch.compile(blocks._ffn, backend="aot_eager", fullgraph=True)
        h = torch.randn(2, 12, 64)
        with torch.no_grad():
            assert torch.equal(ffn(block.ffn, h, "exact", ("ffn_gelu",)),
                               blocks._ffn(block.ffn, h, "exact", ("ffn_gelu",)))
    finally:
        torch._dynamo.reset()
    assert any("_addmm_activation" in g for g in graphs)
    assert (out - eager).abs().max().item() <= tolerance(torch.float32, eager.abs().max().item())


# ------------------------------------------------------------------------------------------- the doctor
def test_on_a_cpu_the_feature_is_not_available():
    for dtype in (torch.float32, torch.bfloat16):
        d = doctor_for("cpu", dtype, 16)
        why = d.unavailable("kernel.ffn_gelu")[0]
        assert why and "CUDA" in why and "erf" in why
        assert d.check("kernel.ffn_gelu") is None and d.probes == 0


def _verdict(cache_path, probe) -> dict:
    feats = {"kernel.ffn_gelu": Feature("kernel.ffn_gelu", "epilogue", lambda ctx: probe)}
    d = Doctor(cache=LimitCache(cache_path), context=CTX, timer=lambda fn, dev: 0.01, features=feats)
    return d.check("kernel.ffn_gelu", recheck=True)


def test_the_probe_refuses_the_erf_gelu_and_a_dropped_bias_and_passes_the_tanh_gelu(cache_path, monkeypatch):
    x, w, b = _ffn_gelu_inputs(CTX)            # the probe's own inputs, in float32 on the CPU
    z = F.linear(x.double(), w.double(), b.double())
    tanh, erf = F.gelu(z, approximate="tanh"), F.gelu(z)
    bound = tolerance(torch.float32, tanh.abs().max().item())             # the doctor's ulps (Probe.ulps)
    assert (tanh - erf).abs().max().item() > 20 * bound     # the two functions differ far beyond float32's bound

    erf_verdict = _verdict(cache_path, ffn_gelu_probe(x, w, b))      # the CPU's own call: the erf GELU
    assert erf_verdict["status"] == "failed" and "wrong numbers" in erf_verdict["error"]
    assert erf_verdict["difference"] > 10 * erf_verdict["tolerance"]

    monkeypatch.setattr(torch, "_addmm_activation", _tanh_addmm_activation(bias_used=False))
    assert _verdict(cache_path, ffn_gelu_probe(x, w, b))["status"] == "failed"

    monkeypatch.setattr(torch, "_addmm_activation", _tanh_addmm_activation())
    right = _verdict(cache_path, ffn_gelu_probe(x, w, b))
    assert right["status"] == "passed" and right["difference"] <= right["tolerance"]


def test_a_run_report_names_the_epilogue_only_where_it_runs(monkeypatch):
    from types import SimpleNamespace
    monkeypatch.setattr(runner, "kernels_run_on", lambda device: True)

    def ran(device, dtype, **options):
        model = SimpleNamespace(device=device, compute_dtype=dtype)
        summary = features_summary(model, runner.FastOptions(**options), {"path": "optimized"}, None)
        assert summary["enabled"]["kernel.rms_norm"]
        return summary["enabled"]["kernel.ffn_gelu"]
    assert ran("cuda", torch.bfloat16) and ran("cuda", torch.float16)
    assert not ran("cuda", torch.float32) and not ran("cpu", torch.bfloat16)
    assert not ran("cuda", torch.bfloat16, switched_off={"kernel.ffn_gelu"})


def test_a_report_says_fused_kernels_where_every_kernel_that_applies_ran():
    """The GELU epilogue applies on CUDA in bf16/fp16 only: a CPU run (the Triton kernels interpreted) that ran every
    Triton kernel reports ``fused_kernels`` true; on CUDA in bf16 the epilogue must have run too."""
    from wan_accel.app.doctor.gate import fused_kernels_ran
    from wan_accel.model.blocks import KERNEL_NAMES
    triton_only = {"enabled": {f"kernel.{k}": k != "ffn_gelu" for k in KERNEL_NAMES}}
    assert fused_kernels_ran(triton_only, "cpu", torch.float32)
    assert not fused_kernels_ran(triton_only, "cuda", torch.bfloat16)
    assert fused_kernels_ran(triton_only, "cuda", torch.float32)
    every = {"enabled": {f"kernel.{k}": True for k in KERNEL_NAMES}}
    assert fused_kernels_ran(every, "cuda", torch.bfloat16)
    one_off = {"enabled": dict(every["enabled"], **{"kernel.rms_norm": False})}
    assert not fused_kernels_ran(one_off, "cpu", torch.float32)
