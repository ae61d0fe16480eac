"""Input checks shared by the command line and the nodes: every value is checked before any work, and every
message names the input, its valid range and, where there is one, a value that passes every check.

Pure Python (no torch at import). Names of inputs are passed in, so the same check says ``--frames`` on the
command line and ``num_frames`` in a node.
"""
from __future__ import annotations

import functools
import math
import os
import stat
import sys
from pathlib import Path

from ..cache.owned_files import read_regular
from ..cache.safety import file_kind, system_folder
from ..sampling.actions_script import MAX_VIDEO_FRAMES


class UsageError(ValueError):
    """A value that no command or node can run with; the message names the input and its valid range."""


VAE_TIME_STRIDE, VAE_SPACE_STRIDE = 4, 8
PIXEL_MULTIPLE = 16                 # 8x VAE downsampling x 2x2 patches (every Wan 2.1 model)
MIN_PIXELS, MAX_PIXELS = 16, 4096   # as the sampler node's widgets
MAX_FRAMES_PER_BLOCK = 64
MAX_KV_WINDOW = 1024
MAX_SEED = 0xFFFFFFFFFFFFFFFF
MAX_STEP = 1000.0

DTYPES = ("bf16", "fp16", "fp32")   # the nodes' spelling
DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
                 "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}
TORCH_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


# ------------------------------------------------------------------------------------------------- numbers
def check_int(name: str, value, lo: int | None = None, hi: int | None = None, hint: str = "") -> int:
    """An int within [lo, hi], else UsageError naming ``name`` and the range."""
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            value = int(value)
        except (TypeError, ValueError, OverflowError):
            raise UsageError(f"{name} must be a whole number, got {value!r}{hint}") from None
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        rng = (f"between {lo} and {hi}" if lo is not None and hi is not None
               else f"at least {lo}" if lo is not None else f"at most {hi}")
        raise UsageError(f"{name} must be {rng}, got {value}{hint}")
    return value


def check_float(name: str, value, lo: float | None = None, hi: float | None = None, *, lo_open=False) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise UsageError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(value):
        raise UsageError(f"{name} must be a finite number, got {value}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise UsageError(f"{name} must be {'greater than' if lo_open else 'at least'} {lo:g}, got {value:g}")
    if hi is not None and value > hi:
        raise UsageError(f"{name} must be at most {hi:g}, got {value:g}")
    return value


def check_steps(name: str, text) -> str:
    """A step list like '1000,750,500,250': numbers in (0, 1000], at least one."""
    if text is None:
        return text
    parts = str(text).replace(",", " ").split()
    if not parts:
        raise UsageError(f"{name} is empty: give timesteps in (0, 1000] separated by commas, e.g. 1000,750,500,250")
    for p in parts:
        try:
            v = float(p)
        except ValueError:
            raise UsageError(f"{name}: {p!r} is not a number; give timesteps in (0, 1000] separated by commas, "
                             f"e.g. 1000,750,500,250") from None
        if not math.isfinite(v) or not 0 < v <= MAX_STEP:
            raise UsageError(f"{name}: timestep {p} is outside (0, 1000]; e.g. 1000,750,500,250")
    return str(text)


# ------------------------------------------------------------------------------------------------- geometry
def valid_video_frames_near(video_frames: int, frames_per_block: int) -> list[int]:
    """Video frame counts nearest to ``video_frames`` (one below or equal, one above) that are 4k+1 and give a
    whole number of ``frames_per_block``-frame latent blocks, within [1, MAX_VIDEO_FRAMES]."""
    fpb = max(1, int(frames_per_block))
    step = VAE_TIME_STRIDE * fpb

    def video(m):  # m blocks -> video frames
        return VAE_TIME_STRIDE * (m * fpb - 1) + 1

    m = max(1, (int(video_frames) + VAE_TIME_STRIDE - 1 + step - 1) // step)  # first m with video(m) >= n
    while m > 1 and video(m - 1) >= video_frames:
        m -= 1
    out = []
    if m > 1 and video(m) > video_frames:
        out.append(video(m - 1))
    out.append(video(m))
    if video(m) == video_frames and video(m + 1) <= MAX_VIDEO_FRAMES:
        out.append(video(m + 1))
    return sorted({v for v in out if 1 <= v <= MAX_VIDEO_FRAMES}) or [video(1)]


def check_pixels(name: str, value, default_hint: str = "") -> int:
    value = check_int(name, value, MIN_PIXELS, MAX_PIXELS,
                      hint=f" (pixels, a multiple of {PIXEL_MULTIPLE}{default_hint})")
    if value % PIXEL_MULTIPLE:
        near = {max(MIN_PIXELS, value // PIXEL_MULTIPLE * PIXEL_MULTIPLE),      # the multiples below and above
                min(MAX_PIXELS, -(-value // PIXEL_MULTIPLE) * PIXEL_MULTIPLE)}
        raise UsageError(f"{name} {value} is not a multiple of {PIXEL_MULTIPLE} (8x VAE downsampling x 2x2 "
                         f"patches); use {' or '.join(map(str, sorted(near)))}")
    return value


def check_geometry(frames, height, width, frames_per_block=3, kv_window=-1, sink=0, *, names=None,
                   recache: str = "switch") -> dict:
    """Check a causal Wan request in the user's units (video frames, pixels) and return the latent sizes:
    ``{"latent_frames", "latent_height", "latent_width"}``. ``names`` maps 'frames', 'height', 'width',
    'frames_per_block', 'kv_window', 'sink' (and 'recache') to the input names shown in messages; ``recache``: the
    cache mode the run uses (``check_window``)."""
    n = {"frames": "frames", "height": "height", "width": "width", "frames_per_block": "frames_per_block",
         "kv_window": "kv_window", "sink": "sink"}
    n.update(names or {})
    fpb = check_int(n["frames_per_block"], frames_per_block, 1, MAX_FRAMES_PER_BLOCK,
                    hint=" (latent frames per chunk; 3 for the released models)")
    frames = check_int(n["frames"], frames, 1, MAX_VIDEO_FRAMES, hint=" (video frames, 4k+1)")
    lf_exact = (frames - 1) % VAE_TIME_STRIDE == 0
    lf = (frames - 1) // VAE_TIME_STRIDE + 1
    if not lf_exact or lf % fpb:
        use = " or ".join(map(str, valid_video_frames_near(frames, fpb)))
        if not lf_exact:
            why = "is not 4k+1 (the Wan VAE packs 4 video frames per latent frame after the first)"
        else:
            why = (f"give {lf} latent frames, not a whole number of {fpb}-frame blocks "
                   f"({n['frames_per_block']} {fpb})")
        raise UsageError(f"{n['frames']} {frames} {why}; use {use}")
    height, width = check_pixels(n["height"], height), check_pixels(n["width"], width)
    check_window(fpb, kv_window, sink, recache, names=n)
    return {"latent_frames": lf, "latent_height": height // VAE_SPACE_STRIDE,
            "latent_width": width // VAE_SPACE_STRIDE, "frames": frames, "height": height, "width": width}


CACHE_MODES = ("switch", "none", "krea")    # sampling/krea.py CACHE_MODES (not imported here: no torch)


def check_window(frames_per_block, kv_window, sink, recache: str = "switch", *, names: dict | None = None) -> int:
    """The one check of a run's KV window, sink frames and cache mode, before any work; returns the window.

    Every value it refuses is answered with advice that passes this same check: a rolling window holds the sink
    frames plus one chunk; ``sink`` needs a rolling window; with ``recache`` 'krea' the cache is rebuilt before
    every chunk from a context of K = kv_window - frames_per_block frames (K >= 2; -1: Krea's K = 3) and there are
    no sink frames, so a sink is refused rather than ignored. ``names`` maps 'frames_per_block', 'kv_window',
    'sink', 'recache' to the input names of messages."""
    n = {"frames_per_block": "frames_per_block", "kv_window": "kv_window", "sink": "sink", "recache": "recache",
         **(names or {})}
    fpb = check_int(n["frames_per_block"], frames_per_block, 1, MAX_FRAMES_PER_BLOCK,
                    hint=" (latent frames per chunk; 3 for the released models)")
    window = check_int(n["kv_window"], kv_window, -1, MAX_KV_WINDOW, hint=" (latent frames; -1 keeps every frame)")
    sink = check_int(n["sink"], sink, 0, MAX_KV_WINDOW, hint=" (latent frames)")
    if recache not in CACHE_MODES:
        raise UsageError(f"{n['recache']} must be one of {', '.join(CACHE_MODES)}, got {recache!r}")
    if recache == "krea":
        from ..sampling.krea import krea_window_problem
        problem = krea_window_problem(fpb, window, sink, n)
        if problem:
            raise UsageError(problem)
        return window
    if window == 0 or 0 < window < fpb:
        raise UsageError(f"{n['kv_window']} {window} is too small: use -1 (keep every frame) or at least "
                         f"{n['frames_per_block']} ({fpb}) latent frames")
    if sink and window == -1:
        raise UsageError(f"{n['sink']} {sink} needs a rolling window: set {n['kv_window']} (latent frames), or "
                         f"{n['sink']} 0")
    if sink and sink + fpb > window:
        raise UsageError(f"{n['sink']} {sink} latent frames leaves no room in the {n['kv_window']} of {window} "
                         f"latent frames for a {fpb}-frame chunk: use {n['sink']} at most {max(0, window - fpb)}, "
                         f"or {n['kv_window']} at least {sink + fpb}")
    return window


# ------------------------------------------------------------------------------------------------- names
def normalize_dtype(name: str, value, *, quiet: bool = False) -> str | None:
    """bf16 / fp16 / fp32 (the nodes' spelling); bfloat16 / float16 / float32 are accepted with a note."""
    if value is None:
        return None
    v = str(value).strip().lower()
    if v in DTYPES:
        return v
    if v in DTYPE_ALIASES:
        if not quiet:
            print(f"note: {name} {value} is spelled {DTYPE_ALIASES[v]} (as in the nodes); using {DTYPE_ALIASES[v]}",
                  file=sys.stderr)
        return DTYPE_ALIASES[v]
    raise UsageError(f"{name} must be one of {', '.join(DTYPES)} (also accepted: bfloat16, float16, float32), "
                     f"got {value!r}")


def dtype_arg(option: str):
    """argparse ``type=`` for a dtype option."""
    def parse(value):
        try:
            return normalize_dtype(option, value)
        except UsageError as exc:
            import argparse
            raise argparse.ArgumentTypeError(str(exc).replace(f"{option} ", "", 1)) from None
    parse.__name__ = "dtype"
    return parse


def check_device(name: str, value) -> str | None:
    """cpu, cuda or cuda:N, and CUDA only when there is a CUDA device."""
    if value is None:
        return None
    v = str(value).strip().lower()
    if v == "cpu":
        return v
    if v == "cuda" or (v.startswith("cuda:") and v[5:].isdigit()):
        import torch
        if not torch.cuda.is_available():
            raise UsageError(f"{name} {value}: no CUDA device is available here; use {name} cpu")
        index = int(v[5:]) if ":" in v else 0
        if index >= torch.cuda.device_count():
            raise UsageError(f"{name} {value}: there are {torch.cuda.device_count()} CUDA device(s); use cuda:0"
                             f"..cuda:{torch.cuda.device_count() - 1}")
        return v
    raise UsageError(f"{name} must be cpu, cuda or cuda:N, got {value!r}")


# ------------------------------------------------------------------------------------------------- files
def check_input_file(name: str, value, kind: str = "safetensors", convert: str | None = "convert") -> Path:
    """An existing, non-empty regular file; for kind 'safetensors' also a readable safetensors header (a pickle
    file is told the command that converts it: ``convert`` for a DiT, ``convert-lora`` for a LoRA; None for a file
    no command converts (a decoder, a text embedding): it is told to get or save the .safetensors form)."""
    if value is None or str(value).strip() == "":
        raise UsageError(f"{name} is empty: give the path of a .{kind} file")
    path = Path(str(value)).expanduser()
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UsageError(f"{name} {path}: file not found") from None
    except OSError as exc:
        raise UsageError(f"{name} {path}: cannot be opened ({exc.strerror or exc})") from None
    if stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{name} {path} is a folder; give the path of a .{kind} file")
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{name} {path} is not a regular file (a device or a pipe); give the path of a .{kind} "
                         f"file")
    if st.st_size == 0:
        raise UsageError(f"{name} {path} is empty (0 bytes); give a complete .{kind} file")
    if kind == "safetensors":
        if path.suffix.lower() in (".pt", ".pth", ".ckpt", ".bin", ".pkl"):
            if convert is None:
                raise UsageError(f"{name} {path} is a pickle file; only .safetensors files are loaded (pickle files "
                                 f"can run code) and no wan_accel command converts this kind: give its .safetensors "
                                 f"release, or save its tensors with safetensors.torch.save_file")
            raise UsageError(f"{name} {path} is a pickle checkpoint; only .safetensors files are loaded. Convert it "
                             f"once: python -m wan_accel {convert} {path} {path.with_suffix('.safetensors')}")
        try:
            from safetensors import safe_open
            with safe_open(str(path), framework="pt", device="cpu") as f:
                f.keys()
        except Exception as exc:  # noqa: BLE001 - any failure means the header is unreadable
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UsageError(f"{name} {path} is not a readable safetensors file ({detail}); it may be damaged or "
                             f"incomplete: download or write it again") from None
    return path


def shown(value, limit: int = 60) -> str:
    """``value`` as a message quotes it: its repr, cut to about ``limit`` characters with the length said (a
    100,000-character input is never echoed whole)."""
    text = str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def check_text(name: str, value) -> str:
    """A text typed by the user (a prompt, a schedule, an action script) that can be encoded as UTF-8: bytes that
    are not UTF-8 on the command line reach Python as lone surrogates, which fail only later, deep in the run."""
    text = str(value)
    bad = next((i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF), None)
    if bad is not None:
        raise UsageError(f"{name} is not UTF-8 text (character {bad + 1} is not a UTF-8 character: the command line "
                         f"or the file gave bytes in another encoding); type it in UTF-8, or save it to a UTF-8 file")
    return text


USER_FILE_BYTES = 1 << 20          # a text input file (a prompt schedule) larger than this is not one


def read_user_file(name: str, value, *, what: str = "a text file", limit: int = USER_FILE_BYTES) -> bytes:
    """The bytes of a file the user names as input ``name`` (a prompt schedule, ...): the user's own file, only
    read. A folder, a pipe, a device (also through a link: /dev/zero), a missing file, one without permission or
    larger than ``limit`` bytes is refused with a UsageError that says what was found and what to give instead;
    opened without blocking, and never more than ``limit`` bytes are read."""
    text = "" if value is None else str(value)
    if not text.strip():
        raise UsageError(f"{name} is empty: give the path of {what}")
    try:
        path = Path(text).expanduser()
        link = os.path.islink(path)
    except (OSError, ValueError, RuntimeError):        # a NUL byte, ~user that does not exist
        raise UsageError(f"{name} {shown(text)} cannot name a file; give the path of {what}") from None
    where = f"{name} {shown(str(path))}" + (f" (a link to {shown(os.path.realpath(path))})" if link else "")

    def refuse(st: os.stat_result) -> None:
        if not stat.S_ISREG(st.st_mode):
            kind = file_kind(st.st_mode)
            fix = "a file in it" if kind == "a folder" else "a regular file (save the text to a file first)"
            raise UsageError(f"{where} is {kind}, not a file; give the path of {what}: {fix}")
        if st.st_size > limit:
            raise UsageError(f"{where} is {st.st_size} bytes, more than the {limit} bytes {what} can be; check the "
                             f"path")
    try:       # a pipe, device or socket is refused before it is opened: opening some devices acts (a tty, a tape)
        data = read_regular(path, limit + 1, refuse)    # or can stall
    except FileNotFoundError:
        raise UsageError(f"{where}: no such file; check the path (give the path of {what})") from None
    except PermissionError:
        raise UsageError(f"{where}: permission denied; give {what} you may read") from None
    except OSError as exc:
        raise UsageError(f"{where} cannot be read ({exc.strerror or exc}); give the path of {what}") from None
    if len(data) > limit:                  # grew while read
        raise UsageError(f"{where} is more than the {limit} bytes {what} can be; check the path")
    return data


def user_text(name: str, data: bytes, path) -> str:
    """The UTF-8 text of a user's file read by :func:`read_user_file` (a BOM is dropped)."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{name} {shown(str(path))} is not UTF-8 text (byte {data[exc.start]:#04x} at offset "
                         f"{exc.start}); save it as plain UTF-8 text") from None


def check_output_dir(name: str, value) -> Path:
    """A folder to write into (created when absent): not a file, not a device, not a system folder."""
    if value is None or str(value).strip() == "":
        raise UsageError(f"{name} is empty: give an output folder")
    path = Path(str(value)).expanduser()
    root = system_folder(path / "x")
    if root is not None:
        raise UsageError(f"{name} {path} is in the system folder {root}; choose a folder of your own")
    for p in [path, *path.parents]:
        try:
            st = os.stat(p)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise UsageError(f"{name} {path}: {p} cannot be used ({exc.strerror or exc})") from None
        if not stat.S_ISDIR(st.st_mode):
            raise UsageError(f"{name} {path}: {p} is a file, not a folder; choose another {name}")
        if not os.access(p, os.W_OK | os.X_OK):        # refused now, not when the first file is written
            raise UsageError(f"{name} {path}: {p} is not writable (permission denied or a read-only disk); choose "
                             f"a folder you may write")
        break
    return path


# ------------------------------------------------------------------------------------------------- argparse
def _number(text, kind=float):
    """argparse ``type=`` of an int (``kind`` int) or finite float option."""
    import argparse
    try:
        value = kind(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a {'whole ' if kind is int else ''}number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def friendly_numbers(parser) -> None:
    """int/float options of ``parser`` and its subcommands answer 'must be a whole number, got ...' (argparse's
    own message for 'abc' is 'invalid int value'); floats also refuse nan and inf."""
    import argparse
    for action in parser._actions:
        if action.type in (int, float):
            action.type = functools.partial(_number, kind=action.type)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                friendly_numbers(sub)


# ------------------------------------------------------------------------------------------------- memory
def device_memory(device=None) -> tuple[int, str]:
    """(bytes a run may allocate, the device's memory in words): free CUDA memory of a CUDA device, else the
    available host RAM (memory/system.py), either capped by ``WAN_ACCEL_MEMORY_LIMIT_GB``."""
    from ..memory.system import MEMORY_LIMIT_ENV, detect_system, gib, memory_limit

    system = detect_system(device)
    limit = memory_limit()
    note = "" if limit is None else f" ({MEMORY_LIMIT_ENV} {limit / 1024 ** 3:g})"
    if system.has_gpu:
        # What this process already holds (another model ComfyUI can unload, a cache the OOM retry can drop) is
        # counted as available: only a run that cannot fit even then is refused.
        import torch
        held = int(torch.cuda.memory_allocated(system.device_index))
        budget = system.free_vram if limit is not None and system.free_vram == limit else system.free_vram + held
        capped = note if system.free_vram == limit else ""
        also = f" (+{gib(held)} this process holds and can release)" if held and not capped else ""
        return budget, (f"cuda:{system.device_index} ({system.gpu_name}) has {gib(system.free_vram)} free{also} "
                        f"of {gib(system.total_vram)}{capped}")
    capped = note if system.host_ram_available == limit else ""
    return system.host_ram_available, (f"the CPU has {gib(system.host_ram_available)} of RAM available (of "
                                       f"{gib(system.host_ram_total)}){capped}")


def check_fits(model_config: dict, frames, height, width, *, device=None, frames_per_block=3, kv_window=-1,
               batch=1, dtype: str | None = None, weight_bytes: int = 0, names: dict | None = None,
               window_option: bool = True, world: int = 1) -> None:
    """Refuse a sampling run whose estimated peak (latents, KV cache, activations and weights still to load;
    ``memory/estimate.py``) exceeds the device's memory, before any tensor is made. The message gives the estimate,
    the device's free/total (CUDA) or available RAM (CPU) and the settings that would fit. Every sampler entry
    point (command line, nodes, ``prepare.sample_video``) calls it with its own input names; ``world``: ranks of a
    sequence-parallel run (the estimate is one rank's). Arithmetic and one memory query: cheap to repeat."""
    from ..memory.estimate import fit_problem

    budget, where = device_memory(device)
    cuda = where.startswith("cuda")
    dtype = normalize_dtype("dtype", dtype, quiet=True) or ("bf16" if cuda else "fp32")   # the runs' defaults
    elem = 4 if dtype == "fp32" else 2
    problem = fit_problem(model_config, int(frames), int(height), int(width), budget, where,
                          frames_per_block=int(frames_per_block), kv_window=int(kv_window), batch=int(batch),
                          elem_bytes=elem, weight_bytes=int(weight_bytes), names=names,
                          window_option=window_option, swap_option=cuda, world=int(world))
    if problem:
        raise UsageError(problem)


def check_decode_fits(name: str, latent_shape, time_ratio: int = VAE_TIME_STRIDE,
                      space_ratio: int = VAE_SPACE_STRIDE) -> None:
    """Refuse decoding a video latent [B, C, T, h, w] whose decoded frames (float32 RGB, kept in host RAM) exceed
    the available RAM, before the first chunk; the message gives the size, the RAM and the latent frames that fit."""
    from ..memory.estimate import decoded_video_bytes

    b, _, t, h, w = (int(v) for v in latent_shape)
    budget, where = device_memory("cpu")

    def need(frames: int) -> int:
        return decoded_video_bytes(frames, h, w, b, time_ratio, space_ratio)

    if need(t) <= budget:
        return
    fit = max((f for f in range(t - 1, 0, -1) if need(f) <= budget), default=0)
    fix = (f"decode at most {fit} latent frames at a time (split the latent) or lower the resolution" if fit
           else "lower the resolution")
    raise UsageError(f"{name}: {t} latent frames at {w * space_ratio}x{h * space_ratio} decode to about "
                     f"{need(t) / 1024 ** 3:.2f} GiB of frames but {where}; {fix}. Nothing was decoded")


def check_latent(name: str, samples, *, dims: tuple = (5,), channels: int | None = None):
    """The tensor of a LATENT input (a dict with a 'samples' tensor, or the tensor itself): a floating tensor of
    one of ``dims`` dimensions, no empty dimension, ``channels`` channels where given, every value finite.
    UsageError names the input and what to connect instead."""
    latent = samples.get("samples") if isinstance(samples, dict) else samples
    if getattr(latent, "is_nested", False):
        latent = latent.unbind()[0]
    fix = "connect the LATENT output of a sampler or a VAE Encode"
    if getattr(latent, "dim", None) is None or getattr(latent, "dtype", None) is None:
        raise UsageError(f"{name} holds no latent tensor (got {type(latent).__name__}); {fix}")
    shape = tuple(latent.shape)
    if latent.dim() not in dims:
        want = " or ".join(f"{d}-D" for d in dims)
        raise UsageError(f"{name} must be a {want} latent [B, C, (T,) H, W], got shape {list(shape)}; {fix}")
    if 0 in shape:
        raise UsageError(f"{name} is empty (shape {list(shape)}); {fix}")
    if channels is not None and shape[1] != channels:
        raise UsageError(f"{name} has {shape[1]} channels but {channels} are needed (shape {list(shape)}); "
                         f"connect a Wan 2.1 latent")
    if not (latent.dtype.is_floating_point and not latent.dtype.is_complex):
        raise UsageError(f"{name} holds {str(latent.dtype).replace('torch.', '')} values, not a floating latent; {fix}")
    from ..cache.finite_flags import bad_flag
    if bool(bad_flag(latent)):
        raise UsageError(f"{name} holds NaN or infinite values; re-run the node that made it (lower the shift or "
                         f"use fp32/bf16 instead of fp16)")
    return latent


def check_schedule_args(preset: str, steps=None, shift=None, warp=None, *, names: dict | None = None) -> None:
    """A preset, step list and shift that give a finite schedule (the computed timesteps checked too: a tiny shift
    gives inf); UsageError names the input."""
    from ..sampling.scheduler import PRESET_NAMES, ScheduleError, resolve_schedule

    n = {"preset": "preset", "steps": "steps", "shift": "shift", **(names or {})}
    if preset not in PRESET_NAMES:
        raise UsageError(f"{n['preset']} must be one of {', '.join(PRESET_NAMES)}, got {preset!r}")
    if steps is not None:
        check_steps(n["steps"], steps if isinstance(steps, str) else ",".join(str(s) for s in steps))
    if shift is not None:
        check_float(n["shift"], shift, 0.0, 100.0, lo_open=True)
    try:
        resolve_schedule(preset, steps, shift, warp)
    except ScheduleError as exc:
        name = n["shift"] if shift is not None and "shift" in str(exc) else n["steps"]
        raise UsageError(f"{name}: {exc}") from None

