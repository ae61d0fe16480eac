"""The pack's side of ComfyUI's own objects, used by the node classes one floor up: ComfyUI's names through one
door (``comfy_core``), its model files, its compiler, the engine that samples a native MODEL (``native_engine``, its
probe and bench side), the streaming decoder over its VAE and the reference-image helpers. No node class lives
here, only their bases ``Node`` (fixed ``INPUTS``) and ``FreshNode`` (runs on every prompt)."""
import copy


class Node:
    """A node whose inputs never change: ``INPUTS`` is its INPUT_TYPES (a fresh copy per call)."""
    INPUTS: dict = {}

    @classmethod
    def INPUT_TYPES(cls):
        return copy.deepcopy(cls.INPUTS)


class FreshNode(Node):
    """A node that runs again on every queued prompt (its result is never taken from ComfyUI's cache)."""

    @classmethod
    def IS_CHANGED(cls, **_kwargs):
        return float("nan")


def check_choice(name: str, value, choices):
    """A combo widget's value checked: ValueError naming the input and its choices when it is not one of them."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def with_notes(result: tuple, notes: list):
    """A node's ``result``, with ``notes`` (features that failed their self-check here) said in the node's text."""
    return {"ui": {"text": ["\n".join(notes)]}, "result": result} if notes else result


def node_mappings(nodes: dict) -> tuple[dict, dict]:
    """An area's (NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS) from its nodes named once: {key: (class, name)}."""
    return {k: cls for k, (cls, _) in nodes.items()}, {k: name for k, (_, name) in nodes.items()}
