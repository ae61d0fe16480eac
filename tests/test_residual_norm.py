"""The fused residual + LayerNorm kernel (``kernels/residual_layernorm.py``) under TRITON_INTERPRET=1 against its torch
definition: the updated residual bit for bit, the normalised output within one bf16 rounding, for the two uses in a
Wan block (gated residual + affine LayerNorm; plain residual + LayerNorm + modulation), every operand combination,
one-pass and looped tiles (a masked tail), per-frame gates broadcast over the batch;
and its argument checks."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tolerances import step

HERE = Path(__file__).resolve()
MARK = "RESIDUAL_NORM_CASES "

# (B, L, D, frames F, dtype, per-frame batch, gate, affine (w / wb), modulate, offset of x)
CASES = [
    (1, 6, 1536, 3, "bfloat16", 1, True, "wb", False, 0.5),     # after self-attention: gated residual + norm3
    (2, 6, 1536, 1, "bfloat16", 2, False, None, True, 0.5),     # after cross-attention: residual + norm2 + modulation
    (3, 4, 96, 2, "float32", 1, True, "w", True, 0.5),          # every operand, the per-frame batch broadcast
    (2, 3, 96, 3, "bfloat16", 2, False, None, False, 0.5),      # plain residual + LayerNorm
    # rows far from zero (fp16 spacing 2 at 2048): the rounding of x + y moves values by a good part of the rows'
    # deviation, so h is right only when it normalises the rounded x_new, as the unfused path does (fp16: the
    # interpreter rounds it as the GPU does, so the kernel's own rounding is what is tested)
    (1, 4, 96, 1, "float16", 1, False, None, False, 2048.0),
]
STORE_CASE = 2


def _configs(mod, d):
    cands = mod.candidates(d)
    looped = [c for c in cands if not c.get("ROW")]
    one_pass = [c for c in cands if c.get("ROW")]
    picks = [min(looped, key=lambda c: (c["YBLOCK"], c["RBLOCK"])),
             max(looped, key=lambda c: (c["YBLOCK"], c["num_warps"]))]
    if one_pass:
        picks += [min(one_pass, key=lambda c: (c["YBLOCK"], c["num_warps"])),
                  max(one_pass, key=lambda c: (c["YBLOCK"], c["num_warps"]))]
    return picks


def _inputs(case, seed):
    b, l, d, f, dtype, fb, gate, affine, modulate, offset = case
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)

    def r(*shape, scale=1.0, offset=0.0, to=dt):
        return (torch.randn(*shape, generator=g) * scale + offset).to(to)

    x, y = r(b, l, d, scale=3.0, offset=offset), r(b, l, d, scale=2.0)
    kw = {}
    if gate:
        kw["gate"] = r(fb, f, d, to=torch.float32)
    if affine:
        kw["weight"] = r(d, scale=0.2, offset=1.0)
        if affine == "wb":
            kw["bias"] = r(d, scale=0.1)
    if modulate:
        kw["shift"], kw["scale"] = r(fb, f, d, to=torch.float32), r(fb, f, d, scale=0.3, to=torch.float32)
    return x, y, kw


def _child() -> None:
    from wan_accel.kernels import _common, residual_layernorm as mod

    rows = []
    for i, case in enumerate(CASES):
        x, y, kw = _inputs(case, seed=i)
        ref_x, ref_h = mod.residual_norm_reference(x, y, **kw)
        ref = ref_h.float()
        for cfg in _configs(mod, x.shape[-1]):
            out_x, out_h = mod.run_triton(x, y, **kw, config=cfg)
            diff = (out_h.float() - ref).abs()
            ulp = step(getattr(torch, case[4]), ref) if case[4] != "float32" else 0.0    # one rounding
            rows.append({"case": i, "config": cfg, "x_equal": bool(torch.equal(out_x, ref_x)),
                         "dtypes": [str(out_x.dtype), str(out_h.dtype)] == [str(x.dtype)] * 2,
                         "max": float(diff.max()), "mean": float(diff.mean()), "ref_max": float(ref.abs().max()),
                         "within_ulp": bool((diff <= ulp + 1e-5 * ref.abs().max()).all()),
                         "unequal": float((diff > 0).float().mean())})
        if i != STORE_CASE:
            continue
        # the public entry point runs the kernel here (interpreter), through the operator store (which times every
        # candidate: one small case)
        out_x, out_h = mod.residual_norm(x, y, **kw)
        rows.append({"case": i, "config": "store", "x_equal": bool(torch.equal(out_x, ref_x)), "dtypes": True,
                     "max": float((out_h.float() - ref).abs().max()), "mean": 0.0, "ref_max": float(ref.abs().max()),
                     "within_ulp": True, "unequal": 0.0})
    print(MARK + json.dumps({"interpreter_usable": _common.use_triton(torch.zeros(1)), "rows": rows}), flush=True)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    sys.path.insert(0, str(HERE.parent))
    from interpret_child import run_interpreted_child
    return run_interpreted_child(HERE, tmp_path_factory.mktemp("residual_norm"), MARK)


def test_cases_ran_looped_and_one_pass_tiles(results):
    assert results["interpreter_usable"] is True
    rows = results["rows"]
    assert sorted({r["case"] for r in rows}) == list(range(len(CASES)))
    kinds = {(r["case"], bool(r["config"].get("ROW"))) for r in rows if r["config"] != "store"}
    assert all((i, False) in kinds for i in range(len(CASES)))
    assert all((i, True) in kinds for i in range(len(CASES)))
    assert [r["case"] for r in rows if r["config"] == "store"] == [STORE_CASE]


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"D{c[2]}-{c[4]}-g{int(c[6])}-{c[7]}-m{int(c[8])}"
                                                          for c in CASES])
def test_kernel_matches_the_torch_definition(results, index):
    dtype = CASES[index][4]
    for row in (r for r in results["rows"] if r["case"] == index):
        assert row["x_equal"] and row["dtypes"], row                   # the residual stream bit for bit
        if dtype == "float32":
            assert row["max"] <= 1e-5 * row["ref_max"], row
        elif row["config"] != "store":
            # one rounding of a float32 result whose sums run in another order than torch's: equal but where they
            # land on the other side of a rounding boundary (rare at bf16's spacing; fp16's is 8 times finer)
            assert row["within_ulp"] and row["mean"] <= 1e-3, row
            assert dtype == "float16" or row["unequal"] <= 0.01, row
        else:
            assert row["max"] <= 2.0 ** -7 * row["ref_max"], row


def test_reference_is_the_unfused_block_math():
    """The definition equals the two steps it fuses: the gated residual, then the module LayerNorm (affine in x's
    dtype) or LayerNorm + modulation."""
    from wan_accel.kernels import gated_residual_reference, layernorm_modulate_reference
    from wan_accel.kernels.residual_layernorm import residual_norm_reference
    from wan_accel.model.layers import LayerNorm

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(2, 6, 64, generator=g), torch.randn(2, 6, 64, generator=g)
    gate, shift, scale = (torch.randn(2, 3, 64, generator=g) for _ in range(3))
    norm = LayerNorm(64, eps=1e-6, elementwise_affine=True)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=g))
        norm.bias.copy_(torch.randn(64, generator=g))
    xn, h = residual_norm_reference(x, y, gate, norm.weight, norm.bias, eps=1e-6)
    assert torch.equal(xn, gated_residual_reference(x, y, gate))
    torch.testing.assert_close(h, norm(xn).detach(), rtol=1e-6, atol=1e-6)
    xn, h = residual_norm_reference(x, y, shift=shift, scale=scale)
    assert torch.equal(xn, x + y)
    torch.testing.assert_close(h, layernorm_modulate_reference(x + y, shift, scale, 1e-6), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kwargs, words", [
    ({"y": torch.zeros(1, 4, 8)}, "x and y must both be"),
    ({"shift": torch.zeros(1, 2, 16)}, "shift and scale go together"),
    ({"bias": torch.zeros(16)}, "a bias needs a weight"),
    ({"weight": torch.zeros(8)}, "weight must be [16]"),
    ({"gate": torch.zeros(1, 3, 16)}, "must divide L=4"),
    ({"gate": torch.zeros(2, 2, 16), "shift": torch.zeros(1, 2, 16), "scale": torch.zeros(1, 2, 16)}, "one shape"),
    ({"gate": torch.zeros(3, 2, 16)}, "batch 1 broadcasts"),
])
def test_bad_arguments_say_what_is_wrong(kwargs, words):
    from wan_accel.kernels.residual_layernorm import residual_norm

    args = {"x": torch.zeros(2, 4, 16), "y": torch.zeros(2, 4, 16)}
    args.update(kwargs)
    with pytest.raises(ValueError, match=None) as err:
        residual_norm(**args)
    assert words in str(err.value)


if __name__ == "__main__" and "--child" in sys.argv:
    _child()


def test_block_fuses_only_its_own_layernorm(monkeypatch):
    """The block's gated residual + norm3 run as one kernel only for the pack's own LayerNorm; another LayerNorm
    module (a borrowed block's, which may cast or patch its weights as it runs) is called as it is."""
    from types import SimpleNamespace

    from wan_accel.model import blocks
    from wan_accel.model.layers import LayerNorm

    calls = []
    real = blocks.residual_norm
    monkeypatch.setattr(blocks, "residual_norm", lambda *a, **kw: calls.append("fused") or real(*a, **kw))

    class Borrowed(torch.nn.LayerNorm):
        def forward(self, x):
            calls.append("module")
            return super().forward(x)

    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(1, 6, 16, generator=g), torch.randn(1, 6, 16, generator=g)
    m = torch.randn(1, 3, 6, 16, generator=g)
    on = blocks.BlockParts(fused_kernels=True)
    for norm, parts, want in ((LayerNorm(16, eps=1e-6), on, ["fused"]), (Borrowed(16, eps=1e-6), on, ["module"]),
                              (LayerNorm(16, eps=1e-6), blocks.BlockParts(fused_kernels=("gated_residual",)), [])):
        calls.clear()
        xn, h = blocks._gated_norm3(SimpleNamespace(norm3=norm), x, y, m, parts)
        assert calls == want
        torch.testing.assert_close(h, torch.nn.functional.layer_norm(xn, (16,), norm.weight, norm.bias, 1e-6))


def test_bench_kernels_gpu_rows_time_each_fused_use_against_its_unfused_steps(monkeypatch):
    """``bench kernels``' GPU rows, run on the CPU with the GPU's timer and synchronisation stood in for (its Python
    only: the numbers mean nothing here): each use of the fused residual + LayerNorm gets a row with its error
    against the reference and its time against the unfused steps it replaces."""
    triton_testing = pytest.importorskip("triton.testing")
    from wan_accel.bench import kernels as bench

    timed = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **kw: None)
    monkeypatch.setattr(triton_testing, "do_bench", lambda fn, warmup=0, rep=0: (timed.append(fn()), 1.0)[1])
    real = bench._inputs
    monkeypatch.setattr(bench, "_inputs", lambda name, b, l, d, heads, frames, dtype, device:
                        real(name, b, l, d, heads, frames, dtype, "cpu"))
    monkeypatch.setattr(bench, "GPU_SHAPES", (("small", 1, 6, 32, 2),))
    rows = {r["kernel"]: r for r in bench.gpu_rows("float32", 3)}
    for name in ("residual_norm3", "residual_norm2"):
        assert rows[name]["fused_vs_unfused"] == 1.0 and rows[name]["max_err"] <= 1e-5
        assert rows[name]["unfused_ms"] == 1.0
    assert "fused_vs_unfused" not in rows["gated_residual"]
    # the unfused steps compute what the fused kernel does: (x_new, h) side by side
    x, y, g, w, b = real("residual_norm3", 1, 6, 32, 2, 3, torch.float32, "cpu")
    torch.testing.assert_close(bench._unfused("residual_norm3")(x, y, g, w, b),
                               dict((n, f) for n, f, _r in bench._kernels())["residual_norm3"](x, y, g, w, b))
