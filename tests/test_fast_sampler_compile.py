"""Regional compile of the optimized path: no recompiles from Python bookkeeping (cache fill state, write offsets)."""
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from wan_accel.compile import CompileSettings, uncompile_model
from wan_accel.compile.apply import compile_handle
from wan_accel.app.prepare import compile_for_sampling
from run_helpers import generate_latents
from wan_accel.model.tiny import TINY_CONFIG, tiny_causal_model


def _graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def test_compiled_blocks_compile_once_per_distinct_chunk_shape():
    model = tiny_causal_model()
    ctx = torch.randn(1, 4, TINY_CONFIG.text_dim, generator=torch.Generator().manual_seed(0))
    eager = generate_latents(model, ctx, 6, 4, 6, seed=1, path="optimized",
                             fast_options={"skip_last_refresh": False})
    settings = CompileSettings(backend="eager", warm_start=False)
    torch._dynamo.reset()
    counters.clear()
    try:
        # two chunks (global cache: chunk 0 attends 1 chunk, chunk 1 attends 2: two distinct shapes) + refreshes
        compile_for_sampling(model, settings)
        out = generate_latents(model, ctx, 6, 4, 6, seed=1, path="optimized",
                               fast_options={"skip_last_refresh": False})
        assert compile_handle(model) is not None and compile_handle(model).settings.scope == "blocks"
        first = _graphs()
        assert 1 <= first <= 2, first
        compile_for_sampling(model, settings)          # the same settings: kept, not recompiled
        generate_latents(model, ctx, 6, 4, 6, seed=1, path="optimized",
                         fast_options={"skip_last_refresh": False})
        assert _graphs() == first                      # a second run compiles nothing
    finally:
        uncompile_model(model)
        torch._dynamo.reset()
    assert (out - eager).abs().max().item() <= 1e-5
