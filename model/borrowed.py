"""The engine over another implementation's Wan modules: a ``WanModel`` whose layers are borrowed, not copied.

Any module tree with the official Wan 2.1 attribute names (``patch_embedding``, ``text_embedding``,
``time_embedding``, ``time_projection``, ``blocks[i].{norm1, norm2, norm3, self_attn.{q, k, v, o, norm_q, norm_k},
cross_attn.{...}, ffn, modulation}``, ``head.{norm, head, modulation}``) can be sampled by the pack's one block
forward and chunk loop: ``borrow_wan_model`` builds a thin ``WanModel`` whose submodules *are* the source's
modules (the same objects: no second copy of a weight, and whatever the source's layers do when called, e.g. cast
a stored float8 weight or apply a patch, still happens). The ``modulation`` tables, plain parameters in the
source, are read through a cast to the run's dtype and device at each use, as the source does.

Nothing here knows where the source comes from; ``nodes/comfy/native_engine.py`` feeds it ComfyUI's model.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .blocks import WanBlock, WanCrossAttention, WanSelfAttention
from .checkpoint import infer_config
from .config import WanConfig
from .dit import WanModel
from .fused_qkv import drop_fused_qkv
from .layers import Head
from .rope import RopeCache

_ATTN_PARTS = ("q", "k", "v", "o", "norm_q", "norm_k")
# what a layer carries when it does more than a plain GEMM on its stored weight when called (e.g. ComfyUI's ops):
# a cast flag, per-call weight patches (LoRA in low-VRAM mode), per-layer quantization scales
_CAST_FLAGS = ("comfy_cast_weights",)
_PATCH_LISTS = ("weight_function", "bias_function")
_SCALES = ("scale_weight", "weight_scale", "weight_scale_2", "scale_input", "input_scale")


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def qkv_fusion_blocker(layer, dtype: torch.dtype, device=None) -> str | None:
    """Why one GEMM over ``layer``'s stored weight would not do what calling the layer does (None: it would).
    Fused q/k/v reads the stored weights directly, so layers that cast, dequantize or patch their weight when
    called (or carry hooks) must be called one by one."""
    stored = getattr(getattr(layer, "weight", None), "data", None)
    if stored is not None and type(stored) is not torch.Tensor:
        return f"the weights are {type(stored).__name__} (quantized), dequantized when called"
    if not isinstance(layer, nn.Linear):
        return f"the layer is a {type(layer).__name__}, not a linear layer"
    if layer._forward_hooks or layer._forward_pre_hooks:
        return "the layers carry forward hooks"
    if any(getattr(layer, n, False) for n in _CAST_FLAGS):
        return "the layers cast their weights when called (manual cast or low-VRAM offload)"
    if any(len(getattr(layer, n, None) or ()) for n in _PATCH_LISTS):
        return "weight patches (e.g. a LoRA) are applied when the layers are called"
    if any(getattr(layer, n, None) is not None for n in _SCALES):
        return "the weights are quantized (scaled) and dequantized when called"
    for t in (layer.weight, layer.bias):
        if t is None:
            continue
        if type(t.data) is not torch.Tensor:
            return f"the weights are {type(t.data).__name__} (quantized), dequantized when called"
        if t.dtype != dtype:
            return f"the weights are stored in {t.dtype} and cast to the run's {dtype} when called"
        if device is not None and not _same_device(t.device, torch.device(device)):
            return f"the weights are on {t.device}, the run on {device}"
    return None


def borrowed_config(source: nn.Module, num_heads: int | None = None, text_len: int | None = None,
                    eps: float | None = None) -> WanConfig:
    """The WanConfig of a source module tree, read from its layer shapes as a checkpoint's are
    (``checkpoint.infer_config``; heads/text_len/eps from the source's attributes when not given). Raises a clear
    error when a part the engine needs is missing."""
    missing = [n for n in ("patch_embedding", "text_embedding", "time_embedding", "time_projection", "blocks",
                           "head") if getattr(source, n, None) is None]
    if missing or len(source.blocks) == 0:
        raise ValueError(f"{type(source).__name__} is not a Wan 2.1 DiT: it has no {missing or ['blocks']}")
    b0 = source.blocks[0]
    heads = num_heads or getattr(source, "num_heads", None) or getattr(b0.self_attn, "num_heads", None)
    if not heads:
        raise ValueError("the source model does not say its number of attention heads")
    text_len = text_len or getattr(source, "text_len", None) or getattr(getattr(source, "config", None),
                                                                        "text_len", 512)
    eps = eps if eps is not None else getattr(b0.norm1, "eps", 1e-6)
    shapes = {name: tuple(p.shape) for name, p in source.named_parameters()}
    return infer_config(shapes, int(heads), {"text_len": int(text_len), "eps": float(eps)})


class _CastModulation:
    """``modulation`` read from the source module at each use (its owner may replace the parameter object, e.g.
    when it patches weights), cast to the run's dtype and device."""

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        p = obj.__dict__["modulation_owner"].modulation
        return p.to(device=obj.run_device or p.device, dtype=obj.compute_dtype)


class BorrowedBlock(WanBlock):
    """A WanBlock over a source block's layers. Each call also fires the source block's own forward pre-hooks and
    forward hooks (with this call's x), so what the owner hung on its blocks (e.g. weight streaming of a block swap)
    still happens around the block's work."""

    modulation = _CastModulation()

    def _hooked(self, x, run, *args):
        """``run(*args)`` between the source block's forward pre-hooks and forward hooks (called with x, the
        forward hooks also with what ``run`` returns)."""
        src = self.__dict__["modulation_owner"]
        pre, post = list(src._forward_pre_hooks.values()), list(src._forward_hooks.values())
        for hook in pre:
            hook(src, (x,))
        out = run(*args)
        for hook in post:
            hook(src, (x,), out)
        return out

    def forward(self, x, e0, rope, call, actions=None):
        return self._hooked(x, super().forward, x, e0, rope, call, actions)

    def kv_only(self, x, e0, rope, call) -> None:
        self._hooked(x, super().kv_only, x, e0, rope, call)

    def __init__(self, source: nn.Module, num_heads: int, dtype: torch.dtype):
        nn.Module.__init__(self)
        self.norm1, self.norm2, self.norm3, self.ffn = source.norm1, source.norm2, source.norm3, source.ffn
        self.self_attn = _borrow_attention(WanSelfAttention, source.self_attn, num_heads)
        self.cross_attn = _borrow_attention(WanCrossAttention, source.cross_attn, num_heads)
        self.__dict__["modulation_owner"] = source      # not a submodule: its layers are borrowed one by one
        self.compute_dtype, self.run_device = dtype, None


class BorrowedHead(Head):
    modulation = _CastModulation()

    def __init__(self, source: nn.Module, dtype: torch.dtype):
        nn.Module.__init__(self)
        self.norm, self.head = source.norm, source.head
        self.__dict__["modulation_owner"] = source
        self.compute_dtype, self.run_device = dtype, None


def _borrow_attention(cls, source: nn.Module, num_heads: int):
    attn = cls.__new__(cls)
    nn.Module.__init__(attn)
    attn.num_heads = num_heads
    for name in _ATTN_PARTS:
        setattr(attn, name, getattr(source, name))
    if cls is WanCrossAttention:
        attn.has_image = False
    return attn


class BorrowedWanModel(WanModel):
    """A WanModel over borrowed modules; ``set_run`` picks the dtype and device of a run (never casts weights)."""

    def __init__(self, source: nn.Module, config: WanConfig, dtype: torch.dtype = torch.float32, device=None):
        nn.Module.__init__(self)
        if config.model_type != "t2v":
            raise ValueError("only text-to-video Wan 2.1 models can be borrowed (this one has an image branch)")
        self.config = config
        self.patch_embedding = source.patch_embedding
        self.text_embedding = source.text_embedding
        self.time_embedding = source.time_embedding
        self.time_projection = source.time_projection
        self.blocks = nn.ModuleList(BorrowedBlock(b, config.num_heads, dtype) for b in source.blocks)
        self.head = BorrowedHead(source.head, dtype)
        self.attn_backend = "auto"
        self.rope = RopeCache()
        self._run_device = None
        self.set_run(dtype, device)

    def set_precision(self, precision: str, dtype: torch.dtype = torch.bfloat16):
        raise RuntimeError("a borrowed model keeps its owner's weights as they are; use set_run(dtype, device)")

    def set_run(self, dtype: torch.dtype, device=None) -> "BorrowedWanModel":
        """Run in ``dtype`` (residual stream and matmul inputs, as causal checkpoints run) on ``device``."""
        self.precision = "float32" if dtype == torch.float32 else "self_forcing"
        self.stream_dtype = self.compute_dtype = dtype
        self._run_device = None if device is None else torch.device(device)
        for part in (*self.blocks, self.head):
            part.compute_dtype, part.run_device = dtype, self._run_device
        return self

    def qkv_fusion_blocker(self) -> str | None:
        """None when every block's q/k/v can run as one GEMM over their stored weights (plain weights in the run
        dtype on the run device), else why not (the first block and layer that cannot)."""
        for i, block in enumerate(self.blocks):
            for name in ("q", "k", "v"):
                why = qkv_fusion_blocker(getattr(block.self_attn, name), self.compute_dtype, self._run_device)
                if why:
                    return f"block {i} self_attn.{name}: {why}"
        return None

    def unfuse_qkv(self) -> None:
        """Drop the concatenated q/k/v weights' own references: the layers' weights (views) keep the memory, so
        when the owner moves or replaces them nothing is left behind; a later fuse finds them again as a view
        while they still lie back to back."""
        for block in self.blocks:
            drop_fused_qkv(block.self_attn)

    @property
    def device(self) -> torch.device:
        return self._run_device if self._run_device is not None else self.patch_embedding.weight.device


def borrow_wan_model(source: nn.Module, dtype: torch.dtype = torch.float32, device=None, **config_overrides
                     ) -> BorrowedWanModel:
    """The engine's model over ``source``'s modules (see module doc); config_overrides: num_heads, text_len, eps."""
    return BorrowedWanModel(source, borrowed_config(source, **config_overrides), dtype, device)
