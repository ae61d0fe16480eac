from _comfy_stub import stub_package

stub_package(__name__, "PyAV: ComfyUI's video file inputs and outputs; the bench reads and writes no video files")
