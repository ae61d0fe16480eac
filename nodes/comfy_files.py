"""File names that nodes read, resolved only inside ComfyUI's folders.

A node input names a file inside one of ComfyUI's folders (its input folder, models/diffusion_models). A name
that is absolute, climbs with ``..``, or reaches a file outside the folder through a symbolic link is refused
with a ValueError that names the input and the folder, so a workflow cannot make the pack read files elsewhere.
"""
from __future__ import annotations

import ntpath
import os
from pathlib import Path


def resolve_inside(folder, name, *, input_name: str, folder_label: str, suffixes: tuple = (".safetensors",)) -> Path:
    """The real path of the file ``name`` inside ``folder``; ValueError when it is not a plain name of a regular
    file there (absolute, ``..``, a link leading out, missing, a folder, another suffix)."""
    text = "" if name is None else str(name).strip()
    if not text:
        raise ValueError(f"{input_name} is empty: give the name of a file in {folder_label}")
    if os.path.isabs(text) or ntpath.isabs(text) or ntpath.splitdrive(text)[0] or text.startswith("~"):
        raise ValueError(f"{input_name} {text!r} is an absolute path; give a file name inside {folder_label} "
                         f"(put the file there)")
    if ".." in text.replace("\\", "/").split("/"):
        raise ValueError(f"{input_name} {text!r} climbs out with '..'; give a file name inside {folder_label}")
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
    import folder_paths

    return resolve_inside(folder_paths.get_input_directory(), name, input_name=input_name,
                          folder_label="ComfyUI's input folder", suffixes=suffixes)


def model_file(folder_kind: str, name, *, input_name: str) -> str:
    """A file of ComfyUI's ``models/<folder_kind>`` (and the folders configured for it), as ComfyUI resolves
    it; a name that is absolute, climbs with ``..`` or is not there is refused. Outside ComfyUI (scripts, tests)
    the name is a path chosen by the caller and is returned as given."""
    try:
        import folder_paths
    except ImportError:
        return name
    text = "" if name is None else str(name).strip()
    label = f"models/{folder_kind}"
    if os.path.isabs(text) or ntpath.isabs(text) or ntpath.splitdrive(text)[0] or text.startswith("~"):
        raise ValueError(f"{input_name} {text!r} is an absolute path; choose a file of {label}")
    if ".." in text.replace("\\", "/").split("/"):
        raise ValueError(f"{input_name} {text!r} climbs out with '..'; choose a file of {label}")
    full = folder_paths.get_full_path(folder_kind, text) if text else None
    if not full:
        raise ValueError(f"{input_name}: no file {text!r} in {label}; put the file there (or pick one in the list)")
    return full
