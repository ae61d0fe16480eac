"""One definition of "out of memory" (cache/oom.py), shared by the OOM retry, the graph manager and the tuner."""
from __future__ import annotations

import torch

from wan_accel.cache import autotune, oom
from wan_accel.memory import oom as memory_oom


def test_memory_oom_re_exports_the_one_definition():
    assert memory_oom.is_oom is oom.is_oom


def test_is_oom_covers_allocator_messages_and_types():
    assert oom.is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert oom.is_oom(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)"))
    assert oom.is_oom(MemoryError()) and oom.is_oom(oom.SoftOOM("tiled"))
    assert not oom.is_oom(RuntimeError("no kernel image is available for execution on the device"))
    assert not oom.is_oom(ValueError("out of memory"))


def test_autotuner_treats_every_oom_kind_as_transient():
    # cuBLAS allocation failures used to be recorded as a permanent config failure
    assert autotune._is_transient(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED"))
    assert autotune._is_transient(KeyboardInterrupt())
    assert not autotune._is_transient(RuntimeError("PTXAS error"))
