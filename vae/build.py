"""The decoders by name (``bench sampler --decode``): built from a .safetensors file, or with seeded random
weights of the released architecture (or of a reduced width, for CPU-sized runs)."""
from __future__ import annotations

from . import taehv, wan21
from .stream import StreamingDecoder
from .weights import DecoderWeightsError, init_random, read_header

DECODERS = {  # name -> (class, released config, reduced config)
    "wan": (wan21.WanVAEDecoder, wan21.WAN21_VAE, wan21.REDUCED),
    "tiny": (taehv.TinyVideoDecoder, taehv.TAEW2_1, taehv.REDUCED),
}
MARKS = {"wan": "decoder.middle.0.residual.0.gamma", "tiny": "decoder.22.bias"}   # a key only that file has


def decoder_kind(header: dict) -> str | None:
    """'wan' or 'tiny': the decoder whose weights a file's header (``weights.read_header``) holds, by a key only that
    decoder's file has; None for neither."""
    found = [k for k, mark in MARKS.items() if mark in header]
    return found[0] if len(found) == 1 else None


def build_decoder(kind: str, path=None, reduced: bool = False, seed: int = 0) -> StreamingDecoder:
    """A float32 decoder on the CPU: ``kind`` 'wan' or 'tiny'; weights from ``path`` (a .safetensors file whose
    key names are the real file's), else random (seeded) at the released size or, with ``reduced``, narrow."""
    if kind not in DECODERS:
        raise ValueError(f"unknown decoder {kind!r}; choose from {', '.join(DECODERS)}")
    cls, released, narrow = DECODERS[kind]
    if path is not None:
        header = read_header(path)
        other = decoder_kind(header)
        if other not in (None, kind):
            raise DecoderWeightsError(f"{path} holds the weights of the '{other}' decoder, not of '{kind}': decode "
                                      f"it with '{other}' or give a '{kind}' file")
        return cls.from_file(path, header).eval().requires_grad_(False)
    return init_random(cls(narrow if reduced else released), seed).eval().requires_grad_(False)
