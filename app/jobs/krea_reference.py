"""Krea Realtime fixture format for ``check-reference`` (tests/fixtures/krea_realtime/README.md).

The official session is reproduced with the pack's causal sampler and its ``KreaRecompute`` cache policy (the KV
cache rebuilt from a short clean context before every block, the block sampled at a capped position), the prompt
changes as a prompt schedule of Krea's interpolations (``krea_schedule_line``: exact also when a change interrupts
a running one), Krea's step list (``krea_schedule``) and the
fixture's stand-in VAE round trip ``a * float16(x) + b``. It runs on both sampler paths (``reference`` and
``optimized``).

Compared: the step list, the prompt embedding in effect per block, the call sequence (current start and timestep
of every denoising call; the context recompute passes are the policy's and are not traced), the frames handed to
the re-encoder, every denoising call's x0 and the output. Every number comes from the config JSON, and every tensor
the config implies (each block's prompt embedding, each block and step's x0, each re-encoded frame, the output, the
step list) is expected: one missing from the io file is a failing row. The three cases of the folder
(``krea_config.json``, ``krea_partial_block_config.json``, ``krea_interrupted_config.json``) all run.
"""
from __future__ import annotations

from pathlib import Path

import torch

FIXTURE_NAME = "krea_realtime_recompute"
FIXTURE_NAMES = (FIXTURE_NAME, "krea_realtime_partial_block", "krea_realtime_interrupted")
PATHS = ("reference", "optimized")


def detect(cfg: dict) -> bool:
    return cfg.get("fixture") in FIXTURE_NAMES


def _model(directory: Path, cfg: dict, device):
    from ...model.config import WanConfig
    from ...model.loader import load_wan_checkpoint
    return load_wan_checkpoint(directory / cfg["weights_file"], device=device, dtype=torch.float32,
                               precision="float32", config=WanConfig.from_dict(cfg["config"]), attention="sdpa")


def _prompt_count(cfg: dict) -> int:
    """Prompts the session uses: prompt0 and every prompt a change names."""
    return 1 + max([int(ch["prompt"]) for ch in cfg["prompt_changes"]], default=0)


def _prompts(cfg: dict, io) -> dict:
    return {f"p{i}": io[f"prompt{i}"] for i in range(_prompt_count(cfg))}      # a missing one names the io file


def schedule_text(cfg: dict) -> str:
    """Krea's prompt changes (requested before block b, interpolated over N blocks) as a prompt schedule over
    prompts p0, p1, ...: ``krea_schedule_line``, exact also for a change that interrupts a running one."""
    from ...sampling.krea import krea_schedule_line
    return "\n".join(["0: p0"] + [krea_schedule_line(int(ch["block"]), f"p{int(ch['prompt'])}", int(ch["interp_steps"]))
                                   for ch in cfg["prompt_changes"]])


def reencoded_blocks(cfg: dict) -> int:
    """How many blocks re-encode a stand-in first frame (each hands one frame to the encoder)."""
    from ...sampling.krea import context_frames
    s = cfg["session"]
    k, fpb = int(s["kv_cache_num_frames"]), int(s["num_frame_per_block"])
    return sum(any(i < 0 for i in context_frames(b * fpb, k, fpb, bool(s.get("keep_first_frame", False))))
               for b in range(int(s["num_blocks"])))


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
    from .reference import Row
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
                        prompt_embeddings=_prompts(cfg, io),
                        recache="none", cache_policy=policy, tracer=records.append,
                        fast_options={"cuda_graphs": "off"} if path == "optimized" else None)
    denoise = [rec for rec in records if rec["kind"] == "denoise"]
    rows = [(f"{path}.calls", _calls_row(denoise, cfg["calls"]))]
    expected = reencoded_blocks(cfg)
    recorded = [key for key in io if key.startswith("reencode_input.")]
    counted = len(handed) == expected == len(recorded)
    rows.append(Row(f"{path}.reencode_count", 0.0 if counted else float("inf"), None if counted else
                    f"the run re-encoded {len(handed)} frames and the config implies {expected}; {io.path.name} "
                    f"records {len(recorded)}"))
    for i in range(max(expected, len(recorded))):
        key = f"reencode_input.{i}"
        rows.append(io.compare(key, handed[i] if i < len(handed) else None, outside_float16_cell, f"{path}.{key}"))
    ours = {(rec["chunk"], rec["step"]): rec["x0"] for rec in denoise}
    for b in range(int(s["num_blocks"])):
        for step in range(int(s["num_denoising_steps"])):
            key = f"block{b}.step{step}.x0"
            rows.append(io.compare(key, ours.get((b, step)), name=f"{path}.{key}"))
    rows.append(io.compare("output", out, name=f"{path}.output"))
    return rows


def run(directory, cfg: dict, device="cpu") -> list:
    from ...sampling.prompts import PromptSchedule
    from .reference import _load_io
    directory = Path(directory)
    io = _load_io(directory, cfg)
    rows = [io.compare("denoising_step_list", torch.tensor(_schedule(cfg).timesteps, dtype=torch.float32))]
    blocks = int(cfg["session"]["num_blocks"])
    contexts = PromptSchedule.parse(schedule_text(cfg)).contexts(_prompts(cfg, io), blocks)
    for b, ctx in enumerate(contexts):
        rows.append(io.compare(f"block{b}.prompt_embeds", ctx))
    model = _model(directory, cfg, device)
    for path in PATHS:
        rows += _run_path(model, cfg, io, path)
    return rows
