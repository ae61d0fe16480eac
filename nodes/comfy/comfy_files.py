"""File names that nodes read, resolved only inside ComfyUI's folders.

A node input names a file inside one of ComfyUI's folders (its input folder, models/diffusion_models). A name
that is absolute, climbs with ``..``, or reaches a file outside the folder through a symbolic link is refused
with a ValueError that names the input and the folder, so a workflow cannot make the pack read files elsewhere.
"""
from __future__ import annotations

import ntpath
import os
from pathlib import Path

from .comfy_core import core, optional


NAME_MAX = 255   # bytes in one path component on the file systems ComfyUI runs on


def check_name_text(text: str, *, input_name: str) -> str:
    """``text`` when it can name a file at all; ValueError naming the input when it holds a NUL or another control
    character, or a path component longer than the file system allows (the OS would refuse it later, deep inside
    a write, with an error that names no input)."""
    bad = next((c for c in text if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:
        raise ValueError(f"{input_name} holds the control character {bad!r}; type a plain name without it")
    try:
        parts = [part.encode("utf-8") for part in text.replace("\\", "/").split("/")]
    except UnicodeEncodeError:
        raise ValueError(f"{input_name} holds a character that cannot be written in a file name; type a plain "
                         f"name") from None
    if any(len(part) > NAME_MAX for part in parts):
        raise ValueError(f"{input_name} has a name longer than {NAME_MAX} bytes ({max(map(len, parts))}); give a "
                         f"shorter name")
    return text


def check_relative(text: str, *, input_name: str, fix: str, absolute_fix: str = "") -> str:
    """``text`` as a name inside a folder (:func:`check_name_text`, not absolute, no ``..``); errors end with fix."""
    check_name_text(text, input_name=input_name)
    if os.path.isabs(text) or ntpath.isabs(text) or ntpath.splitdrive(text)[0] or text.startswith("~"):
        raise ValueError(f"{input_name} {text!r} is an absolute path; {fix}{absolute_fix}")
    if ".." in text.replace("\\", "/").split("/"):
        raise ValueError(f"{input_name} {text!r} climbs out with '..'; {fix}")
    return text


def resolve_inside(folder, name, *, input_name: str, folder_label: str, suffixes: tuple = (".safetensors",)) -> Path:
    """The real path of the file ``name`` inside ``folder``; ValueError when it is not a plain name of a regular
    file there (absolute, ``..``, a link leading out, missing, a folder, another suffix)."""
    text = "" if name is None else str(name).strip()
    if not text:
        raise ValueError(f"{input_name} is empty: give the name of a file in {folder_label}")
    check_relative(text, input_name=input_name, fix=f"give a file name inside {folder_label}",
                   absolute_fix=" (put the file there)")
    if suffixes and not text.lower().endswith(suffixes):
        raise ValueError(f"{input_name} {text!r} must be a {' or '.join(suffixes)} file in {folder_label}")
    base = os.path.realpath(str(folder))
    full = os.path.realpath(os.path.join(base, text))
    if os.path.commonpath([base, full]) != base:
        raise ValueError(f"{input_name} {text!r} leads out of {folder_label} through a symbolic link; put the file "
                         f"itself in {folder_label}")
    if not os.path.isfile(full):
        raise ValueError(f"{input_name}: no file {text!r} in {folder_label}; put the file there")
    return Path(full)


def input_file(name, *, input_name: str = "file", suffixes: tuple = (".safetensors",)) -> Path:
    """A file in ComfyUI's input folder (see :func:`resolve_inside`)."""
    return resolve_inside(core("folder_paths").get_input_directory(), name, input_name=input_name,
                          folder_label="ComfyUI's input folder", suffixes=suffixes)


def model_file(folder_kind: str, name, *, input_name: str) -> str:
    """A file of ComfyUI's ``models/<folder_kind>`` (and the folders configured for it), as ComfyUI resolves
    it; a name that is absolute, climbs with ``..`` or is not there is refused. Outside ComfyUI (scripts, tests)
    the name is a path chosen by the caller and is returned as given."""
    folder_paths = optional("folder_paths")
    if folder_paths is None:
        return name
    text = "" if name is None else str(name).strip()
    label = f"models/{folder_kind}"
    check_relative(text, input_name=input_name, fix=f"choose a file of {label}")
    full = folder_paths.get_full_path(folder_kind, text) if text else None
    if not full:
        raise ValueError(f"{input_name}: no file {text!r} in {label}; put the file there (or pick one in the list)")
    # the folder ComfyUI found it in (models/<kind> or one configured for it): the name's own parts taken off
    depth = len([p for p in text.replace("\\", "/").split("/") if p not in ("", ".")])
    base = Path(full)
    for _ in range(depth):
        base = base.parent
    real_base, real = os.path.realpath(str(base)), os.path.realpath(full)
    if os.path.commonpath([real_base, real]) != real_base:
        raise ValueError(f"{input_name} {text!r} leads out of {label} through a symbolic link; put the file itself "
                         f"in {label}")
    return full


def save_path(prefix, *, input_name: str = "filename_prefix"):
    """ComfyUI's ``get_save_image_path`` for a filename prefix typed in a widget: (folder, name, counter,
    subfolder) inside ComfyUI's output folder. A prefix that is absolute, climbs with ``..``, holds a control
    character or an over-long name is refused with a ValueError naming the input, before ComfyUI's own check
    (a bare Exception) or the OS (an error naming no input) would meet it."""
    folder_paths = core("folder_paths")
    text = check_relative("" if prefix is None else str(prefix).strip(), input_name=input_name,
                          fix="give a name inside ComfyUI's output folder")
    if not text:
        raise ValueError(f"{input_name} is empty: give a name such as wan_accel/play")
    out_dir = folder_paths.get_output_directory()
    try:
        full, name, counter, subfolder, _ = folder_paths.get_save_image_path(text, out_dir)
    except Exception as exc:  # noqa: BLE001 - ComfyUI refuses with a bare Exception
        raise ValueError(f"{input_name} {text!r}: {exc}") from None
    return full, name, counter, subfolder
