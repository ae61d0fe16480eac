"""One chunk forward of ComfyUI's own CausalWanModel against the pack's engine over the same modules.

Run with ComfyUI's Python, cwd = ComfyUI, the pack importable as ``wan_accel``: loads the public causal fixture's
weights with ComfyUI's loader (WAN21_CausalAR), then runs two chunks (frames 0-2 at t=1000, frames 3-5 at t=937.5
after them, KV cache kept) with core's ``forward_block`` and with ``model.borrowed`` + ``forward_chunk``. Prints
the largest differences of the flows as JSON. The prompt is padded to text_len first (core does not pad).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from comfy.cli_args import args

args.cpu = True
import comfy.model_management  # noqa: E402
import comfy.sd  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from wan_accel.model.checkpoint import core_causal_metadata  # noqa: E402
from wan_accel.model.config import WanConfig  # noqa: E402
from wan_accel.model.kv_cache import CrossAttnCache, KVCache  # noqa: E402
from wan_accel.nodes.comfy.native_engine import engine_for  # noqa: E402


def main(fixture: Path) -> None:
    cfg = json.loads((fixture / "causal_config.json").read_text())
    config = WanConfig.from_dict(cfg["config"])
    sd = load_file(str(fixture / "causal_weights.safetensors"))
    patcher = comfy.sd.load_diffusion_model_state_dict(sd, metadata=core_causal_metadata(config))
    comfy.model_management.load_models_gpu([patcher])
    base = patcher.model
    dm = base.diffusion_model
    io = load_file(str(fixture / "causal_io.safetensors"))
    ctx = io["context"]
    ctx = torch.cat([ctx, ctx.new_zeros(1, config.text_len - ctx.shape[1], ctx.shape[2])], 1)
    x = io["initial_noise"]                                           # [B, F, C, H, W]
    b, f, _, h, w = x.shape
    frame_tokens = (h // 2) * (w // 2)
    kv = dm.init_kv_caches(b, f * frame_tokens, "cpu", torch.float32)
    cross = dm.init_crossattn_caches(b, "cpu", torch.float32)
    engine = engine_for(base, torch.device("cpu"))
    ekv, ecross = KVCache.for_model(engine, b, frame_tokens, f), CrossAttnCache(config.num_layers)
    diffs = []
    with torch.no_grad():
        for f0, t in ((0, 1000.0), (3, 937.5)):
            chunk = x[:, f0:f0 + 3]
            core = dm.forward_block(chunk.movedim(1, 2), torch.full((b, 3), t), ctx, f0, kv, cross).movedim(1, 2)
            ours = engine.forward_chunk(chunk, torch.full((b, 3), t), ctx, ekv, ecross, f0 * frame_tokens)
            diffs.append(float((core - ours).abs().max()))
    print(json.dumps({"model": type(base).__name__, "diffusion_model": type(dm).__name__,
                      "max_abs_diff_per_chunk": diffs}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
