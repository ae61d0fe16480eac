"""comfy-kitchen's backends are called with the dtypes they declare; a switched-off feature is said once per run."""
import logging

import pytest
import torch

from wan_accel.kernels import candidates as C, kitchen
from wan_accel.kernels.qk_norm_rope import rmsnorm_rope_reference

pytestmark = pytest.mark.skipif(not kitchen.available(), reason="comfy-kitchen is not installed")
HALF = frozenset({torch.float16, torch.bfloat16})


@pytest.fixture
def half_only_rope(monkeypatch):
    """The eager backend declares what comfy-kitchen's CUDA apply_rope1 declares: float16/bfloat16 inputs only;
    every call's x dtype is recorded."""
    real_accepted, real_rope1 = kitchen.accepted_dtypes, kitchen.rope1
    seen = []

    def accepted(backend, func, param="x"):
        return HALF if func == "apply_rope1" else real_accepted(backend, func, param)

    def rope1(x, cos, sin, backend):
        seen.append(x.dtype)
        if x.dtype not in HALF:
            raise RuntimeError("apply_rope1 called with a dtype it does not take")
        return real_rope1(x, cos, sin, backend)

    monkeypatch.setattr(kitchen, "accepted_dtypes", accepted)
    monkeypatch.setattr(kitchen, "rope1", rope1)
    C._CHOSEN.clear()
    yield seen
    C._CHOSEN.clear()


def _rope_args(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 12, 64, generator=g).to(dtype)
    ang = torch.rand(12, 8, generator=g) * 6.283
    return x, (1 + 0.1 * torch.randn(64, generator=g)).to(dtype), ang.cos(), ang.sin(), 4, 1e-6


def test_a_half_only_backend_gets_half_inputs_and_passes_its_check(half_only_rope):
    args = _rope_args(torch.bfloat16)
    cand = C.CANDIDATES["rmsnorm_rope"]["kitchen.eager"]
    diff = C.verify(cand, args)                       # within the bf16 tolerance of the float32 reference
    assert half_only_rope == [torch.bfloat16]
    assert diff <= C.tolerance(torch.bfloat16, float(rmsnorm_rope_reference(*args).float().abs().max()))


def test_a_half_only_backend_is_not_a_candidate_for_float32_calls_and_says_why(half_only_rope):
    rows = dict((c.name, why) for c, why in C.listing("rmsnorm_rope", "cpu", "kitchen", dtype=torch.float32))
    assert "takes bfloat16, float16" in rows["kitchen.eager"] and "float32" in rows["kitchen.eager"]
    name, why = C.choose("rmsnorm_rope", _rope_args(torch.float32), "kitchen")
    assert name == "torch" and half_only_rope == []   # never called with float32, so never failed for it
    from wan_accel.cache.autotune import get_autotuner
    entry = get_autotuner().entry(C.store_kernel("rmsnorm_rope"), C.call_key("rmsnorm_rope", _rope_args(torch.float32))) or {}
    assert not entry.get("failed")


def test_the_switched_off_line_is_said_once_per_run(caplog):
    from wan_accel.app.doctor.gate import _say, new_record
    shown, lines, record = [], [], new_record()
    with caplog.at_level(logging.WARNING, logger="wan_accel"):
        for _ in range(3):
            _say(lines, "op.rmsnorm_rope.kitchen.cuda", "wrong numbers", shown.append, record)
    assert len(shown) == 1 and len(lines) == 1
    assert not [r for r in caplog.records if "switched off" in r.getMessage()]    # not also through the log
    with caplog.at_level(logging.WARNING, logger="wan_accel"):
        _say([], "fused_qkv", "slower", None, None)
    assert len([r for r in caplog.records if "fused_qkv" in r.getMessage()]) == 1
