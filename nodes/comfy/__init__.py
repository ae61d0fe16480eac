"""The pack's side of ComfyUI's own objects, used by the node classes one floor up: ComfyUI's names through one
door (``comfy_core``), its model files, its compiler, the engine that samples a native MODEL (``native_engine``, its
probe and bench side), the streaming decoder over its VAE and the reference-image helpers. No node class lives here."""
