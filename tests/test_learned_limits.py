"""One key per learned limit, built by the same function on the writing side (the sampling guard, the decode
node) and the reading side (the VRAM plan): what a run learns reaches the next plan."""
from __future__ import annotations

import io
import json
import logging
from contextlib import redirect_stdout

import pytest
import torch

from wan_accel.cache import LimitCache
from wan_accel.memory.block_swap import ensure_block_swap
from wan_accel.memory.estimate import Workload
from wan_accel.memory.limits import vae_kind
from wan_accel.memory.plan import make_plan
from wan_accel.memory.sampling_guard import oom_guard
from wan_accel.memory.system import SystemInfo
from wan_accel.memory.weights import weights_from_checkpoint
from checkpoint_files import save_wan_checkpoint
from wan_accel.model.loader import load_wan_checkpoint
from wan_accel.model.tiny import TINY_CONFIG, tiny_causal_model
from run_helpers import generate_latents

F, H, W = 9, 4, 6                                   # latent frames / height / width of the runs below
VIDEO = dict(width=W * 8, height=H * 8, frames=4 * (F - 1) + 1)
GPU = SystemInfo.simulated_gpu(80, ram_gb=64, capability=(9, 0))   # plans bfloat16 compute


def _cli_plan(*args) -> dict:
    from wan_accel.cli import main

    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["plan", *args, "--width", str(VIDEO["width"]), "--height", str(VIDEO["height"]),
                     "--frames", str(VIDEO["frames"]), "--vram-gb", "80", "--ram-gb", "64",
                     "--capability", "9.0", "--json"]) == 0
    return json.loads(out.getvalue())


def _checkpoints(tmp_path) -> dict:
    """The tiny model stored in float32 and in bfloat16 (same architecture, same config)."""
    return {"float32": save_wan_checkpoint(tiny_causal_model(), tmp_path / "tiny_f32.safetensors"),
            "bfloat16": save_wan_checkpoint(tiny_causal_model(dtype=torch.bfloat16),
                                            tmp_path / "tiny_bf16.safetensors")}


def _learn_dit_limit(path) -> None:
    """Sample the checkpoint in bfloat16 with an out-of-memory forced inside chunk 1 (as on a GPU that is too
    small): the sampling guard swaps a block, redoes the chunk and records the resident blocks that worked."""
    model = load_wan_checkpoint(path, dtype=torch.bfloat16)
    ctx = torch.randn(1, 4, TINY_CONFIG.text_dim, generator=torch.Generator().manual_seed(0))
    calls = [0]

    def oom(_module, _args):
        calls[0] += 1
        if calls[0] == 7:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    handle = model.blocks[1].register_forward_pre_hook(oom)
    try:
        generate_latents(model, ctx, F, H, W, seed=3, path="optimized",
                         chunk_guard=oom_guard(model, (1, F, TINY_CONFIG.out_dim, H, W), 3, mode="on"))
    finally:
        handle.remove()
        ensure_block_swap(model, None)


@pytest.mark.parametrize("sampled", ["float32", "bfloat16"], ids=["learned-on-fp32-file", "learned-on-bf16-file"])
def test_dit_limit_learned_in_bf16_reaches_the_plan_of_either_stored_dtype(tmp_path, cache_path, sampled):
    files = _checkpoints(tmp_path)
    _learn_dit_limit(files[sampled])
    learned = [e for e in LimitCache(cache_path).entries("memory") if e["key"].startswith("dit/")]
    assert len(learned) == 1 and learned[0]["value"]["size"] == 1
    for stored, path in files.items():
        plan = make_plan(weights_from_checkpoint(path), Workload(**VIDEO), GPU, cache=LimitCache(cache_path))
        assert plan.dtype == "bfloat16"
        assert "learned" in plan.reasons["blocks_to_swap"], (stored, plan.reasons["blocks_to_swap"])
        assert plan.blocks_to_swap == TINY_CONFIG.num_layers - 1 and plan.learned["dit"]["key"] == learned[0]["key"]
        cli = _cli_plan("--checkpoint", str(path))
        assert "learned" in cli["reasons"]["blocks_to_swap"], stored


class _Wan22VAE:
    """Stands in for ComfyUI's Wan 2.2 VAE (48 latent channels); falls back to tiled decoding (ComfyUI logs a
    warning) above ``tile_above`` latent frames, which the decode node treats as out of memory."""

    def __init__(self, tile_above: int):
        self.tile_above, self.calls, self.vae_dtype = tile_above, [], torch.float32

    def temporal_compression_decode(self):
        return 4

    def decode(self, z):
        self.calls.append(z.shape[2])
        if z.shape[2] > self.tile_above:
            logging.warning("Warning: Ran out of memory when regular VAE decoding, retrying with tiled VAE decoding.")
        t = z.shape[2]
        idx = [0] + [1 + (j - 1) // 4 for j in range(1, 1 + 4 * (t - 1))]
        return z[:, :3, idx].permute(0, 2, 3, 4, 1).contiguous()


def test_vae_kind_comes_from_the_latent_channels():
    assert (vae_kind(16), vae_kind(48)) == ("wan2.1", "wan2.2")
    assert vae_kind(32, _Wan22VAE(1)) == "_Wan22VAE-c32"


def test_wan22_vae_limit_learned_by_the_decode_node_reaches_the_plan(tmp_path, cache_path):
    from wan_accel.nodes.memory_nodes import WanChunkedVAEDecode, WanVRAMPlan

    latent = torch.randn(1, 48, F, H, W, generator=torch.Generator().manual_seed(1))
    WanChunkedVAEDecode().decode({"samples": latent}, _Wan22VAE(tile_above=4), chunk_frames=0, overlap=1)
    learned = [e for e in LimitCache(cache_path).entries("memory") if e["key"].startswith("vae_decode/")]
    assert len(learned) == 1 and "/wan2.2/" in learned[0]["key"] and learned[0]["value"]["size"] <= 4

    # a Wan 2.2 model (48 latent channels) gets the Wan 2.2 limit without being told
    wan22 = TINY_CONFIG.replace(in_dim=48, out_dim=48)
    path = save_wan_checkpoint(tiny_causal_model(config=wan22), tmp_path / "tiny_wan22.safetensors")
    for plan in (make_plan(weights_from_checkpoint(path), Workload(**VIDEO), GPU, cache=LimitCache(cache_path)),
                 _cli_plan("--checkpoint", str(path))):
        reasons = plan.reasons if hasattr(plan, "reasons") else plan["reasons"]
        chunk = plan.vae_chunk_frames if hasattr(plan, "vae_chunk_frames") else plan["vae_chunk_frames"]
        assert "learned" in reasons["vae_chunk_frames"] and chunk == learned[0]["value"]["size"]
    # a preset with the Wan 2.2 VAE named where the plan is built: the CLI and the VRAM plan node
    assert "learned" in _cli_plan("--model", "1.3b", "--vae", "wan2.2")["reasons"]["vae_chunk_frames"]
    assert "learned" not in _cli_plan("--model", "1.3b")["reasons"]["vae_chunk_frames"]   # the Wan 2.1 VAE
    node_plan, _ = WanVRAMPlan().plan(model_source="1.3b", vae_kind="wan2.2", **VIDEO)["result"]
    assert node_plan.learned["vae"]["key"] == learned[0]["key"]

