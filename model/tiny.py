"""The built-in tiny causal model: deterministic random weights, for smoke runs, tests and demos.

Its outputs are not meaningful video: it exists so that the whole pipeline (sampler, KV cache, nodes,
preview, report) runs anywhere in seconds without downloading a checkpoint.
"""
from __future__ import annotations

import hashlib
import math

import torch

from .config import WanConfig
from .dit import WanModel

TINY_CONFIG = WanConfig(model_type="t2v", patch_size=(1, 2, 2), text_len=32, in_dim=16, dim=64, ffn_dim=256,
                        freq_dim=32, text_dim=64, out_dim=16, num_heads=4, num_layers=2)


def init_tiny_weights(model: WanModel, seed: int = 0) -> WanModel:
    """Seeded, deterministic initialisation (fan-in scaled normals, norms near 1, small modulation)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, w in draw_weights({n: p.shape for n, p in params.items()}, seed):
            params[name].copy_(w)
    return model


def name_seed(seed: int, name: str) -> int:
    """A generator seed of (seed, name): the first 8 bytes of sha256, 63 bits."""
    digest = hashlib.sha256(f"{int(seed)}\0{name}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def draw_weights(shapes: dict, seed: int = 0, device="cpu", dtype=torch.float32, *, per_tensor: bool = False):
    """The one maker of random weights: (name, tensor) for every {name: shape}, in sorted name order, standard normals
    given the spread of each kind (``shape_values``). By default one generator on ``device`` seeded ``seed`` draws
    every tensor in float32, in that order, cast to ``dtype``. ``per_tensor``: each tensor from its own generator
    seeded by (seed, name) (``name_seed``), drawn in ``dtype`` (float32 unless a 16-bit float), so its values do not
    depend on the other tensors (a model made on the meta device, tensor by tensor)."""
    gen = torch.Generator(device=device).manual_seed(int(seed))
    draw = dtype if per_tensor and dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    for name, shape in sorted(shapes.items()):
        if per_tensor:
            gen = torch.Generator(device=device).manual_seed(name_seed(seed, name))
        w = torch.randn(tuple(shape), generator=gen, device=device, dtype=draw)
        yield name, shape_values(name, w).to(draw if per_tensor else dtype)


def shape_values(name: str, w: torch.Tensor) -> torch.Tensor:
    """Standard normals ``w`` drawn for parameter ``name`` given the spread of its kind: modulation 0.1, norm
    weights 1 +- 0.05, biases 0.02, other weights scaled by 1/sqrt(fan-in)."""
    if name.endswith("modulation"):
        return 0.1 * w
    if "norm" in name and name.endswith("weight"):
        return 1.0 + 0.05 * w
    if name.endswith("bias"):
        return 0.02 * w
    fan_in = math.prod(w.shape[1:]) if w.dim() > 1 else w.shape[0]
    return w / math.sqrt(fan_in)


def tiny_causal_model(seed: int = 0, device="cpu", dtype=torch.float32, precision=None,
                      config: WanConfig | None = None, model_class=WanModel) -> WanModel:
    """Build the tiny model (a ``model_class``, the Wan DiT or a subclass); precision: 'float32' for float32, else
    'self_forcing'."""
    model = init_tiny_weights(model_class(config or TINY_CONFIG), seed)
    precision = precision or ("float32" if dtype == torch.float32 else "self_forcing")
    model.set_precision(precision, dtype)
    return model.to(device).eval().requires_grad_(False)


def tiny_text_embedding(text: str, text_len: int, text_dim: int) -> torch.Tensor:
    """The built-in tiny model's stand-in text encoder: [1, text_len, text_dim] float32 normals drawn from a CPU
    generator seeded by sha256(0, text). The same text always gives the same rows, on every machine; different
    texts give unrelated ones. Not a language model: it only lets prompt schedules run on the tiny model."""
    if not isinstance(text, str):
        raise ValueError(f"a prompt is text, got {type(text).__name__}")
    gen = torch.Generator().manual_seed(name_seed(0, text))
    return torch.randn(1, int(text_len), int(text_dim), generator=gen, dtype=torch.float32)
