"""FLOP count of causal sampling runs and the peak-throughput table used for MFU.

A multiply-add counts as 2 FLOPs. Counted: every matmul / convolution / attention product of the DiT (patch
embedding, time and text embeddings, q/k/v/o and FFN projections, both attention products of self- and
cross-attention, cross-attention K/V once per prompt, head). Not counted: norms, RoPE, modulation and other
element-wise work (a few percent at most), and the Matrix-Game-2 action modules.
"""
from __future__ import annotations

from dataclasses import dataclass

# Dense (no sparsity) fp16/bf16 tensor-core TFLOP/s of the data-centre part of each architecture. Consumer parts of
# the same compute capability have fewer SMs and often half-rate fp32 accumulation: their MFU here is a lower
# bound; pass --peak-tflops for an exact figure.
PEAK_TFLOPS = {
    (7, 0): 125.0,     # V100 (fp16)
    (7, 5): 65.0,      # T4 (fp16)
    (8, 0): 312.0,     # A100
    (8, 6): 155.0,     # A40 / RTX A6000
    (8, 9): 362.0,     # L40S
    (9, 0): 989.0,     # H100 SXM / H200
    (10, 0): 2250.0,   # B200
}


def peak_tflops(device, override: float | None = None) -> tuple[float | None, str]:
    """(peak dense bf16 TFLOP/s, source) of ``device``; (None, why) on a CPU or an unknown GPU."""
    import torch
    if override:
        return float(override), "given"
    device = torch.device(device)
    if device.type != "cuda":
        return None, "CPU: no tensor-core peak (MFU n/a)"
    cap = tuple(torch.cuda.get_device_capability(device))
    if cap in PEAK_TFLOPS:
        return PEAK_TFLOPS[cap], f"table, compute capability {cap[0]}.{cap[1]}"
    return None, f"compute capability {cap[0]}.{cap[1]} not in the table (pass --peak-tflops)"


@dataclass
class Geometry:
    batch: int
    num_frames: int            # latent frames
    frame_tokens: int          # tokens per latent frame (after patching)
    frames_per_block: int = 3
    kv_window: int = -1        # latent frames; -1 global
    sink: int = 0
    in_channels: int | None = None   # channels entering the patch embedding (default config.in_dim)


def is_action_model(cfg) -> bool:
    return bool(getattr(cfg, "extra", {}).get("action_config"))


def _dims(cfg):
    """(dim, ffn, text tokens, image tokens, patch volume) of the cross-attention context."""
    pt, ph, pw = cfg.patch_size
    if is_action_model(cfg):               # Matrix-Game-2: the image tokens are the whole context
        return cfg.dim, cfg.ffn_dim, cfg.clip_tokens, 0, pt * ph * pw
    image = cfg.clip_tokens if cfg.model_type == "i2v" else 0
    return cfg.dim, cfg.ffn_dim, cfg.text_len, image, pt * ph * pw


def forward_flops(cfg, q_tokens: int, kv_tokens: int, *, batch: int = 1, head: bool = True, lean_last: bool = False,
                  time_rows: int = 0, in_channels: int | None = None, attention: bool = True) -> int:
    """One chunk forward: q_tokens query tokens attending kv_tokens cached tokens (per batch element).

    lean_last: the last block computes only its k/v (refresh pass of the optimized path). time_rows: rows of the
    time embedding computed in this call (0 when precomputed)."""
    d, f, t, img, pv = _dims(cfg)
    cin = in_channels or cfg.in_dim
    L, att = q_tokens, int(attention)
    block = (8 * L * d * d                  # self q, k, v, o
             + att * 4 * L * kv_tokens * d  # QK^T and PV
             + 4 * L * d * d                # cross q, o
             + att * 4 * L * (t + img) * d  # cross-attention products
             + 4 * L * d * f)               # FFN
    n = cfg.num_layers
    total = (n - 1) * block + (4 * L * d * d if lean_last else block)
    total += 2 * L * d * cin * pv                              # patch embedding
    if head:
        total += 2 * L * d * pv * cfg.out_dim
    total += 2 * time_rows * (cfg.freq_dim * d + d * d + 6 * d * d)
    return batch * total


def prompt_flops(cfg, batch: int = 1) -> int:
    """Once per run: text embedding and every block's cross-attention K/V."""
    d, _f, t, img, _pv = _dims(cfg)
    c = cfg.clip_dim
    if is_action_model(cfg):
        embed = 2 * t * (c * c + c * d)                       # img_emb on the context tokens
    else:
        embed = 2 * t * (cfg.text_dim * d + d * d) + (2 * img * (c * c + c * d) if img else 0)
    return batch * (embed + cfg.num_layers * 4 * (t + img) * d * d)


def run_flops(cfg, geo: Geometry, steps: int, *, optimized: bool, skip_last_refresh: bool,
              attention: bool = True) -> dict:
    """FLOPs of a whole sampling run as executed by the reference or the optimized path (its refreshes lean)."""
    ft = geo.frame_tokens
    window = geo.kv_window if 0 < geo.kv_window < geo.num_frames else geo.num_frames
    chunks = []                 # (q_tokens, kv_tokens) per chunk of frames_per_block latent frames
    for f0 in range(0, geo.num_frames, geo.frames_per_block):
        n = min(geo.frames_per_block, geo.num_frames - f0)
        chunks.append((n * ft, min(f0 + n, window) * ft))
    total = prompt_flops(cfg, geo.batch)
    distinct_t = steps + 1
    if optimized:
        total += geo.batch * distinct_t * 2 * (cfg.freq_dim * cfg.dim + cfg.dim ** 2 + 6 * cfg.dim ** 2)
    for i, (lq, lk) in enumerate(chunks):
        rows = 0 if optimized else lq // geo.frame_tokens
        kw = dict(batch=geo.batch, time_rows=rows, in_channels=geo.in_channels, attention=attention)
        total += steps * forward_flops(cfg, lq, lk, **kw)
        if not (skip_last_refresh and i == len(chunks) - 1):
            total += forward_flops(cfg, lq, lk, head=False, lean_last=optimized, **kw)
    return {"flops": int(total), "forwards": len(chunks) * (steps + 1) - (1 if skip_last_refresh else 0)}


def mfu(flops: float, seconds: float, peak: float | None) -> float | None:
    if not peak or not seconds:
        return None
    return flops / seconds / (peak * 1e12)
