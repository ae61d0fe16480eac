"""The GPU-only edges of the fast paths, on a real CUDA GPU (marked ``cuda``: skipped without one, run by
``python -m wan_accel selftest`` where a GPU is present). Each one is a defect the first GPU run found."""
import pytest
import torch

pytestmark = pytest.mark.cuda


def _model_and_ctx(dtype=torch.bfloat16):
    from wan_accel.model.tiny import tiny_causal_model
    model = tiny_causal_model(0, "cuda", dtype)
    ctx = torch.randn(1, 4, model.config.text_dim, generator=torch.Generator().manual_seed(0)).cuda()
    return model, ctx


def test_compiled_blocks_with_comfy_kitchens_ops_run_and_match_eager():
    from wan_accel.compile import CompileSettings, uncompile_model
    from wan_accel.compile.apply import compile_handle
    from wan_accel.app.prepare import compile_for_sampling
    from wan_accel.kernels import kitchen
    from run_helpers import generate_latents
    if kitchen.backend_problem("cuda", "adaln", "cuda"):
        pytest.skip("comfy-kitchen's CUDA backend is not available here")
    model, ctx = _model_and_ctx()
    run = lambda: generate_latents(model, ctx, 6, 4, 6, seed=1, path="optimized",  # noqa: E731
                                   fast_options={"ops": "kitchen", "cuda_graphs": "off"})
    eager = run()
    torch._dynamo.reset()
    try:
        compile_for_sampling(model, CompileSettings(warm_start=False))
        out = run()
        assert compile_handle(model).failed is None
    finally:
        uncompile_model(model)
        torch._dynamo.reset()
    eps = torch.finfo(torch.bfloat16).eps
    assert (out - eager).abs().max().item() <= 64 * eps * max(1.0, eager.abs().max().item())


def test_every_kitchen_candidate_verifies_in_the_dtypes_it_takes():
    from wan_accel.kernels import candidates as C
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(1, 24, 128, device="cuda", dtype=dtype)
        w = torch.ones(128, device="cuda", dtype=dtype)
        ang = torch.rand(24, 16, device="cuda") * 6.283
        args = (x, w, ang.cos(), ang.sin(), 4, 1e-6)
        for cand, why in C.listing("rmsnorm_rope", "cuda", "kitchen", dtype=dtype):
            if why is None and cand.group == "kitchen":
                C.verify(cand, args)                 # raises CandidateMismatch when its numbers are wrong


def test_sdpa_kernels_each_verify_where_they_run():
    from wan_accel.model import attention as att
    q = torch.randn(1, 300, 4, 128, device="cuda", dtype=torch.bfloat16)
    ref = att.attention_reference(q, q, q).float()
    tol = att.STORE_ULPS * torch.finfo(torch.bfloat16).eps * max(1.0, ref.abs().max().item())
    ran = 0
    for name in att.SDPA_KERNELS:
        if att.AUTO_CANDIDATES[name].rejected("cuda", torch.bfloat16, 128):
            continue
        try:
            out = att.AUTO_CANDIDATES[name].fn(q, q, q)
        except RuntimeError:
            continue                                  # this kernel does not take the call here: the store fails it
        ran += 1
        assert (out.float() - ref).abs().max().item() <= tol, name
    assert ran >= 1
