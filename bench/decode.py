"""The decode columns of ``bench sampler --decode wan|tiny``: each chunk decoded as soon as the sampler makes it.

The decoder (``vae/``: the Wan 2.1 VAE or the TAEHV-class tiny decoder) streams: the sampler's ``on_chunk_latents``
hook hands it the chunk's final latents (its last denoising step's x0, before the chunk's cache-refresh pass) and it
returns that chunk's pixel frames, its state carried to the next chunk. The decode is timed between device
syncs, so a run's wall time splits into sampling and decode:

  decode_s               decode seconds per video (median of the timed runs)
  decode_ms              decode milliseconds per chunk (median per chunk)
  end_to_end_s           sampling + decode seconds per video (median wall time of the timed runs)
  video_fps_with_decode  decoded pixel frames / end_to_end_s: video FPS including decode
  first_frame_s          from the run's start to the first chunk's frames decoded (median)
  decode_share           decode_s / end_to_end_s
  decoder_peak_mb        CUDA: the most memory one chunk's decode allocates above what was in use when it started
                         (its working memory; measured in one more, untimed pass over the same latents); n/a on a
                         CPU
  decoder_weights_mb     the decoder's weights in the run dtype

The sampler's own columns (steady_s, chunk_ms, video_fps, MFU) stay DiT-only: each run's decode time is taken out.
"""
from __future__ import annotations

import statistics
import time

import torch

from ..profiling.runner import sync_device
from ..cache.finite_flags import bad_flag, read_flags


def build_bench_decoder(args, device: torch.device, dtype: torch.dtype, shape: str):
    """The decoder of ``--decode`` on ``device`` in ``dtype`` (None for 'none'): ``--vae`` weights, else seeded
    random weights of the released architecture, or a narrow one at the tiny random-model shape. The default
    (contiguous) memory layout: channels-last made both decoders slower on an H200 in bf16 (docs/benchmarks.md)."""
    if args.decode == "none":
        return None
    from ..vae.build import build_decoder
    reduced = args.vae is None and shape == "tiny" and not args.checkpoint
    decoder = build_decoder(args.decode, args.vae, reduced=reduced, seed=args.seed)
    return decoder.prepare(device, dtype)


class ChunkDecoder:
    """The sampler's ``on_chunk_latents``: decodes each chunk as soon as its latents exist (once per chunk, before
    its refresh pass), timing the decode between device syncs."""

    def __init__(self, decoder, device: torch.device, t0: float):
        self.stream, self.device, self.t0 = decoder.stream(), device, t0
        self.decode_s: list = []
        self.chunk_frames: list = []        # latent frames per chunk
        self.frames = 0                     # pixel frames decoded
        self.first_frame_s = None
        self.finite: list = []              # per chunk: whether its pixels hold NaN/inf (device bools, one sync at end)

    def __call__(self, ci, num_chunks, x0) -> None:
        sync_device(self.device)
        start = time.perf_counter()
        pixels = self.stream.push(x0)
        made = pixels.shape[2]
        sync_device(self.device)
        now = time.perf_counter()
        self.finite.append(bad_flag(pixels))               # after the clock: what was timed is checked too
        self.decode_s.append(now - start)
        self.chunk_frames.append(int(x0.shape[1]))
        self.frames += made
        if self.first_frame_s is None and made:
            self.first_frame_s = now - self.t0

    def check(self, kind: str) -> None:
        """NonFiniteError when a decoded chunk held NaN or inf pixels: a timed decode of non-finite frames is no
        figure (one host sync, after the run)."""
        from ..model.finite import NonFiniteError
        bad = read_flags(self.finite)
        if any(bad):
            first = bad.index(True)
            raise NonFiniteError(f"--decode {kind}: the decoder gave NaN or inf pixels (chunk {first}); its weights "
                                 f"are damaged or overflow in the run dtype: give another --vae, or run --dtype fp32")


def decoder_peak_mb(decoder, latents: torch.Tensor, chunk_frames: list, device: torch.device):
    """CUDA: the most memory one chunk's decode allocates above what was allocated when it began (a fresh stream
    over ``latents`` [B, F, 16, h, w] in the run's chunks); None elsewhere. Resets the device's peak counter."""
    if device.type != "cuda":
        return None
    stream, f, peak = decoder.stream(), 0, 0
    for n in chunk_frames:
        chunk = latents[:, f:f + n].to(device)
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        stream.push(chunk)                  # its frames dropped at once, as a player that shows them would
        torch.cuda.synchronize(device)
        peak = max(peak, torch.cuda.max_memory_allocated(device) - base)
        f += n
    return round(peak / 2 ** 20, 1)


def decode_columns(runs: list, totals: list, decoder) -> dict:
    """The decode columns from the timed runs (``runs``: their ChunkDecoders; ``totals``: their wall times)."""
    end_to_end = statistics.median(totals)
    decode = statistics.median(sum(r.decode_s) for r in runs)
    per_chunk = [statistics.median(r.decode_s[i] for r in runs) for i in range(len(runs[0].decode_s))]
    frames = runs[0].frames
    weights = sum(p.numel() * p.element_size() for p in decoder.parameters())
    return {"decode_s": round(decode, 4), "decode_ms": [round(1e3 * d, 2) for d in per_chunk],
            "end_to_end_s": round(end_to_end, 4), "decoded_frames": frames,
            "video_fps_with_decode": round(frames / end_to_end, 2) if end_to_end else None,
            "first_frame_s": round(statistics.median(r.first_frame_s for r in runs), 4),
            "decode_share": round(decode / end_to_end, 3) if end_to_end else None,
            "decoder_weights_mb": round(weights / 2 ** 20, 1)}
