from _comfy_stub import stub_package

stub_package(__name__, "tokenizers and text encoders of ComfyUI's CLIP loaders; the bench gives the model a random text embedding")
