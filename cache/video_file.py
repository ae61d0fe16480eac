"""Video files written as their frames are decoded: ``VideoFile(path, fps)``, its format by the path's suffix.

* ``.mp4``: H.264 (yuv420p) through PyAV, the library ComfyUI itself writes video with (each frame encoded and
  muxed as it comes; an odd width or height loses its last pixel row / column, as yuv420p needs even sizes);
* ``.webp``: an animated WebP through Pillow, which every install has: each frame is encoded by Pillow as a still
  WebP and its bitstream appended at once as one frame (``ANMF`` chunk) of the animation; the container's size is
  set when the file is closed (Pillow's own animated writer needs every frame first).

The file fills a temporary beside its target (``owned_files.new_temporary``); ``close()`` hands that temporary to
the pack's one writer (``owned_files.write_with``: checked again, fsynced, renamed), so the target is either the
whole video or untouched. Float frames that hold NaN or inf are refused where they are written
(``NonFiniteFramesError``, the file discarded: the pack's one finite check, ``finite_flags``), never cast to bytes;
``discard()`` (or the object's collection) removes the temporary of a run that failed. Users: ``generate --decode``
(``app/jobs/video.py``) and Matrix-Game-2 Play Save (``nodes/play_nodes.py``).
"""
from __future__ import annotations

import io
import struct
import weakref
from pathlib import Path

from .owned_files import check_target, new_temporary, release, write_with

FPS = 16                             # Wan 2.1's frame rate
WEBP_QUALITY = 90


def have_av() -> bool:
    """Whether a real PyAV imports here: its module has a version string (an import stand-in, such as the one
    ``tools/comfy_stubs`` puts on the path for ComfyUI's imports, has none), whatever it does while imported."""
    from .guarded_import import try_import
    av, _ = try_import("av")
    return av is not None and isinstance(getattr(av, "__version__", None), str) and callable(getattr(av, "open", None))


def video_format_for(wanted: str = "mp4") -> str:
    """'mp4' when it is wanted and PyAV can write it, else 'webp' (Pillow's, always there)."""
    return "mp4" if wanted == "mp4" and have_av() else "webp"


def _chunk(fourcc: bytes, payload: bytes) -> bytes:
    return fourcc + struct.pack("<I", len(payload)) + payload + (b"\0" if len(payload) % 2 else b"")


def _u24(value: int) -> bytes:
    return int(value).to_bytes(3, "little")


def frame_bitstream(webp: bytes) -> bytes:
    """The image chunks (ALPH, VP8, VP8L) of a still WebP file, as one frame of an animation carries them."""
    if webp[:4] != b"RIFF" or webp[8:12] != b"WEBP":
        raise ValueError("Pillow's WebP encoder gave no WebP file")
    out, at = [], 12
    while at + 8 <= len(webp):
        fourcc, size = webp[at:at + 4], struct.unpack("<I", webp[at + 4:at + 8])[0]
        if fourcc in (b"ALPH", b"VP8 ", b"VP8L"):
            out.append(_chunk(fourcc, webp[at + 8:at + 8 + size]))
        at += 8 + size + (size % 2)
    if not out:
        raise ValueError("Pillow's WebP encoder gave a file without an image")
    return b"".join(out)


class _AnimatedWebp:
    """RIFF 'WEBP' with a VP8X header (animation), ANIM (black background, endless loop) and one ANMF chunk per
    frame (at 0, 0, the canvas size, not blended, not disposed), appended as frames come."""

    def __init__(self, path: str, fps: int):
        self.fh = open(path, "wb")
        self.duration = max(1, round(1000 / fps))
        self.size = None

    def add(self, frame) -> None:
        from PIL import Image
        img = Image.fromarray(frame, "RGB")
        w, h = img.size
        if self.size is None:
            self.size = img.size
            self.fh.write(b"RIFF\0\0\0\0WEBP" + _chunk(b"VP8X", bytes([0x02, 0, 0, 0]) + _u24(w - 1) + _u24(h - 1))
                          + _chunk(b"ANIM", struct.pack("<IH", 0xFF000000, 0)))
        buf = io.BytesIO()
        img.save(buf, format="WEBP", quality=WEBP_QUALITY)
        head = _u24(0) + _u24(0) + _u24(w - 1) + _u24(h - 1) + _u24(self.duration) + bytes([0x02])
        self.fh.write(_chunk(b"ANMF", head + frame_bitstream(buf.getvalue())))

    def close(self) -> None:
        size = self.fh.tell()
        self.fh.seek(4)
        self.fh.write(struct.pack("<I", size - 8))
        self.fh.close()

    def abort(self) -> None:
        self.fh.close()


class _Mp4:
    def __init__(self, path: str, fps: int):
        import av
        self.av, self.fps = av, fps
        self.out = av.open(path, mode="w", format="mp4")
        self.stream = None

    def add(self, frame) -> None:
        frame = frame[: frame.shape[0] // 2 * 2, : frame.shape[1] // 2 * 2]     # yuv420p: even sizes
        if self.stream is None:
            self.stream = self.out.add_stream("h264", rate=self.fps)
            self.stream.width, self.stream.height, self.stream.pix_fmt = frame.shape[1], frame.shape[0], "yuv420p"
        self.out.mux(self.stream.encode(self.av.VideoFrame.from_ndarray(frame, format="rgb24")))

    def close(self) -> None:
        if self.stream is not None:
            self.out.mux(self.stream.encode())
        self.out.close()

    def abort(self) -> None:
        self.out.close()


class NonFiniteFramesError(ValueError):
    """Frames given to a video hold NaN or inf; the message names the video, the frame and the likely cause."""


class VideoFile:
    """A video written frame by frame (see the module doc): ``write(images)`` each batch of frames [T, H, W, 3]
    (float 0..1 or uint8, every frame the size of the first), ``close()`` once (returns the path), ``discard()``
    on failure. ``frames``: frames written."""

    def __init__(self, path, fps: int = FPS, *, option: str = "", purpose: str = "the video"):
        self.path, self.option, self.purpose = Path(path), option, purpose
        if self.path.suffix.lower() not in (".mp4", ".webp"):
            raise ValueError(f"{self.path}: a video is written as .mp4 or .webp")
        check_target(self.path, option=option, purpose=purpose)
        self.fmt = self.path.suffix.lower()[1:]
        self.tmp = new_temporary(self.path)
        self._cleanup = weakref.finalize(self, release, self.tmp, True)   # removes the unfinished file
        try:
            self.encoder = (_Mp4 if self.fmt == "mp4" else _AnimatedWebp)(self.tmp, fps)
        except BaseException:
            self.discard()
            raise
        self.frames, self.shape, self.closed = 0, None, False

    def write(self, images) -> None:
        import torch
        if isinstance(images, torch.Tensor):
            if images.is_floating_point():
                self._check_finite(images)
                images = (images.detach().float().clamp(0, 1) * 255).round()
            images = images.to("cpu", torch.uint8).numpy()
        if images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(f"video frames are [frames, H, W, 3], got {tuple(images.shape)}")
        if self.shape is None:
            self.shape = images.shape[1:]
        elif images.shape[1:] != self.shape:
            raise ValueError(f"frames of {tuple(images.shape[1:])} in a video of {tuple(self.shape)}")
        for frame in images:
            self.encoder.add(frame)
            self.frames += 1

    def _check_finite(self, images) -> None:
        """NonFiniteFramesError (the unfinished file discarded) when float frames hold NaN or inf: a NaN cast to a
        byte is a pixel of no value, so such a video is never written (one host sync per batch of frames, which is
        copied to the host anyway)."""
        from .finite_flags import counts, first_bad, non_finite        # torch's: imported when frames come
        if non_finite({"frames": images}):
            first = self.frames + first_bad(images)
            self.discard()
            raise NonFiniteFramesError(
                f"{self.purpose} ({self.path.name}): frame {first} holds values that are not numbers "
                f"({counts(images)}): the decoder overflowed (its weights are damaged or too large "
                f"for its dtype); give other decoder weights or decode in float32. No video was written")

    def close(self) -> Path:
        """The complete video at ``path`` (ValueError for a video without frames, which is discarded)."""
        if self.frames == 0:
            self.discard()
            raise ValueError(f"{self.path}: no frames were decoded, so no video was written")
        self.encoder.close()
        write_with(self.path, lambda tmp: None, option=self.option, purpose=self.purpose, tmp=self.tmp)
        self.closed = True
        self._cleanup.detach()
        return self.path

    def discard(self) -> None:
        """Stop and remove the unfinished file (nothing once closed)."""
        if self.closed:
            return
        self.closed = True
        encoder = getattr(self, "encoder", None)
        if encoder is not None:
            try:
                encoder.abort()
            except Exception:  # noqa: BLE001 - the file is removed whatever the encoder says
                pass
        self._cleanup()

