"""Everything the pack knows about a Wan DiT checkpoint file without loading its tensors: the safetensors header,
the key names (wrapper prefixes, diffusers-format names), the config stored in the metadata (ours and ComfyUI's),
the config inferred from the tensor shapes, and the shapes a config expects.

The loader (``loader.py``: build the model from a file), the converter (``convert.py``) and the VRAM planner
(``memory/weights.py``: bytes per tensor) all read files through this module, so they agree on what a file holds.

A safetensors file starts with an 8-byte little-endian header length N, then N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [start, end]}, "__metadata__": {...}}``; ``end - start`` is the exact
byte size of a tensor. Only the header is read here.

Metadata conventions read (later ones win):
- ``config``: ComfyUI's. JSON whose ``"transformer"`` object is merged over the detected config by ComfyUI
  (``{"transformer": {"causal_ar": true, "num_heads": ...}}`` makes ComfyUI load the file as causal Wan). A flat
  JSON object (no ``"transformer"``) is read as the config itself.
- ``wan_accel.config`` (``METADATA_KEY``): ours, the full ``WanConfig.to_dict()``; written by ``convert``.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from ..cache.safety import loads_json
from .config import WanConfig

log = logging.getLogger("wan_accel")

PREFIXES = ("model.diffusion_model.", "diffusion_model.", "model.")
METADATA_KEY = "wan_accel.config"
COMFY_METADATA_KEY = "config"       # ComfyUI's: {"transformer": {...}} merged over its detection
PICKLE_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".pkl")
REAL_HEAD_DIM = 128                 # the head size of every released Wan model
MAX_HEADER_BYTES = 100 * 1024 * 1024
# bits per element of every safetensors dtype name we know
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E4M3FN": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "F64": 64, "I64": 64, "U64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
TORCH_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
                "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
FLOAT_DTYPES = {"F16", "BF16", "F32", "F64", "F8_E5M2", "F8_E4M3", "F8_E4M3FN", "F8_E4M3FNUZ", "F8_E5M2FNUZ"}
LOADABLE_DTYPES = {"F32", "F16", "BF16", "F64", "F8_E4M3", "F8_E5M2"}
FP8_DTYPES = {"F8_E4M3", "F8_E5M2"}         # fp8 weights the loader keeps in 1 byte (model/quant.py)
# quantization side tensors beside a layer's weight, ComfyUI's names: scaled fp8 files (``scale_weight``,
# ``scale_input``, and a ``scaled_fp8`` marker tensor) and its per-layer formats (``weight_scale``, ``input_scale``,
# ``comfy_quant``: the layer's format as JSON bytes; the file's ``_quantization_metadata`` lists them too)
WEIGHT_SCALES = ("scale_weight", "weight_scale")
INPUT_SCALES = ("scale_input", "input_scale")
QUANT_SIDE = WEIGHT_SCALES + INPUT_SCALES + ("comfy_quant",)
SCALED_FP8_MARK = "scaled_fp8"
QUANT_METADATA_KEY = "_quantization_metadata"
FP8_FORMATS = ("float8_e4m3fn", "float8_e5m2")   # per-layer formats the pack's loader reads; others need ComfyUI
# Matrix-Game-2 checkpoints are recognised by their action modules (mg2_model.py, imported lazily)
MG2_KEY_MARK = ".action_model."


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or loaded; the message says what to fix."""


class HeaderError(CheckpointError):
    """The file is not a readable safetensors file (damaged, truncated, or another format)."""


def _list(names, limit=10) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more

# diffusers WanTransformer3DModel names -> official names. Note diffusers' affine norm2 is the
# official cross-attention norm3.
_B = r"blocks\.(\d+)\."
_DIFFUSERS_RULES = [
    (r"condition_embedder\.time_embedder\.linear_1\.(.+)", r"time_embedding.0.\1"),
    (r"condition_embedder\.time_embedder\.linear_2\.(.+)", r"time_embedding.2.\1"),
    (r"condition_embedder\.text_embedder\.linear_1\.(.+)", r"text_embedding.0.\1"),
    (r"condition_embedder\.text_embedder\.linear_2\.(.+)", r"text_embedding.2.\1"),
    (r"condition_embedder\.time_proj\.(.+)", r"time_projection.1.\1"),
    (r"condition_embedder\.image_embedder\.norm1\.(.+)", r"img_emb.proj.0.\1"),
    (r"condition_embedder\.image_embedder\.ff\.net\.0\.proj\.(.+)", r"img_emb.proj.1.\1"),
    (r"condition_embedder\.image_embedder\.ff\.net\.2\.(.+)", r"img_emb.proj.3.\1"),
    (r"condition_embedder\.image_embedder\.norm2\.(.+)", r"img_emb.proj.4.\1"),
    (r"scale_shift_table", r"head.modulation"),
    (r"proj_out\.(.+)", r"head.head.\1"),
    (_B + r"scale_shift_table", r"blocks.\1.modulation"),
    # attn1 / attn2: the self- / cross-attention's q, k, v, o and q/k norms
    *((_B + rf"{attn}\.{part}\.(.+)", rf"blocks.\1.{owner}.{layer}.\2")
      for attn, owner in (("attn1", "self_attn"), ("attn2", "cross_attn"))
      for part, layer in (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), (r"to_out\.0", "o"))),
    *((_B + rf"{attn}\.norm_([qk])\.(.+)", rf"blocks.\1.{owner}.norm_\2.\3")
      for attn, owner in (("attn1", "self_attn"), ("attn2", "cross_attn"))),
    (_B + r"attn2\.add_k_proj\.(.+)", r"blocks.\1.cross_attn.k_img.\2"),
    (_B + r"attn2\.add_v_proj\.(.+)", r"blocks.\1.cross_attn.v_img.\2"),
    (_B + r"attn2\.norm_added_k\.(.+)", r"blocks.\1.cross_attn.norm_k_img.\2"),
    (_B + r"ffn\.net\.0\.proj\.(.+)", r"blocks.\1.ffn.0.\2"),
    (_B + r"ffn\.net\.2\.(.+)", r"blocks.\1.ffn.2.\2"),
    (_B + r"norm2\.(.+)", r"blocks.\1.norm3.\2"),
]
_DIFFUSERS_RULES = [(re.compile(p), r) for p, r in _DIFFUSERS_RULES]
_DIFFUSERS_MARKERS = ("condition_embedder.", ".attn1.", ".attn2.", "proj_out.", "scale_shift_table")


def strip_prefix(name: str, prefixes: tuple = PREFIXES) -> str:
    """``name`` without the first of ``prefixes`` it starts with."""
    for p in prefixes:
        if name.startswith(p):
            return name[len(p):]
    return name


def diffusers_to_official(name: str) -> str:
    """Official name of a diffusers-format key; unknown names are returned unchanged."""
    for pattern, repl in _DIFFUSERS_RULES:
        if pattern.fullmatch(name):
            return pattern.sub(repl, name)
    return name


def canonical_names(names) -> dict:
    """{official name: name in the file}. Strips wrapper prefixes and maps diffusers-format names."""
    stripped = {strip_prefix(n): n for n in names}
    if any(m in n for n in stripped for m in _DIFFUSERS_MARKERS):      # diffusers-format names
        mapped = {diffusers_to_official(n): src for n, src in stripped.items()}
    else:
        mapped = stripped
    if len(mapped) != len(stripped):
        raise CheckpointError("checkpoint has keys that collide after removing prefixes / renaming; "
                              "it mixes two key formats")
    return mapped


# --------------------------------------------------------------------- the header
@dataclass
class TensorInfo:
    name: str
    dtype: str          # safetensors dtype name, e.g. 'BF16'
    shape: tuple
    nbytes: int
    offset: int = -1    # absolute file offset of the tensor's bytes (-1: unknown)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES


def check_path(path) -> Path:
    """The path of a safetensors file; pickle checkpoints are refused by name, never opened."""
    path = Path(path)
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise CheckpointError(
            f"{path.name} is a pickle checkpoint; only .safetensors files are read (pickle files can run "
            f"code). Convert it once: python -m wan_accel convert {path} {path.with_suffix('.safetensors')} "
            f"[--ema]")
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    return path


def read_header(path) -> tuple[dict[str, TensorInfo], dict]:
    """({name: TensorInfo}, metadata {str: str}) of a safetensors file, reading only its header.
    Raises HeaderError (a CheckpointError) when the file is damaged or not safetensors."""
    path = check_path(path)
    what = f"{path.name} is not a readable safetensors file"
    hint = "; pickle checkpoints must be converted with: python -m wan_accel convert IN.pt OUT.safetensors"
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise HeaderError(f"{what}: only {len(head)} bytes; a safetensors file starts with an 8-byte "
                                  f"header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise HeaderError(f"{what}: header length {n} does not fit in a file of {size} bytes (another "
                                  f"format, or truncated){hint}")
            raw = fh.read(n)
    except OSError as exc:
        raise HeaderError(f"cannot read {path}: {exc}") from None
    try:
        header = loads_json(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HeaderError(f"{what}: header is not valid JSON ({exc}){hint}") from None
    if not isinstance(header, dict):
        raise HeaderError(f"{what}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_size = size - 8 - n
    tensors = {}
    for name, entry in header.items():
        try:
            dtype, shape = str(entry["dtype"]), tuple(int(s) for s in entry["shape"])
            start, end = (int(v) for v in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise HeaderError(f"{what}: entry {name!r} lacks dtype/shape/data_offsets") from None
        if not 0 <= start <= end <= data_size:
            raise HeaderError(f"{path.name}: tensor {name!r} lies outside the data ({start}..{end} of {data_size} "
                              f"bytes); the file is truncated or damaged")
        bits = DTYPE_BITS.get(dtype)
        if bits is not None and (math.prod(shape) * bits + 7) // 8 != end - start:
            raise HeaderError(f"{path.name}: tensor {name!r} ({dtype} {list(shape)}) has {end - start} bytes, "
                              f"expected {(math.prod(shape) * bits + 7) // 8}")
        tensors[name] = TensorInfo(name, dtype, shape, end - start, 8 + n + start)
    return tensors, {str(k): str(v) for k, v in metadata.items()}


def read_tensor_into(path, info: TensorInfo, out) -> bool:
    """Read a tensor's bytes from the file straight into ``out`` (a contiguous CPU tensor of the file's dtype and
    shape) with plain reads, so no page of the file stays mapped for it. False when ``out`` does not match."""
    import torch
    want = TORCH_DTYPES.get(info.dtype)
    if want is None or info.offset < 0 or out.device.type != "cpu" or out.dtype != getattr(torch, want, None) \
            or tuple(out.shape) != tuple(info.shape) or not out.is_contiguous():
        return False
    view = memoryview(out.view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
    with open(path, "rb") as fh:
        fh.seek(info.offset)
        got = fh.readinto(view)
    if got != info.nbytes:
        raise HeaderError(f"{Path(path).name}: tensor {info.name!r} is truncated ({got} of {info.nbytes} bytes)")
    return True


# --------------------------------------------------------------------- the config in the metadata
def _json_object(meta: dict, key: str, strict: bool) -> dict:
    raw = (meta or {}).get(key)
    if not raw:
        return {}
    try:
        value = loads_json(raw)
    except ValueError as exc:
        if strict:
            raise CheckpointError(f"metadata '{key}' is not valid JSON: {exc}") from exc
        log.debug("wan_accel: metadata '%s' is not JSON (%s); ignored", key, exc)
        return {}
    if not isinstance(value, dict):
        if strict:
            raise CheckpointError(f"metadata '{key}' is not a JSON object")
        return {}
    return value


def metadata_config(meta: dict) -> dict | None:
    """The model config a file's metadata states, or None: ComfyUI's ``config`` (its ``transformer`` object, or the
    object itself when flat) with ours (``wan_accel.config``) over it. ComfyUI's flag ``causal_ar`` is kept."""
    comfy = _json_object(meta, COMFY_METADATA_KEY, strict=False)
    if isinstance(comfy.get("transformer"), dict):
        comfy = comfy["transformer"]
    ours = _json_object(meta, METADATA_KEY, strict=True)
    merged = {**comfy, **ours}
    return merged or None


# --------------------------------------------------------------------- config inference
# Rank and layout of the tensors the config is read from.
_INFER_SHAPES = {"patch_embedding.weight": "[dim, in_dim, pt, ph, pw]", "head.head.weight": "[out_dim * patch, dim]",
                 "blocks.0.ffn.0.weight": "[ffn_dim, dim]", "time_embedding.0.weight": "[dim, freq_dim]",
                 "text_embedding.0.weight": "[dim, text_dim]", "img_emb.proj.1.weight": "[dim, clip_dim]"}


def _shape(shapes, name):
    if name not in shapes:
        raise CheckpointError(f"cannot infer the model config: key '{name}' is missing. Is this a Wan 2.1 "
                              f"DiT checkpoint?")
    shape = tuple(shapes[name])
    layout = _INFER_SHAPES.get(name)
    if layout is not None and len(shape) != layout.count(",") + 1:
        raise CheckpointError(f"tensor '{name}' has shape {list(shape)}, expected {layout} "
                              f"({layout.count(',') + 1}-D); this is not a Wan 2.1 DiT checkpoint or it is damaged")
    return shape


def default_num_heads(dim: int) -> int | None:
    """Heads of a checkpoint whose metadata does not say: dim / 128 (every released Wan model), else None."""
    return dim // REAL_HEAD_DIM if dim > 0 and dim % REAL_HEAD_DIM == 0 else None


def _block_indices(shapes) -> set:
    return {int(m.group(1)) for n in shapes for m in [re.match(r"blocks\.(\d+)\.", n)] if m}


OVERRIDABLE = ("text_len", "eps", "window_size", "local_attn_size", "sink_size", "clip_tokens")
MG2_OVERRIDABLE = ("eps", "local_attn_size", "sink_size", "clip_tokens")


def infer_config(shapes: dict, num_heads: int | None = None, overrides: dict | None = None) -> WanConfig:
    """WanConfig from {official key name: shape}. num_heads comes from (in order) the argument,
    ``overrides`` (e.g. checkpoint metadata), or dim / 128 (the head size of every released Wan model).
    Matrix-Game-2 (keys of action modules): no text branch (the image tokens are the context), a rolling window of 6
    latent frames unless overridden, and the ``action_config`` the action modules' shapes give (``mg2_model.py``)."""
    overrides = dict(overrides or {})
    mg2 = any(MG2_KEY_MARK in n for n in shapes)
    pe = _shape(shapes, "patch_embedding.weight")
    dim, in_dim, patch = pe[0], pe[1], tuple(pe[2:5])
    layers = _block_indices(shapes)
    if not layers or layers != set(range(len(layers))):
        raise CheckpointError(f"transformer blocks must be numbered 0..N-1, found {sorted(layers)[:10]}")
    head_out = _shape(shapes, "head.head.weight")[0]
    vol = patch[0] * patch[1] * patch[2]
    if head_out % vol:
        raise CheckpointError(f"head.head.weight has {head_out} outputs, not a multiple of the patch volume {vol}")
    heads = num_heads or overrides.pop("num_heads", None) or default_num_heads(dim)
    if heads is None:
        raise CheckpointError(
            f"cannot infer num_heads for dim={dim} (real Wan models use head_dim {REAL_HEAD_DIM}); pass "
            f"num_heads explicitly or store the config in the safetensors metadata key '{METADATA_KEY}'")
    i2v = mg2 or "img_emb.proj.1.weight" in shapes or "blocks.0.cross_attn.k_img.weight" in shapes
    cfg = dict(
        model_type="i2v" if i2v else "t2v", patch_size=patch, in_dim=in_dim, dim=dim,
        ffn_dim=_shape(shapes, "blocks.0.ffn.0.weight")[0],
        freq_dim=_shape(shapes, "time_embedding.0.weight")[1],
        out_dim=head_out // vol, num_heads=int(heads), num_layers=len(layers),
        qk_norm="blocks.0.self_attn.norm_q.weight" in shapes,
        cross_attn_norm="blocks.0.norm3.weight" in shapes)
    if mg2:
        cfg.update(local_attn_size=6, sink_size=0)
    else:
        cfg["text_dim"] = _shape(shapes, "text_embedding.0.weight")[1]
    if mg2 or "img_emb.proj.1.weight" in shapes:
        cfg["clip_dim"] = _shape(shapes, "img_emb.proj.1.weight")[1]
    for key in MG2_OVERRIDABLE if mg2 else OVERRIDABLE:
        if key in overrides:
            cfg[key] = overrides[key]
    if mg2:
        from .mg2_model import infer_action_config
        try:
            action = infer_action_config(shapes, dim)
        except (KeyError, ValueError) as exc:
            raise CheckpointError(f"cannot infer the Matrix-Game-2 config: {exc}") from exc
        cfg["extra"] = {"action_config": {**action, **(overrides.get("action_config") or {})}}
    try:
        return WanConfig(**cfg)
    except ValueError as exc:
        raise CheckpointError(f"inferred config is invalid: {exc}") from exc


_CORE_DEFAULTS = {"text_len": 512, "freq_dim": 256, "text_dim": 4096, "eps": 1e-6}   # what core assumes for Wan 2.1


def core_causal_metadata(config: WanConfig) -> dict:
    """The ComfyUI metadata that makes core load a causal text-to-video file as ``WAN21_CausalAR``: ``causal_ar``,
    and each size core does not read from the shapes when it differs from core's assumption (heads: dim // 128;
    text length, frequency and text widths, eps). Empty for models core cannot run that way (image branch, action
    modules, another patch size)."""
    if config.model_type != "t2v" or config.extra.get("action_config") is not None or \
            tuple(config.patch_size) != (1, 2, 2):
        return {}
    transformer = {"causal_ar": True}
    if config.num_heads != config.dim // REAL_HEAD_DIM:
        transformer["num_heads"] = config.num_heads
    for key, core_default in _CORE_DEFAULTS.items():
        if getattr(config, key) != core_default:
            transformer[key] = getattr(config, key)
    return {COMFY_METADATA_KEY: json.dumps({"transformer": transformer})}


def model_class(config: WanConfig):
    """The nn.Module class a config describes: the plain Wan DiT, or Matrix-Game-2 (action modules)."""
    if config.extra.get("action_config") is not None:
        from .mg2_model import MatrixGameModel
        return MatrixGameModel
    from .dit import WanModel
    return WanModel


def config_dict(config: WanConfig) -> dict:
    """A config as one flat dict, ``extra`` (e.g. Matrix-Game-2's action_config) included."""
    return {**config.extra, **config.to_dict()}


def partial_config(shapes: dict, overrides: dict | None = None) -> dict:
    """What the shapes and metadata show of a file that is not a complete Wan DiT (missing keys, unknown head
    size): the fields ``infer_config`` would give, as far as they can be seen. For sizing only, never loading."""
    cfg = dict(overrides or {})

    def dim_of(name, axis):
        s = shapes.get(name)
        return s[axis] if s is not None and len(s) > axis else None

    pe = shapes.get("patch_embedding.weight")
    dim = int(cfg.get("dim") or dim_of("blocks.0.self_attn.q.weight", 0) or (pe[0] if pe else 0))
    cfg["dim"] = dim
    cfg.setdefault("ffn_dim", dim_of("blocks.0.ffn.0.weight", 0) or 4 * dim)
    if pe is not None and len(pe) == 5:
        cfg.setdefault("in_dim", pe[1])
        cfg.setdefault("patch_size", tuple(pe[2:5]))
    patch = tuple(cfg.get("patch_size", (1, 2, 2)))
    head_out = dim_of("head.head.weight", 0)
    if head_out and head_out % math.prod(patch) == 0:
        cfg.setdefault("out_dim", head_out // math.prod(patch))
    if dim_of("text_embedding.0.weight", 1):
        cfg.setdefault("text_dim", dim_of("text_embedding.0.weight", 1))
    i2v = any(n.startswith("img_emb.") or ".k_img." in n for n in shapes)
    cfg.setdefault("model_type", "i2v" if i2v else "t2v")
    layers = _block_indices(shapes)
    cfg.setdefault("num_layers", 1 + max(layers) if layers else 0)
    # unknown head size: one head per 128 channels, at least one (only the attention-score estimate uses it)
    cfg["num_heads"] = int(cfg.get("num_heads") or default_num_heads(dim) or max(1, dim // REAL_HEAD_DIM))
    return cfg


# --------------------------------------------------------------------- expected shapes and validation
def expected_shapes(config: WanConfig) -> dict:
    """{official key name: shape} of the model a config describes (built on the meta device, no memory)."""
    import torch

    with torch.device("meta"):
        model = model_class(config)(config)
    return {n: tuple(t.shape) for n, t in model.state_dict().items()}


def validate_keys(expected: dict, found: dict, source: str = "checkpoint") -> None:
    """One error listing missing / unexpected / wrong-shape keys (first 10 of each and counts)."""
    missing = set(expected) - set(found)
    unexpected = set(found) - set(expected)
    wrong = [f"{n} {tuple(found[n])} (expected {tuple(expected[n])})"
             for n in set(expected) & set(found) if tuple(found[n]) != tuple(expected[n])]
    if not (missing or unexpected or wrong):
        return
    parts = [f"{source} does not match the Wan model it describes; nothing was loaded."]
    if missing:
        parts.append(f"missing {len(missing)} keys: {_list(missing)}")
    if unexpected:
        parts.append(f"unexpected {len(unexpected)} keys: {_list(unexpected)}")
    if wrong:
        parts.append(f"wrong shape {len(wrong)} keys: {_list(wrong)}")
    raise CheckpointError("\n".join(parts))


def check_dtypes(dtypes: dict) -> None:
    """Only float32/float16/bfloat16/float64 and fp8 (e4m3fn, e5m2; scaled or not) tensors are loaded."""
    bad = {n: d for n, d in dtypes.items() if d not in LOADABLE_DTYPES}
    if bad:
        raise CheckpointError(f"unsupported tensor dtypes (float32/float16/bfloat16 and fp8 e4m3fn/e5m2 "
                              f"checkpoints are read; other quantized formats (MXFP8, NVFP4, int8) load with "
                              f"ComfyUI's Load Diffusion Model and sample with the Wan Accel AR Sampler): "
                              f"{_list(f'{n} {d}' for n, d in bad.items())}")


# --------------------------------------------------------------------- quantization side tensors
def quant_side(name: str) -> tuple[str, str] | None:
    """(layer, kind) of a quantization side tensor ('blocks.0.ffn.0', 'scale_weight'), else None."""
    layer, _, leaf = name.rpartition(".")
    if leaf in QUANT_SIDE and layer:
        return layer, leaf
    return None


def split_quant(tensors: dict) -> tuple[dict, dict]:
    """({name: TensorInfo} of the model's own tensors, {layer: {kind: TensorInfo}} of the quantization side
    tensors). The ``scaled_fp8`` marker is dropped."""
    own, side = {}, {}
    for name, info in tensors.items():
        if name == SCALED_FP8_MARK:
            continue
        q = quant_side(name)
        if q is None:
            own[name] = info
        else:
            side.setdefault(q[0], {})[q[1]] = info
    return own, side


def metadata_quant_formats(meta: dict) -> dict:
    """{layer: format} from the file's ``_quantization_metadata`` (ComfyUI's per-layer quantization formats)."""
    conf = _json_object(meta, QUANT_METADATA_KEY, strict=True)
    layers = conf.get("layers", {})
    if not isinstance(layers, dict):
        raise CheckpointError(f"metadata '{QUANT_METADATA_KEY}' has no 'layers' object")
    return {strip_prefix(str(k)): (v.get("format") if isinstance(v, dict) else None) for k, v in layers.items()}


def check_quant_side(path, tensors: dict, names: dict, quant: dict, meta: dict) -> None:
    """The quantization side of a file, checked when it is opened (loading and sizing alike): every side tensor
    belongs to a layer weight of the file, and the metadata's per-layer formats are a JSON object. CheckpointError
    naming the file and the tensor or metadata key."""
    name = Path(path).name
    for layer, side in (quant or {}).items():
        if f"{layer}.weight" not in tensors:
            src = names.get(f"{layer}.{next(iter(side))}", f"{layer}.{next(iter(side))}")
            raise CheckpointError(f"{name}: quantization tensor {src!r} belongs to no layer weight of the model (no "
                                  f"'{layer}.weight'); the file is damaged or mixes two models")
    try:
        metadata_quant_formats(meta)
    except CheckpointError as exc:
        raise CheckpointError(f"{name}: {exc}; the file is damaged: download or convert it again") from None


def check_quant_formats(formats: dict) -> None:
    """The pack's loader reads the fp8 formats; a layer in another one (MXFP8, NVFP4, int8, ...) is refused."""
    bad = {layer: fmt for layer, fmt in formats.items() if fmt not in FP8_FORMATS}
    if bad:
        raise CheckpointError(
            f"layers quantized in formats the pack's loader does not read ({_list(f'{n}: {f}' for n, f in bad.items())});"
            f" it reads plain and scaled fp8 ({', '.join(FP8_FORMATS)}). Load this file with ComfyUI's Load Diffusion "
            f"Model and sample it with the Wan Accel AR Sampler")


def keeps_fp8(name: str, dtype: str, shape) -> bool:
    """Whether the loader keeps this tensor in fp8 (1 byte per element): the 2-D weight of a linear layer inside a
    transformer block stored as fp8. Other fp8 tensors are dequantized to the run's dtype when loaded."""
    return dtype in FP8_DTYPES and len(tuple(shape)) == 2 and name.endswith(".weight") and \
        MG2_KEY_MARK not in name and re.match(r"^(?:blocks|transformer_blocks)\.\d+\.", name) is not None


# --------------------------------------------------------------------- one file, read once
@dataclass
class Checkpoint:
    """A checkpoint file as the pack sees it: its tensors (official names), metadata and model config."""
    path: Path
    tensors: dict          # official name -> TensorInfo (with its size in the file)
    names: dict            # official name -> name in the file
    metadata: dict
    config: WanConfig | None   # None when the file is not a complete Wan DiT (see ``error``)
    error: str = ""
    quant: dict = None     # layer (official name) -> {kind: TensorInfo}: quantization side tensors (split_quant)

    @property
    def shapes(self) -> dict:
        return {n: t.shape for n, t in self.tensors.items()}

    @property
    def stated_config(self) -> dict:
        try:
            return metadata_config(self.metadata) or {}
        except CheckpointError:
            return {}

    def sizing_config(self) -> dict:
        """The config the planner sizes with: the inferred one, else what the shapes and metadata show."""
        if self.config is not None:
            return config_dict(self.config)
        return partial_config(self.shapes, self.stated_config)


def open_checkpoint(path, config=None, num_heads: int | None = None, *, strict: bool = True) -> Checkpoint:
    """Read a checkpoint's header and settle its config: ``config`` (WanConfig or dict) when given, else inferred
    from the shapes with the metadata's config over the defaults (``num_heads`` beats both). strict: the config must
    be complete and every key must match it (loading); otherwise a file that is not a complete Wan DiT still opens,
    with ``config`` None and the reason in ``error`` (sizing)."""
    path = Path(path)
    raw, meta = read_header(path)     # refuses a pickle file or a missing one (check_path)
    names = canonical_names(raw)
    tensors, quant = split_quant({n: raw[src] for n, src in names.items()})
    check_quant_side(path, tensors, names, quant, meta)     # every reader of the file: named errors, no IndexError
    shapes = {n: t.shape for n, t in tensors.items()}
    try:
        if config is None:
            config = infer_config(shapes, num_heads=num_heads, overrides=metadata_config(meta))
        elif isinstance(config, dict):
            config = WanConfig.from_dict(config)
        if strict:
            validate_keys(expected_shapes(config), shapes, path.name)
    except CheckpointError as exc:
        if strict:
            raise
        return Checkpoint(path, tensors, names, meta, None, str(exc), quant)
    return Checkpoint(path, tensors, names, meta, config, quant=quant)
