"""Stand-ins for the parts of ComfyUI cores newer than 0.33 that the pack meets, shaped as those cores' files
(read, not run: they need a comfy-aimdo and comfy-kitchen this machine's ComfyUI does not have):

* ``comfy/model_prefetch.py`` (the Comfy Compiler, 0.34+): one comfy-aimdo memory graph per thread in
  ``MALLOC_GRAPHS``; ``malloc_graph_enabled(device)`` is ``not args.disable_comfy_compiler and aimdo_enabled and
  is_device_cuda(device)``; ``malloc_graph_begin(device)`` records (or pushes) this thread's graph;
  ``pause_malloc_graph(sync=False)`` is a context manager pausing an active graph; ``malloc_graph_end()``.
* ``comfy_aimdo.malloc_graph.record(stream, assert_graph_breaks)`` -> a graph with ``pause/resume/push/pop/abort``.
* ``comfy/ldm/modules/attention.py`` (0.40): ``AttentionTensorContainer`` (``peek``/``take``), ``ComfyAttention``
  (an nn.Module with ``config`` and ``function``), ``optimized_attention(q, k, v, heads, ...,
  preferred_attention=None, transformer_options=None)`` taking containers.
* ``comfy/ops.py``: ``run_every_op()``, ``linear_input_act(linear, x, input_act, act_weight=None, act_eps=0.0,
  residual=None, residual_scale=None)`` and ``disable_weight_init.Linear / RMSNorm`` whose ``forward(*args,
  **kwargs)`` casts when ``comfy_cast_weights`` or patches are set.
* ``comfy/ldm/wan/model.py`` (0.40): self-attention modules carrying ``comfy_attention = ComfyAttention()`` and
  calling ``optimized_attention`` with containers, and ``WanFeedForward`` (an ``nn.Sequential`` of [Linear,
  GELU(tanh), Linear] whose forward is ``comfy.ops.linear_input_act(self[2], self[0](x), "gelu_tanh")``).

``install(monkeypatch, version)`` puts them (with ``comfy.cli_args``, ``comfy.memory_management``,
``comfy.model_management`` and ``comfyui_version``) in ``sys.modules`` for one test. The device check answers
True for every device: the stand-in is a GPU machine's core on a CPU.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import types
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


class MallocGraph:
    """comfy_aimdo.malloc_graph's recorder: records allocations while active and not paused."""

    def __init__(self, stream, assert_graph_breaks=False):
        self.stream, self.paused, self.depth, self.events = stream, 0, 1, []

    @property
    def recording(self) -> bool:
        return self.depth > 0 and self.paused == 0

    def pause(self, sync=False):
        self.paused += 1
        self.events.append("pause")

    def resume(self, sync=False):
        self.paused -= 1
        self.events.append("resume")

    def push(self):
        self.depth += 1

    def pop(self):
        self.depth -= 1
        return False

    def abort(self):
        self.depth = 0


def _module(name, **attrs):
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


def _early_prefetch(args, memory_management, model_management, malloc_graph):
    """The first compiler cores' ``comfy/model_prefetch.py``: ``malloc_graph_begin(module, device)`` keeps the graph
    on the module and the active one per thread in ``ACTIVE_MALLOC_GRAPHS``; there is no ``pause_malloc_graph``."""
    active: dict = {}

    def malloc_graph_enabled(device):
        return (not args.disable_comfy_compiler and memory_management.aimdo_enabled
                and model_management.is_device_cuda(device))

    def malloc_graph_begin(module, device):
        if not malloc_graph_enabled(device):
            return
        graph = getattr(module, "_comfy_malloc_graph", None)
        if graph is None:
            graph = module._comfy_malloc_graph = malloc_graph.record(model_management.current_stream(device))
        else:
            graph.push()
        active[threading.get_ident()] = graph

    def malloc_graph_end():
        graph = active.pop(threading.get_ident(), None)
        if graph is not None:
            graph.pop()

    return _module("comfy.model_prefetch", ACTIVE_MALLOC_GRAPHS=active, malloc_graph_enabled=malloc_graph_enabled,
                   malloc_graph_begin=malloc_graph_begin, malloc_graph_end=malloc_graph_end)


def _prefetch(args, memory_management, model_management, malloc_graph):
    graphs: dict = {}

    def malloc_graph_enabled(device):
        return (not args.disable_comfy_compiler and memory_management.aimdo_enabled
                and model_management.is_device_cuda(device))

    @contextlib.contextmanager
    def pause_malloc_graph(sync=False):
        graph = graphs.get(threading.get_ident())
        active = graph is not None and graph._comfy_active
        if active:
            graph.pause(sync=sync)
        try:
            yield
        finally:
            if active:
                graph.resume(sync=sync)

    def malloc_graph_begin(device):
        if not malloc_graph_enabled(device):
            return
        graph = graphs.get(threading.get_ident())
        if graph is None:
            graph = malloc_graph.record(model_management.current_stream(device), args.assert_graph_breaks)
            graphs[threading.get_ident()] = graph
        else:
            graph.push()
        graph._comfy_active = True

    def malloc_graph_end():
        graph = graphs.get(threading.get_ident())
        if graph is not None and graph._comfy_active:
            graph.pop()
            graph._comfy_active = False

    return _module("comfy.model_prefetch", MALLOC_GRAPHS=graphs, malloc_graph_enabled=malloc_graph_enabled,
                   pause_malloc_graph=pause_malloc_graph, malloc_graph_begin=malloc_graph_begin,
                   malloc_graph_end=malloc_graph_end)


# ---------------------------------------------------------------------- attention (0.40)
class AttentionTensorContainer:
    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor

    def peek(self):
        if self.tensor is None:
            raise RuntimeError("attention tensor container has already been consumed")
        return self.tensor

    def take(self):
        tensor = self.peek()
        self.tensor = None
        return tensor


class ComfyAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = None
        self.function = None


def optimized_attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                        skip_output_reshape=False, preferred_attention=None, transformer_options=None, **kwargs):
    if isinstance(q, AttentionTensorContainer):
        q, k, v = q.take(), k.take(), v.take()
    if preferred_attention is not None and preferred_attention.function is not None:
        return preferred_attention.function(q, k, v, heads, mask=mask, **kwargs)
    b, _, dim = q.shape
    split = [t.view(b, -1, heads, dim // heads).transpose(1, 2) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*split, attn_mask=mask)
    return out.transpose(1, 2).reshape(b, -1, dim)


# ---------------------------------------------------------------------- ops
def _ops(model_management):
    calls = {"run_every_op": 0, "linear_input_act": 0}

    def run_every_op():
        calls["run_every_op"] += 1
        model_management.throw_exception_if_processing_interrupted()

    def cast(layer, x):
        w = layer.weight.to(dtype=x.dtype, device=x.device)
        for f in layer.weight_function:
            w = f(w)
        b = None if layer.bias is None else layer.bias.to(dtype=x.dtype, device=x.device)
        return w, b

    class CastWeightBiasOp:
        comfy_cast_weights = False
        weight_function: tuple = ()       # core's are lists, empty on the class
        bias_function: tuple = ()

    class Linear(nn.Linear, CastWeightBiasOp):
        def forward(self, *args, **kwargs):
            run_every_op()
            if self.comfy_cast_weights or self.weight_function or self.bias_function:
                x = args[0]
                return F.linear(x, *cast(self, x))
            return super().forward(*args, **kwargs)

    class RMSNorm(nn.RMSNorm, CastWeightBiasOp):
        def forward(self, *args, **kwargs):
            run_every_op()
            if self.comfy_cast_weights:
                x = args[0]
                return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)
            return super().forward(*args, **kwargs)

    class disable_weight_init:
        pass

    disable_weight_init.Linear, disable_weight_init.RMSNorm = Linear, RMSNorm

    class manual_cast(disable_weight_init):
        pass

    manual_cast.Linear = type("Linear", (Linear,), {"comfy_cast_weights": True})
    manual_cast.RMSNorm = type("RMSNorm", (RMSNorm,), {"comfy_cast_weights": True})

    def linear_input_act(linear, x, input_act, act_weight=None, act_eps=0.0, residual=None, residual_scale=None):
        calls["linear_input_act"] += 1
        if input_act == "gelu_tanh":
            x = F.gelu(x, approximate="tanh")
        elif input_act == "rms_norm":
            x = F.rms_norm(x, x.shape[-1:], act_weight, act_eps)
        elif input_act is not None:
            raise ValueError(f"unsupported input_act {input_act!r}")
        out = linear(x)
        return out if residual is None else torch.addcmul(residual, out, residual_scale)

    return _module("comfy.ops", run_every_op=run_every_op, linear_input_act=linear_input_act,
                   disable_weight_init=disable_weight_init, manual_cast=manual_cast, CALLS=calls)


class WanFeedForward(nn.Sequential):
    """[Linear, GELU(tanh), Linear], the GELU folded into the down-projection (core 0.40's Wan FFN)."""

    def forward(self, x):
        return sys.modules["comfy.ops"].linear_input_act(self[2], self[0](x), "gelu_tanh")


def install(monkeypatch, version: str = "0.47.1", compiler: bool | str = True):
    """A newer core in sys.modules for this test (``compiler``: True, False, or 'early' for the first compiler
    cores' model_prefetch): {'args', 'prefetch', 'ops', 'modules'}."""
    args = SimpleNamespace(cpu=False, disable_comfy_compiler=False, disable_cuda_graphs=False,
                           assert_graph_breaks=False)
    memory_management = _module("comfy.memory_management", aimdo_enabled=True)
    model_management = _module("comfy.model_management", is_device_cuda=lambda device: True,
                               current_stream=lambda device: None,
                               throw_exception_if_processing_interrupted=lambda: None,
                               get_torch_device=lambda: torch.device("cpu"))
    malloc_graph = _module("comfy_aimdo.malloc_graph", record=MallocGraph)
    ops = _ops(model_management)
    attention = _module("comfy.ldm.modules.attention", AttentionTensorContainer=AttentionTensorContainer,
                        ComfyAttention=ComfyAttention, optimized_attention=optimized_attention)
    comfy = _module("comfy", __path__=[])
    mods = {"comfy": comfy, "comfy.cli_args": _module("comfy.cli_args", args=args),
            "comfy.memory_management": memory_management, "comfy.model_management": model_management,
            "comfy.ops": ops, "comfy.ldm": _module("comfy.ldm", __path__=[]),
            "comfy.ldm.modules": _module("comfy.ldm.modules", __path__=[]),
            "comfy.ldm.modules.attention": attention,
            "comfy_aimdo": _module("comfy_aimdo", __path__=[], malloc_graph=malloc_graph),
            "comfy_aimdo.malloc_graph": malloc_graph,
            "comfyui_version": _module("comfyui_version", __version__=version),
            "folder_paths": _module("folder_paths")}
    if compiler:
        make = _early_prefetch if compiler == "early" else _prefetch
        mods["comfy.model_prefetch"] = make(args, memory_management, model_management, malloc_graph)
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
        parent, _, child = name.rpartition(".")
        if parent:
            monkeypatch.setattr(mods[parent], child, mod, raising=False)
    return SimpleNamespace(args=args, prefetch=mods.get("comfy.model_prefetch"), ops=ops, modules=mods)


def newer_core_wan(source: nn.Module, ops) -> nn.Module:
    """``source`` (a pack WanModel) with its blocks' layers rebuilt as core 0.40's Wan modules: ``comfy.ops``
    Linear/RMSNorm holding the same weights, attention modules carrying a ComfyAttention, WanFeedForward FFNs."""
    def linear(old):
        new = ops.disable_weight_init.Linear(old.in_features, old.out_features, bias=old.bias is not None)
        new.load_state_dict(old.state_dict())
        return new

    def norm(old):
        if not isinstance(old, nn.RMSNorm):
            return old
        new = ops.disable_weight_init.RMSNorm(old.normalized_shape, eps=old.eps)
        new.load_state_dict(old.state_dict())
        return new

    for block in source.blocks:
        for attn in (block.self_attn, block.cross_attn):
            for name in ("q", "k", "v", "o"):
                setattr(attn, name, linear(getattr(attn, name)))
            attn.norm_q, attn.norm_k = norm(attn.norm_q), norm(attn.norm_k)
            attn.comfy_attention = ComfyAttention()
        first, act, last = block.ffn
        block.ffn = WanFeedForward(linear(first), act, linear(last))
    return source
