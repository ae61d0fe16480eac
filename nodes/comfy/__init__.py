"""The pack's side of ComfyUI's own objects, used by the node classes one floor up: ComfyUI's names through one
door (``comfy_core``), its model files, its compiler, the engine that samples a native MODEL (``native_engine``, its
probe and bench side), the streaming decoder over its VAE and the reference-image helpers. No node class lives here."""
import copy


class Node:
    """A node whose inputs never change: ``INPUTS`` is its INPUT_TYPES (a fresh copy per call)."""
    INPUTS: dict = {}

    @classmethod
    def INPUT_TYPES(cls):
        return copy.deepcopy(cls.INPUTS)
