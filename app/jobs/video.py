"""``generate --decode wan|tiny|none [--vae FILE]``: the video of a run, each chunk decoded and written as the
sampler makes it.

The pack's streaming decoder (``vae/``, through ``vae.frames.DecoderFrames``: the one streaming decoder interface)
decodes each chunk's final latents (the sampler's ``on_chunk_latents``) and the frames go at once to ``video.mp4``
(PyAV installed) or an animated ``video.webp`` beside the latents (``cache/video_file.py``). The default (no
``--decode``) is the decoder of the ``--vae`` file when one is given, else none. Without ``--vae`` the built-in tiny
model decodes with the decoder's seeded random weights at a reduced width (as ``bench sampler --decode`` does at the
tiny shape: no download; its frames show the pipeline, not a picture); a checkpoint's video needs the decoder's
weights (``--vae``).
"""
from __future__ import annotations

import time
from pathlib import Path

from ...cache.video_file import FPS, VideoFile, video_format_for

DECODES = ("wan", "tiny", "none")
VAE_FILES = {"wan": "a Wan 2.1 VAE file (wan_2.1_vae.safetensors)", "tiny": "a taew2_1 file (taew2_1.safetensors)"}


def check_decode(decode: str | None, vae: str | None, checkpoint, names: dict | None = None) -> str:
    """The decoder a generate run uses ('wan', 'tiny' or 'none'): ``decode`` (None: the ``--vae`` file's decoder,
    else 'none'), checked with ``vae`` before any work (UsageError naming the option): an empty or missing file, a
    file of neither decoder or of the other one, ``--vae`` without a decoder, a checkpoint without ``--vae``."""
    from ..validate import UsageError, check_input_file
    names = {"decode": "--decode", "vae": "--vae", **(names or {})}
    d, v = names["decode"], names["vae"]
    if decode is not None and decode not in DECODES:
        raise UsageError(f"{d} {decode!r}: choose {', '.join(DECODES)}")
    if vae is not None:
        path = check_input_file(v, vae)
        if decode == "none":
            raise UsageError(f"{v} gives weights for a decoder and {d} none decodes nothing: add {d} wan "
                             f"({VAE_FILES['wan']}) or {d} tiny ({VAE_FILES['tiny']}), or leave {v} out")
        from ...vae.build import decoder_kind
        from ...vae.weights import read_header
        kind = decoder_kind(read_header(path))
        if kind is None:
            raise UsageError(f"{v} {path}: neither decoder's weights (no Wan 2.1 VAE decoder nor taew2_1 keys); "
                             f"give {VAE_FILES['wan']} or {VAE_FILES['tiny']}")
        if decode is not None and kind != decode:
            raise UsageError(f"{v} {path} holds the '{kind}' decoder's weights, not '{decode}': use {d} {kind}, or "
                             f"give {VAE_FILES[decode]}")
        return kind
    if decode in ("wan", "tiny") and checkpoint:
        raise UsageError(f"{d} {decode} on a checkpoint needs the decoder's weights: add {v} FILE "
                         f"({VAE_FILES[decode]}); random weights would decode noise")
    return decode or "none"


class GenerateVideo:
    """The sampler's ``on_chunk_latents`` of a generate run: each chunk's final latents (model space
    [B, n, 16, h, w]) decoded at once by the pack's streaming decoder and the first video's frames written."""

    def __init__(self, frames, file: VideoFile, weights: str):
        self.stream, self.file, self.weights = frames, file, weights
        self.decode_s = 0.0

    def __call__(self, ci, num_chunks, x0) -> None:
        from ...vae.latents import to_vae_latents
        t = time.perf_counter()
        images = self.stream.push(to_vae_latents(x0))
        if images is not None:
            self.file.write(images[0])
        self.decode_s += time.perf_counter() - t

    def close(self) -> str:
        tail = self.stream.finish()
        if tail is not None:
            self.file.write(tail[0])
        return str(self.file.close())

    def report(self) -> dict:
        return {"decoder": self.stream.kind, "weights": self.weights, "file": str(self.file.path),
                "format": self.file.fmt, "frames": self.file.frames, "fps": FPS, "decode_seconds": self.decode_s}


def open_generate_video(decode: str | None, vae: str | None, checkpoint, out_dir, device, dtype: str, seed: int = 0,
                        option: str = "out_dir", log=print):
    """The ``GenerateVideo`` of a run (None for no decode): decoder checked and built (``--vae`` weights, or seeded
    random ones of a reduced width for the built-in tiny model) on ``device`` in ``dtype``, the video file opened
    in ``out_dir`` (``video.mp4`` with PyAV, else ``video.webp``)."""
    kind = check_decode(decode, vae, checkpoint, names={"decode": "decode", "vae": "vae"})
    if kind == "none":
        return None
    from ...vae.build import build_decoder
    from ...vae.frames import DecoderFrames
    from .handle import parse_dtype
    path = Path(str(out_dir)).expanduser() / f"video.{video_format_for('mp4')}"
    decoder = build_decoder(kind, vae, reduced=vae is None, seed=seed).prepare(device, parse_dtype(dtype))
    weights = str(vae) if vae is not None else f"random (seed {seed}, reduced width: the frames are not a picture)"
    if vae is None:
        log(f"decode {kind}: the decoder's seeded random weights (no --vae file): the video shows the pipeline, "
            f"not a picture")
    return GenerateVideo(DecoderFrames(decoder), VideoFile(path, FPS, option=option,
                                                           purpose="the decoded video"), weights)
