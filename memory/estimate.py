"""Estimates of what a generation needs besides the weights: activations, KV caches, VAE decode.

All functions return bytes and take plain numbers, so they are easy to test and to reason about. They are
estimates: a limit learned on the machine (the ``memory`` namespace of the limit cache) always wins.
"""
from __future__ import annotations

from dataclasses import dataclass

from .system import PlainFields, gib as _gib

VAE_TIME_RATIO = 4          # Wan 2.1 VAE: t latent frames -> 1 + 4 (t - 1) video frames
VAE_SPACE_RATIO = 8
VAE_WEIGHT_BYTES = 127_000_000 * 2      # Wan 2.1 VAE, about 127 M parameters held in 16-bit
# Working memory of the Wan 2.1 causal VAE decoder per output pixel and element byte, independent of the chunk
# length (it decodes a few latent frames at a time with a feature cache): full-resolution 96-channel features,
# the cached frames and the upsampling intermediates. A measured limit replaces this guess.
VAE_WORK_PER_PIXEL = 3000
PCIE_BYTES_PER_S = {"pinned": 20e9, "pageable": 6e9}   # host->device copy rates assumed for time estimates


def video_frames_for(latent_frames: int, time_ratio: int = VAE_TIME_RATIO) -> int:
    return 0 if latent_frames <= 0 else 1 + time_ratio * (latent_frames - 1)


@dataclass
class Workload(PlainFields):
    """What is generated: video size and how the DiT is run."""
    width: int
    height: int
    frames: int                      # video frames (4k+1 for Wan)
    batch: int = 1
    mode: str = "causal"             # 'causal': chunks with a KV cache; 'full': one bidirectional sequence
    frames_per_block: int = 3        # latent frames per causal chunk

    def __post_init__(self):
        if self.width <= 0 or self.height <= 0 or self.frames <= 0 or self.batch <= 0:
            raise ValueError(f"width, height, frames and batch must be positive (got {self.width}x{self.height}, "
                             f"{self.frames} frames, batch {self.batch})")
        if self.mode not in ("causal", "full"):
            raise ValueError(f"mode must be 'causal' or 'full', got {self.mode!r}")
        if self.frames_per_block <= 0:
            raise ValueError("frames_per_block must be positive")

    @property
    def latent_frames(self) -> int:
        return (self.frames - 1) // VAE_TIME_RATIO + 1

    @property
    def latent_h(self) -> int:
        return self.height // VAE_SPACE_RATIO

    @property
    def latent_w(self) -> int:
        return self.width // VAE_SPACE_RATIO

    def tokens_per_frame(self, patch_size=(1, 2, 2)) -> int:
        return (self.latent_h // patch_size[1]) * (self.latent_w // patch_size[2])

    def cache_frames(self) -> int:
        """Latent frames a global KV cache holds: all of them, rounded up to whole chunks."""
        fpb = self.frames_per_block
        return -(-self.latent_frames // fpb) * fpb

    def notes(self) -> list[str]:
        out = []
        if (self.frames - 1) % VAE_TIME_RATIO:
            out.append(f"{self.frames} frames is not 4k+1; Wan produces {video_frames_for(self.latent_frames)} frames "
                       f"from {self.latent_frames} latent frames")
        if self.width % 16 or self.height % 16:
            out.append(f"{self.width}x{self.height} is not a multiple of 16; the latent is cropped to "
                       f"{self.latent_w // 2 * 16}x{self.latent_h // 2 * 16}")
        return out


def query_tokens(w: Workload, patch_size=(1, 2, 2)) -> int:
    """Tokens in one DiT forward (per batch item)."""
    frames = min(w.frames_per_block, w.latent_frames) if w.mode == "causal" else w.latent_frames
    return frames * w.tokens_per_frame(patch_size)


def attended_tokens(w: Workload, window_frames: int, patch_size=(1, 2, 2)) -> int:
    """Keys one query attends to: the cached window (causal) or the whole sequence (full)."""
    if w.mode == "full":
        return w.latent_frames * w.tokens_per_frame(patch_size)
    return window_frames * w.tokens_per_frame(patch_size)


def kv_cache_bytes(layers: int, tokens: int, dim: int, elem_bytes: int, batch: int = 1) -> int:
    """A KV cache: layers x (k, v) x tokens x dim. The self-attention cache (its frames' tokens), and the
    cross-attention K/V computed once per prompt (its text tokens)."""
    return layers * 2 * tokens * dim * elem_bytes * batch


def activation_bytes(q_tokens: int, dim: int, ffn_dim: int, heads: int, elem_bytes: int, batch: int = 1) -> int:
    """Peak activations of one block forward.

    Attention phase: residual, normed input, q, k, v, rotated q/k, output and projection (~10 x dim per token)
    plus q/k RMSNorm in float32. FFN phase: residual, modulated input, hidden and GELU output (2 x ffn_dim),
    output. Attention scratch: flash/efficient attention keeps per-row statistics only (the attended keys add
    nothing).
    """
    per_token = max(10 * dim, 4 * dim + 2 * ffn_dim) * elem_bytes + 2 * dim * 4
    total = q_tokens * per_token
    total += heads * q_tokens * 4 * 2
    return total * batch


def vae_decode_bytes(latent_chunk: int, latent_h: int, latent_w: int, elem_bytes: int = 2, batch: int = 1,
                     weights: int = VAE_WEIGHT_BYTES, space_ratio: int = VAE_SPACE_RATIO) -> int:
    """Peak VRAM of decoding ``latent_chunk`` latent frames: weights, decoder working set, output frames
    (in the VAE dtype plus the float32 copy handed back)."""
    h, w = latent_h * space_ratio, latent_w * space_ratio
    frames = video_frames_for(latent_chunk)
    work = VAE_WORK_PER_PIXEL * elem_bytes * h * w
    out = frames * h * w * 3 * (elem_bytes + 4)
    return weights + batch * (work + out)


def decoded_video_bytes(latent_frames: int, latent_h: int, latent_w: int, batch: int = 1,
                        time_ratio: int = VAE_TIME_RATIO, space_ratio: int = VAE_SPACE_RATIO,
                        elem_bytes: int = 4) -> int:
    """Bytes of a whole decoded video (the IMAGE a decode hands back: float32 RGB frames, host memory)."""
    frames = video_frames_for(latent_frames, time_ratio)
    return batch * frames * latent_h * space_ratio * latent_w * space_ratio * 3 * elem_bytes


def transfer_ms(n_bytes: int, pinned: bool) -> float:
    return n_bytes / PCIE_BYTES_PER_S["pinned" if pinned else "pageable"] * 1e3


def peak_matmul_flops(capability) -> float:
    """Rough dense 16-bit throughput actually reached by a DiT block, for words in a plan (not a benchmark)."""
    if capability is None:
        return 0.5e12
    rates = (((9, 0), 400e12), ((8, 9), 120e12), ((8, 0), 150e12))   # the first at or below the capability
    return next((flops for cap, flops in rates if tuple(capability) >= cap), 40e12)


def block_compute_ms(block_params: int, q_tokens: int, k_tokens: int, dim: int, capability, batch: int = 1) -> float:
    flops = 2 * block_params * q_tokens + 4 * q_tokens * k_tokens * dim
    return batch * flops / peak_matmul_flops(capability) * 1e3


# ---------------------------------------------------------------------- does a sampling run fit?
def sampling_need(model: dict, frames: int, height: int, width: int, *, frames_per_block: int = 3,
                  kv_window: int = -1, batch: int = 1, elem_bytes: int = 4, weight_bytes: int = 0,
                  world: int = 1) -> dict:
    """Bytes a causal sampling run allocates on its device, by part, before the first tensor is made.

    ``model``: a config dict (``dim``, ``ffn_dim``, ``num_heads``, ``num_layers``, ``patch_size``, ``out_dim``,
    ``text_len``); ``frames``/``height``/``width``: video frames and pixels; ``weight_bytes``: weights still to be
    loaded on the device (0 when the model is already there). Parts: the whole video's latents (the output and the
    noisy chunk being denoised, float32), the self-attention KV cache (every latent frame, or ``kv_window``),
    the cross-attention cache and one block's activations for a chunk. ``world``: ranks of a sequence-parallel
    run; each holds its share of the heads' caches and of a chunk's tokens (the estimate is one rank's)."""
    w = Workload(width=int(width), height=int(height), frames=int(frames), batch=int(batch),
                 frames_per_block=int(frames_per_block))
    patch = tuple(model.get("patch_size") or (1, 2, 2))
    dim, layers = int(model["dim"]), int(model["num_layers"])
    tpf = w.tokens_per_frame(patch)
    full = w.cache_frames()
    window = full if kv_window is None or kv_window < 0 else min(int(kv_window), full)
    text = int(model.get("text_len") or 512) + (int(model.get("clip_tokens") or 0)
                                                if model.get("model_type") == "i2v" else 0)
    latents = 2 * batch * full * int(model.get("out_dim") or 16) * w.latent_h * w.latent_w * 4
    ranks = max(1, int(world))
    return {"weights": int(weight_bytes), "latents": latents,
            "kv_cache": -(-kv_cache_bytes(layers, window * tpf, dim, elem_bytes, batch) // ranks),
            "cross_attn_cache": -(-kv_cache_bytes(layers, text, dim, elem_bytes, batch) // ranks),
            "activations": -(-activation_bytes(query_tokens(w, patch), dim, int(model["ffn_dim"]),
                                               int(model["num_heads"]), elem_bytes, batch) // ranks)}


def fit_problem(model: dict, frames: int, height: int, width: int, budget: int, where: str, *,
                frames_per_block: int = 3, kv_window: int = -1, batch: int = 1, elem_bytes: int = 4,
                weight_bytes: int = 0, names: dict | None = None, window_option: bool = True,
                swap_option: bool = False, world: int = 1) -> str | None:
    """None when ``sampling_need`` fits in ``budget`` bytes, else the refusal: the estimate by part, ``where``
    (the device's memory in words) and what would fit (fewer frames, a smaller size, a KV window, block swap).
    ``names`` maps 'frames', 'height', 'width', 'kv_window' to the input names shown."""
    n = {"frames": "frames", "height": "height", "width": "width", "kv_window": "kv_window", **(names or {})}
    fpb = int(frames_per_block)
    kw = dict(frames_per_block=fpb, batch=batch, elem_bytes=elem_bytes, world=world)

    def total(f=frames, h=height, w_=width, win=kv_window, wb=weight_bytes) -> int:
        return sum(sampling_need(model, f, h, w_, kv_window=win, weight_bytes=wb, **kw).values())

    need = sampling_need(model, frames, height, width, kv_window=kv_window, weight_bytes=weight_bytes, **kw)
    peak = sum(need.values())
    if peak <= budget:
        return None
    ways = []
    blocks = (int(frames) - 1) // VAE_TIME_RATIO // fpb + 1        # latent blocks of the request

    def video(m: int) -> int:
        return VAE_TIME_RATIO * (m * fpb - 1) + 1

    lo, hi = 0, blocks - 1                                           # largest block count that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if total(f=video(mid)) <= budget:
            lo = mid
        else:
            hi = mid - 1
    if lo >= 1:
        ways.append(f"{n['frames']} {video(lo)} or fewer")
    for k in (2, 4, 8, 16):
        h, w_ = max(16, int(height) // k // 16 * 16), max(16, int(width) // k // 16 * 16)
        if total(h=h, w_=w_) <= budget:
            ways.append(f"{n['width']} x {n['height']} {w_}x{h}")
            break
    if window_option:
        cur = need["kv_cache"]
        latent = (int(frames) - 1) // VAE_TIME_RATIO + 1
        for win in range(2 * fpb, latent, fpb)[::-1]:
            if total(win=win) <= budget:
                if sampling_need(model, frames, height, width, kv_window=win, **kw)["kv_cache"] < cur:
                    ways.append(f"a rolling {n['kv_window']} of {win} latent frames")
                break
    if swap_option and weight_bytes and total(wb=0) <= budget:
        ways.append("block swap (weights streamed from host memory)")
    parts = ", ".join(f"{k.replace('_', ' ')} {_gib(v)}" for k, v in need.items() if v)
    fix = ("; it would fit with " + ", or ".join(ways)) if ways else \
        "; even the smallest settings do not fit: lower the resolution and frame count, or free memory"
    return (f"{n['frames']} {frames} at {width}x{height} needs about {_gib(peak)} ({parts}) but {where}{fix}. "
            f"Nothing was allocated")
