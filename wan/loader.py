"""Checkpoint loading: safetensors only, config inferred from tensor shapes, streamed one tensor at a time.

The model is built on the meta device and each tensor is read, cast and moved to its target device and
dtype on its own, so host RAM never holds a second full copy. Pickle checkpoints (.pt/.pth/.ckpt) are
never opened here: convert them once with ``python -m wan_accel convert``.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.nn as nn

from .config import WanConfig
from .keys import canonical_names
from .model import WanModel

PICKLE_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".pkl")
METADATA_KEY = "wan_accel.config"
REAL_HEAD_DIM = 128
_ALLOWED_DTYPES = {"F32", "F16", "BF16", "F64"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message says what to fix."""


def _list(names, limit=10) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


# --------------------------------------------------------------------- header
def _check_path(path) -> Path:
    path = Path(path)
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise CheckpointError(
            f"{path.name} is a pickle checkpoint; only .safetensors files are loaded (pickle files can run "
            f"code). Convert it once: python -m wan_accel convert {path} {path.with_suffix('.safetensors')} "
            f"[--ema]")
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    return path


def read_header(path):
    """(shapes {name: tuple}, dtypes {name: str}, metadata dict) without reading tensor data."""
    from safetensors import safe_open
    path = _check_path(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            shapes, dtypes = {}, {}
            for name in f.keys():
                sl = f.get_slice(name)
                shapes[name], dtypes[name] = tuple(sl.get_shape()), sl.get_dtype()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{path.name} is not a readable safetensors file ({exc}). Pickle checkpoints "
                              f"must be converted with: python -m wan_accel convert IN.pt OUT.safetensors") from exc
    return shapes, dtypes, meta


def metadata_config(meta: dict) -> dict | None:
    raw = (meta or {}).get(METADATA_KEY)
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise CheckpointError(f"metadata '{METADATA_KEY}' is not valid JSON: {exc}") from exc


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


def infer_config(shapes: dict, num_heads: int | None = None, overrides: dict | None = None) -> WanConfig:
    """WanConfig from {official key name: shape}. num_heads comes from (in order) the argument,
    ``overrides`` (e.g. checkpoint metadata), or dim / 128 (the head size of every released Wan model)."""
    overrides = dict(overrides or {})
    pe = _shape(shapes, "patch_embedding.weight")
    dim, in_dim, patch = pe[0], pe[1], tuple(pe[2:5])
    layers = {int(m.group(1)) for n in shapes for m in [re.match(r"blocks\.(\d+)\.", n)] if m}
    if not layers or layers != set(range(len(layers))):
        raise CheckpointError(f"transformer blocks must be numbered 0..N-1, found {sorted(layers)[:10]}")
    head_out = _shape(shapes, "head.head.weight")[0]
    vol = patch[0] * patch[1] * patch[2]
    if head_out % vol:
        raise CheckpointError(f"head.head.weight has {head_out} outputs, not a multiple of the patch volume {vol}")
    heads = num_heads or overrides.pop("num_heads", None)
    if heads is None:
        if dim % REAL_HEAD_DIM:
            raise CheckpointError(
                f"cannot infer num_heads for dim={dim} (real Wan models use head_dim {REAL_HEAD_DIM}); pass "
                f"num_heads explicitly or store the config in the safetensors metadata key '{METADATA_KEY}'")
        heads = dim // REAL_HEAD_DIM
    i2v = "img_emb.proj.1.weight" in shapes or "blocks.0.cross_attn.k_img.weight" in shapes
    cfg = dict(
        model_type="i2v" if i2v else "t2v", patch_size=patch, in_dim=in_dim, dim=dim,
        ffn_dim=_shape(shapes, "blocks.0.ffn.0.weight")[0],
        freq_dim=_shape(shapes, "time_embedding.0.weight")[1],
        text_dim=_shape(shapes, "text_embedding.0.weight")[1],
        out_dim=head_out // vol, num_heads=int(heads), num_layers=len(layers),
        qk_norm="blocks.0.self_attn.norm_q.weight" in shapes,
        cross_attn_norm="blocks.0.norm3.weight" in shapes)
    if "img_emb.proj.1.weight" in shapes:
        cfg["clip_dim"] = _shape(shapes, "img_emb.proj.1.weight")[1]
    for key in ("text_len", "eps", "window_size", "local_attn_size", "sink_size", "clip_tokens"):
        if key in overrides:
            cfg[key] = overrides[key]
    try:
        return WanConfig(**cfg)
    except ValueError as exc:
        raise CheckpointError(f"inferred config is invalid: {exc}") from exc


# --------------------------------------------------------------------- model families
# The plain Wan DiT, and Matrix-Game-2 (recognised by its action modules; wan/mg2_model.py, imported lazily).
MG2_KEY_MARK = ".action_model."


def model_class(config: WanConfig):
    """The nn.Module class a config describes."""
    if config.extra.get("action_config") is not None:
        from .mg2_model import MatrixGameModel
        return MatrixGameModel
    return WanModel


def infer_any_config(shapes: dict, num_heads: int | None = None, overrides: dict | None = None) -> WanConfig:
    """infer_config, or the Matrix-Game-2 inference when the keys hold action modules."""
    if any(MG2_KEY_MARK in n for n in shapes):
        from .mg2_model import infer_mg2_config
        try:
            return infer_mg2_config(shapes, num_heads=num_heads, overrides=overrides)
        except (KeyError, ValueError) as exc:
            raise CheckpointError(f"cannot infer the Matrix-Game-2 config: {exc}") from exc
    return infer_config(shapes, num_heads=num_heads, overrides=overrides)


# --------------------------------------------------------------------- validation
def expected_shapes(config: WanConfig) -> dict:
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


def _check_dtypes(dtypes: dict) -> None:
    bad = {n: d for n, d in dtypes.items() if d not in _ALLOWED_DTYPES}
    if bad:
        raise CheckpointError(f"unsupported tensor dtypes (only float32/float16/bfloat16 checkpoints are "
                              f"supported; fp8/quantized files are not): "
                              f"{_list(f'{n} {d}' for n, d in bad.items())}")


# --------------------------------------------------------------------- loading
def _set_param(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)


def resolve_config(path, config=None, num_heads=None):
    """(config, {official name: file name}) for a safetensors checkpoint, validated against the model."""
    shapes, dtypes, meta = read_header(path)
    _check_dtypes(dtypes)
    names = canonical_names(shapes)
    official = {n: shapes[src] for n, src in names.items()}
    if config is None:
        config = infer_any_config(official, num_heads=num_heads, overrides=metadata_config(meta))
    elif isinstance(config, dict):
        config = WanConfig.from_dict(config)
    validate_keys(expected_shapes(config), official, Path(path).name)
    return config, names


def load_wan_checkpoint(path, device="cpu", dtype=torch.float32, precision=None, config=None,
                        num_heads=None, attention="auto") -> WanModel:
    """Load a Wan DiT from a .safetensors file. precision: 'float32' | 'wan21' | 'self_forcing'
    (default: 'float32' for float32, else 'self_forcing'). config: WanConfig/dict to use instead of inferring."""
    from safetensors import safe_open
    precision = precision or ("float32" if dtype == torch.float32 else "self_forcing")
    config, names = resolve_config(path, config, num_heads)
    with torch.device("meta"):
        model = model_class(config)(config)
    model.set_precision(precision, dtype)
    targets = {n: p.dtype for n, p in model.named_parameters()}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for name, src in names.items():
            tensor = f.get_tensor(src).to(device=device, dtype=targets[name])
            _set_param(model, name, tensor)
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise CheckpointError(f"parameters left unloaded: {_list(left)}")
    model.set_precision(precision, dtype).set_attention_backend(attention)
    return model.eval().requires_grad_(False)


def save_wan_checkpoint(model: WanModel, path, extra_metadata: dict | None = None) -> Path:
    """Write a model's state dict as safetensors with its config in the metadata."""
    from safetensors.torch import save_file
    meta = {METADATA_KEY: json.dumps(model.config.to_dict())}
    meta.update(extra_metadata or {})
    tensors = {n: t.detach().contiguous() for n, t in model.state_dict().items()}
    save_file(tensors, str(path), metadata=meta)
    return Path(path)


def convert_pt_to_safetensors(src, dst, ema: bool = False, num_heads: int | None = None) -> dict:
    """See wan.convert.convert_pt_to_safetensors (re-exported here)."""
    from .convert import convert_pt_to_safetensors as convert
    return convert(src, dst, ema=ema, num_heads=num_heads)
