"""GPU-only choices made visible on a CPU: FlashAttention picked by what the installed build runs (fake
capability, fake build), Triton launches on the tensors' GPU (fake cuda:1 tensors, counted device switches), and
the RMSNorm+RoPE kernel reads q/k views of the fused q/k/v output in place."""
from __future__ import annotations

import contextlib

import pytest
import torch

from wan_accel.kernels import _common, norm_modulate, qk_norm_rope, residual
from wan_accel.model import attention as att

NO_KERNEL = "CUDA error: no kernel image is available for execution on the device"


@pytest.fixture
def fresh_attention(monkeypatch):
    monkeypatch.setattr(att, "_BUILD", {})
    att.resolve_backend.cache_clear()
    monkeypatch.setattr(att, "_probe_inputs", lambda device, dtype: (torch.zeros(1, 1, 1, 64),) * 3)
    yield
    att.resolve_backend.cache_clear()


def test_fa2_without_kernels_for_this_gpu_falls_back_to_sdpa(monkeypatch, fresh_attention):
    def fa2_without_sm120(q, k, v):
        raise RuntimeError(NO_KERNEL)

    monkeypatch.setitem(att._FUNCS, "fa3", None)
    monkeypatch.setitem(att._FUNCS, "fa2", fa2_without_sm120)
    name, why = att.explain_backend("auto", "cuda:0", torch.bfloat16, 128, capability=(12, 0))
    assert name == "sdpa" and "does not run on SM 12.0" in why and "no kernel image" in why


def test_fa2_with_kernels_for_this_gpu_is_chosen(monkeypatch, fresh_attention):
    monkeypatch.setitem(att._FUNCS, "fa3", None)
    monkeypatch.setitem(att._FUNCS, "fa2", lambda q, k, v: q)
    assert att.explain_backend("auto", "cuda:0", torch.bfloat16, 128, capability=(12, 0))[0] == "fa2"


def test_a_kernel_image_error_at_run_time_falls_back_for_good(monkeypatch, fresh_attention):
    calls = []

    def fa2(q, k, v):
        calls.append(1)
        raise RuntimeError(NO_KERNEL)

    monkeypatch.setitem(att._FUNCS, "fa2", fa2)
    q = torch.randn(1, 5, 2, 8)
    ref = att._sdpa(q, q, q)
    assert torch.equal(att._flash("fa2", q, q, q), ref)
    assert torch.equal(att._flash("fa2", q, q, q), ref)
    assert calls == [1]                         # not tried again
    monkeypatch.setitem(att._FUNCS, "fa2", lambda q, k, v: (_ for _ in ()).throw(RuntimeError("illegal memory access")))
    att._BUILD.clear()
    with pytest.raises(RuntimeError, match="illegal memory access"):   # other errors are not hidden
        att._flash("fa2", q, q, q)


class _DeviceRecorder:
    """Fake torch.cuda.device + a fake Triton kernel that records the current device at launch."""

    def __init__(self):
        self.current, self.launched_on = 0, []

    def device(self, dev):
        rec = self

        @contextlib.contextmanager
        def ctx():
            before = rec.current
            rec.current = torch.device(dev).index if not isinstance(dev, int) else dev
            try:
                yield
            finally:
                rec.current = before

        return ctx()

    def jit(self, fn):
        rec = self

        class Kernel:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    rec.launched_on.append(rec.current)
                    rec.args = args
                return launch

        return Kernel()


CFG = {"YBLOCK": 2, "RBLOCK": 64, "XBLOCK": 64, "num_warps": 4}


@pytest.mark.skipif(qk_norm_rope.tl is None, reason="triton is not installed")
def test_triton_kernels_launch_on_the_tensors_gpu(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    rec = _DeviceRecorder()
    monkeypatch.setattr(_common, "jit", rec.jit)
    monkeypatch.setattr(torch.cuda, "device", rec.device)
    with FakeTensorMode(allow_non_fake_inputs=True):
        dev = torch.device("cuda:1")            # the model's GPU; the current device stays 0
        x = torch.empty(1, 4, 64, device=dev)
        mod = torch.empty(1, 1, 64, device=dev)
        norm_modulate.run_triton(x, mod, mod, config=CFG)
        residual.run_triton(x, x, mod, config=CFG)
        cos = torch.empty(4, 8, device=dev)
        qk_norm_rope.run_triton(x, torch.empty(64, device=dev), cos, cos, 4, config=CFG)
    assert rec.launched_on == [1, 1, 1] and rec.current == 0


@pytest.mark.skipif(qk_norm_rope.tl is None, reason="triton is not installed")
def test_rmsnorm_rope_reads_fused_qkv_views_in_place(monkeypatch):
    rec = _DeviceRecorder()
    monkeypatch.setattr(_common, "jit", rec.jit)
    qkv = torch.randn(2, 4, 3 * 64)
    q, k, _v = qkv.split(64, dim=-1)
    assert not k.is_contiguous()
    cos = torch.randn(4, 8)
    qk_norm_rope.run_triton(k, torch.ones(64), cos, cos, 4, config=CFG)
    x_arg = rec.args[0]
    assert x_arg.data_ptr() == k.data_ptr() and rec.args[10] == 3 * 64   # no copy; rows 3*D apart
    odd = torch.randn(4, 2, 64).transpose(0, 1)                           # rows not evenly spaced: copied
    qk_norm_rope.run_triton(odd, torch.ones(64), cos, cos, 4, config=CFG)
    assert rec.args[0].is_contiguous() and rec.args[10] == 64
