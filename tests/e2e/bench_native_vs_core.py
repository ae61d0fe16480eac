"""Wall time per video: the Wan Accel AR Sampler against core's SamplerARVideo on the same native MODEL.

Run with ComfyUI's Python, cwd = ComfyUI, the pack importable as ``wan_accel``:

    python bench_native_vs_core.py --shape tiny|mid [--repeats 3] [--out result.json]

Builds a random causal Wan 2.1 state dict (tiny: dim 64, 2 layers, 6 latent frames of 8x12; mid: dim 512, 8 layers,
21 latent frames of 16x16), loads it with ComfyUI's own loader as WAN21_CausalAR, and samples it through a Basic
Guider with both samplers (Self-Forcing sigmas, 3 frames per block, global cache) alternately after one warm-up
each; reports every wall time and the medians as JSON. Then one untimed run of each under
``profiling.dispatch_counts`` (and of the pack's own optimized path on the same weights) gives ``syncs_per_video``
(host syncs in a whole video) and ``ops_per_step`` (aten ops of one steady-state denoising step: the last block's
last step) per sampler, with the path each ran.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from comfy.cli_args import args

args.cpu = True
import comfy.model_management  # noqa: E402
import comfy.samplers  # noqa: E402
import comfy.sd  # noqa: E402
from comfy_extras.nodes_custom_sampler import Guider_Basic  # noqa: E402

from wan_accel.model.checkpoint import core_causal_metadata, expected_shapes  # noqa: E402
from wan_accel.model.config import WanConfig  # noqa: E402
from wan_accel.model.dit import WanModel  # noqa: E402
from wan_accel.profiling.dispatch_counts import DispatchCounts  # noqa: E402
from wan_accel.sampling.sampler import sample_causal  # noqa: E402
from wan_accel.sampling.scheduler import schedule_from_sigmas  # noqa: E402
from wan_accel.nodes.native_engine import sample_wan_accel  # noqa: E402
from wan_accel.nodes.native_nodes import causal_sigmas  # noqa: E402

SHAPES = {
    "tiny": (WanConfig(dim=64, ffn_dim=128, freq_dim=32, text_dim=48, text_len=16, num_heads=4, num_layers=2),
             6, 8, 12, 10),
    "mid": (WanConfig(dim=512, ffn_dim=2048, num_heads=4, num_layers=8), 21, 16, 16, 512),
}


def random_state_dict(config: WanConfig, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, shape in sorted(expected_shapes(config).items()):
        w = torch.randn(shape, generator=g)
        if name.endswith("modulation"):
            w = 0.1 * w
        elif "norm" in name:
            w = 1.0 + 0.05 * w
        elif name.endswith("bias"):
            w = 0.02 * w
        elif w.dim() > 1:
            w = w / (w[0].numel() ** 0.5)
        sd[name] = w
    return sd


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _counted(fn, counts: DispatchCounts):
    """A KSAMPLER function counting only what the sampler function itself dispatches (not the guider around it:
    its noise scaling and sigma checks are the same for every sampler)."""
    def sampler_function(*args, **kwargs):
        with torch.no_grad(), counts:
            return fn(*args, **kwargs)
    return sampler_function


def structure(guider, config, sd, noise, latent, sigmas, context) -> dict:
    """syncs_per_video (host syncs of one video inside the sampler function) and ops_per_step (aten ops of one
    steady-state denoising step: the last block's last step) of the Wan Accel AR Sampler (both paths), core's
    SamplerARVideo and the pack's own optimized path on the same weights, each after one warm-up run."""
    from comfy.k_diffusion.sampling import sample_ar_video
    out = {}
    runs = {"wan_accel": (sample_wan_accel, {"frames_per_block": 3, "path": "optimized"}),
            "wan_accel_reference": (sample_wan_accel, {"frames_per_block": 3, "path": "reference"}),
            "core_ar_video": (sample_ar_video, {"num_frame_per_block": 3})}
    for name, (fn, opts) in runs.items():
        for warm in (True, False):
            counts, marks = DispatchCounts(), []
            extra = dict(opts, step_callback=counts.step_callback()) if fn is sample_wan_accel else opts
            sampler = comfy.samplers.KSAMPLER(_counted(fn, counts), extra_options=extra)
            guider.sample(noise.clone(), latent.clone(), sampler, sigmas.clone(), seed=7, disable_pbar=True,
                          callback=lambda *a, c=counts, m=marks: m.append(c.snapshot()))
        step = counts.steady_step() if counts.steps else marks[-1] - marks[-2]
        out[name] = {"syncs_per_video": counts.syncs, "sync_names": dict(counts.sync_names), "ops_per_step": step.ops}
    own = WanModel(config).eval().requires_grad_(False)
    own.load_state_dict(sd)
    sched = schedule_from_sigmas(sigmas)
    for _ in range(2):
        counts = DispatchCounts()
        with torch.no_grad(), counts:
            sample_causal(own, context, noise.movedim(1, 2), sched, 3, generator=torch.Generator().manual_seed(7),
                          path="optimized", callback=counts.step_callback())
    out["pack_optimized"] = {"syncs_per_video": counts.syncs, "sync_names": dict(counts.sync_names),
                             "ops_per_step": counts.steady_step().ops}
    ref = out["pack_optimized"]["ops_per_step"]
    for row in out.values():
        row["ops_per_step_vs_pack_optimized"] = round(row["ops_per_step"] / ref, 4)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    a = p.parse_args()
    config, frames, h, w, tokens = SHAPES[a.shape]
    metadata = core_causal_metadata(config)
    sd = random_state_dict(config)
    patcher = comfy.sd.load_diffusion_model_state_dict(dict(sd), metadata=metadata)
    g = torch.Generator().manual_seed(1)
    context = torch.randn(1, tokens, config.text_dim, generator=g)
    guider = Guider_Basic(patcher)
    guider.set_conds([[context, {}]])
    latent = torch.zeros(1, 16, frames, h, w)
    noise = torch.randn(latent.shape, generator=g)
    sigmas = causal_sigmas("self_forcing")
    samplers = {
        "wan_accel": comfy.samplers.KSAMPLER(sample_wan_accel, extra_options={"frames_per_block": 3}),
        "core_ar_video": comfy.samplers.ksampler("ar_video", {"num_frame_per_block": 3}),
    }
    times = {k: [] for k in samplers}
    outs = {}
    for rep in range(a.repeats + 1):
        for name, sampler in samplers.items():
            t0 = time.perf_counter()
            outs[name] = guider.sample(noise.clone(), latent.clone(), sampler, sigmas.clone(), seed=7,
                                       disable_pbar=True)
            dt = time.perf_counter() - t0
            if rep:                                   # the first round warms up both
                times[name].append(dt)
    result = {
        "shape": a.shape, "config": {k: getattr(config, k) for k in ("dim", "ffn_dim", "num_heads", "num_layers")},
        "latent": list(latent.shape), "steps": len(sigmas) - 1, "frames_per_block": 3, "repeats": a.repeats,
        "threads": torch.get_num_threads(), "cpu": cpu_name(),
        "torch": torch.__version__, "model": type(patcher.model).__name__,
        "weight_dtype": str(patcher.model.get_dtype()),
        "times_s": times, "median_s": {k: statistics.median(v) for k, v in times.items()},
        "min_s": {k: min(v) for k, v in times.items()},
        "max_abs_diff_between_samplers": float((outs["wan_accel"] - outs["core_ar_video"]).abs().max()),
        "structure": structure(guider, config, sd, noise, latent, sigmas, context),
    }
    text = json.dumps(result, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
