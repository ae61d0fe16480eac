"""Decoder weights: read from a .safetensors file by key name (never pickle), checked against the decoder's own
state dict before anything is copied, or drawn at random (seeded) for a benchmark without a file.

A file is checked whole: every key the decoder needs must be there with its shape and a floating-point dtype,
and every other key must belong to a part the decoder does not use (the encoder of a full VAE file). A file that
fails gets one ``DecoderWeightsError`` line naming the file, what it should be, and the first keys of each kind
of problem (missing, unexpected, mis-shaped).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..cache.finite_flags import non_finite
from ..model.checkpoint import _list

FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
SHOWN = 4               # keys named per problem in a message


class DecoderWeightsError(ValueError):
    """A decoder weights file that cannot be loaded; the message says which keys are wrong and what to use."""


def read_header(path) -> dict:
    """{key: (shape tuple, safetensors dtype name)} of a .safetensors file, without reading the tensors."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            out = {}
            for key in f.keys():
                part = f.get_slice(key)
                out[key] = (tuple(part.get_shape()), str(part.get_dtype()))
            return out
    except (OSError, ValueError):
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors' own error type differs between versions
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DecoderWeightsError(f"{path}: not a readable safetensors file ({detail}); write or download it "
                                  f"again") from None


def check_keys(module: torch.nn.Module, header: dict, path, what: str, unused_prefixes: tuple, hint: str) -> None:
    """DecoderWeightsError unless ``header`` holds exactly ``module``'s state dict (shapes, float dtypes), give or
    take keys under ``unused_prefixes``."""
    wanted = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    missing = [k for k in wanted if k not in header]
    unexpected = [k for k in header if k not in wanted and not k.startswith(unused_prefixes)]
    shapes = [f"{k} {list(header[k][0])} (expected {list(wanted[k])})" for k in wanted
              if k in header and header[k][0] != wanted[k]]
    dtypes = [f"{k} {header[k][1]}" for k in wanted if k in header and header[k][1] not in FLOAT_DTYPES]
    problems = [f"{len(v)} {label}: {_list(v, SHOWN)}" for label, v in
                (("missing", missing), ("unexpected", unexpected), ("with another shape", shapes),
                 ("not floating point", dtypes)) if v]
    if problems:
        raise DecoderWeightsError(f"{path}: not a {what} ({'; '.join(problems)}); {hint}")


@torch.no_grad()
def load_file(build, path, what: str, unused_prefixes: tuple, hint: str, header: dict) -> torch.nn.Module:
    """The decoder ``build()`` makes, with the weights of ``path`` (its ``header``: ``read_header``) copied in by key
    name after checking the whole file (see module doc), then every weight checked finite. The header is checked
    against a copy built on the meta device, so a small file that only claims a wide decoder is refused from its
    header before anything is allocated."""
    from safetensors import safe_open
    path = Path(path)
    with torch.device("meta"):
        check_keys(build(), header, path, what, unused_prefixes, hint)     # shapes only: nothing allocated
    module = build()
    with safe_open(str(path), framework="pt", device="cpu") as f:
        return _copy_in(module, f.get_tensor, path, hint)


SAFETENSORS_DTYPES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64"}


def header_of(state: dict) -> dict:
    """A state dict's {key: (shape tuple, safetensors dtype name)}, as ``read_header`` gives a file's."""
    return {k: (tuple(v.shape), SAFETENSORS_DTYPES.get(v.dtype, str(v.dtype))) for k, v in state.items()}


@torch.no_grad()
def load_state(module: torch.nn.Module, state: dict, source: str, what: str, unused_prefixes: tuple = (),
               hint: str = "") -> torch.nn.Module:
    """Copy the tensors of ``state`` (another implementation's state dict, e.g. a ComfyUI VAE's) into ``module`` by
    key name, checked as a file is (``source`` names it in a message)."""
    check_keys(module, header_of(state), source, what, unused_prefixes, hint)
    return _copy_in(module, lambda key: state[key].detach().to("cpu"), source, hint)


def _copy_in(module: torch.nn.Module, get, source, hint: str) -> torch.nn.Module:
    """Every weight of ``module`` from ``get(key)``, then DecoderWeightsError naming the first weight that holds NaN
    or inf (a damaged file, or values that overflow the decoder's dtype)."""
    for key, target in module.state_dict().items():
        target.copy_(get(key).to(target.dtype))
    bad = non_finite(module.state_dict())               # one host sync for every weight
    if bad:
        raise DecoderWeightsError(f"{source}: {bad[0]} holds NaN or inf values (a damaged file, or values too large "
                                  f"for float32); write or download it again" + (f": {hint}" if hint else ""))
    return module


@torch.no_grad()
def init_random(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Seeded random weights of the real architecture: norm gains near 1, small biases, other weights with unit
    output variance per input (1/sqrt(fan-in)); the same seed gives the same weights on every machine."""
    gen = torch.Generator().manual_seed(int(seed))
    for name, p in module.named_parameters():
        if name.endswith("gamma"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif p.dim() == 1:
            p.copy_(0.02 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5)
    return module
