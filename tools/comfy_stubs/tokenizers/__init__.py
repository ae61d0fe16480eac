from _comfy_stub import stub_package

stub_package(__name__, "text encoders' tokenizers; the bench gives the model a random text embedding")
