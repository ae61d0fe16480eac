"""The op registry (kernels/registry.py): every family listed with its candidates and reasons (``doctor --ops``),
one override that picks the candidate it names, rejected candidates reported with their reason, unknown names
refused with the known ones listed."""
from __future__ import annotations

import json
import re

import pytest
import torch

from cli_run import run_cli
from wan_accel.kernels import _common, registry
from wan_accel.kernels import candidates as C
from wan_accel.model import attention as att
from wan_accel.sampling.runner import FastOptions, kernels_part, ops_part

TRITON_NEEDS = "Triton needs CUDA (or TRITON_INTERPRET=1)"


@pytest.fixture
def no_interpreter(monkeypatch):
    """A CPU without Triton's interpreter, whatever this process's TRITON_INTERPRET says."""
    monkeypatch.setattr(_common, "interpreter_usable", lambda: False)


def test_doctor_ops_json_lists_every_family_with_candidates_and_reasons(no_interpreter):
    code, out, err = run_cli("doctor", "--ops", "--json", "--device", "cpu", "--dtype", "bf16", "--head-dim", "64")
    assert code == 0, err
    found = json.loads(out)
    families = {f["family"]: f for f in found["families"]}
    assert len(families) >= 10, sorted(families)
    assert {"attention", "attention.fp8", "attention.int8", "attention.kv_append", "layernorm_modulate",
            "rmsnorm_rope", "linear.fp8", "kv_write.fp8", "fp8_quant", "gated_residual", "residual_norm",
            "rms_norm", "vae_norm_silu"} <= set(families)
    for fam in families.values():
        assert fam["candidates"], fam["family"]
        for name, cand in fam["candidates"].items():
            assert cand["status"] in ("chosen", "usable", "rejected") and cand["reason"], (fam["family"], name)
        assert fam["timed"] or fam["candidates"][fam["chosen"]]["status"] == "chosen"
    # this CPU: plain torch is chosen, the pack's kernels are rejected with the reason
    assert families["gated_residual"]["chosen"] == "torch"
    assert families["gated_residual"]["candidates"]["pack"] == {
        "summary": "the pack's Triton kernel", "status": "rejected", "reason": TRITON_NEEDS}
    assert families["attention.fp8"]["candidates"]["fa3"]["reason"].startswith("attention.fa3: ")
    code, text, err = run_cli("doctor", "--ops", "--device", "cpu")
    assert code == 0 and f"rejected pack: {TRITON_NEEDS}" in text and "chosen   torch" in text, err


def test_a_rejected_candidate_says_why_from_its_constraints(monkeypatch):
    monkeypatch.setitem(registry.FAMILIES, "test.family", None)             # taken out again after the test
    registry.register("test.family", "a test family", [
        registry.Candidate("test.family", "gpu", "pack", devices=("cuda",)),
        registry.Candidate("test.family", "bf16", "pack", dtypes=(torch.bfloat16,)),
        registry.Candidate("test.family", "heads", "pack", head_dims=(64, 128)),
        registry.Candidate("test.family", "probe", "pack", problem=lambda d, dt, hd: "the probe says no"),
        registry.Candidate("test.family", "on_fp8", "pack", needs=("attention.fp8", "triton")),
        registry.Candidate("test.family", "torch", "torch")])
    chosen, why = registry.walk("test.family", "cpu", torch.float32, 96)
    assert chosen == "torch" and why == {
        "gpu": "needs a CUDA device, not cpu", "bf16": "takes bfloat16, not float32",
        "heads": "takes head sizes 64, 128, not 96", "probe": "the probe says no",
        "on_fp8": f"attention.fp8.triton: {registry.candidate('attention.fp8', 'triton').rejected('cpu', torch.float32, 96)}",
        "torch": None}
    assert registry.explain("test.family", "cpu", torch.float32, 96)["candidates"]["bf16"] == {
        "summary": "", "status": "rejected", "reason": "takes bfloat16, not float32"}


def test_an_override_picks_the_candidate(no_interpreter):
    x = torch.randn(1, 8, 32)
    shift, scale = torch.zeros(1, 1, 32), torch.zeros(1, 1, 32)
    with registry.use({"layernorm_modulate": "torch"}):
        assert C.choose("layernorm_modulate", (x, shift, scale, 1e-6))[0] == "torch"
        assert [c.name for c, why in C.listing("layernorm_modulate", "cpu") if why is None] == ["torch"]
    assert att.fp8_implementation("cpu", torch.float32, 64)[0] == "torch"
    with att.fp8_numerics("fa3-torch"):                       # the fp8 mode's override (bench fidelity, checks)
        assert att.fp8_implementation("cpu", torch.float32, 64) == (
            "fa3-torch", "fp8 (FlashAttention 3's math in torch) (chosen by override)")
    assert att.fp8_implementation("cpu", torch.float32, 64)[0] == "torch"          # only while it is active
    q = torch.randn(1, 16, 2, 64)
    with registry.use({"attention": "torch"}):                 # exact attention: the reference math only
        assert att.auto_name(q, q, q, "auto") == "torch"
    with pytest.raises(ValueError, match="cannot run here: needs a CUDA device"):
        with registry.use({"linear.fp8": "scaled_mm"}):
            registry.choice("linear.fp8", "cpu")


def test_the_ops_string_takes_family_candidate_pairs(monkeypatch):
    assert registry.parse_ops("auto") == ("auto", {})
    assert registry.parse_ops("kitchen, attention.fp8=fa3-torch,rms_norm=torch") == (
        "kitchen", {"attention.fp8": "fa3-torch", "rms_norm": "torch"})
    options = FastOptions(ops="gated_residual=torch,rms_norm=torch")
    monkeypatch.setattr(_common, "interpreter_usable", lambda: True)           # the fused kernels run here
    kept = kernels_part(options, "cpu")
    assert "gated_residual" not in kept and "rms_norm" not in kept and "layernorm_modulate" in kept
    assert ops_part(options, "cpu", kept)[0] == "auto"


@pytest.mark.parametrize("ops,message", [
    ("attention.fp9=torch", "unknown op family 'attention.fp9'; families: attention, attention.fp8,"),
    ("attention.fp8=fa4", "op family 'attention.fp8' has no candidate 'fa4'; its candidates: fa3, triton, torch"),
    ("fastest", "ops must be one of ('auto', 'pack', 'kitchen', 'torch') or 'family=candidate' pairs"),
    ("pack,torch", "names more than one mode (pack, torch): keep one"),
])
def test_an_unknown_family_or_candidate_is_a_clear_error(ops, message):
    with pytest.raises(ValueError) as exc:
        FastOptions(ops=ops)
    assert message in str(exc.value)
    with pytest.raises(ValueError, match="has no candidate 'nope'"):
        registry.use({"rms_norm": "nope"})


def test_an_override_that_cannot_run_here_is_refused_before_the_run(no_interpreter):
    options = FastOptions(ops="rmsnorm_rope=pack")
    with pytest.raises(ValueError, match=re.escape(f"ops='rmsnorm_rope=pack' cannot run here (rmsnorm_rope=pack: "
                                                   f"{TRITON_NEEDS})")):
        ops_part(options, "cpu", False)


def test_no_speed_is_judged_on_a_cpu():
    ran = []
    slower, why = registry.speed("speed.test", "k", "mode", lambda: ran.append(1), lambda: ran.append(2), None, "cpu")
    assert (slower, why, ran) == (None, "speed not judged on cpu", [])
