"""Model sizes without loading tensors: the safetensors header, per-tensor and per-block bytes, preset shapes.

A safetensors file starts with an 8-byte little-endian header length N, then N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [start, end]}, "__metadata__": {...}}``; ``end - start`` is the exact
byte size of a tensor. Only the header is read here.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field

# bits per element of every safetensors dtype name we know
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E4M3FN": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "F64": 64, "I64": 64, "U64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
FLOAT_DTYPES = {"F16", "BF16", "F32", "F64", "F8_E5M2", "F8_E4M3", "F8_E4M3FN", "F8_E4M3FNUZ", "F8_E5M2FNUZ"}
MAX_HEADER_BYTES = 100 * 1024 * 1024
KEY_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "model.")
BLOCK_RE = re.compile(r"^(?:blocks|transformer_blocks)\.(\d+)\.")
EMBEDDING_PREFIXES = ("text_embedding.", "img_emb.")
# dtype names accepted by plans, with their byte width
COMPUTE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


class HeaderError(ValueError):
    """The file is not a readable safetensors file."""


@dataclass
class TensorInfo:
    name: str
    dtype: str          # safetensors dtype name, e.g. 'BF16'
    shape: tuple
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES


def read_safetensors_header(path) -> tuple[dict[str, TensorInfo], dict]:
    """Parse the header of a safetensors file: ({name: TensorInfo}, metadata). Raises HeaderError on damage."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise HeaderError(f"{path}: only {len(head)} bytes; a safetensors file starts with an 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise HeaderError(f"{path}: header length {n} does not fit in a file of {size} bytes; "
                                  "not a safetensors file or truncated")
            raw = fh.read(n)
    except OSError as exc:
        raise HeaderError(f"cannot read {path}: {exc}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HeaderError(f"{path}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise HeaderError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_size = size - 8 - n
    tensors = {}
    for name, entry in header.items():
        try:
            dtype, shape = str(entry["dtype"]), tuple(int(s) for s in entry["shape"])
            start, end = (int(v) for v in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise HeaderError(f"{path}: entry {name!r} lacks dtype/shape/data_offsets") from None
        if not 0 <= start <= end <= data_size:
            raise HeaderError(f"{path}: tensor {name!r} lies outside the data ({start}..{end} of {data_size} bytes); "
                              "the file is truncated or damaged")
        bits = DTYPE_BITS.get(dtype)
        if bits is not None and (math.prod(shape) * bits + 7) // 8 != end - start:
            raise HeaderError(f"{path}: tensor {name!r} ({dtype} {list(shape)}) has {end - start} bytes, "
                              f"expected {(math.prod(shape) * bits + 7) // 8}")
        tensors[name] = TensorInfo(name, dtype, shape, end - start)
    return tensors, {str(k): str(v) for k, v in metadata.items()}


def strip_prefix(name: str) -> str:
    for p in KEY_PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return name


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
            if t.is_float:
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
        out = []
        for name, t in self.tensors.items():
            m = BLOCK_RE.match(name)
            if m is not None and int(m.group(1)) == index:
                out.append(t.numel * elem_bytes if (elem_bytes and t.is_float) else t.nbytes)
        return out

    def _other(self, prefixes=None):
        return [t for n, t in self.tensors.items() if not BLOCK_RE.match(n)
                and (prefixes is None or n.startswith(prefixes))]

    @property
    def embedding_bytes(self) -> int:
        """Bytes of the text / image embeddings (what ``offload_embeddings`` moves to the host)."""
        return sum(t.nbytes for t in self._other(EMBEDDING_PREFIXES))

    @property
    def storage_dtype(self) -> str:
        """The float dtype holding most bytes (safetensors name)."""
        by = {}
        for t in self.tensors.values():
            if t.is_float:
                by[t.dtype] = by.get(t.dtype, 0) + t.nbytes
        return max(by, key=by.get) if by else "F32"

    def _at(self, tensors, elem_bytes) -> int:
        return sum(t.numel * elem_bytes if t.is_float else t.nbytes for t in tensors)

    def block_bytes_at(self, elem_bytes: int | None) -> list[int]:
        """Per-block bytes once float tensors are held at ``elem_bytes`` per element (None: as stored)."""
        if elem_bytes is None:
            return list(self.block_bytes)
        return [n * elem_bytes + o for n, o in zip(self.block_float_numel, self.block_other_bytes)]

    def other_bytes_at(self, elem_bytes: int | None) -> int:
        return self.other_bytes if elem_bytes is None else self._at(self._other(), elem_bytes)

    def embedding_bytes_at(self, elem_bytes: int | None) -> int:
        return self.embedding_bytes if elem_bytes is None else self._at(self._other(EMBEDDING_PREFIXES), elem_bytes)

    @property
    def signature(self) -> str:
        """Short identity of the architecture and storage, used in learned-limit keys."""
        return f"wan-{self.model_type}-d{self.dim}-f{self.ffn_dim}-l{self.num_layers}-{self.storage_dtype.lower()}"

    def summary(self) -> dict:
        return {"source": self.source, "signature": self.signature, "params": self.total_params,
                "bytes": self.total_bytes, "blocks": self.num_layers, "block_bytes": self.block_bytes,
                "other_bytes": self.other_bytes, "embedding_bytes": self.embedding_bytes,
                "storage_dtype": self.storage_dtype, "dim": self.dim, "ffn_dim": self.ffn_dim,
                "num_heads": self.num_heads, "model_type": self.model_type}


def _shape_of(tensors, name, axis=None):
    t = tensors.get(name)
    if t is None:
        return None
    return t.shape if axis is None else (t.shape[axis] if len(t.shape) > axis else None)


def weights_from_tensors(tensors: dict[str, TensorInfo], *, source: str = "", config: dict | None = None) -> ModelWeights:
    """Build the table from {name: TensorInfo} (names may carry a ``model.`` prefix); shapes give the config."""
    stripped = {}
    for name, t in tensors.items():
        s = strip_prefix(name)
        stripped[s] = TensorInfo(s, t.dtype, tuple(t.shape), t.nbytes)
    if not any(BLOCK_RE.match(n) for n in stripped):
        raise HeaderError(f"{source}: no 'blocks.<i>.' tensors; this is not a Wan DiT checkpoint")
    cfg = dict(config or {})
    dim = _shape_of(stripped, "blocks.0.self_attn.q.weight", 0) or _shape_of(stripped, "patch_embedding.weight", 0) or 0
    ffn = _shape_of(stripped, "blocks.0.ffn.0.weight", 0) or 4 * dim
    patch = _shape_of(stripped, "patch_embedding.weight")
    kw = dict(dim=int(cfg.get("dim", dim)), ffn_dim=int(cfg.get("ffn_dim", ffn)),
              in_dim=int(cfg.get("in_dim", patch[1] if patch else 16)),
              text_dim=int(cfg.get("text_dim", _shape_of(stripped, "text_embedding.0.weight", 1) or 4096)),
              text_len=int(cfg.get("text_len", 512)),
              patch_size=tuple(cfg.get("patch_size", patch[2:] if patch and len(patch) == 5 else (1, 2, 2))),
              model_type=cfg.get("model_type", "i2v" if any(n.startswith("img_emb.") or ".k_img." in n for n in stripped)
                                 else "t2v"),
              local_attn_size=int(cfg.get("local_attn_size", -1)), sink_size=int(cfg.get("sink_size", 0)))
    # heads are not visible in the shapes; released Wan models use head_dim 128
    heads = cfg.get("num_heads") or (kw["dim"] // 128 if kw["dim"] % 128 == 0 else max(1, kw["dim"] // 64))
    return ModelWeights(stripped, source=source, num_heads=int(heads), num_layers=int(cfg.get("num_layers", 0)), **kw)


def weights_from_checkpoint(path, config: dict | None = None) -> ModelWeights:
    """Header-only table of a safetensors checkpoint (a JSON 'config' in its metadata is honoured)."""
    tensors, meta = read_safetensors_header(path)
    cfg = {}
    if "config" in meta:
        try:
            parsed = json.loads(meta["config"])
            cfg = parsed if isinstance(parsed, dict) else {}
        except json.JSONDecodeError:
            cfg = {}
    cfg.update(config or {})
    return weights_from_tensors(tensors, source=os.fspath(path), config=cfg)


_TORCH_TO_ST = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64",
                "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "int8": "I8", "uint8": "U8",
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
    cfg = dict(config or {})
    mc = getattr(module, "config", None)
    for k in ("num_heads", "num_layers", "text_len", "local_attn_size", "sink_size", "model_type"):
        if mc is not None and hasattr(mc, k):
            cfg.setdefault(k, getattr(mc, k))
    return weights_from_tensors(tensors, source=type(module).__name__, config=cfg)


# ---------------------------------------------------------------------- presets (no file needed)
PRESET_ALIASES = {"1.3b": "wan2.1-1.3b", "14b": "wan2.1-14b", "14b-i2v": "wan2.1-i2v-14b"}


def preset_config(name: str) -> dict:
    from ..model.config import PRESETS

    key = PRESET_ALIASES.get(name.lower(), name.lower())
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESET_ALIASES)}")
    return PRESETS[key].to_dict()


def shape_table(cfg: dict) -> dict[str, tuple]:
    """Every state-dict key of a Wan 2.1 DiT with its shape, from a config (official key names)."""
    d, f, L = int(cfg["dim"]), int(cfg["ffn_dim"]), int(cfg["num_layers"])
    pt, ph, pw = cfg.get("patch_size", (1, 2, 2))
    s = {"patch_embedding.weight": (d, cfg["in_dim"], pt, ph, pw), "patch_embedding.bias": (d,),
         "text_embedding.0.weight": (d, cfg["text_dim"]), "text_embedding.0.bias": (d,),
         "text_embedding.2.weight": (d, d), "text_embedding.2.bias": (d,),
         "time_embedding.0.weight": (d, cfg["freq_dim"]), "time_embedding.0.bias": (d,),
         "time_embedding.2.weight": (d, d), "time_embedding.2.bias": (d,),
         "time_projection.1.weight": (6 * d, d), "time_projection.1.bias": (6 * d,),
         "head.modulation": (1, 2, d), "head.head.weight": (cfg["out_dim"] * pt * ph * pw, d),
         "head.head.bias": (cfg["out_dim"] * pt * ph * pw,)}
    i2v = cfg.get("model_type") == "i2v"
    if i2v:
        c = int(cfg.get("clip_dim", 1280))
        s.update({"img_emb.proj.0.weight": (c,), "img_emb.proj.0.bias": (c,), "img_emb.proj.1.weight": (c, c),
                  "img_emb.proj.1.bias": (c,), "img_emb.proj.3.weight": (d, c), "img_emb.proj.3.bias": (d,),
                  "img_emb.proj.4.weight": (d,), "img_emb.proj.4.bias": (d,)})
    for i in range(L):
        b = f"blocks.{i}."
        s[b + "modulation"] = (1, 6, d)
        s[b + "norm3.weight"], s[b + "norm3.bias"] = (d,), (d,)
        for attn in ("self_attn", "cross_attn"):
            for p in ("q", "k", "v", "o") + (("k_img", "v_img") if i2v and attn == "cross_attn" else ()):
                s[f"{b}{attn}.{p}.weight"], s[f"{b}{attn}.{p}.bias"] = (d, d), (d,)
            for n in ("norm_q", "norm_k") + (("norm_k_img",) if i2v and attn == "cross_attn" else ()):
                s[f"{b}{attn}.{n}.weight"] = (d,)
        s[b + "ffn.0.weight"], s[b + "ffn.0.bias"] = (f, d), (f,)
        s[b + "ffn.2.weight"], s[b + "ffn.2.bias"] = (d, f), (d,)
    return s


def preset_weights(name: str, dtype: str = "BF16") -> ModelWeights:
    """Synthetic byte table of a preset ('1.3b', '14b', '14b-i2v') stored as ``dtype`` (safetensors name)."""
    cfg = preset_config(name)
    bits = DTYPE_BITS[dtype]
    tensors = {n: TensorInfo(n, dtype, shape, math.prod(shape) * bits // 8) for n, shape in shape_table(cfg).items()}
    return weights_from_tensors(tensors, source=f"preset {name}", config=cfg)
