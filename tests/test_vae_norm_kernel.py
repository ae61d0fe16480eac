"""The Wan 2.1 VAE decoder's fused RMS norm + SiLU (kernels/vae_norm.py) and its place in the decoder (vae/wan21.py).

Under TRITON_INTERPRET=1 (in a child process: the interpreter must be on before triton is imported) the kernel
matches its float32 torch definition and the decoder's own torch layers at small shapes, written into a causal
convolution's history buffer, and the whole decoder streamed with the kernel gives the frames of the layers one by
one. Margins come from the dtypes' resolution: the kernel and the definition both compute in float32 (a sum of C
squares, a square root, a few products and the SiLU: a few float32 units plus one per doubling of C for the sum) and
round once to the output dtype (so they may land one unit of the output dtype apart)."""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from wan_accel.kernels import vae_norm
from wan_accel.vae import wan21
from wan_accel.vae.build import build_decoder

HERE = Path(__file__).resolve()
MARK = "VAE_NORM_CASES "
EPS32 = torch.finfo(torch.float32).eps
DEPTH_ULPS = 64               # as tests/test_vae_decoders.py: float32 units over the depth, of the output's scale

# (channels, dims after the channel axis, dtype, silu, config (None: tuned through the operator store), layout:
# 'bt' = x a [B, C, T, H, W] view of [B, T, C, H, W] memory, as the decoder's frames after an up-sampling)
WHOLE, LOOPED = {"PBLOCK": 16, "CBLOCK": 0, "num_warps": 4}, {"PBLOCK": 32, "CBLOCK": 16, "num_warps": 4}
CASES = [
    (4, (1, 3, 5), "float32", True, WHOLE),
    (37, (2, 7, 9), "float32", True, LOOPED),           # 3 steps of 16 channels, the last one masked
    (37, (2, 7, 9), "float32", True, WHOLE),
    (96, (3, 5, 3), "bfloat16", True, WHOLE),
    (96, (4, 3, 7), "bfloat16", True, LOOPED),
    (384, (2, 3, 5), "float32", True, LOOPED),
    (384, (1, 5, 5), "bfloat16", True, None),
    (24, (3, 5, 7), "bfloat16", True, WHOLE, "bt"),
    (40, (2, 3, 9), "float32", True, LOOPED, "bt"),
    (12, (4, 1, 1), "float16", True, None),
    (160, (3, 9), "bfloat16", False, None),              # the attention's norm: [N, C, H, W], no SiLU
    (5, (3, 7), "float32", False, LOOPED),
]


def _bound(ref, pre, dtype, channels):
    """Per element: one unit of the output dtype at the result, and the float32 math's rounding (a few units plus
    one per doubling of C for the sum of squares) at the value before the SiLU and at the result."""
    dt = getattr(torch, dtype)
    k = 4 + math.ceil(math.log2(channels))
    return (torch.finfo(dt).eps * ref.abs() + k * EPS32 * (pre.abs() + ref.abs()) + torch.finfo(dt).tiny)


def _inputs(c, positions, dtype, seed, layout=""):
    g = torch.Generator().manual_seed(seed)
    if layout == "bt":
        x = (torch.randn(1, positions[0], c, *positions[1:], generator=g) * 3 + 0.5).transpose(1, 2)
    else:
        x = torch.randn(1 if len(positions) == 3 else 2, c, *positions, generator=g) * 3 + 0.5
    x = x.to(getattr(torch, dtype))
    gamma = (1 + 0.2 * torch.randn(c, generator=g)).to(x.dtype)
    return x, gamma


def _pre(x, gamma):
    """The float32 value before the SiLU, for the margin."""
    shape = (1, -1) + (1,) * (x.dim() - 2)
    return torch.nn.functional.normalize(x.float(), dim=1) * math.sqrt(x.shape[1]) * gamma.float().reshape(shape)


def _excess(out, ref, pre, dtype, c) -> float:
    """The largest |out - ref| as a fraction of its margin (<= 1: within it)."""
    return float(((out.float() - ref.float()).abs() / _bound(ref.float(), pre, dtype, c)).max())


def _module_math(x, gamma, silu):
    """The decoder's layers one by one (RMSNorm.forward in x's dtype, then SiLU)."""
    norm = wan21.RMSNorm(x.shape[1], images=x.dim() == 4).requires_grad_(False)
    norm.gamma.copy_(gamma.reshape(norm.gamma.shape))
    norm = norm.to(x.dtype)
    y = norm(x)
    return torch.nn.functional.silu(y) if silu else y


# ----------------------------------------------------------------------------------------- the child (interpreter)
def _case(i, c, positions, dtype, silu, cfg, layout="") -> dict:
    x, gamma = _inputs(c, positions, dtype, seed=i, layout=layout)
    assert x.is_contiguous() != (layout == "bt")
    ref = vae_norm.norm_silu_reference(x, gamma, silu)
    pre = _pre(x, gamma)
    if x.dim() == 5:            # into a causal convolution's buffer: 2 history frames in front, kept as they are
        buf = torch.full(x.shape[:2] + (2 + x.shape[2],) + x.shape[3:], 7.0, dtype=x.dtype)
        view = buf[:, :, 2:]
        out = vae_norm.run_triton(x, gamma, silu, view, cfg) if cfg else vae_norm.norm_silu(x, gamma, silu, view)
        assert out.data_ptr() == view.data_ptr()
        history_kept = bool((buf[:, :, :2] == 7.0).all())
    else:
        out = vae_norm.run_triton(x, gamma, silu, None, cfg) if cfg else vae_norm.norm_silu(x, gamma, silu)
        history_kept = True
    module = _module_math(x, gamma, silu)
    # the module's torch layers round in x's dtype after each of ~4 steps: that many units of x's dtype
    mod_margin = 4 * torch.finfo(x.dtype).eps * (pre.abs() + module.float().abs()) + torch.finfo(x.dtype).tiny
    return {"shape_ok": out.shape == x.shape and out.dtype == x.dtype, "history_kept": history_kept,
            "excess": _excess(out, ref, pre, dtype, c),
            "module_excess": float(((out.float() - module.float()).abs() / mod_margin).max()),
            "max_diff": float((out.float() - ref.float()).abs().max())}


def _eps_case() -> dict:
    """Positions whose channels are all zero or whose norm is below 1e-12: F.normalize clamps the norm at 1e-12."""
    x = torch.randn(1, 8, 2, 3, 5, generator=torch.Generator().manual_seed(9))
    x[:, :, 0, 0] = 0.0
    x[:, :, 1, 1] = 3e-14
    x[:, 0, 1, 2] = 4e-13                 # norm 4.2e-13 < eps
    gamma = torch.linspace(0.5, 1.5, 8)
    out = vae_norm.run_triton(x, gamma, True, None, WHOLE)
    ref = vae_norm.norm_silu_reference(x, gamma)
    tiny = out[:, :, 1, 1].flatten()
    return {"finite": bool(out.isfinite().all()), "zeros": bool((out[:, :, 0, 0] == 0).all()),
            "excess": _excess(out, ref, _pre(x, gamma), "float32", 8),
            # below eps the result is x * sqrt(C) / 1e-12 * gamma (not a unit vector): silu of 3e-2 * sqrt(8) * gamma
            "clamped": float(tiny[0]), "clamped_expect": float(torch.nn.functional.silu(
                torch.tensor(3e-14 / 1e-12 * math.sqrt(8) * 0.5)))}


STREAMS = ([5], [1] * 5, [3, 2], [1, 3, 1])


def _unfused(decoder):
    """The Wan decoder with its layers run one by one as the modules define them (no RMS norm fused)."""
    for m in decoder.modules():
        if isinstance(m, wan21.RMSNorm):
            m.fused = False
    return decoder


def _streamed(fused, plain, x, streams=STREAMS):
    """(chunk sizes, frames of ``fused``, frames of ``plain``) for the latents ``x`` pushed in chunks of 1, 2, 3."""
    for sizes in streams:
        got, want = [], []
        for dec, parts in ((fused, got), (plain, want)):
            stream, f = dec.stream(), 0
            for n in sizes:
                parts.append(stream.push(x[:, f:f + n]))
                f += n
        yield sizes, torch.cat(got, 2), torch.cat(want, 2)


def _decoder_case() -> dict:
    """The reduced decoder streamed with the kernel against the layers one by one, float32."""
    calls = {"silu": 0, "plain": 0, "strided": 0}
    run = vae_norm.run_triton

    def counting(x, gamma, silu=True, out=None, config=None):
        calls["silu" if silu else "plain"] += 1
        calls["strided"] += not x.is_contiguous()
        # one looped tile for every width (the cases above check each tile; tuning every shape of the decoder
        # under the interpreter would only time the interpreter)
        return run(x, gamma, silu, out, config or vae_norm._LOOPED[0])

    vae_norm.run_triton = counting
    x = torch.randn(1, 5, 16, 2, 3, generator=torch.Generator().manual_seed(1))
    fused = build_decoder("wan", reduced=True, seed=3)
    plain = _unfused(build_decoder("wan", reduced=True, seed=3))
    rows = []
    # under the interpreter two of the streams (chunks of 1, 2 and 3, first chunks of 1 and 3); every stream runs
    # on the CPU path below
    for sizes, a, b in _streamed(fused, plain, x, ([3, 2], [1, 3, 1])):
        rows.append({"sizes": sizes, "shape_ok": a.shape == b.shape, "err": float((a - b).abs().max()),
                     "bound": DEPTH_ULPS * EPS32 * max(1.0, float(b.abs().max()))})
    vae_norm.run_triton = run
    return {"rows": rows, "calls": calls}


def _child() -> None:
    from wan_accel.cache.autotune import get_autotuner
    from wan_accel.kernels import _common

    get_autotuner().timer = lambda run: 1.0    # the tuned cases check the store's pick, not the interpreter's speed
    results = {"usable": _common.use_triton(torch.zeros(1)),
               "cases": [_case(i, *case) for i, case in enumerate(CASES)],
               "eps": _eps_case(), "decoder": _decoder_case()}
    print(MARK + json.dumps(results), flush=True)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("triton")
    from interpret_child import run_interpreted_child
    return run_interpreted_child(HERE, tmp_path_factory.mktemp("vae_norm"), MARK, timeout=900)


# ----------------------------------------------------------------------------------------- under the interpreter
@pytest.mark.parametrize("index", range(len(CASES)),
                         ids=[f"C{c[0]}-{'x'.join(map(str, c[1]))}-{c[2]}-{'silu' if c[3] else 'norm'}-"
                              f"{'tuned' if c[4] is None else 'whole' if c[4]['CBLOCK'] == 0 else 'looped'}"
                              f"{'-' + c[5] if len(c) > 5 else ''}" for c in CASES])
def test_kernel_matches_the_torch_definition(results, index):
    assert results["usable"] is True
    case = results["cases"][index]
    assert case["shape_ok"] and case["history_kept"], case
    assert case["excess"] <= 1.0, case                  # the float32 definition, within the margin
    assert case["module_excess"] <= 1.0, case           # and the decoder's torch layers in x's dtype


def test_the_norm_is_clamped_as_f_normalize_clamps_it(results):
    eps = results["eps"]
    assert eps["finite"] and eps["zeros"] and eps["excess"] <= 1.0, eps
    assert eps["clamped"] == pytest.approx(eps["clamped_expect"], rel=8 * EPS32)


def test_the_decoder_streamed_with_the_kernel_gives_the_frames_of_the_layers(results):
    dec = results["decoder"]
    # every residual block's two norms and the head's ran the kernel with SiLU, the attention's without; the first
    # norm after an up-sampling on its permuted frames as they are
    calls = dec["calls"]
    assert calls["silu"] > 0 and calls["plain"] > 0 and calls["strided"] > 0, calls
    for row in dec["rows"]:
        assert row["shape_ok"] and row["err"] <= row["bound"], row


# ----------------------------------------------------------------------------------------- on the CPU (torch)
@pytest.fixture
def torch_path(monkeypatch):
    """A CPU without Triton's interpreter, whatever this process's TRITON_INTERPRET says (tests/test_interpret_pass.py
    runs this file again under TRITON_INTERPRET=1): CPU tensors take the torch path."""
    from wan_accel.kernels import _common

    monkeypatch.setattr(_common, "interpreter_usable", lambda: False)
    assert not _common.use_triton(torch.zeros(1))


def test_the_cpu_path_writes_the_buffer_without_the_kernel(torch_path):
    """No Triton here: the fused layout's torch ops (no concatenation) give the layers' frames, history included."""
    torch.manual_seed(0)
    norm = wan21.RMSNorm(6).requires_grad_(False)
    norm.gamma.normal_()
    conv = wan21.CausalConv3d(6, 4, 3, (1, 1, 1)).requires_grad_(False)
    x1, x2 = torch.randn(1, 6, 3, 4, 5), torch.randn(1, 6, 1, 4, 5)
    assert not norm.kernel_runs(x1)
    fused_state, plain_state = {}, {}
    with torch.no_grad():
        for x in (x1, x2):          # a second chunk of 1 frame: the history spans both chunks
            fused = wan21._norm_silu_conv(norm, conv, x, fused_state)
            norm.fused = False
            plain = wan21._norm_silu_conv(norm, conv, x, plain_state)
            norm.fused = True
            torch.testing.assert_close(fused, plain, rtol=0, atol=8 * EPS32 * float(plain.abs().max()))
            torch.testing.assert_close(fused_state[conv], plain_state[conv], rtol=0, atol=4 * EPS32)
    assert fused_state[conv].shape[2] == 2


def test_with_autograd_the_layers_run_one_by_one():
    """Writing into a buffer cannot be differentiated: with gradients on, the layers run as the modules define them."""
    block = wan21.ResidualBlock(4, 4)
    x = torch.randn(1, 4, 2, 3, 3, requires_grad=True)
    block(x, {}).sum().backward()
    assert x.grad is not None and block.residual[0].gamma.grad is not None


@pytest.mark.parametrize("call,message", [
    (lambda: vae_norm.norm_silu(torch.zeros(2, 3, 4), torch.ones(3)), "x must be [B, C, T, H, W] or [N, C, H, W]"),
    (lambda: vae_norm.norm_silu(torch.zeros(1, 3, 2, 2), torch.ones(4)), "gamma must have C = 3 elements"),
    (lambda: vae_norm.norm_silu(torch.zeros(1, 3, 2, 2), torch.ones(3), out=torch.zeros(1, 3, 2, 3)), "out must be"),
    (lambda: vae_norm.norm_silu(torch.zeros(1, 3, 2, 2), torch.ones(3), out=torch.zeros(1, 3, 2, 2).transpose(2, 3)),
     "out's frames must each lie contiguous"),
])
def test_bad_input_gives_one_clear_error(call, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        call()
    assert "\n" not in str(info.value)


def test_the_torch_fallback_is_the_definition(torch_path):
    x, gamma = _inputs(7, (2, 3, 3), "float32", 0)
    out = torch.empty(1, 7, 4, 3, 3)
    got = vae_norm.norm_silu(x, gamma, True, out[:, :, 2:])
    assert got.data_ptr() == out[:, :, 2:].data_ptr()
    assert torch.equal(out[:, :, 2:], vae_norm.norm_silu_reference(x, gamma))
    assert _excess(out[:, :, 2:], _module_math(x, gamma, True), _pre(x, gamma), "float32", 7) <= 1.0


def test_bench_kernels_vae_row_on_the_cpu(torch_path):
    from wan_accel.bench import kernels as bench

    (row,) = bench.vae_rows("cpu", "float32", ("tiny", 8, 2, 5, 7))
    assert row["kernel"] == "vae norm+silu" and row["dims"] == [1, 8, 2, 5, 7] and row["ok"], row
    assert row["fused"] == "torch, no concatenation" and row["ratio"] > 0 and not row["absolute"]
    assert row["max_err"] <= 8 * EPS32 * 3      # the same torch math in float32 (SiLU in place): a few units
    assert bench.VAE_GPU_SHAPE[1:] == (96, 4, 480, 832)


# ----------------------------------------------------------------------------------------- on a CUDA GPU
@pytest.mark.cuda
@pytest.mark.parametrize("c,dims,layout", [(96, (3, 120, 208), ""), (384, (2, 60, 104), ""),
                                           (192, (3, 60, 104), "bt"), (384, (60, 104), "")])
def test_the_kernel_matches_on_the_gpu(c, dims, layout, tmp_path, monkeypatch):
    """Compiled Triton (its tiles tuned into a fresh store) at the decoder's widths, bf16, into a history buffer."""
    monkeypatch.setenv("WAN_ACCEL_CACHE", str(tmp_path / "limits.json"))
    from wan_accel.cache.autotune import reset_autotuners
    reset_autotuners()
    x, gamma = _inputs(c, dims, "bfloat16", 0, layout)
    x, gamma = x.cuda(), gamma.cuda()
    assert vae_norm.usable(x, gamma)
    silu = x.dim() == 5
    buf = torch.full(x.shape[:2] + (2 + x.shape[2],) + x.shape[3:], 7.0, dtype=x.dtype, device="cuda") if silu \
        else torch.empty_like(x)
    out = vae_norm.norm_silu(x, gamma, silu, buf[:, :, 2:] if silu else buf)
    ref = vae_norm.norm_silu_reference(x, gamma, silu)
    assert _excess(out, ref, _pre(x, gamma), "bfloat16", c) <= 1.0
    assert not silu or bool((buf[:, :, :2] == 7.0).all())
    reset_autotuners()


@pytest.mark.cuda
def test_the_decoder_with_the_kernel_gives_the_frames_of_the_layers_on_the_gpu(tmp_path, monkeypatch):
    """float32 without TF32 (which would round the convolutions' inputs to 10 bits), chunks of 1, 2 and 3."""
    monkeypatch.setenv("WAN_ACCEL_CACHE", str(tmp_path / "limits.json"))
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    fused = build_decoder("wan", reduced=True, seed=3).prepare("cuda", torch.float32)
    plain = _unfused(build_decoder("wan", reduced=True, seed=3).prepare("cuda", torch.float32))
    x = torch.randn(1, 5, 16, 4, 6, generator=torch.Generator().manual_seed(1))
    assert fused.decoder.head[0].kernel_runs(torch.zeros(1, 4, 1, 2, 2, device="cuda"))
    for sizes, a, b in _streamed(fused, plain, x):
        assert (a - b).abs().max().item() <= DEPTH_ULPS * EPS32 * max(1.0, b.abs().max().item()), sizes


if __name__ == "__main__" and "--child" in sys.argv:
    _child()
