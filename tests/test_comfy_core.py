"""The one door to ComfyUI (nodes/comfy/comfy_core.py) against stand-ins shaped as cores newer than 0.33 (tests/
comfy_newer.py): the pack's loop, block swap and compiled regions run outside the Comfy Compiler's memory graph;
the engine samples core 0.40's Wan modules (attention containers, the linear_input_act FFN) as it samples plain
ones; a missing name or a too-old dependency is said in words."""
from __future__ import annotations

import ast
import functools
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import comfy_newer
import pytest
import torch
from test_memory_nodes import FakePatcher
from test_native_sampler import _native
from torch import nn
from wan_accel.model.borrowed import borrow_wan_model
from wan_accel.model.tiny import TINY_CONFIG, tiny_causal_model
from wan_accel.nodes.comfy import comfy_core
from wan_accel.nodes.comfy.native_engine import sample_wan_accel
from run_helpers import generate_latents
from wan_accel.sampling.scheduler import resolve_schedule

NODES = Path(comfy_core.__file__).parents[1]          # nodes/, ComfyUI's side in nodes/comfy/
COMFY_ROOTS = {"comfy", "comfy_extras", "comfy_api", "comfy_execution", "folder_paths", "server", "comfyui_version",
               "latent_preview", "node_helpers", "execution"}
CTX = torch.randn(1, 5, TINY_CONFIG.text_dim, generator=torch.Generator().manual_seed(4))


def _model_k(dm):
    return _native(dm, CTX)[0]


def _sample(model_k, step_callback=None):
    noise = torch.randn(1, 16, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    sigmas = torch.tensor(resolve_schedule("self_forcing").sigmas())
    return sample_wan_accel(model_k, noise, sigmas, extra_args={"seed": 1}, frames_per_block=3, path="reference",
                            step_callback=step_callback)


# ---------------------------------------------------------------------- one door
def _comfy_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
        found += [n for n in names if n.split(".")[0] in COMFY_ROOTS]
    return found


def test_only_comfy_core_imports_comfyui_and_every_name_used_is_declared():
    package = NODES.parent
    sources = [p for p in package.rglob("*.py") if p.name != "comfy_core.py"
               and not {"tests", "tools", "build"} & set(p.relative_to(package).parts)
               and not any(part.startswith(".") for part in p.relative_to(package).parts)]   # .venv and the like
    direct = {str(p.relative_to(package)): _comfy_imports(p) for p in sources}
    assert not {k: v for k, v in direct.items() if v}, "ComfyUI imported outside nodes/comfy/comfy_core.py"
    kitchen_imports = [str(p.relative_to(package)) for p in sources
                       if re.search(r"import_module\(\s*f?[\"']comfy_(kitchen|aimdo)|^\s*(from|import) comfy_(kitchen|aimdo)",
                                    p.read_text(), re.MULTILINE)]
    assert kitchen_imports == ["kernels/kitchen.py"], kitchen_imports      # comfy-kitchen found in one place too
    used = set()
    for p in NODES.rglob("*.py"):
        used |= set(re.findall(r"""\b(?:core|optional)\(\s*f?["']([\w.]+)["']""", p.read_text()))
    assert used and used <= set(comfy_core.NAMES), sorted(used - set(comfy_core.NAMES))


def test_missing_name_says_what_and_which_core_has_it(monkeypatch):
    comfy_newer.install(monkeypatch, version="0.31.0")
    with pytest.raises(comfy_core.CoreMissing) as err:
        comfy_core.core("comfy.sd.load_diffusion_model_state_dict")
    text = str(err.value)
    assert "comfy.sd.load_diffusion_model_state_dict" in text and "(0.31.0)" in text
    assert f"ComfyUI {comfy_core.RUN_CORE} has it" in text
    from wan_accel.nodes.native_nodes import WanTinyNativeModel
    with pytest.raises(comfy_core.CoreMissing, match="load_diffusion_model_state_dict"):
        WanTinyNativeModel().load(seed=0)
    assert comfy_core.optional("comfy.sd.load_diffusion_model_state_dict") is None


def test_a_core_that_needs_a_newer_aimdo_names_the_fix(monkeypatch):
    comfy_newer.install(monkeypatch, compiler=False)
    import importlib

    real = importlib.import_module

    def failing(name, *a, **k):                 # core's model_prefetch importing comfy_aimdo.malloc_graph on aimdo 0.4
        if name == "comfy.model_prefetch":
            raise ModuleNotFoundError("No module named 'comfy_aimdo.malloc_graph'", name="comfy_aimdo.malloc_graph")
        return real(name, *a, **k)
    monkeypatch.setattr(comfy_core.importlib, "import_module", failing)
    with pytest.raises(comfy_core.CoreMissing) as err:
        comfy_core.core("comfy.model_prefetch.pause_malloc_graph")
    assert "comfy_aimdo.malloc_graph" in str(err.value) and "comfy-aimdo" in str(err.value)
    assert "requirements.txt" in str(err.value)


def test_outside_comfyui_names_are_absent_and_core_says_so():
    assert comfy_core.optional("comfy.model_management") is None
    assert comfy_core.progress_and_interrupt() == (None, None)
    with pytest.raises(comfy_core.CoreMissing, match="does not import here"):
        comfy_core.core("comfy.samplers.KSAMPLER")
    with comfy_core.outside_memory_graph():      # nothing to step out of
        pass


# ---------------------------------------------------------------------- the Comfy Compiler's memory graph
def _graph_checker(prefetch, device, seen):
    """A step callback recording, at each step of the pack's loop, whether core's graph records or could open."""
    def check(*_):
        graph = prefetch.MALLOC_GRAPHS.get(threading.get_ident())
        seen.append((graph is not None and graph.recording, prefetch.malloc_graph_enabled(device)))
    return check


def test_the_pack_loop_never_runs_inside_core_memory_graph(monkeypatch):
    newer = comfy_newer.install(monkeypatch)
    device = torch.device("cpu")
    prefetch = newer.prefetch
    model_k = _model_k(tiny_causal_model(seed=2))
    seen: list = []
    out_free = _sample(model_k, _graph_checker(prefetch, device, seen))
    assert seen and not any(enabled for _, enabled in seen)     # nothing called inside the loop may open a graph
    assert newer.args.disable_comfy_compiler is False            # given back after the run
    prefetch.malloc_graph_begin(device)                          # a graph open on this thread (core's, a preview's)
    graph = prefetch.MALLOC_GRAPHS[threading.get_ident()]
    seen.clear()
    out = _sample(model_k, _graph_checker(prefetch, device, seen))
    assert seen and seen == [(False, False)] * len(seen)         # paused and closed for the whole loop
    assert graph.recording and graph.events == ["pause", "resume"]
    torch.testing.assert_close(out, out_free, rtol=0, atol=0)
    prefetch.malloc_graph_end()


def test_first_compiler_cores_without_pause_helper_are_stepped_out_of_too(monkeypatch):
    newer = comfy_newer.install(monkeypatch, version="0.34.0", compiler="early")
    prefetch, device = newer.prefetch, torch.device("cpu")
    owner = nn.Module()
    prefetch.malloc_graph_begin(owner, device)
    graph = prefetch.ACTIVE_MALLOC_GRAPHS[threading.get_ident()]
    seen = []

    def check(*_):
        seen.append((graph.recording, prefetch.malloc_graph_enabled(device)))
    _sample(_model_k(tiny_causal_model(seed=2)), check)
    assert seen and seen == [(False, False)] * len(seen)
    assert graph.recording and newer.args.disable_comfy_compiler is False
    prefetch.malloc_graph_end()


def test_a_user_disabled_compiler_is_left_as_set(monkeypatch):
    newer = comfy_newer.install(monkeypatch)
    newer.args.disable_comfy_compiler = True
    with comfy_core.outside_memory_graph(), comfy_core.outside_memory_graph():
        assert newer.args.disable_comfy_compiler is True
    assert newer.args.disable_comfy_compiler is True


def test_on_033_the_door_does_nothing(monkeypatch):
    newer = comfy_newer.install(monkeypatch, version="0.33.0", compiler=False)
    newer.args.__dict__.pop("disable_comfy_compiler")
    assert not comfy_core.compiler_present()
    with comfy_core.outside_memory_graph():
        assert not hasattr(newer.args, "disable_comfy_compiler")
    out = _sample(_model_k(tiny_causal_model(seed=2)))
    assert out.shape == (1, 16, 3, 8, 8)


def _core_forward_inside_outer_sample(patcher, prefetch, device):
    """Core's sampling run: the OUTER_SAMPLE wrappers, then a model forward that opens the graph when enabled
    (as a core model that opted into the compiler does) and reports whether it did."""
    def forward():
        opened = prefetch.malloc_graph_enabled(device)
        if opened:
            prefetch.malloc_graph_begin(device)
            prefetch.malloc_graph_end()
        return opened
    run = forward
    for fn in patcher.wrappers.get("outer_sample", {}).values():
        run = functools.partial(fn, run)            # wrapper(executor): the executor is the inner run
    return run()


def test_block_swap_on_core_model_steps_out_at_outer_sample(monkeypatch):
    from wan_accel.nodes import memory_nodes
    newer = comfy_newer.install(monkeypatch)
    device = torch.device("cpu")
    base = nn.Module()
    base.diffusion_model = tiny_causal_model(seed=1)
    patcher = FakePatcher(base)
    assert _core_forward_inside_outer_sample(patcher, newer.prefetch, device)      # unpatched: core compiles
    (patched,) = memory_nodes.WanBlockSwap().apply(patcher, blocks_to_swap=1, prefetch_blocks=1)
    assert memory_nodes.PATCH_KEY in patched.wrappers["outer_sample"]
    assert not _core_forward_inside_outer_sample(patched, newer.prefetch, device)
    assert newer.args.disable_comfy_compiler is False


def test_apply_compile_on_core_model_steps_out_at_outer_sample(monkeypatch):
    from wan_accel.compile import apply as compile_apply
    from wan_accel.nodes.comfy.comfy_compile import compile_for_comfy
    newer = comfy_newer.install(monkeypatch)
    ended = []
    handle = SimpleNamespace(end_warmup=lambda: ended.append(True), settings=None)
    monkeypatch.setattr(compile_apply, "compile_regions", lambda dm, settings, cache, prefix: (handle, {}))
    base = nn.Module()
    base.diffusion_model = nn.Linear(2, 2)
    patched = compile_for_comfy(FakePatcher(base))
    assert not _core_forward_inside_outer_sample(patched, newer.prefetch, torch.device("cpu")) and ended


# ---------------------------------------------------------------------- core 0.40's Wan modules
def test_engine_samples_core_040_modules_as_plain_ones(monkeypatch):
    newer = comfy_newer.install(monkeypatch)
    plain = tiny_causal_model(seed=5)
    want = generate_latents(plain, CTX, 6, 8, 8, seed=3, frames_per_block=3, path="reference")
    source = comfy_newer.newer_core_wan(tiny_causal_model(seed=5), newer.ops)
    attn = source.blocks[0].self_attn
    assert isinstance(attn.comfy_attention, comfy_newer.ComfyAttention)
    assert type(source.blocks[0].ffn).__name__ == "WanFeedForward"
    engine = borrow_wan_model(source)
    assert engine.blocks[0].self_attn.q is attn.q                   # core's layers, called as they are
    got = generate_latents(engine, CTX, 6, 8, 8, seed=3, frames_per_block=3, path="reference")
    assert newer.ops.CALLS["run_every_op"] > 0 and newer.ops.CALLS["linear_input_act"] > 0
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_core_040_attention_contract_gives_the_engine_attention(monkeypatch):
    """Core 0.40's cross-attention over the same layers (containers in, preferred_attention) and the engine's own
    cross-attention agree: the layers the engine borrows carry core's contract, not a different projection."""
    newer = comfy_newer.install(monkeypatch)
    source = comfy_newer.newer_core_wan(tiny_causal_model(seed=5), newer.ops)
    attn = source.blocks[0].cross_attn
    x = torch.randn(1, 12, TINY_CONFIG.dim, generator=torch.Generator().manual_seed(1))
    ctx = torch.randn(1, 7, TINY_CONFIG.dim, generator=torch.Generator().manual_seed(2))
    Container = comfy_newer.AttentionTensorContainer
    q, k, v = (Container(attn.norm_q(attn.q(x))), Container(attn.norm_k(attn.k(ctx))), Container(attn.v(ctx)))
    core = attn.o(comfy_newer.optimized_attention(q, k, v, heads=TINY_CONFIG.num_heads,
                                                  preferred_attention=attn.comfy_attention, transformer_options={}))
    engine = borrow_wan_model(source).blocks[0].cross_attn
    mine = engine(x, engine.context_kv(ctx), "sdpa")
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(mine, core, rtol=64 * eps, atol=64 * eps)


def test_attention_a_checkpoint_declares_for_core_is_said_once(monkeypatch, caplog):
    newer = comfy_newer.install(monkeypatch)
    source = comfy_newer.newer_core_wan(tiny_causal_model(seed=5), newer.ops)
    source.blocks[1].self_attn.comfy_attention.config = {"attention": "comfy_kitchen_int8"}
    with caplog.at_level("INFO", logger="wan_accel"):
        _sample(_model_k(source))
        _sample(_model_k(source))
    said = [r.getMessage() for r in caplog.records if "declares attention" in r.getMessage()]
    assert len(said) == 1 and "'comfy_kitchen_int8'" in said[0] and "attention=int8" in said[0]
