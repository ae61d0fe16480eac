from _comfy_stub import stub_package

stub_package(__name__, "audio models (LTX-Video audio, Stable Audio); Wan video sampling does not use them")
