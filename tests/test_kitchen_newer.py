"""comfy-kitchen's newer ops against the pack's: the prequantized int8 attention pair is a candidate only where it
runs (``int8_attention_is_available``), equals the one-call kernel and is faster; ``rms_rope_split_half`` is not
Wan's norm and rotation, so it is no candidate. Kitchen's int8 kernels are CUDA only, so the choice is tested with
a stand-in following kitchen's signatures (``int8_attention(q, k, v, *, scale=None, attn_mask=None)``,
``prequantize_int8_attention(q, k, v, *, scale=None, attn_mask=None)``, ``int8_attention_from_prequantized(
packed)``, ``int8_attention_is_available(device=None)``; layout [B, heads, L, D]); the rotation with kitchen's
real eager backend."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from wan_accel.cache.autotune import Autotuner
from wan_accel.kernels import candidates as C
from wan_accel.kernels import int8_attention as int8
from wan_accel.kernels import kitchen
from wan_accel.kernels.qk_norm_rope import rmsnorm_rope_reference


class StandInKitchen:
    """comfy-kitchen's int8 attention entry points, computed with the pack's torch int8 math."""

    def __init__(self, prequantized_error: float = 0.0):
        self.calls = {"int8_attention": 0, "prequantize_int8_attention": 0, "int8_attention_from_prequantized": 0}
        self.error = prequantized_error

    def int8_attention_is_available(self, device=None):
        return True

    def int8_attention(self, q, k, v, *, scale=None, attn_mask=None):
        self.calls["int8_attention"] += 1
        return int8.int8_attention_torch(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    def prequantize_int8_attention(self, q, k, v, *, scale=None, attn_mask=None):
        self.calls["prequantize_int8_attention"] += 1
        return SimpleNamespace(q=q, k=k, v=v, attention_scale=scale)

    def int8_attention_from_prequantized(self, packed):
        self.calls["int8_attention_from_prequantized"] += 1
        out = int8.int8_attention_torch(packed.q.transpose(1, 2), packed.k.transpose(1, 2),
                                        packed.v.transpose(1, 2)).transpose(1, 2)
        return out + self.error


def _qkv():
    g = torch.Generator().manual_seed(3)
    return tuple(torch.randn(1, 40, 2, 16, generator=g) for _ in range(3))


@pytest.fixture
def stand_in(monkeypatch):
    """The stand-in as comfy-kitchen, on a device the checks accept (the CPU plays the CUDA GPU)."""
    def install(error=0.0):
        ck = StandInKitchen(error)
        monkeypatch.setattr(kitchen, "module", lambda: ck)
        real = int8.kitchen_problem
        monkeypatch.setattr(int8, "kitchen_problem", lambda device, dtype=torch.bfloat16, head_dim=128,
                            call="kitchen": real(torch.device("cuda", 0), dtype, head_dim, call))
        monkeypatch.setattr(int8, "_STATE", {})
        monkeypatch.setattr(int8, "_CALLS", {})
        return ck
    return install


def test_on_this_cpu_kitchen_int8_is_unavailable_and_the_torch_version_runs():
    q, k, v = _qkv()
    for call in int8.KITCHEN_CALLS:
        why = int8.kitchen_problem(q.device, q.dtype, q.shape[-1], call)
        assert why and ("CUDA" in why or "not installed" in why)
    assert int8.kitchen_call(q, k, v)[0] is None
    torch.testing.assert_close(int8.int8_attention(q, k, v), int8.int8_attention_torch(q, k, v), rtol=0, atol=0)


def test_a_kitchen_without_the_prequantized_pair_keeps_the_one_call_kernel(stand_in, monkeypatch):
    ck = stand_in()
    monkeypatch.setattr(StandInKitchen, "prequantize_int8_attention", property(lambda self: (_ for _ in ()).throw(
        AttributeError("no such op"))))
    q, k, v = _qkv()
    assert "prequantize_int8_attention" in int8.kitchen_problem(q.device, q.dtype, 16, "kitchen.prequantized")
    assert int8.kitchen_call(q, k, v)[0] == "kitchen"
    int8.int8_attention_kitchen(q, k, v)
    assert ck.calls["int8_attention"] == 1


@pytest.mark.parametrize("faster, expect", [("kitchen.prequantized", "kitchen.prequantized"), ("kitchen", "kitchen")])
def test_the_faster_verified_entry_point_is_chosen_and_remembered(stand_in, faster, expect):
    ck = stand_in()
    q, k, v = _qkv()
    times = {"kitchen": 2.0, "kitchen.prequantized": 2.0}
    times[faster] = 1.0
    timed = []

    def timer(fn):
        before = dict(ck.calls)
        fn()
        name = "kitchen.prequantized" if ck.calls["prequantize_int8_attention"] > before[
            "prequantize_int8_attention"] else "kitchen"
        timed.append(name)
        return times[name]
    tuner = Autotuner(None, timer=timer)
    assert int8.kitchen_call(q, k, v, tuner=tuner)[0] == expect
    assert sorted(set(timed)) == ["kitchen", "kitchen.prequantized"]
    assert int8.kitchen_call(q, k, v, tuner=tuner)[0] == expect and len(timed) == 2     # not measured again


def test_a_prequantized_pair_with_other_numbers_is_failed_alone(stand_in):
    stand_in(error=1e-2)
    q, k, v = _qkv()
    tuner = Autotuner(None, timer=lambda fn: (fn(), 1.0)[1])
    assert int8.kitchen_call(q, k, v, tuner=tuner)[0] == "kitchen"
    entry = tuner.entry(C.store_kernel(int8.STORE_OP), int8._store_key(q, k))
    assert list(entry["failed"]) == ["impl=kitchen.prequantized"]
    assert "wrong numbers" in entry["failed"]["impl=kitchen.prequantized"]["error"]["message"]


def test_rms_rope_split_half_is_not_wan_norm_and_rotation():
    """comfy-kitchen's rms_rope_split_half normalizes per head and rotates pairs (j, j + D/2); Wan normalizes the
    whole width and rotates adjacent pairs: it is no candidate of rmsnorm_rope (kitchen's real eager backend)."""
    ck = kitchen.module()
    if ck is None or not hasattr(ck, "rms_rope_split_half"):
        pytest.skip("comfy-kitchen with rms_rope_split_half is not installed")
    g = torch.Generator().manual_seed(1)
    b, l, h, d = 1, 6, 2, 16
    x = torch.randn(b, l, h * d, generator=g)
    w = 1 + 0.1 * torch.randn(h * d, generator=g)
    ang = torch.rand(l, d // 2, generator=g) * 6.283
    want = rmsnorm_rope_reference(x, w, ang.cos(), ang.sin(), h, 1e-6)
    eager = ck.registry.get_implementation("rms_rope_split_half", backend="eager")
    got, _ = eager(x.view(b, l, h, d), x.view(b, l, h, d), kitchen.freqs_cis(ang.cos(), ang.sin()),
                   w.view(h, d)[0], None, 1e-6, 0)
    assert (got - want.reshape(b, l, h, d)).abs().max() > 0.1
    assert not any("split_half" in c.summary for op in C.CANDIDATES.values() for c in op.values())
