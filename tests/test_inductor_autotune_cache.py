"""Inductor's GEMM autotune results stay in Inductor's own cache, which reads them back; the pack's store does
not keep a copy that nothing reads."""
from __future__ import annotations

from wan_accel.cache import LimitCache
from wan_accel.model.tiny import tiny_causal_model


def test_max_autotune_compile_leaves_gemm_choices_to_inductors_own_cache(cache_path, monkeypatch):
    """Inductor's GEMM autotune results are not copied into the operator store (nothing read them back); Inductor
    keeps and reads them itself, in its cache folder, which a warm start puts beside the limit cache."""
    import os

    from torch._inductor import select_algorithm

    from wan_accel.compile import CompileSettings, compile_model, uncompile_model

    savers = []
    monkeypatch.setattr(select_algorithm, "add_feedback_saver", savers.append)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    model = tiny_causal_model()
    compile_model(model, CompileSettings(mode="max-autotune", warm_start=True), cache=LimitCache(cache_path))
    try:
        assert savers == []
        assert os.path.dirname(os.environ["TORCHINDUCTOR_CACHE_DIR"]) == str(cache_path.parent)
        assert not [e for e in LimitCache(cache_path).entries("operator") if e["key"].startswith("inductor/")]
    finally:
        uncompile_model(model)
