"""int8 attention (opt-in): the pack's torch version and comfy-kitchen's kernel against exact attention within the
stated bound (kernels/int8_attention.error_bound), the bound not trivially loose, the mode reachable from the CLI,
the loader node, the native sampler node and both sampler paths, exact attention everywhere by default, and the
Fidelity table of docs/sampler.md as measured on the fixtures."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import attention_cases as cases

from wan_accel.kernels import int8_attention as ia
from wan_accel.model import attention as attn

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_int8_is_within_the_stated_bound_on_wan_shapes(dtype):
    q, k, v = cases.wan_qkv(dtype)
    out = attn.attention(q, k, v, backend="int8")
    assert out.shape == q.shape and out.dtype == dtype and torch.isfinite(out).all()
    err, ratio = cases.ratio(out, q, k, v, ia.error_bound)
    assert float(ratio.max()) <= 1.0
    exact_err = (attn.attention(q, k, v, backend="sdpa").float() - cases.exact(q, k, v))[:, cases.ROWS].abs()
    assert float(err.max()) > 2 * float(exact_err.max())           # int8, not exact attention in this dtype


@pytest.mark.parametrize("coarser", [2, 3])
def test_a_few_quantization_steps_more_error_fails_the_bound(monkeypatch, coarser):
    """int8 steps 2-3 times the 1/127 of the block maximum (rounding errors of a few steps) exceed the bound."""
    q, k, v = cases.wan_qkv(torch.float32)
    with monkeypatch.context() as m:
        m.setattr(ia, "LEVELS", ia.LEVELS // coarser)
        planted = ia.int8_attention_torch(q, k, v)
    _, ratio = cases.ratio(planted, q, k, v, ia.error_bound)
    assert float(ratio.max()) > 1.0


def test_comfy_kitchen_int8_within_the_bound_where_it_runs():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    why = ia.kitchen_problem(device, torch.bfloat16, 128)
    if why is not None:
        assert ia.implementation(device, torch.bfloat16, 128)[0] == "torch"
        pytest.skip(f"comfy-kitchen's int8 kernel does not run here: {why}")
    q, k, v = (t.to(device) for t in cases.wan_qkv(torch.bfloat16))
    out = ia.int8_attention_kitchen(q, k, v)
    assert out.shape == q.shape
    _, ratio = cases.ratio(out.cpu(), q.cpu(), k.cpu(), v.cpu(), ia.error_bound, kernel="kitchen")
    assert float(ratio.max()) <= 1.0


def test_on_a_cpu_the_torch_version_runs_and_says_why():
    backend, reason = attn.explain_backend("int8", "cpu", torch.float32, 128)
    assert backend == "int8" and "torch version" in reason and "CUDA" in reason


def test_padded_keys_are_ignored():
    q, k, v = cases.wan_qkv(torch.float32, lq=40, lk=70, heads=2, head_dim=16)
    mask = torch.ones(1, 70, dtype=torch.bool)
    mask[:, 50:] = False
    out = attn.attention(q, k, v, mask, backend="int8")
    v2 = v.clone()
    v2[:, 50:] = 1e3
    assert torch.equal(out, attn.attention(q, k, v2, mask, backend="int8"))
    assert float((out - cases.exact(q[:, :], k[:, :50], v[:, :50])).abs().max()) < 0.1


def test_exact_attention_stays_the_default_everywhere():
    from wan_accel.cli import build_parser
    from wan_accel.model.tiny import tiny_causal_model
    from wan_accel.nodes.model_nodes import CausalWanModelLoader
    from wan_accel.nodes.native_nodes import WanAccelARSampler
    from wan_accel.sampling.runner import FastOptions
    assert build_parser().parse_args(["generate"]).attention == "auto"
    assert CausalWanModelLoader.INPUT_TYPES()["required"]["attention"][1]["default"] == "auto"
    assert WanAccelARSampler.INPUT_TYPES()["optional"]["attention"][1]["default"] == "auto"
    assert FastOptions().attention is None and tiny_causal_model(0).attn_backend == "auto"
    for requested in ("auto", "flash_attn", "sdpa"):
        assert attn.explain_backend(requested, "cpu", torch.bfloat16, 128)[0] != "int8"


def test_int8_is_offered_by_the_cli_and_the_nodes():
    from wan_accel.cli import build_parser
    from wan_accel.nodes.model_nodes import CausalWanModelLoader
    from wan_accel.nodes.native_nodes import WanAccelARSampler
    assert build_parser().parse_args(["generate", "--attention", "int8"]).attention == "int8"
    assert "int8" in CausalWanModelLoader.INPUT_TYPES()["required"]["attention"][0]
    assert "int8" in WanAccelARSampler.INPUT_TYPES()["optional"]["attention"][0]


@pytest.mark.parametrize("path", ["reference", "optimized"])
def test_both_sampler_paths_run_int8_from_the_loader(monkeypatch, path):
    """The loader node's handle with attention int8: every attention call of the run goes through int8; the
    latents differ from exact attention's, closely."""
    outs, reports = cases.loader_runs(ia, "int8_attention_torch", "int8", path, monkeypatch)
    for mode, report in reports.items():
        assert report["path"] == path
        if path == "optimized":
            assert report["attention"] == mode
    diff = (outs["int8"] - outs["sdpa"]).abs().max()
    assert torch.isfinite(outs["int8"]).all() and 0 < float(diff) < 0.1


def test_bench_sampler_puts_int8_rows_beside_exact():
    import argparse
    from wan_accel.bench import sampler
    ns = argparse.Namespace(variants="reference,optimized", attention="int8")
    assert sampler._variant_names(ns, "fp32") == ["reference", "reference-int8", "optimized", "optimized-int8"]
    assert sampler.VARIANTS["optimized-int8"]["attention"] == "int8"
    assert sampler.VARIANTS["optimized"]["attention"] == "auto"


def _fidelity_section() -> str:
    return (REPO / "docs" / "sampler.md").read_text().split("## Fidelity", 1)[1].split("\n## ", 1)[0]


def test_every_int8_call_of_the_fidelity_runs_is_within_the_bound(monkeypatch):
    """What the Fidelity section of docs/sampler.md states and every CPU reproduces: on the recorded fixtures, both sampler
    paths, every int8 attention call of ``bench fidelity``'s runs stays within ``error_bound`` of exact attention
    (float64) on that call's own inputs, and int8 does change the video. The whole-video figures of the table
    are one machine's measurement (another CPU sums float32 in another order, an int8 code rounds the other way
    and the figures move by percents), so they are checked for their form and the machine they name, not their
    digits."""
    from wan_accel.bench.fidelity import PATHS, measure
    worst, calls = [0.0], [0]
    real = ia.int8_attention_torch

    def checked(q, k, v, key_padding_mask=None):
        out = real(q, k, v, key_padding_mask)
        keep = slice(None) if key_padding_mask is None else key_padding_mask[0]
        assert key_padding_mask is None or bool((key_padding_mask == key_padding_mask[:1]).all())
        bound = ia.error_bound(q, k, v, key_padding_mask)
        exact = cases.exact(q, k[:, keep], v[:, keep])
        worst[0] = max(worst[0], float(((out.float() - exact).abs() / bound).max()))
        calls[0] += 1
        return out

    monkeypatch.setattr(ia, "int8_attention_torch", checked)
    section = _fidelity_section()
    table = {(m[0], m[1]): [float(x) for x in m[2:]] for m in re.findall(
        r"^\| (\w+) \| (reference|optimized) \| ([\d.e+-]+) \| ([\d.e+-]+) \| ([\d.e+-]+) \|", section, re.M)}
    fixtures = ("wan_reference", "matrix_game2")
    assert set(table) == {(f, p) for f in fixtures for p in PATHS}, section
    assert re.search(r"^\| .*measured on (an? )?[A-Z][\w ]*(CPU|GPU)", section, re.M), "rows name their machine"
    for fixture in fixtures:
        calls[0], worst[0] = 0, 0.0
        rows = measure(FIXTURES / fixture, "int8")
        assert calls[0] > 0, "the int8 runs went through int8 attention"
        assert worst[0] <= 1.0, (fixture, worst[0])
        assert [r["path"] for r in rows] == list(PATHS)
        for row in rows:
            assert row["steps"] and all(s["max_abs"] > 0 for s in row["steps"]), (fixture, row["path"])
            assert row["final"]["max_abs"] > 0, (fixture, row["path"])
