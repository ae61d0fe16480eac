"""The opt-in fp8 linear mode on a model: which layers get an fp8 copy of their weight, and whether it pays here.

Under ``linear: fp8`` (``FastOptions.linear``, ``generate --linear fp8``) every linear layer inside a transformer
block runs the dynamic fp8 matmul of ``kernels/fp8_linear.py``: the self-attention's q/k/v (one concatenated
copy, so the fused q/k/v GEMM stays one GEMM) and o, the cross-attention's q/k/v/o (and the i2v image branch's
k_img/v_img), the FFN's two layers. The embeddings, the time and modulation MLPs, the head and Matrix-Game-2's
action modules stay exact.

``ensure_fp8(block)`` quantizes each weight once into non-persistent buffers beside it (``blocks.FP8_WEIGHT`` /
``FP8_SCALE`` on a layer; ``QKV_FP8_*`` on the self-attention): ``model.to``, block swap and the state dict treat
them as they treat any buffer (moved with the module, never saved). Each copy remembers the weight it was made
from (its storage and version counter), so a weight changed in place (a LoRA merged after a run) or moved is
quantized again before the next run; ``drop_fp8`` frees the copies (an exact run does).

Layers left as they are: weights already stored quantized (an fp8 checkpoint's ``FP8Linear``, ComfyUI's scaled
or quantized tensors: they keep their own path). Refused, with the layer named: layers that do more than a GEMM
over their stored weight when called (per-call weight patches such as a LoRA applied by ComfyUI in low-VRAM mode,
weight casting, forward hooks), since one fp8 copy made up front would silently drop what they add.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..kernels import fp8_linear as fp8, registry
from .blocks import FP8_SCALE, FP8_WEIGHT, QKV_FP8_BIAS, QKV_FP8_SCALE, QKV_FP8_WEIGHT, WanBlock
from .borrowed import qkv_fusion_blocker
from .quant import is_fp8, is_quantized

LINEAR_MODES = ("exact", "fp8")
SPEED_KERNEL = "speed.linear.fp8"       # the operator store's kernel for the opt-in fp8 mode's speed verdict
_SOURCE = "_fp8_source"                 # module __dict__ key: what each fp8 copy was made from


class Fp8Refused(ValueError):
    """A layer the fp8 mode cannot take (the message names it and what to do instead)."""


def check_mode(mode: str) -> str:
    if mode not in LINEAR_MODES:
        raise ValueError(f"linear must be one of {LINEAR_MODES}, got {mode!r}")
    return mode


def block_layers(block: WanBlock) -> list:
    """[(name, layer)] of the block's single fp8 layers (self-attention q/k/v are one concatenated copy)."""
    ca = block.cross_attn
    names = ["self_attn.o", "cross_attn.q", "cross_attn.k", "cross_attn.v", "cross_attn.o"]
    if getattr(ca, "has_image", False):
        names += ["cross_attn.k_img", "cross_attn.v_img"]
    names += ["ffn.0", "ffn.2"]
    out = []
    for n in names:
        try:
            out.append((n, block.get_submodule(n)))
        except AttributeError:      # a borrowed block without this layer: nothing to copy there
            continue
    return out


def kept_as_is(layer: nn.Module) -> bool:
    """The layer's weight is stored quantized already (it keeps its own path)."""
    w = getattr(layer, "weight", None)
    return is_quantized(layer) or w is None or type(w.data) is not torch.Tensor or is_fp8(w.dtype)


def refusal(name: str, layer: nn.Module) -> str | None:
    """Why the fp8 mode refuses ``layer`` (None: it takes it, or leaves it as it is)."""
    if kept_as_is(layer):
        return None
    why = qkv_fusion_blocker(layer, layer.weight.dtype)
    if why is None:
        return None
    return (f"the fp8 linear mode cannot take {name}: {why}, and one fp8 copy of the stored weight made up front "
            f"would drop that; merge a LoRA into the weights before the run (the pack's loader does: --lora) or "
            f"run with linear 'exact'")


def _copy(owner: nn.Module, names: tuple, layers: list) -> None:
    """(Re)make ``owner``'s fp8 copy of ``layers`` (concatenated rows) unless it is current."""
    stamp = tuple((t.data_ptr(), t._version, t.dtype, str(t.device)) for m in layers      # what it is made from
                  for t in (m.weight, m.bias) if t is not None)
    key = f"{_SOURCE}.{names[0]}"
    w = owner._buffers.get(names[0])
    if w is not None and w.dtype == fp8.FP8 and owner.__dict__.get(key) == stamp:
        return
    with torch.no_grad():
        parts = [fp8.quantize_weight(m.weight) for m in layers]
        weight = parts[0][0] if len(parts) == 1 else torch.cat([p[0] for p in parts])
        scale = parts[0][1] if len(parts) == 1 else torch.cat([p[1] for p in parts])
        owner.register_buffer(names[0], weight, persistent=False)
        owner.register_buffer(names[1], scale, persistent=False)
        if len(names) > 2:
            bias = None if layers[0].bias is None else torch.cat([m.bias.detach() for m in layers])
            owner.register_buffer(names[2], bias, persistent=False)
    owner.__dict__[key] = stamp


def _drop(owner: nn.Module, names: tuple) -> None:
    for n in names:
        owner._buffers.pop(n, None)
    owner.__dict__.pop(f"{_SOURCE}.{names[0]}", None)


QKV = (QKV_FP8_WEIGHT, QKV_FP8_SCALE, QKV_FP8_BIAS)
SINGLE = (FP8_WEIGHT, FP8_SCALE)


def check_block(block: WanBlock, prefix: str = "") -> None:
    """Fp8Refused naming the first layer of the block the mode cannot take."""
    sa = block.self_attn
    named = [(f"self_attn.{n}", getattr(sa, n)) for n in ("q", "k", "v")] + block_layers(block)
    for name, layer in named:
        why = refusal(prefix + name, layer)
        if why:
            raise Fp8Refused(why)


def ensure_fp8(block: WanBlock, prefix: str = "", groups=None) -> tuple[int, int]:
    """Give the block's layers their fp8 copies (current ones are kept); (layers with a copy, layers left as they
    are). ``groups``: only the layers of these speed groups (``GROUPS``; None: all), the others' copies freed.
    Fp8Refused when a layer cannot take it (nothing is changed then)."""
    check_block(block, prefix)
    sa = block.self_attn
    qkv = [sa.q, sa.k, sa.v]
    done = kept = 0
    if groups is not None:
        drop_fp8(block, set(GROUPS) - set(groups))
    singles = [(n, m) for n, m in block_layers(block) if groups is None or group_of(n) in groups]
    take_qkv = groups is None or "qkv" in groups
    if take_qkv and (any(kept_as_is(m) for m in qkv) or len({(m.weight.shape, m.bias is None) for m in qkv}) != 1):
        _drop(sa, QKV)
        singles = [(n, m) for n, m in zip("qkv", qkv)] + singles      # a copy each (where not stored quantized)
    elif take_qkv:
        _copy(sa, QKV, qkv)
        for m in qkv:
            _drop(m, SINGLE)
        done += 3
    for _name, layer in singles:
        if kept_as_is(layer):
            _drop(layer, SINGLE)
            kept += 1
        else:
            _copy(layer, SINGLE, [layer])
            done += 1
    return done, kept


def drop_fp8(block: WanBlock, groups=None) -> int:
    """Free the block's fp8 copies (of the layers of these speed groups; None: all): those layers run exact.
    Returns how many copies were freed."""
    freed = 0
    for owner, names in _copies(block, groups):
        freed += names[0] in owner._buffers
        _drop(owner, names)
    return freed


def _copies(block, groups=None) -> list:
    """[(owner, buffer names)] of the block's fp8 copies (of the layers of these speed groups; None: all)."""
    sa = block.self_attn
    out = [(sa, QKV)] + [(m, SINGLE) for m in (sa.q, sa.k, sa.v)] if groups is None or "qkv" in groups else []
    return out + [(m, SINGLE) for n, m in block_layers(block) if groups is None or group_of(n) in groups]


def fp8_tensors(model) -> list:
    """Every fp8 copy (weights, scales, q/k/v bias) held by the model's blocks: their addresses are part of what a
    CUDA graph captured."""
    out = []
    for block in model.blocks:
        for owner, names in _copies(block):
            out += [t for t in (owner._buffers.get(n) for n in names) if t is not None]
    return out


def linear_path(model) -> tuple[str, str]:
    """('scaled_mm' | 'emulated' | 'mixed' | 'exact', why) of the fp8 copies on the model's device."""
    counts: dict = {}
    for block in model.blocks:
        for owner, names in _copies(block):
            w = owner._buffers.get(names[0])
            if w is not None:
                found = fp8.path_for(model.device, w.shape[1], w.shape[0])
                counts[found] = counts.get(found, 0) + 1
    if not counts:
        return "exact", "no layer holds an fp8 copy"
    if len(counts) == 1:
        return next(iter(counts))
    return "mixed", "; ".join(f"{c} copies {p}: {why}" for (p, why), c in counts.items())


# Layer groups of a block, by GEMM shape: each is judged on its own (fp8 pays for a large GEMM, not for a small one
# whose input quantization costs as much as its bf16 GEMM)
GROUPS = ("qkv", "square", "ffn_up", "ffn_down")


def group_of(name: str) -> str:
    """The speed group of a block layer named as in ``block_layers`` (or ``self_attn.q``/``k``/``v``)."""
    if name.startswith("self_attn.") and name.rsplit(".", 1)[-1] in ("q", "k", "v"):
        return "qkv"
    return {"ffn.0": "ffn_up", "ffn.2": "ffn_down"}.get(name, "square")


def group_shapes(dim: int, ffn_dim: int) -> dict:
    """{group: (out features, in features)} of the GEMM each group stands for."""
    return {"qkv": (3 * dim, dim), "square": (dim, dim), "ffn_up": (ffn_dim, dim), "ffn_down": (dim, ffn_dim)}


def fp8_speed(tokens: int, dim: int, ffn_dim: int, dtype, device, tuner=None
              ) -> tuple[bool | None, str, frozenset | None]:
    """(slower, why, faster groups): fp8 against exact linear layers at the run's largest call (``tokens`` rows),
    one verdict per layer group (``GROUPS``: the fused q/k/v; o and the cross-attention's layers; the FFN's first;
    its second), each timed through the operator store (its pluggable timer; once per GPU and shape). ``slower``
    is True where every group is slower (the mode runs exact), ``faster`` the groups that run fp8. None, None where
    no speed is judged (a CPU, where fp8 is emulated)."""
    device = torch.device(device)
    name = str(dtype).replace("torch.", "")
    faster, shown, unknown = [], [], []
    for group, (n, k) in group_shapes(dim, ffn_dim).items():
        def work(n=n, k=k):
            gen = torch.Generator().manual_seed(0)
            w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(device, dtype)
            return w, fp8.quantize_weight(w), torch.randn(tokens, k, generator=gen).to(device, dtype)

        def fp8_call(_w, copy, x):
            return fp8.fp8_linear(x, copy[0], copy[1])

        def exact_call(w, _copy, x):
            return torch.nn.functional.linear(x, w)

        key = f"{device.type}|m{tokens}|n{n}|k{k}|{name}"
        slower, words = registry.speed(SPEED_KERNEL, key, "fp8", fp8_call, exact_call, work, device, tuner)
        shown.append(f"{group} {words}")
        if slower is None:
            unknown.append(group)
        elif not slower:
            faster.append(group)
    if unknown:
        return None, f"not measured ({'; '.join(shown)})", None
    slower = not faster
    runs = "none" if slower else ", ".join(faster)
    return slower, f"each layer group at {tokens} tokens: {'; '.join(shown)}; fp8 where faster: {runs}", \
        frozenset(faster)
