"""Model sizes without loading tensors: per-tensor and per-block bytes of a checkpoint, a live module or a preset.

Files are read through ``model.checkpoint`` (the one safetensors header reader, key-name mapping and config
inference the loader uses too), so a plan sees the config the loader would build: heads, rolling window, sizes.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

from ..model.checkpoint import (DTYPE_BITS, TORCH_DTYPES, HeaderError, TensorInfo, canonical_names, keeps_fp8,
                                open_checkpoint, partial_config, quant_side)

BLOCK_RE = re.compile(r"^(?:blocks|transformer_blocks)\.(\d+)\.")
EMBEDDING_PREFIXES = ("text_embedding.", "img_emb.")


def held_as_stored(name: str, t: TensorInfo) -> bool:
    """A float tensor the loader keeps in its file dtype whatever the run's dtype: an fp8 linear weight of a block
    (1 byte per element) and the float32 scales of quantized layers (``model/quant.py``)."""
    return keeps_fp8(name, t.dtype, t.shape) or quant_side(name) is not None


@dataclass
class ModelWeights:
    """Byte table of a Wan-style DiT: every tensor, grouped by ``blocks.{i}.``, plus the shapes that matter."""
    tensors: dict                      # stripped name -> TensorInfo
    source: str = ""
    dim: int = 0
    ffn_dim: int = 0
    num_layers: int = 0
    num_heads: int = 0
    in_dim: int = 16
    text_dim: int = 4096
    text_len: int = 512
    patch_size: tuple = (1, 2, 2)
    model_type: str = "t2v"
    local_attn_size: int = -1
    sink_size: int = 0
    out_dim: int = 16                  # latent channels (16: Wan 2.1 VAE, 48: Wan 2.2 VAE)
    config: dict = field(default_factory=dict)   # the model config these sizes come from (see model.checkpoint)
    block_bytes: list = field(default_factory=list)
    block_float_numel: list = field(default_factory=list)
    block_other_bytes: list = field(default_factory=list)   # non-float bytes per block (kept as stored)

    def __post_init__(self):
        n = self.num_layers or (1 + max((int(m.group(1)) for m in map(BLOCK_RE.match, self.tensors) if m), default=-1))
        self.num_layers = n
        self.block_bytes, self.block_float_numel, self.block_other_bytes = [0] * n, [0] * n, [0] * n
        for name, t in self.tensors.items():
            m = BLOCK_RE.match(name)
            if m is None:
                continue
            i = int(m.group(1))
            self.block_bytes[i] += t.nbytes
            if t.is_float and not held_as_stored(name, t):
                self.block_float_numel[i] += t.numel
            else:
                self.block_other_bytes[i] += t.nbytes
        missing = [i for i, b in enumerate(self.block_bytes) if b == 0]
        if missing:
            raise HeaderError(f"{self.source}: blocks {missing[:8]} have no tensors; the checkpoint is incomplete")

    # ------------------------------------------------------------------ sizes
    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def total_params(self) -> int:
        return sum(t.numel for t in self.tensors.values())

    @property
    def other_bytes(self) -> int:
        """Bytes outside the blocks (embeddings, head)."""
        return self.total_bytes - sum(self.block_bytes)

    def block_tensor_bytes_at(self, index: int, elem_bytes: int | None) -> list[int]:
        """Bytes of each tensor of block ``index`` with float tensors held at ``elem_bytes`` (None: as stored)."""
        return [self._at([t], elem_bytes) for name, t in self.tensors.items()
                if (m := BLOCK_RE.match(name)) is not None and int(m.group(1)) == index]

    def _other(self, prefixes=None):
        return [t for n, t in self.tensors.items() if not BLOCK_RE.match(n)
                and (prefixes is None or n.startswith(prefixes))]

    @property
    def embedding_bytes(self) -> int:
        """Bytes of the text / image embeddings (what ``offload_embeddings`` moves to the host)."""
        return self.embedding_bytes_at(None)

    @property
    def storage_dtype(self) -> str:
        """The float dtype holding most bytes (safetensors name)."""
        by = {}
        for t in self.tensors.values():
            if t.is_float:
                by[t.dtype] = by.get(t.dtype, 0) + t.nbytes
        return max(by, key=by.get) if by else "F32"

    def _at(self, tensors, elem_bytes) -> int:
        """Bytes of ``tensors`` with float tensors held at ``elem_bytes`` per element (None: as stored)."""
        return sum(t.numel * elem_bytes if elem_bytes and t.is_float and not held_as_stored(t.name, t) else t.nbytes
                   for t in tensors)

    def block_bytes_at(self, elem_bytes: int | None) -> list[int]:
        """Per-block bytes once float tensors are held at ``elem_bytes`` per element (None: as stored)."""
        if elem_bytes is None:
            return list(self.block_bytes)
        return [n * elem_bytes + o for n, o in zip(self.block_float_numel, self.block_other_bytes)]

    def other_bytes_at(self, elem_bytes: int | None) -> int:
        return self._at(self._other(), elem_bytes)

    def embedding_bytes_at(self, elem_bytes: int | None) -> int:
        return self._at(self._other(EMBEDDING_PREFIXES), elem_bytes)

    def sampling_config(self) -> dict:
        """The config a run's memory estimate reads (``validate.check_fits``): the file's config with the sizes
        read from its tensors."""
        return dict(self.config, **{k: getattr(self, k) for k in ("dim", "ffn_dim", "num_layers", "num_heads")})

    def bytes_at(self, elem_bytes: int | None) -> int:
        """Bytes of every tensor once float tensors are held at ``elem_bytes`` per element (None: as stored)."""
        return sum(self.block_bytes_at(elem_bytes)) + self.other_bytes_at(elem_bytes)

    @property
    def signature(self) -> str:
        """Short identity of the architecture (limits.model_identity: the same for every storage dtype)."""
        from .limits import model_identity

        return model_identity(self.config or self.__dict__)

    def summary(self) -> dict:
        return {"source": self.source, "signature": self.signature, "params": self.total_params,
                "bytes": self.total_bytes, "blocks": self.num_layers, "block_bytes": self.block_bytes,
                "other_bytes": self.other_bytes, "embedding_bytes": self.embedding_bytes,
                "storage_dtype": self.storage_dtype, "dim": self.dim, "ffn_dim": self.ffn_dim,
                "num_heads": self.num_heads, "num_layers": self.num_layers, "model_type": self.model_type,
                "local_attn_size": self.local_attn_size, "sink_size": self.sink_size, "in_dim": self.in_dim,
                "out_dim": self.out_dim, "text_dim": self.text_dim}


_FIELDS = ("dim", "ffn_dim", "num_layers", "num_heads", "in_dim", "text_dim", "text_len", "model_type",
           "local_attn_size", "sink_size", "out_dim")


def weights_from_tensors(tensors: dict[str, TensorInfo], *, source: str = "", config: dict | None = None) -> ModelWeights:
    """Build the table from {name: TensorInfo} (names may carry a wrapper prefix or diffusers names) and the model
    config (a dict; what it lacks is read from the shapes by ``model.checkpoint.partial_config``)."""
    official = {n: tensors[src] for n, src in canonical_names(tensors).items()}
    table = {n: TensorInfo(n, t.dtype, tuple(t.shape), t.nbytes) for n, t in official.items()}
    if not any(BLOCK_RE.match(n) for n in table):
        raise HeaderError(f"{source}: no 'blocks.<i>.' tensors; this is not a Wan DiT checkpoint")
    cfg = partial_config({n: t.shape for n, t in table.items()}, config)
    kw = {k: (cfg[k] if k == "model_type" else int(cfg[k])) for k in _FIELDS if cfg.get(k) is not None}
    return ModelWeights(table, source=source, patch_size=tuple(cfg.get("patch_size", (1, 2, 2))), config=cfg, **kw)


def weights_from_checkpoint(path, config: dict | None = None) -> ModelWeights:
    """Header-only table of a safetensors checkpoint, with the config the loader infers for it (shapes, and the
    metadata's config: ours or ComfyUI's); ``config`` overrides fields of it."""
    ckpt = open_checkpoint(path, strict=False)
    cfg = {**ckpt.sizing_config(), **(config or {})}
    tensors = dict(ckpt.tensors)            # with the quantization scales, which the loaded model holds too
    tensors.update({f"{layer}.{kind}": info for layer, side in (ckpt.quant or {}).items() for kind, info in side.items()
                    if kind != "comfy_quant"})
    return weights_from_tensors(tensors, source=os.fspath(path), config=cfg)


_TORCH_TO_ST = {**{torch_name: st for st, torch_name in TORCH_DTYPES.items()}, "int8": "I8", "uint8": "U8",
                "int32": "I32", "int64": "I64", "bool": "BOOL", "int16": "I16"}


def weights_from_module(module, config: dict | None = None) -> ModelWeights:
    """Table of a live model (parameters and persistent buffers), exact bytes; needs ``module.blocks``."""
    tensors = {}
    persistent = [(f"{prefix}.{n}" if prefix else n, b)
                  for prefix, mod in module.named_modules()
                  for n, b in mod._buffers.items()
                  if b is not None and n not in mod._non_persistent_buffers_set]
    # Non-persistent buffers (for example a fused q/k/v weight whose views are the q/k/v parameters) hold no
    # bytes of their own in a checkpoint and would be counted twice.
    for name, t in list(module.named_parameters()) + persistent:
        dt = _TORCH_TO_ST.get(str(t.dtype).replace("torch.", ""), "U8")
        tensors[name] = TensorInfo(name, dt, tuple(t.shape), t.numel() * t.element_size())
    cfg = {}
    mc = getattr(module, "config", None)
    if hasattr(mc, "to_dict"):
        from ..model.checkpoint import config_dict

        cfg = config_dict(mc)
    cfg.update(config or {})
    return weights_from_tensors(tensors, source=type(module).__name__, config=cfg)


# ---------------------------------------------------------------------- presets (no file needed)
PRESET_ALIASES = {"1.3b": "wan2.1-1.3b", "14b": "wan2.1-14b", "14b-i2v": "wan2.1-i2v-14b", "krea-14b": "krea-14b"}


def preset_weights(name: str, dtype: str = "BF16") -> ModelWeights:
    """Synthetic byte table of a preset ('1.3b', '14b', '14b-i2v') stored as ``dtype`` (safetensors name)."""
    from ..model.checkpoint import expected_shapes
    from ..model.config import PRESETS, WanConfig

    key = PRESET_ALIASES.get(name.lower(), name.lower())
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESET_ALIASES)}")
    cfg = PRESETS[key].to_dict()
    bits = DTYPE_BITS[dtype]
    shapes = expected_shapes(WanConfig.from_dict(cfg))
    tensors = {n: TensorInfo(n, dtype, shape, math.prod(shape) * bits // 8) for n, shape in shapes.items()}
    return weights_from_tensors(tensors, source=f"preset {name}", config=cfg)


# ---------------------------------------------------------------------- from a config alone (nothing built)
SIZE_FIELDS = ("dim", "ffn_dim", "num_layers", "in_dim", "out_dim", "text_dim", "freq_dim", "clip_dim")


def config_parameters(config: dict) -> int:
    """About how many parameters the Wan DiT of ``config`` has, by arithmetic on its sizes (no tensor, not even
    on the meta device, so a config claiming an absurd size is sized, never allocated): per block self- and
    cross-attention (4 dim x dim each, plus the image branch of i2v), the FFN (2 dim x ffn_dim) and the
    modulation; the patch, text, time and image embeddings and the head. Within a few per cent of the built model
    (biases and norms are counted; Matrix-Game-2's action modules are not)."""
    get = lambda key, default=0: int(config.get(key) or default)       # noqa: E731
    dim, ffn, layers = get("dim"), get("ffn_dim"), get("num_layers")
    patch = math.prod(int(p) for p in (config.get("patch_size") or (1, 2, 2)))
    i2v = config.get("model_type") == "i2v"
    attn = 4 * (dim * dim + dim)
    block = 2 * attn + (2 * (dim * dim + dim) if i2v else 0) + 2 * dim * ffn + ffn + dim + 6 * dim + 8 * dim
    text = 0 if "action_config" in config else get("text_dim", 4096) * dim + dim * dim + 2 * dim  # MG2: none
    embed = (get("in_dim") * patch * dim + dim + text
             + get("freq_dim", 256) * dim + dim * dim + 2 * dim + 6 * (dim * dim + dim)
             + dim * get("out_dim") * patch + 4 * dim)
    if i2v:
        clip = get("clip_dim", 1280)
        embed += clip * dim + dim * dim + 2 * clip + 4 * dim
    return layers * block + embed


def largest_size_field(config: dict) -> str:
    """The size field of ``config`` with the largest value (the one to look at when a config claims too much)."""
    fields = [k for k in SIZE_FIELDS if isinstance(config.get(k), (int, float)) and not isinstance(config.get(k), bool)]
    return max(fields, key=lambda k: config[k], default="dim")
