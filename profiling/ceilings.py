"""Measured ceilings of this GPU beside a profile: the bf16 matmul rate and the device-memory copy rate.

The roofline of a profile compares each kernel class's achieved rate with what this GPU reaches on the same
kind of work when nothing else limits it: a large square bf16 matmul (TFLOP/s) and a large device-to-device copy
(GB/s, bytes read plus bytes written). Timed with CUDA events after a warm-up; None on a device without CUDA.
"""
from __future__ import annotations


def measure_ceilings(device, *, size: int = 8192, copy_mib: int = 1024, repeat: int = 10) -> dict | None:
    import torch

    from ..cache.autotune import event_ms

    device = torch.device(device)
    if device.type != "cuda":
        return None
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    src = torch.empty(copy_mib * 2 ** 20, device=device, dtype=torch.uint8)
    dst = torch.empty_like(src)

    def rate(fn) -> float:
        def repeated():                 # each result dropped before the next call: no allocation is timed
            for _ in range(repeat):
                fn()

        fn()
        torch.cuda.synchronize(device)
        return event_ms(torch.cuda, repeated) / 1000.0 / repeat

    mm_s = rate(lambda: torch.mm(a, b))
    copy_s = rate(lambda: dst.copy_(src))
    del a, b, src, dst
    torch.cuda.empty_cache()
    return {"bf16_matmul_tflops": round(2 * size ** 3 / mm_s / 1e12, 1),
            "copy_gbps": round(2 * copy_mib * 2 ** 20 / copy_s / 1e9, 1)}
