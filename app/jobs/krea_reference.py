"""Krea Realtime fixture format for ``check-reference`` (tests/fixtures/krea_realtime/README.md).

The official session is reproduced with the pack's causal sampler and its ``KreaRecompute`` cache policy (the KV
cache rebuilt from a short clean context before every block, the block sampled at a capped position), the prompt
changes as a prompt schedule with blends (``krea_schedule_entry``), Krea's step list (``krea_schedule``) and the
fixture's stand-in VAE round trip ``a * float16(x) + b``. It runs on both sampler paths (``reference`` and
``optimized``).

Compared: the step list, the prompt embedding in effect per block, the call sequence (current start and timestep
of every denoising call; the context recompute passes are the policy's and are not traced), the frames handed to
the re-encoder, every denoising call's x0 and the output. Every number comes from the config JSON.
"""
from __future__ import annotations

from pathlib import Path

import torch

FIXTURE_NAME = "krea_realtime_recompute"
PATHS = ("reference", "optimized")


def detect(cfg: dict) -> bool:
    return cfg.get("fixture") == FIXTURE_NAME


def _model(directory: Path, cfg: dict, device):
    from ...model.config import WanConfig
    from ...model.loader import load_wan_checkpoint
    return load_wan_checkpoint(directory / cfg["weights_file"], device=device, dtype=torch.float32,
                               precision="float32", config=WanConfig.from_dict(cfg["config"]), attention="sdpa")


def _prompt_count(io: dict) -> int:
    n = 0
    while f"prompt{n}" in io:
        n += 1
    return n


def schedule_text(cfg: dict) -> str:
    """Krea's prompt changes (at block b, interpolated over N blocks) as a prompt schedule over prompts p0, p1, ..."""
    from ...sampling.krea import krea_schedule_entry
    lines = ["0: p0"]
    for ch in cfg["prompt_changes"]:
        chunk, blend = krea_schedule_entry(int(ch["block"]), int(ch["interp_steps"]))
        lines.append(f"{chunk}: p{int(ch['prompt'])} (blend {blend})")
    return "\n".join(lines)


def _schedule(cfg: dict):
    from ...sampling.krea import krea_schedule
    s = cfg["session"]
    return krea_schedule(int(s["num_denoising_steps"]), float(s["strength"]), float(s["timestep_shift"]))


def _calls_row(records: list, official: list) -> float:
    """inf when the denoising calls differ in number, block, step order or current start; else the largest
    timestep gap."""
    ref = [c for c in official if not c["context"]]
    if len(ref) != len(records):
        return float("inf")
    worst = 0.0
    for ours, theirs in zip(records, ref):
        if ours["chunk"] != int(theirs["block"]) or ours["current_start"] != int(theirs["current_start"]):
            return float("inf")
        worst = max(worst, abs(float(ours["t"]) - float(theirs["timestep"])))
    return worst


def outside_float16_cell(ours: torch.Tensor, ref16: torch.Tensor) -> float:
    """How far the float32 frame ``ours`` lies outside the float16 rounding cell of the recorded (float16-valued)
    frame ``ref16``: 0 when ``ours`` rounds to it; a frame that differs from the official one by a few float32
    ulps may round to the neighbouring float16, which is no disagreement. Cell half-width: half the float16
    spacing at |ref16| (2^(floor(log2|ref16|) - 10), at least 2^-24)."""
    ours = ours.detach().to("cpu", torch.float64).reshape(ref16.shape)
    ref = ref16.detach().to("cpu", torch.float64)
    mag = ref.abs().clamp_min(2.0 ** -14)
    half_width = torch.exp2(torch.floor(torch.log2(mag)) - 10).clamp_min(2.0 ** -24) / 2
    if ref.numel() == 0:
        return 0.0
    return float(((ours - ref).abs() - half_width).clamp_min(0).max())


def _run_path(model, cfg: dict, io: dict, path: str) -> list:
    from ...sampling.krea import KreaRecompute
    from ...sampling.sampler import sample_causal
    from .reference import max_abs_diff
    s, r = cfg["session"], cfg["reencode"]
    fpb, k = int(s["num_frame_per_block"]), int(s["kv_cache_num_frames"])
    handed = []

    def reencode(x):
        handed.append(x.detach().to("cpu", torch.float32).clone())
        return float(r["a"]) * x.half().float() + float(r["b"])   # the session hands the frame over in float16

    def provide(ci, step, shape, dtype, dev):
        return io[f"extra_noise.block{ci}.step{step}"].reshape(shape).to(dev, dtype)

    records = []
    policy = KreaRecompute(k, fpb, reencode=reencode, keep_first_frame=bool(s.get("keep_first_frame", False)))
    out = sample_causal(model, None, io["initial_noise"], _schedule(cfg), fpb, noise_provider=provide,
                        kv_window=k + fpb, path=path, prompt_schedule=schedule_text(cfg),
                        prompt_embeddings={f"p{i}": io[f"prompt{i}"] for i in range(_prompt_count(io))},
                        recache="none", cache_policy=policy, tracer=records.append,
                        fast_options={"cuda_graphs": "off"} if path == "optimized" else None)
    denoise = [rec for rec in records if rec["kind"] == "denoise"]
    rows = [(f"{path}.calls", _calls_row(denoise, cfg["calls"]))]
    wanted = sorted((key for key in io if key.startswith("reencode_input.")), key=lambda key: int(key.rsplit(".", 1)[1]))
    if wanted:
        rows.append((f"{path}.reencode_count", 0.0 if len(handed) == len(wanted) else float("inf")))
        for i, key in enumerate(wanted):
            rows.append((f"{path}.{key}", outside_float16_cell(handed[i], io[key]) if i < len(handed)
                         else float("inf")))
    for rec in denoise:
        key = f"block{rec['chunk']}.step{rec['step']}.x0"
        if key in io:
            rows.append((f"{path}.{key}", max_abs_diff(rec["x0"], io[key])))
    rows.append((f"{path}.output", max_abs_diff(out, io["output"])))
    return rows


def run(directory, cfg: dict, device="cpu") -> list:
    from ...sampling.prompts import PromptSchedule
    from .reference import _load_io, max_abs_diff
    directory = Path(directory)
    io = _load_io(directory, cfg)
    rows = []
    if "denoising_step_list" in io:
        rows.append(("denoising_step_list", max_abs_diff(torch.tensor(_schedule(cfg).timesteps,
                                                                      dtype=torch.float32), io["denoising_step_list"])))
    blocks = int(cfg["session"]["num_blocks"])
    contexts = PromptSchedule.parse(schedule_text(cfg)).contexts(
        {f"p{i}": io[f"prompt{i}"] for i in range(_prompt_count(io))}, blocks)
    for b, ctx in enumerate(contexts):
        key = f"block{b}.prompt_embeds"
        if key in io:
            rows.append((key, max_abs_diff(ctx, io[key])))
    model = _model(directory, cfg, device)
    for path in PATHS:
        rows += _run_path(model, cfg, io, path)
    return rows
