"""Compile with any implementation the operator store can choose: one opaque op per op, and eager blocks (with
one line saying why) where compiling fails anyway."""
import dataclasses
import json
import logging

import pytest
import torch

from wan_accel.compile import CompileSettings, uncompile_model
from wan_accel.compile.apply import compile_handle
from wan_accel.app.prepare import compile_for_sampling
from wan_accel.kernels import candidates as C
from wan_accel.kernels.norm_modulate import layernorm_modulate_reference
from wan_accel.kernels.qk_norm_rope import rmsnorm_rope_reference
from wan_accel.model.tiny import TINY_CONFIG, tiny_causal_model
from run_helpers import generate_latents


def _via_dlpack(t: torch.Tensor) -> torch.Tensor:
    """What an extension op does with its input (comfy-kitchen's CUDA adaln): hand it over by DLPack.
    A FakeTensor has no data, so torch.compile cannot trace through this."""
    return torch.from_dlpack(t.contiguous().__dlpack__())


def _dl_lnmod(x, shift, scale, eps=1e-6):
    return layernorm_modulate_reference(_via_dlpack(x), shift, scale, eps)


def _dl_rope(x, w, cos, sin, heads, eps=1e-6):
    return rmsnorm_rope_reference(_via_dlpack(x), w, cos, sin, heads, eps)


@pytest.fixture
def dlpack_kitchen(monkeypatch):
    """comfy-kitchen's candidates replaced by implementations that call ``__dlpack__`` (counted)."""
    calls = {"layernorm_modulate": 0, "rmsnorm_rope": 0}

    def counted(op, fn):
        def inner(*a):
            calls[op] += 1
            return fn(*a)
        return inner

    for op, fn in (("layernorm_modulate", _dl_lnmod), ("rmsnorm_rope", _dl_rope)):
        for name, c in list(C.CANDIDATES[op].items()):      # the registry's own table (the walk reads it)
            if c.group == "kitchen":
                monkeypatch.setitem(C.CANDIDATES[op], name, dataclasses.replace(c, fn=counted(op, fn),
                                                                                problem=lambda *a: None))
    C._CHOSEN.clear()
    yield calls
    C._CHOSEN.clear()


def _run(model, ctx, **fast):
    return generate_latents(model, ctx, 6, 4, 6, seed=1, path="optimized", fast_options={"ops": "kitchen", **fast})


def test_compiled_blocks_run_a_chosen_extension_op_as_one_opaque_node(dlpack_kitchen):
    model = tiny_causal_model()
    ctx = torch.randn(1, 4, TINY_CONFIG.text_dim, generator=torch.Generator().manual_seed(0))
    eager = _run(model, ctx)
    assert dlpack_kitchen["layernorm_modulate"] > 0 and dlpack_kitchen["rmsnorm_rope"] > 0
    torch._dynamo.reset()
    try:
        compile_for_sampling(model, CompileSettings(backend="eager", warm_start=False))
        before = dict(dlpack_kitchen)
        out = _run(model, ctx)
        handle = compile_handle(model)
        assert handle.failed is None and handle.compiles >= 1          # compiled, not fallen back
        assert dlpack_kitchen["layernorm_modulate"] > before["layernorm_modulate"]   # the chosen op ran inside
    finally:
        uncompile_model(model)
        torch._dynamo.reset()
    assert (out - eager).abs().max().item() <= 1e-5


def test_opaque_op_is_one_node_in_the_traced_graph(dlpack_kitchen):
    seen = []

    def backend(gm, example_inputs):
        seen.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    x = torch.randn(1, 6, 8)
    shift, scale = torch.randn(1, 2, 8) * 0.1, torch.randn(1, 2, 8) * 0.1
    fn = torch.compile(lambda x, a, b: C.run("layernorm_modulate", "kitchen", (), x, a, b, 1e-6) * 2,
                       backend=backend, fullgraph=True)
    torch._dynamo.reset()
    try:
        out = fn(x, shift, scale)
    finally:
        torch._dynamo.reset()
    assert torch.allclose(out, 2 * layernorm_modulate_reference(x, shift, scale, 1e-6), atol=1e-6)
    assert any("wan_accel.ops_layernorm_modulate" in t for t in seen[0]), seen


def test_a_compile_that_fails_falls_back_to_eager_blocks_with_one_line(dlpack_kitchen, monkeypatch, caplog):
    """Without the opaque op (as if a new op had none) compiling fails: the run finishes eagerly and says why."""
    monkeypatch.setattr(C, "OPAQUE", {})
    model = tiny_causal_model()
    ctx = torch.randn(1, 4, TINY_CONFIG.text_dim, generator=torch.Generator().manual_seed(0))
    eager = _run(model, ctx)
    torch._dynamo.reset()
    try:
        compile_for_sampling(model, CompileSettings(backend="eager", warm_start=False))
        with caplog.at_level(logging.WARNING, logger="wan_accel.compile"):
            out = _run(model, ctx)
            out2 = _run(model, ctx)
        handle = compile_handle(model)
        assert handle.failed and "dlpack" in handle.failed.lower()
    finally:
        uncompile_model(model)
        torch._dynamo.reset()
    lines = [r.getMessage() for r in caplog.records if "compiling the blocks failed" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert torch.equal(out, eager) and torch.equal(out2, eager)


def test_generate_compile_kitchen_optimized_finishes_with_an_extension_op(dlpack_kitchen, tmp_path):
    from wan_accel.app.jobs.generate import GenerateOptions, run_generate

    torch._dynamo.reset()
    try:
        report = run_generate(GenerateOptions(out_dir=str(tmp_path / "out"), device="cpu", compile=True,
                                              ops="kitchen", sampler="optimized", preview=False),
                              log=lambda *_: None)
    finally:
        torch._dynamo.reset()
    assert report["sampler"]["compile"]["ran"] == "compiled" and report["sampler"]["compile"]["failed"] is None
    assert dlpack_kitchen["layernorm_modulate"] > 0
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["sampler"]["compile"]["ran"] == "compiled"
