from _comfy_stub import stub_package

stub_package(__name__, "image models and transforms of other model families; Wan sampling does not use them")
