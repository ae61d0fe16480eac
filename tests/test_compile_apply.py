"""compile_model / compile_for_comfy with Dynamo's eager backend (fast): structure, scoping, no global change."""
from __future__ import annotations

import pytest
import torch

import wan_accel.compile.compat as compat
from wan_accel.compile import CompileSettings, compile_model, end_warmup, uncompile_model
from wan_accel.compile.apply import compile_handle
from wan_accel.nodes.comfy.comfy_compile import compile_for_comfy
from wan_accel.bench.compile import tiny_workload
from wan_accel.kernels import current_caps

EAGER = dict(backend="eager", warm_start=False)


def _dynamo_snapshot():
    import torch._dynamo.config as dc

    return dc.get_config_copy()


def _inductor_snapshot():
    import torch._inductor.config as ic

    return ic.save_config_portable()


def test_blocks_scope_compiles_each_block_and_keeps_state_dict():
    model, run = tiny_workload(blocks=3)
    expected = run(model)
    keys = list(model.state_dict())
    compile_model(model, CompileSettings(**EAGER))
    handle = compile_handle(model)
    assert len(handle.targets) == 3 and all(name == "forward" for _, name in handle.targets)
    assert list(model.state_dict()) == keys
    assert torch.allclose(run(model), expected, atol=1e-6)
    assert handle.calls == 3 and handle.compiles == 1  # identical blocks share one graph
    assert uncompile_model(model) and compile_handle(model) is None
    assert "forward" not in model.blocks[0].__dict__


def test_whole_scope_compiles_forward():
    model, run = tiny_workload(blocks=2)
    expected = run(model)
    compile_model(model, CompileSettings(scope="whole", **EAGER))
    assert [name for _, name in compile_handle(model).targets] == ["forward"]
    assert torch.allclose(run(model), expected, atol=1e-6)


def test_blocks_scope_needs_blocks():
    with pytest.raises(ValueError, match="model.blocks"):
        compile_model(torch.nn.Linear(4, 4), CompileSettings(**EAGER))


def test_compile_failures_are_dynamo_and_inductor_errors():
    """The errors a failed compile raises (not the region's own computation's) are found in this torch."""
    from torch._dynamo.exc import TorchDynamoException
    from torch._inductor.exc import InductorError

    from wan_accel.compile.apply import compile_errors

    assert compile_errors() == (TorchDynamoException, InductorError)


class _Probe(torch.nn.Module):
    """Reads the Dynamo recompile limit and kernel caps while the compiled region runs."""

    seen: list = []

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4)])

    def forward(self, x):
        return self.blocks[0](x)


@torch._dynamo.disable
def _record(tag):
    import torch._dynamo.config as dc

    _Probe.seen.append((tag, getattr(dc, compat.dynamo_limit_name()), current_caps()["XBLOCK"]))


class _ProbeBlock(torch.nn.Linear):
    def forward(self, x):
        _record("call")
        return super().forward(x)


@pytest.mark.parametrize("per_call", [True, False])
def test_lock_global_ops_leaves_global_config_unchanged(monkeypatch, per_call):
    monkeypatch.setattr(compat, "per_call_recompile_limit", lambda: per_call)
    model = _Probe()
    model.blocks[0] = _ProbeBlock(4, 4)
    dyn, ind = _dynamo_snapshot(), _inductor_snapshot()
    limit_before = getattr(torch._dynamo.config, compat.dynamo_limit_name())
    _Probe.seen.clear()
    compile_model(model, CompileSettings(recompile_limit=limit_before + 5, tiling_preset="EXTREME-PLUS", **EAGER))
    x = torch.randn(2, 4)
    model(x)
    end_warmup(model)
    model(x)
    assert _dynamo_snapshot() == dyn and _inductor_snapshot() == ind
    assert _Probe.seen and all(caps == 64 for _, _, caps in _Probe.seen)  # locked: conservative caps
    if not per_call:  # no per-call argument: the limit is patched only around the calls
        assert all(limit == limit_before + 5 for _, limit, _ in _Probe.seen)


def test_unlocked_fallback_sets_and_restores_global_limit(monkeypatch):
    monkeypatch.setattr(compat, "per_call_recompile_limit", lambda: False)
    name = compat.dynamo_limit_name()
    before = getattr(torch._dynamo.config, name)
    model, run = tiny_workload(blocks=1)
    compile_model(model, CompileSettings(lock_global_ops=False, recompile_limit=before + 3, **EAGER))
    assert getattr(torch._dynamo.config, name) == before + 3
    uncompile_model(model)
    assert getattr(torch._dynamo.config, name) == before


def test_stance_after_warmup_runs_eager_instead_of_recompiling():
    model, run = tiny_workload(blocks=1, dim=16)
    compile_model(model, CompileSettings(dynamic="false", **EAGER))
    handle = compile_handle(model)
    x = torch.randn(1, 8, 16)
    e = torch.randn(1, 4, 16)
    with torch.no_grad():
        model(x, e)
        end_warmup(model)
        graphs = compat.graph_count()
        out = model(torch.randn(1, 5, 16), e)  # new shape: would recompile (dynamic=false)
    assert compat.graph_count() == graphs and out.shape == (1, 5, 16)
    assert handle.warm


class FakePatcher:
    """The part of ComfyUI's ModelPatcher that compile_for_comfy uses."""

    def __init__(self, base, wrappers=None):
        self.model = base
        self.wrappers = {k: {kk: list(vv) for kk, vv in v.items()} for k, v in (wrappers or {}).items()}

    def clone(self):
        return FakePatcher(self.model, self.wrappers)

    def get_model_object(self, name):
        return getattr(self.model, name)

    def add_wrapper_with_key(self, wtype, key, fn):
        self.wrappers.setdefault(wtype, {}).setdefault(key, []).append(fn)

    def remove_wrappers_with_key(self, wtype, key):
        self.wrappers.get(wtype, {}).pop(key, None)


class Executor:
    def __init__(self, class_obj, fn):
        self.class_obj, self.fn = class_obj, fn

    def __call__(self, *a, **k):
        return self.fn(*a, **k)


def test_comfy_patch_swaps_blocks_only_during_apply_model():
    diffusion_model, run = tiny_workload(blocks=2)
    base = torch.nn.Module()
    base.diffusion_model = diffusion_model
    original_blocks = list(diffusion_model.blocks)
    expected = run(diffusion_model)
    patcher = FakePatcher(base)
    patched = compile_for_comfy(patcher, CompileSettings(**EAGER))
    assert patched is not patcher and patcher.wrappers == {}  # the input patcher is untouched
    apply_wrapper = patched.wrappers["apply_model"]["wan_accel.compile"][0]
    outer_wrapper = patched.wrappers["outer_sample"]["wan_accel.compile"][0]
    seen = []

    def apply_model():
        seen.append([type(b).__name__ for b in base.diffusion_model.blocks])
        return run(base.diffusion_model)

    out = apply_wrapper(Executor(base, apply_model))
    assert torch.allclose(out, expected, atol=1e-6)
    assert seen == [["CompiledRegion", "CompiledRegion"]]
    assert list(diffusion_model.blocks) == original_blocks  # restored after the call
    assert not any("_orig_mod" in k for k in base.state_dict())
    handle = apply_wrapper.handle
    assert not handle.warm
    outer_wrapper(Executor(base, lambda: apply_wrapper(Executor(base, apply_model))))
    assert handle.warm
    # applying again replaces the previous wrappers instead of stacking them
    again = compile_for_comfy(patched, CompileSettings(**EAGER))
    assert len(again.wrappers["apply_model"]["wan_accel.compile"]) == 1


def test_tiny_causal_wan_compiles_per_block_with_identical_samples():
    from wan_accel.bench.compile import wan_workload

    model, run = wan_workload()
    expected = run(model)
    compile_model(model, CompileSettings(**EAGER))
    handle = compile_handle(model)
    assert len(handle.targets) == len(model.blocks)
    first = run(model)
    compiles = handle.compiles
    end_warmup(model)
    second = run(model)  # same shapes: no new graph after warm-up
    assert handle.compiles == compiles
    assert torch.equal(first, expected) and torch.equal(second, expected)


def test_native_block_regions_pass_a_contiguous_residual_input():
    """A strided first-block input must not fail the stride guard of the graph identical blocks share."""
    import torch

    from wan_accel.compile.apply import _ScopedForward

    seen = []

    class Handle:
        def call(self, fn, args, kwargs, eager=None):
            seen.append(args)
            return fn(*args, **kwargs)

    x = torch.randn(4, 6).t()  # non-contiguous view
    other = torch.randn(4, 6).t()
    region = _ScopedForward(lambda a, b: a + b, Handle(), contiguous_input=True)
    out = region(x, other)
    assert seen[0][0].is_contiguous() and torch.equal(out, x + other)
    assert seen[0][1] is other  # only the residual input is touched
    _ScopedForward(lambda a, b: a, Handle())(x, other)
    assert seen[1][0] is x  # our own model's regions are left as they are


@pytest.mark.parametrize("swap_first", [True, False])
def test_block_swap_streams_under_apply_compile_native(swap_first):
    """The compiled stand-ins fire the original blocks' hooks: swapped blocks are materialised under compile, in
    either order of the nodes (a swap installed before or after Apply Compile), and outputs match resident."""
    from wan_accel.memory.block_swap import SwapSettings, apply_block_swap

    diffusion_model, run = tiny_workload(blocks=3)
    base = torch.nn.Module()
    base.diffusion_model = diffusion_model
    with torch.no_grad():
        expected = run(diffusion_model)
    swap = apply_block_swap(diffusion_model, SwapSettings(2, 1), device="cpu") if swap_first else None
    patched = compile_for_comfy(FakePatcher(base), CompileSettings(**EAGER))
    if swap is None:
        swap = apply_block_swap(diffusion_model, SwapSettings(2, 1), device="cpu")
    apply_wrapper = patched.wrappers["apply_model"]["wan_accel.compile"][0]
    seen = []

    def apply_model():
        seen.append([type(b).__name__ for b in base.diffusion_model.blocks])
        with torch.no_grad():
            return run(base.diffusion_model)

    for n in (1, 2):
        out = apply_wrapper(Executor(base, apply_model))
        assert seen[-1] == ["CompiledRegion"] * 3
        assert torch.allclose(out, expected, atol=1e-6)
        assert swap.stats.copies == 2 * n, "the swap's hooks did not fire under compile"
        assert all(u.state == "host" for u in swap.units.values())  # dropped again after each block
    swap.remove()


def test_call_with_module_hooks_honours_kwargs_hooks_and_results():
    from wan_accel.compile.apply import call_with_module_hooks

    m = torch.nn.Linear(2, 2)
    calls = []
    m.register_forward_pre_hook(lambda mod, args: calls.append("pre") or (args[0] * 2,))
    m.register_forward_pre_hook(lambda mod, args, kw: calls.append("pre_kw") or (args, kw), with_kwargs=True)
    m.register_forward_hook(lambda mod, args, out: calls.append("post") or out + 1)
    x = torch.ones(1, 2)
    out = call_with_module_hooks(m, lambda a: a, (x,), {})
    assert calls == ["pre", "pre_kw", "post"] and torch.equal(out, x * 2 + 1)
