"""Building a Triton kernel for a GPU without one (PTX for an ``sm_XX`` target): the front end, the layouts and the
shared memory a launch there would use. Skips where this triton build cannot target CUDA (no NVIDIA backend or
ptxas)."""
from __future__ import annotations

import pytest


def build_ptx(fn, signature: dict, consts: dict, arch: int, num_warps: int, num_stages: int = 3,
              aligned: tuple = ()):
    """The compiled kernel of ``fn`` (a plain function or a ``triton.jit`` one) for ``sm_<arch>``: ``signature``
    types the runtime arguments, ``consts`` the constexpr ones; ``aligned`` names the pointers and strides a real
    launch specializes as multiples of 16 (Triton does so for the pack's tensors), which lets it vectorize and
    pipeline their loads. Set TRITON_CACHE_DIR to a fresh folder first (a real compile, not a cache hit)."""
    triton = pytest.importorskip("triton")
    compiler = pytest.importorskip("triton.compiler")
    backends = pytest.importorskip("triton.backends.compiler")
    jitted = fn if hasattr(fn, "arg_names") else triton.jit(fn)
    attrs = {(jitted.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = compiler.ASTSource(fn=jitted, signature=dict(signature, **{k: "constexpr" for k in consts}),
                             constexprs=consts, attrs=attrs)
    try:
        return triton.compile(src, target=backends.GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    except RuntimeError as exc:  # no ptxas / NVIDIA backend in this triton build
        if "ptxas" in str(exc).lower() or "backend" in str(exc).lower():
            pytest.skip(f"cannot build for CUDA here: {exc}")
        raise
