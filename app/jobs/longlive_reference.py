"""LongLive v1.0 fixture format for ``check-reference`` (tests/fixtures/longlive/README.md).

Each variant (window, sink, prompt switches, with or without the generator LoRA) is sampled with the pack's causal
sampler as the official interactive pipeline ran it: a prompt schedule with one line per switch (a switch applies
from the first chunk whose first frame is at or after ``switch_frame_indices``), the KV re-cache at every switch
(``recache='switch'``), the official run's re-noise draws in order. Every variant runs on both sampler paths
(``reference`` and ``optimized``); the LoRA variant also runs on the merged weights file.

Compared: each variant's warped step list, its call sequence (start frame and timestep of every chunk and cache
refresh call, the re-cache passes left out), the x0 of every step of every chunk (``x0_steps``) and the final
latents. Every tensor the config implies is expected (each variant's latents; each variant without the LoRA, its
``x0_steps``): one missing from the io file is a failing row. Every number (model, schedule, window, sink, switch
frames, prompts) comes from the config JSON; the file names the producer writes are used when the config does
not name them.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

IO_FILE = "longlive_io.safetensors"          # the names produce.py writes
LORA_FILE = "lora_peft.safetensors"
MERGED_FILE = "merged_weights.safetensors"
PATHS = ("reference", "optimized")


def detect(cfg: dict) -> bool:
    variants = cfg.get("variants")
    return (isinstance(variants, dict) and bool(variants) and "base_weights" in cfg and "global_sink" in cfg
            and all(isinstance(v, dict) and "switch_frame_indices" in v and "calls" in v for v in variants.values()))


def _model(weights: Path, cfg: dict, device, lora: Path | None = None):
    from ...model.config import WanConfig
    from ...model.loader import load_wan_checkpoint
    config = WanConfig.from_dict(dict(cfg["model"], local_attn_size=-1, sink_size=0))   # window/sink: per run
    return load_wan_checkpoint(weights, device=device, dtype=torch.float32, precision="float32", config=config,
                               attention="sdpa", lora=lora)


def schedule_text(cfg: dict, variant: str) -> str:
    """The official switch_frame_indices as a prompt schedule (first chunk at or after each index)."""
    fpb = int(cfg["frames_per_block"])
    chunks = [0] + [-(-int(f) // fpb) for f in cfg["variants"][variant]["switch_frame_indices"]]
    return "\n".join(f"{c}: {p}" for c, p in zip(chunks, cfg["prompts"]))


def _calls_row(records: list, official: list, fpb: int, frame_tokens: int) -> float:
    """inf when the chunk/refresh calls differ in number, kind or start frame; else the largest timestep gap.
    The re-cache passes (t = 0 over more than one chunk) are not traced by the sampler and are left out."""
    ref = [c for c in official if not (float(c["t"]) == 0 and int(c["frames"]) > fpb)]
    if len(ref) != len(records):
        return float("inf")
    worst = 0.0
    for ours, theirs in zip(records, ref):
        if ours["current_start"] != int(theirs["start_frame"]) * frame_tokens or int(theirs["frames"]) != fpb:
            return float("inf")
        worst = max(worst, abs(float(ours["t"]) - float(theirs["t"])))
    return worst


def _sample(model, cfg: dict, io: dict, variant: str, path: str, records: list):
    from ...sampling.prompts import PromptSchedule
    from ...sampling.sampler import sample_causal
    from .reference import _schedule_from_steps
    s, v = cfg["schedule"], cfg["variants"][variant]
    per_chunk = len(s["steps"]) - 1
    embeddings = {p: io[f"prompt{i}"] for i, p in enumerate(cfg["prompts"])}

    def provide(ci, k, shape, dtype, dev):
        return io[f"renoise.{ci * per_chunk + k:03d}"].reshape(shape).to(dev, dtype)

    return sample_causal(model, embeddings[cfg["prompts"][0]], io["initial_noise"],
                         _schedule_from_steps(s["steps"], s["shift"], s.get("warp", True)),
                         int(cfg["frames_per_block"]), noise_provider=provide, kv_window=int(v["local_attn_size"]),
                         sink=int(v["sink_size"]), path=path, refresh_t=float(cfg.get("context_noise", 0)),
                         prompt_schedule=PromptSchedule.parse(schedule_text(cfg, variant)),
                         prompt_embeddings=embeddings, recache="switch", tracer=records.append)


def _run_rows(model, cfg: dict, io: dict, variant: str, path: str, tag: str) -> list:
    from .reference import Row, max_abs_diff
    fpb = int(cfg["frames_per_block"])
    noise = io["initial_noise"]
    p = model.config.patch_size
    frame_tokens = (noise.shape[-2] // p[1]) * (noise.shape[-1] // p[2])
    records = []
    out = _sample(model, cfg, io, variant, path, records)
    rows = [(f"{tag}.calls", _calls_row(records, cfg["variants"][variant]["calls"], fpb, frame_tokens))]
    key = f"{variant}.x0_steps"
    if x0_steps_expected(cfg, variant) or key in io:
        if key not in io:
            rows.append(io.compare(key, None, name=f"{tag}.x0_steps"))
        else:
            ref = io.reference(key)
            seen = torch.full(ref.shape, float("nan"), dtype=torch.float64)
            for rec in records:
                if rec["kind"] == "denoise" and rec["step"] < ref.shape[0]:
                    c = rec["chunk"]
                    seen[rec["step"], :, c * fpb:(c + 1) * fpb] = rec["x0"].detach().to("cpu", torch.float64)
            diff = max_abs_diff(seen, ref)
            made = bool(torch.isfinite(seen).all())
            rows.append(Row(f"{tag}.x0_steps", diff if made else float("inf"),
                            None if made else "the run made no x0 for some recorded steps"))
    rows.append(io.compare(f"{variant}.latents", out, name=f"{tag}.latents"))
    return rows


def x0_steps_expected(cfg: dict, variant: str) -> bool:
    """Whether the io file must record ``<variant>.x0_steps``: the producer records every step's x0 of each
    variant run without the LoRA adapter (the adapter run's steps are not traced; its latents are)."""
    return not cfg["variants"][variant].get("lora")


def run(directory, cfg: dict, device="cpu") -> list:
    from .reference import _schedule_from_steps, load_recorded, max_abs_diff
    directory = Path(directory)
    io = load_recorded(directory / cfg.get("io_file", IO_FILE))
    base = (directory / cfg["base_weights"]).resolve()
    rows = []
    if "base_weights_sha256" in cfg:
        same = hashlib.sha256(base.read_bytes()).hexdigest() == cfg["base_weights_sha256"]
        rows.append(("base_weights_sha256", 0.0 if same else float("inf")))
    s = cfg["schedule"]
    steps = torch.tensor(_schedule_from_steps(s["steps"], s["shift"], s.get("warp", True)).timesteps,
                         dtype=torch.float32)
    for variant, v in cfg["variants"].items():
        if "denoising_step_list" in v:
            rows.append((f"{variant}.denoising_step_list", max_abs_diff(steps, torch.tensor(v["denoising_step_list"]))))
    plain = _model(base, cfg, device)
    lora_model = None
    for variant, v in cfg["variants"].items():
        if v.get("lora"):
            lora_model = lora_model or _model(base, cfg, device, lora=directory / cfg.get("lora_file", LORA_FILE))
        model = lora_model if v.get("lora") else plain
        for path in PATHS:
            rows += _run_rows(model, cfg, io, variant, path, f"{path}.{variant}")
    merged = directory / cfg.get("merged_file", MERGED_FILE)
    if merged.is_file():
        lora_variants = [name for name, v in cfg["variants"].items() if v.get("lora")]
        if lora_variants:
            model = _model(merged, cfg, device)
            for path in PATHS:
                rows += _run_rows(model, cfg, io, lora_variants[0], path, f"{path}.{lora_variants[0]}.merged")
    return rows
