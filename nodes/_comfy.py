"""ComfyUI's progress bar and interrupt check, looked up lazily; both are None outside ComfyUI."""
from __future__ import annotations


def progress_and_interrupt():
    """(ProgressBar class or None, interrupt-check function or None)."""
    try:
        import comfy.model_management as mm
        import comfy.utils
    except ImportError:
        return None, None
    return comfy.utils.ProgressBar, mm.throw_exception_if_processing_interrupted
