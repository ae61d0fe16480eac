"""ComfyUI as the pack meets it: every name of ComfyUI (core, its extras, ``folder_paths``, ``server``) that the
pack uses is looked up here, and only here, lazily.

``NAMES`` lists each name with the first core known to offer it. ``core(name)`` returns it or raises
``CoreMissing``, a message naming what is missing, the ComfyUI that runs, the core that has the name and, when the
import itself failed because of a dependency (e.g. a core that imports ``comfy_aimdo.malloc_graph`` beside an older
comfy-aimdo), the install that fixes it; never an AttributeError from deep inside a node. ``optional(name)`` is
None where ComfyUI (or that name) is absent: outside ComfyUI (tests, the command line) and on older cores.

Cores with the Comfy Compiler (0.34 and newer: ``comfy.model_prefetch``, comfy-aimdo's memory graph and per-block
CUDA graphs) record every GPU allocation made while a graph is open on the thread. The pack's own chunk loop, its
allocations, CUDA graphs and block swap must not be recorded there: ``outside_memory_graph()`` pauses a graph open
on this thread (``pause_malloc_graph``) and keeps the compiler off while the pack's work runs (so nothing inside
opens one); ``add_outer_sample_guard(patcher)`` enters it at the OUTER_SAMPLE wrapper, where a pack must (a
DIFFUSION_MODEL wrapper runs after core opened the graph). On 0.33 both do nothing.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
import threading

from ...app.doctor.versions import NOT_FOUND, comfyui_version, dependency_fix
from ...cache.guarded_import import ImportProblem, guarded_import

log = logging.getLogger("wan_accel")

RUN_CORE = "0.33.0"          # the core the pack's end-to-end tests run: it offers every name below but the newer ones
COMPILER_CORE = "0.34.0"     # the first core with the Comfy Compiler (comfy.model_prefetch)

# name -> the core that has it. A name is "module" or "module.attribute[.attribute]".
NAMES = {
    "comfy.cli_args.args": RUN_CORE,
    "comfy.model_management": RUN_CORE,
    "comfy.utils.ProgressBar": RUN_CORE,
    "comfy.utils.load_torch_file": RUN_CORE,
    "comfy.samplers.KSAMPLER": RUN_CORE,
    "comfy.sd.load_diffusion_model": RUN_CORE,
    "comfy.sd.load_diffusion_model_state_dict": RUN_CORE,
    "comfy.sd.load_lora_for_models": RUN_CORE,
    "comfy.patcher_extension.WrappersMP": RUN_CORE,
    "comfy.patcher_extension.CallbacksMP": RUN_CORE,
    "comfy.quant_ops": RUN_CORE,
    "comfy.ldm.wan.vae": RUN_CORE,
    "comfy_extras.nodes_ar_video.SamplerARVideo": RUN_CORE,
    "comfy_extras.nodes_custom_sampler.Guider_Basic": RUN_CORE,
    "folder_paths": RUN_CORE,
    "server.PromptServer": RUN_CORE,
    "comfy.model_prefetch": COMPILER_CORE,
    "comfy.model_prefetch.pause_malloc_graph": COMPILER_CORE,
    "comfy.model_prefetch.ACTIVE_MALLOC_GRAPHS": COMPILER_CORE,
}


class CoreMissing(RuntimeError):
    """A ComfyUI name the pack needs is not offered by the running ComfyUI (the message says what to do)."""


_UNSET = object()


def _split(name: str):
    """(module, [attributes]) of ``name``: the longest importable module prefix, then the attributes after it."""
    parts = name.split(".")
    last_error = None
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:        # a ComfyUI module that raises or calls sys.exit while imported: an ImportProblem naming it
            return guarded_import(module), parts[cut:], None
        except ImportProblem as exc:
            if exc.installed or (exc.module != module and not module.startswith(exc.module + ".")):
                return None, parts[cut:], exc    # the module fails, or a dependency it imports is absent
            last_error = exc
    return None, parts, last_error


def _lookup(name: str):
    """(object or _UNSET, the failure's text or None)."""
    if name not in NAMES:
        raise KeyError(f"{name} is not in nodes/comfy_core.NAMES: add it there with the core that has it")
    module, attrs, error = _split(name)
    if module is None:
        return _UNSET, error
    obj = module
    for attr in attrs:
        obj = getattr(obj, attr, _UNSET)
        if obj is _UNSET:
            return _UNSET, None
    return obj, None


def _importable(name: str) -> bool:
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def in_comfyui() -> bool:
    """Whether ComfyUI's core imports here (``comfy`` and ``folder_paths``)."""
    return _importable("comfy") and _importable("folder_paths")


def missing_message(name: str, error: BaseException | None = None) -> str:
    """What to tell the user when ``name`` cannot be had: which ComfyUI runs, which core has it, what to install."""
    since = NAMES[name]
    if not in_comfyui():
        why = f" ({error})" if isinstance(error, ImportProblem) and error.installed else ""   # present but failing
        return (f"Wan Accel needs ComfyUI's {name} (ComfyUI {since} or newer): ComfyUI does not import here{why}. "
                f"Run this inside ComfyUI, or with ComfyUI's Python and its folder on the path.")
    found = comfyui_version()           # the running ComfyUI's version (app/doctor/versions.py reads it)
    running = found if found and found != NOT_FOUND else "of unknown version"
    text = f"Wan Accel needs {name} from ComfyUI, which this ComfyUI ({running}) does not offer"
    if error is not None:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        text += f": importing it failed ({type(error).__name__}: {first})"
        fix = dependency_fix(str(error))
        if fix:
            return f"{text}. {fix}"
    return f"{text}. ComfyUI {since} has it: update ComfyUI (or install the version of Wan Accel made for yours)."


def core(name: str):
    """The ComfyUI object ``name`` (a key of NAMES); CoreMissing with what to do when this ComfyUI lacks it."""
    value, error = _lookup(name)
    if value is _UNSET:
        raise CoreMissing(missing_message(name, error))
    return value


def optional(name: str):
    """The ComfyUI object ``name``, or None where ComfyUI or the name is absent (outside ComfyUI, older cores)."""
    value, _ = _lookup(name)
    return None if value is _UNSET else value


def start_core(device_type: str):
    """ComfyUI's model management, started on the CPU (as ``main.py --cpu``) when asked for a CPU before anything
    imported it; CoreMissing when ComfyUI does not import."""
    if device_type == "cpu" and "comfy.model_management" not in sys.modules:
        core("comfy.cli_args.args").cpu = True
    return core("comfy.model_management")


def progress_and_interrupt():
    """(ComfyUI's ProgressBar class, its interrupt check), each None outside ComfyUI."""
    mm = optional("comfy.model_management")
    return optional("comfy.utils.ProgressBar"), getattr(mm, "throw_exception_if_processing_interrupted", None)


class ComfyProgress:
    """A node's progress bar (made at its first update, with that update's total) and interrupt check, each a no-op
    outside ComfyUI."""

    def __init__(self):
        self.bar = None
        self.bar_cls, self.interrupt = progress_and_interrupt()

    def check(self, *_args) -> None:
        """Stop here when the prompt was interrupted (any arguments: those of a step callback)."""
        if self.interrupt is not None:
            self.interrupt()

    def update(self, done: int, total: int, preview=None) -> None:
        if self.bar_cls is not None:
            self.bar = self.bar or self.bar_cls(total)
            self.bar.update_absolute(done, total, preview)


# the wrapper and callback kinds the pack registers: (ComfyUI's attribute, its value in every core so far)
_KINDS = {"outer_sample": ("WrappersMP", "OUTER_SAMPLE", "outer_sample"),
          "apply_model": ("WrappersMP", "APPLY_MODEL", "apply_model"),
          "diffusion_model": ("WrappersMP", "DIFFUSION_MODEL", "diffusion_model"),
          "on_load": ("CallbacksMP", "ON_LOAD", "on_load_after"),
          "on_detach": ("CallbacksMP", "ON_DETACH", "on_detach_after"),
          "on_cleanup": ("CallbacksMP", "ON_CLEANUP", "on_cleanup")}


def wrapper_types() -> dict:
    """{kind: ComfyUI's name} of the wrappers and callbacks the pack registers (``comfy.patcher_extension``; the
    same strings outside ComfyUI, where model patchers are stand-ins)."""
    out = {}
    for kind, (holder, attr, value) in _KINDS.items():
        found = optional(f"comfy.patcher_extension.{holder}")
        out[kind] = value if found is None else getattr(found, attr, value)
    return out


# ---------------------------------------------------------------------- the Comfy Compiler (0.34+)
_LOCK = threading.RLock()
_OWNED = [0]                # how many of the pack's runs hold the compiler off (the flag is process-wide)


def compiler_present() -> bool:
    """Whether this core has the Comfy Compiler (``comfy.model_prefetch`` and its ``--disable-comfy-compiler``)."""
    args = optional("comfy.cli_args.args")
    return optional("comfy.model_prefetch") is not None and hasattr(args, "disable_comfy_compiler")


@contextlib.contextmanager
def _compiler_off():
    """``args.disable_comfy_compiler`` set for the duration (counted across overlapping runs, restored after the
    last; a user's own --disable-comfy-compiler is never changed)."""
    args = optional("comfy.cli_args.args") if compiler_present() else None
    owns = False
    if args is not None:
        with _LOCK:
            if _OWNED[0] > 0 or not args.disable_comfy_compiler:
                args.disable_comfy_compiler = True
                _OWNED[0] += 1
                owns = True
    try:
        yield
    finally:
        if owns:
            with _LOCK:
                _OWNED[0] -= 1
                if _OWNED[0] == 0:
                    args.disable_comfy_compiler = False


@contextlib.contextmanager
def _paused(graph):
    graph.pause()
    try:
        yield
    finally:
        graph.resume()


def _pause_graph():
    """Core's pause of the memory graph open on this thread: ``pause_malloc_graph()``, or on the first compiler cores
    (graphs by thread in ``ACTIVE_MALLOC_GRAPHS``, no pause helper) that graph's own pause/resume."""
    pause = optional("comfy.model_prefetch.pause_malloc_graph")
    if pause is not None:
        return pause()
    graphs = optional("comfy.model_prefetch.ACTIVE_MALLOC_GRAPHS")
    graph = graphs.get(threading.get_ident()) if isinstance(graphs, dict) else None
    return _paused(graph) if graph is not None and hasattr(graph, "pause") else contextlib.nullcontext()


@contextlib.contextmanager
def outside_memory_graph():
    """The pack's own work (loop, allocations, CUDA graphs, block swap) outside core's memory graph: a graph open on
    this thread is paused (core's ``pause_malloc_graph``) and the compiler stays off until the work ends, so no
    core code called inside opens one. Nothing happens on cores without the compiler."""
    with _compiler_off(), (_pause_graph() if compiler_present() else contextlib.nullcontext()):
        yield


def _outer_sample_guard(executor, *args, **kwargs):
    with outside_memory_graph():
        return executor(*args, **kwargs)


def add_outer_sample_guard(patcher, key: str) -> None:
    """Register, under ``key``, the OUTER_SAMPLE wrapper that runs a sampling run of ``patcher`` outside core's
    memory graph (a pack's hooks on core's own forward: block swap, compiled regions). Registered on every core:
    the wrapper itself does nothing where there is no compiler."""
    kind = wrapper_types()["outer_sample"]
    remove = getattr(patcher, "remove_wrappers_with_key", None)
    if remove is not None:
        remove(kind, key)
    patcher.add_wrapper_with_key(kind, key, _outer_sample_guard)
