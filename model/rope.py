"""3-axis rotary position embedding of Wan (frame, height, width), tables built once and cached.

head_dim d gives c = d/2 rotation pairs formed from adjacent channels (x[2j], x[2j+1]); the pairs are
split into c - 2*(c//3) frame pairs, c//3 height pairs and c//3 width pairs. For an axis with n pairs
the angle of pair j at position p is p / 10000^(j/n). Angles are computed in float64.
"""
from __future__ import annotations

import torch

MAX_POSITIONS = 1024   # length of the official per-axis RoPE table
THETA = 10000.0


def axis_pairs(head_dim: int) -> tuple[int, int, int]:
    c = head_dim // 2
    return c - 2 * (c // 3), c // 3, c // 3


def _axis_angles(positions: torch.Tensor, n: int) -> torch.Tensor:
    """[P] float64 positions -> [P, n] float64 angles."""
    inv = 1.0 / torch.pow(torch.tensor(THETA, dtype=torch.float64),
                          torch.arange(n, dtype=torch.float64) / n)
    return positions[:, None] * inv[None, :]


def check_positions(start_frame: int, frames: int, height: int, width: int) -> None:
    last = start_frame + frames
    if last > MAX_POSITIONS or height > MAX_POSITIONS or width > MAX_POSITIONS:
        raise ValueError(
            f"RoPE position out of range: frames [{start_frame}, {last}), grid {height}x{width}; the "
            f"model's rotary table has {MAX_POSITIONS} positions per axis. Generate fewer latent "
            f"frames (at most {MAX_POSITIONS} in total) or a smaller resolution.")


def build_angles(head_dim: int, frames: int, height: int, width: int, start_frame: int = 0) -> torch.Tensor:
    """Angles [frames*height*width, head_dim/2] (float64, CPU) in row-major (f, h, w) token order."""
    check_positions(start_frame, frames, height, width)
    nf, nh, nw = axis_pairs(head_dim)
    af = _axis_angles(torch.arange(start_frame, start_frame + frames, dtype=torch.float64), nf)
    ah = _axis_angles(torch.arange(height, dtype=torch.float64), nh)
    aw = _axis_angles(torch.arange(width, dtype=torch.float64), nw)
    grid = torch.cat([
        af[:, None, None, :].expand(frames, height, width, nf),
        ah[None, :, None, :].expand(frames, height, width, nh),
        aw[None, None, :, :].expand(frames, height, width, nw),
    ], dim=-1)
    return grid.reshape(frames * height * width, head_dim // 2)


class RopeCache:
    """(cos, sin) tables keyed by (device, dtype, grid, start frame, padded length).

    Padded token rows (beyond the video tokens) get cos=1, sin=0: they are left unrotated, as in the
    original implementation.
    """

    def __init__(self, max_entries: int = 64):
        self.max_entries = max_entries
        self._tables: dict = {}

    def get(self, head_dim: int, grid: tuple[int, int, int], start_frame: int, device,
            dtype=torch.float32, padded_len: int | None = None):
        f, h, w = grid
        n = f * h * w
        padded_len = n if padded_len is None else padded_len
        key = (str(device), dtype, head_dim, f, h, w, start_frame, padded_len)
        hit = self._tables.get(key)
        if hit is not None:
            return hit
        ang = build_angles(head_dim, f, h, w, start_frame)
        cos, sin = torch.cos(ang), torch.sin(ang)
        if padded_len > n:
            pad = padded_len - n
            cos = torch.cat([cos, torch.ones(pad, head_dim // 2, dtype=cos.dtype)])
            sin = torch.cat([sin, torch.zeros(pad, head_dim // 2, dtype=sin.dtype)])
        table = (cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype))
        if len(self._tables) >= self.max_entries:
            self._tables.clear()
        self._tables[key] = table
        return table

    def clear(self) -> None:
        self._tables.clear()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs of x [B, L, H, D] by tables [L, D/2] (or per sample [B, L, D/2]);
    math in the table dtype, result in x's dtype."""
    b, l, h, d = x.shape
    xp = x.to(cos.dtype).reshape(b, l, h, d // 2, 2)
    xr, xi = xp[..., 0], xp[..., 1]
    c = cos[:, :, None, :] if cos.dim() == 3 else cos[None, :, None, :]
    s = sin[:, :, None, :] if sin.dim() == 3 else sin[None, :, None, :]
    out = torch.stack([xr * c - xi * s, xr * s + xi * c], dim=-1)
    return out.reshape(b, l, h, d).to(x.dtype)
