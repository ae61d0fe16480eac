"""VRAM plan decisions for a table of machines and workloads, with their reasons; learned limits; the CLI."""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
from contextlib import redirect_stdout

import pytest

from wan_accel.cache import LimitCache
from wan_accel.memory.estimate import Workload, kv_cache_bytes
from wan_accel.memory.limits import NAMESPACE, dit_limit_key, vae_limit_key
from wan_accel.memory.plan import MemoryPlan, make_plan
from wan_accel.memory.system import GiB, SystemInfo, detect_system
from wan_accel.memory.weights import preset_weights


def cpu_only(ram):
    return SystemInfo(host_ram_total=ram * GiB, host_ram_available=ram * GiB, pinned_budget=0)


def gpu(vram, cap=(8, 9), ram=64):
    return SystemInfo.simulated_gpu(vram, ram_gb=ram, capability=cap)


CASES = [
    # id, system, preset, (w, h, frames), expectations
    ("h100-1.3b", gpu(80, (9, 0)), "1.3b", (832, 480, 81),
     dict(fits=True, swap=0, kv=-1, vae=21, dtype="bfloat16", backend="flash", reason="fit beside")),
    ("8g-1.3b", gpu(8), "1.3b", (832, 480, 81),
     dict(fits=True, swap=(1, 29), kv=-1, reason="resident")),
    ("24g-14b", gpu(24), "14b", (832, 480, 81),
     dict(fits=True, swap=(30, 40), kv=(6, 20), kv_reason="rolling window", emb=True)),
    ("minimal-4g-1.3b", gpu(4), "1.3b", (832, 480, 81),
     dict(fits=True, swap=(25, 30), kv=(6, 20), kv_reason="rolling window")),
    ("too-small-6g-14b-720p", gpu(6), "14b", (1280, 720, 81),
     dict(fits=False, swap=40, fits_reason="lower the resolution")),
    ("t4-sm75", gpu(16, (7, 5)), "1.3b", (832, 480, 81),
     dict(fits=True, dtype="float16", backend="efficient", dtype_reason="no bf16")),
    ("cpu-only", cpu_only(32), "1.3b", (832, 480, 81),
     dict(fits=True, swap=0, dtype="float32", backend="cpu", device="cpu", reason="no CUDA device")),
    ("h100-14b-720p", gpu(80, (9, 0)), "14b", (1280, 720, 81),
     dict(fits=True, swap=(1, 39), kv=-1)),
]


def _within(value, want):
    return want[0] <= value <= want[1] if isinstance(want, tuple) else value == want


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_plan_decisions_table(case):
    _, system, preset, (w, h, f), exp = case
    weights = preset_weights(preset)
    plan = make_plan(weights, Workload(w, h, f), system)
    assert plan.fits is exp["fits"]
    if "swap" in exp:
        assert _within(plan.blocks_to_swap, exp["swap"]), plan.blocks_to_swap
    if "kv" in exp:
        assert _within(plan.kv_window, exp["kv"]), plan.kv_window
    if "vae" in exp:
        assert plan.vae_chunk_frames == exp["vae"] and plan.vae_overlap == 0
    for field, key in (("dtype", "dtype"), ("backend", "attention_backend"), ("device", "device")):
        if field in exp:
            assert getattr(plan, key) == exp[field]
    if "emb" in exp:
        assert plan.offload_embeddings is exp["emb"] and "embeddings" in plan.reasons["offload_embeddings"]
    for field, key in (("reason", "blocks_to_swap"), ("kv_reason", "kv_window"), ("fits_reason", "fits"),
                       ("dtype_reason", "dtype")):
        if field in exp:
            assert exp[field] in plan.reasons[key], plan.reasons[key]
    # every decision has words
    for key in ("dtype", "attention_backend", "blocks_to_swap", "kv_window", "vae_chunk_frames"):
        assert len(plan.reasons[key]) > 10
    assert plan.estimated_peak_bytes == sum(plan.breakdown.values())
    if plan.fits:
        assert plan.estimated_peak_bytes <= plan.budget_bytes
        if 2 <= plan.blocks_to_swap and system.has_gpu:
            # minimal: one more resident block would not fit
            block = weights.block_bytes_at(2)[0]
            assert plan.estimated_peak_bytes + block > plan.budget_bytes
        if plan.blocks_to_swap:
            assert plan.prefetch == 1 and plan.pinned_blocks == plan.blocks_to_swap
    else:
        assert plan.estimated_peak_bytes > plan.budget_bytes
    assert "fits: " in plan.summary()


def test_kv_cache_size_matches_the_reference_numbers():
    # Self-Forcing global cache: 30 layers x 2 x 32760 tokens x 1536 x 2 bytes ~ 6.0 GB
    assert kv_cache_bytes(30, 32760, 1536, 2) == 30 * 2 * 32760 * 1536 * 2
    plan = make_plan(preset_weights("1.3b"), Workload(832, 480, 81), gpu(80))
    assert plan.breakdown["kv_cache"] == kv_cache_bytes(30, 21 * 1560, 1536, 2)
    assert 90e6 < plan.breakdown["cross_attn_cache"] < 100e6   # ~94 MB


def test_reserve_float32_checkpoint_and_explicit_window():
    f32 = preset_weights("1.3b", "F32")
    plan = make_plan(f32, Workload(832, 480, 81), gpu(24))
    assert plan.dtype == "bfloat16" and "float32" in plan.reasons["dtype"] and "halves" in plan.reasons["dtype"]
    roomy = make_plan(preset_weights("1.3b"), Workload(832, 480, 81), gpu(12))
    tight = make_plan(preset_weights("1.3b"), Workload(832, 480, 81), gpu(12), reserve_bytes=4 * GiB)
    assert tight.budget_bytes == roomy.budget_bytes - 4 * GiB
    assert tight.blocks_to_swap > roomy.blocks_to_swap
    windowed = make_plan(preset_weights("1.3b"), Workload(832, 480, 81), gpu(80), kv_window=6)
    assert windowed.kv_window == 6 and "rolling" in windowed.reasons["kv_window"]
    assert windowed.breakdown["kv_cache"] == kv_cache_bytes(30, 6 * 1560, 1536, 2)
    full = make_plan(preset_weights("1.3b"), Workload(832, 480, 81, mode="full"), gpu(80))
    assert full.breakdown["kv_cache"] == 0 and full.kv_window == -1


def test_learned_limits_override_estimates(tmp_path):
    cache = LimitCache(tmp_path / "limits.json")
    weights = preset_weights("1.3b")
    wl = Workload(832, 480, 81)
    cache.put(NAMESPACE, dit_limit_key(weights.config, "bfloat16", 832, 480, 81), {"size": 10, "unit": "resident_blocks"})
    cache.put(NAMESPACE, vae_limit_key("wan2.1", 1, 60, 104), {"size": 5, "unit": "latent frames"})
    plan = make_plan(weights, wl, gpu(80), cache=cache)
    assert plan.blocks_to_swap == 20 and "learned" in plan.reasons["blocks_to_swap"]
    assert plan.vae_chunk_frames == 5 and plan.vae_overlap == 2 and "learned" in plan.reasons["vae_chunk_frames"]
    assert plan.learned["dit"]["resident_blocks"] == 10
    ignored = make_plan(weights, wl, gpu(80))        # no cache: the estimates alone
    assert ignored.blocks_to_swap == 0 and ignored.vae_chunk_frames == 21


def test_plan_is_json_serialisable_and_round_trips():
    plan = make_plan(preset_weights("14b"), Workload(832, 480, 81), gpu(24))
    data = json.loads(plan.to_json())
    again = MemoryPlan.from_dict(data)
    assert again == plan
    assert again.swap_settings().blocks_to_swap == plan.blocks_to_swap


def test_detect_system_on_this_machine_is_sane():
    s = detect_system()
    assert s.host_ram_total > 0 and 0 < s.host_ram_available <= s.host_ram_total
    if not s.has_gpu:
        assert s.total_vram == 0 and s.pinned_budget == 0 and "CPU only" in s.describe()
    assert SystemInfo.from_dict(s.to_dict()) == s


def _cli(*argv):
    from wan_accel.cli import memory as cli_memory

    parser = argparse.ArgumentParser()
    cli_memory.register(parser.add_subparsers())
    args = parser.parse_args(list(argv))
    from wan_accel.cli.errors import run_guarded

    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = run_guarded(args.func, args)       # as main() runs a command: usage errors become exit code 2
    return rc, buf.getvalue()


def test_cli_plan_without_gpu(tmp_path):
    rc, out = _cli("plan", "--model", "1.3b", "--vram-gb", "8", "--ram-gb", "64", "--json")
    data = json.loads(out)
    assert rc == 0 and data["fits"] and 0 < data["blocks_to_swap"] < 30 and data["system"]["simulated"]
    rc, text = _cli("plan", "--model", "14b", "--width", "1280", "--height", "720", "--vram-gb", "6", "--ram-gb", "64")
    assert rc == 0 and "fits: NO" in text and "what to change" in text
    from safetensors.torch import save_file
    import torch

    ck = tmp_path / "tiny.safetensors"
    save_file({"blocks.0.self_attn.q.weight": torch.zeros(64, 64), "blocks.1.self_attn.q.weight": torch.zeros(64, 64),
               "patch_embedding.weight": torch.zeros(64, 16, 1, 2, 2)}, str(ck))
    rc, out = _cli("plan", "--checkpoint", str(ck), "--json", "--width", "64", "--height", "64", "--frames", "9")
    assert rc == 0 and json.loads(out)["blocks_total"] == 2
    assert _cli("plan", "--checkpoint", str(tmp_path / "missing.safetensors"))[0] == 2


def test_cli_module_entry_point(tmp_path):
    env = dict(os.environ, WAN_ACCEL_CACHE=str(tmp_path / "limits.json"),
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, "-m", "wan_accel", "plan", "--model", "14b", "--vram-gb", "24",
                          "--ram-gb", "64", "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["blocks_to_swap"] >= 30


def test_auto_dtype_is_fp16_without_bf16_tensor_cores():
    from wan_accel.memory.system import SystemInfo, auto_dtype

    name, why = auto_dtype(SystemInfo.simulated_gpu(16, ram_gb=32, capability=(7, 5)))
    assert name == "fp16" and "7.5" in why
    assert auto_dtype(SystemInfo.simulated_gpu(16, ram_gb=32, capability=(8, 6)))[0] == "bf16"
    assert auto_dtype(cpu_only(8))[0] == "fp32"
