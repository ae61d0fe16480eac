from _comfy_stub import stub_package

stub_package(__name__, "the beta scheduler, the LMS sampler's integration and pose heatmaps; the AR samplers use none of them")
