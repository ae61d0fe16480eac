"""Model configuration of the Wan 2.1 DiT (full-sequence and causal variants)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


class DictConfig:
    """A dataclass config that is written as a plain dict (its tuples as lists, ``extra`` left out) and read from
    one; the dataclass has an ``extra`` field for the keys it does not know."""

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("extra")
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: dict):
        """Build from a dict; unknown keys are kept in ``extra`` (not an error)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        extra = {k: v for k, v in d.items() if k not in names}
        return cls(**known, extra=extra)


@dataclass
class WanConfig(DictConfig):
    model_type: str = "t2v"                 # 't2v' or 'i2v'
    patch_size: tuple = (1, 2, 2)           # (pt, ph, pw)
    text_len: int = 512
    in_dim: int = 16
    dim: int = 1536
    ffn_dim: int = 8960
    freq_dim: int = 256
    text_dim: int = 4096
    out_dim: int = 16
    num_heads: int = 12
    num_layers: int = 30
    qk_norm: bool = True
    cross_attn_norm: bool = True
    eps: float = 1e-6
    window_size: tuple = (-1, -1)
    local_attn_size: int = -1               # frames, -1 = global KV cache
    sink_size: int = 0                      # frames kept at the start of a rolling cache
    clip_dim: int = 1280                    # i2v image-token width (img_emb input)
    clip_tokens: int = 257                  # i2v image tokens in front of the text tokens
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.patch_size = tuple(int(p) for p in self.patch_size)
        self.window_size = tuple(int(w) for w in self.window_size)
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    def validate(self) -> None:
        if self.model_type not in ("t2v", "i2v"):
            raise ValueError(f"model_type must be 't2v' or 'i2v', got {self.model_type!r}")
        if len(self.patch_size) != 3:
            raise ValueError(f"patch_size must have 3 entries (pt, ph, pw), got {self.patch_size}")
        if self.num_heads <= 0 or self.dim % self.num_heads:
            raise ValueError(f"dim {self.dim} is not divisible by num_heads {self.num_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even (RoPE rotates pairs)")
        if self.freq_dim % 2:
            raise ValueError(f"freq_dim {self.freq_dim} must be even")

    def replace(self, **changes) -> "WanConfig":
        return dataclasses.replace(self, **changes)


WAN_1_3B = WanConfig(dim=1536, ffn_dim=8960, num_heads=12, num_layers=30)
WAN_14B = WanConfig(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40)
WAN_14B_I2V = WanConfig(model_type="i2v", in_dim=36, dim=5120, ffn_dim=13824,
                        num_heads=40, num_layers=40)
# Krea Realtime: Wan 2.1 14B made causal; its cache holds a rebuilt context of 3 latent frames plus the 3-frame block
KREA_14B = WAN_14B.replace(local_attn_size=6)
PRESETS = {"wan2.1-1.3b": WAN_1_3B, "wan2.1-14b": WAN_14B, "wan2.1-i2v-14b": WAN_14B_I2V, "krea-14b": KREA_14B}
