"""Kernel dispatch: torch fallback, input validation, tile caps, every-config-fails fallback, compile op."""
from __future__ import annotations

import logging

import pytest
import torch

from wan_accel.cache import LimitCache
from wan_accel.cache.autotune import get_autotuner, reset_autotuners
from wan_accel.compile.presets import CONSERVATIVE_CAPS, EXTREME_CAPS
from wan_accel.kernels import (_common, gated_residual, gated_residual_reference, layernorm_modulate,
                               layernorm_modulate_reference, norm_modulate, rmsnorm_rope, rmsnorm_rope_reference,
                               use_kernel_caps)

triton_errors = pytest.importorskip("triton.runtime.errors")


@pytest.fixture(autouse=True)
def _fresh_tuners(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reset_autotuners()
    yield
    reset_autotuners()


def _ln_inputs(b=2, l=6, d=24, f=3, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(b, l, d, generator=g).to(dtype), torch.randn(b, f, d, generator=g),
            torch.randn(b, f, d, generator=g))


def test_cpu_without_interpreter_uses_torch_reference():
    x, shift, scale = _ln_inputs()
    assert not _common.use_triton(x)
    assert torch.equal(layernorm_modulate(x, shift, scale, 1e-6), layernorm_modulate_reference(x, shift, scale, 1e-6))
    y = torch.randn_like(x)
    assert torch.equal(gated_residual(x, y, shift), gated_residual_reference(x, y, shift))
    w, ang = torch.randn(24), torch.randn(6, 4)
    out = rmsnorm_rope(x, w, ang.cos(), ang.sin(), 3)
    assert out.shape == (2, 6, 3, 8)
    assert torch.equal(out, rmsnorm_rope_reference(x, w, ang.cos(), ang.sin(), 3))


def test_reference_semantics_per_frame_modulation():
    x, shift, scale = _ln_inputs(b=1, l=4, d=8, f=2)
    out = layernorm_modulate_reference(x, shift, scale, 1e-6)
    ln = torch.nn.functional.layer_norm(x, (8,), eps=1e-6)
    # tokens 0-1 use frame 0, tokens 2-3 frame 1
    assert torch.allclose(out[0, 1], ln[0, 1] * (1 + scale[0, 0]) + shift[0, 0])
    assert torch.allclose(out[0, 2], ln[0, 2] * (1 + scale[0, 1]) + shift[0, 1])
    gate = torch.randn(1, 2, 8)
    y = torch.randn(1, 4, 8)
    res = gated_residual_reference(x, y, gate)
    assert torch.allclose(res[0, 3], x[0, 3] + y[0, 3] * gate[0, 1])


def test_rope_rotates_adjacent_pairs():
    x = torch.zeros(1, 1, 4)
    x[0, 0, 0] = 1.0  # pair 0 = (1, 0)
    w = torch.ones(4)
    ang = torch.tensor([[torch.pi / 2, 0.0]])
    out = rmsnorm_rope_reference(x, w, ang.cos(), ang.sin(), 1, eps=0.0)
    rms = 1.0 / (0.25 ** 0.5)
    assert torch.allclose(out[0, 0, 0], torch.tensor([0.0, rms, 0.0, 0.0]), atol=1e-6)


@pytest.mark.parametrize("bad", ["frames", "width", "heads"])
def test_invalid_shapes_raise_clear_errors(bad):
    x, shift, scale = _ln_inputs(l=6, f=3)
    if bad == "frames":
        with pytest.raises(ValueError, match="must divide L"):
            layernorm_modulate(x, torch.randn(2, 4, 24), torch.randn(2, 4, 24))
    elif bad == "width":
        with pytest.raises(ValueError, match="gate must be"):
            gated_residual(x, x, torch.randn(2, 3, 23))
    else:
        with pytest.raises(ValueError, match="not divisible by num_heads"):
            rmsnorm_rope(x, torch.ones(24), torch.ones(6, 2), torch.zeros(6, 2), 5)


class _FakeKernel:
    """Stands in for a jitted kernel: records launches, raises OutOfResources above a tile limit."""

    def __init__(self, limit_elems):
        self.limit = limit_elems
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.launches.append(dict(meta))
            tile = meta["YBLOCK"] * meta.get("RBLOCK", meta.get("XBLOCK", 1))
            if tile > self.limit:
                raise triton_errors.OutOfResources(tile * 4, self.limit * 4, "shared memory")
            args[3].copy_(layernorm_modulate_reference(args[0], args[1], args[2], 1e-6))  # "compute"
        return launch


def test_every_config_failing_falls_back_to_torch_and_is_remembered(monkeypatch, caplog, cache_path):
    fake = _FakeKernel(limit_elems=0)  # every config fails
    monkeypatch.setattr(_common, "jit", lambda fn: fake)
    x, shift, scale = _ln_inputs()
    with caplog.at_level(logging.ERROR, logger="wan_accel.autotune"):
        out = norm_modulate.run_triton(x, shift, scale, 1e-6)
    assert torch.equal(out, layernorm_modulate_reference(x, shift, scale, 1e-6))
    assert any("every config of kernel layernorm_modulate" in r.message and "OutOfResources" in r.message
               for r in caplog.records)
    n_configs = len(_common.capped_configs(norm_modulate.candidates(x.shape[2]), _common.current_caps()))
    assert len(fake.launches) == n_configs
    entry = LimitCache(cache_path).entries("operator")[0]["value"]
    assert len(entry["failed"]) == n_configs and entry["best"] is None
    err = next(iter(entry["failed"].values()))["error"]
    assert err["type"] == "OutOfResources" and err["name"] == "shared memory" and err["limit"] == 0
    # a new tuner (as a new process would) never launches a known-failed config again
    reset_autotuners()
    out2 = norm_modulate.run_triton(x, shift, scale, 1e-6)
    assert torch.equal(out2, out) and len(fake.launches) == n_configs


def test_tile_caps_bound_the_candidates(monkeypatch):
    fake = _FakeKernel(limit_elems=10 ** 9)
    monkeypatch.setattr(_common, "jit", lambda fn: fake)
    x, shift, scale = _ln_inputs()
    with use_kernel_caps(CONSERVATIVE_CAPS):
        norm_modulate.run_triton(x, shift, scale, 1e-6)
    assert fake.launches and all(m["RBLOCK"] <= 64 and m["YBLOCK"] <= 8 and m["num_warps"] <= 8
                                 for m in fake.launches)
    fake.launches.clear()
    with use_kernel_caps(EXTREME_CAPS):
        norm_modulate.run_triton(x, shift, scale, 1e-6)
    assert any(m["RBLOCK"] == 128 for m in fake.launches)
    assert any(m["YBLOCK"] == 16 and m["num_warps"] == 16 for m in fake.launches)
    assert get_autotuner().stats["failures"] == 0


def test_one_pass_tiles_follow_the_width_bound_and_the_row_cap(monkeypatch):
    limit = _common.ROW_WIDTH_LIMIT
    for d in (16, 64, 96, 1536, 5120, limit):
        ones = [c for c in _common.row_candidates(d) if c.get("ROW")]
        assert ones and all(c["RBLOCK"] == _common.next_pow2(d) >= d for c in ones)
        assert all(c["YBLOCK"] * c["RBLOCK"] <= _common.ROW_VALUES_PER_THREAD * 32 * c["num_warps"] for c in ones)
        assert _common.row_candidates(d) is _common.row_candidates(_common.next_pow2(d))   # one tuple per class
    for d in (limit + 2, 2 * limit):                        # wider rows: only the looped tiles
        assert _common.row_candidates(d) is _common.ROW_CANDIDATES
    with pytest.raises(ValueError, match="at most"):
        _common.row_tile({"ROW": 1, "YBLOCK": 1, "num_warps": 4}, limit + 2)
    # the default caps keep them (their RBLOCK is the row's width, not bounded by the RBLOCK cap); ROW 0 drops them
    cands = _common.row_candidates(1536)
    assert any(c.get("ROW") for c in _common.capped_configs(cands, _common.DEFAULT_CAPS))
    assert not any(c.get("ROW") for c in _common.capped_configs(cands, dict(_common.DEFAULT_CAPS, ROW=0)))
    assert not any(c.get("ROW") for c in _common.capped_configs(cands, CONSERVATIVE_CAPS))
    # what the operator store launches: the row's whole width as one tile under the default caps only
    fake = _FakeKernel(limit_elems=10 ** 9)
    monkeypatch.setattr(_common, "jit", lambda fn: fake)
    x, shift, scale = _ln_inputs(d=40)
    norm_modulate.run_triton(x, shift, scale, 1e-6)
    assert {(m["ROW"], m["RBLOCK"]) for m in fake.launches if m["ROW"]} == {(True, 64)}
    assert any(not m["ROW"] for m in fake.launches)
    for caps, wide in ((CONSERVATIVE_CAPS, False), (None, True)):
        fake.launches.clear()
        reset_autotuners()
        with use_kernel_caps(caps):
            norm_modulate.run_triton(*_ln_inputs(d=limit + 8 if wide else 40), 1e-6)
        assert fake.launches and not any(m["ROW"] for m in fake.launches)


def test_kernels_are_one_op_inside_torch_compile():
    x, shift, scale = _ln_inputs()
    y = torch.randn_like(x)

    def f(x, y, shift, scale):
        h = layernorm_modulate(x, shift, scale, 1e-6)
        return gated_residual(x, h + y, shift)

    compiled = torch.compile(f, backend="eager", fullgraph=True)  # fullgraph: no graph break allowed
    assert torch.allclose(compiled(x, y, shift, scale), f(x, y, shift, scale))
