"""3-axis rotary position embedding of Wan (frame, height, width), tables built once and cached.

head_dim d gives c = d/2 rotation pairs formed from adjacent channels (x[2j], x[2j+1]); the pairs are
split into c - 2*(c//3) frame pairs, c//3 height pairs and c//3 width pairs. For an axis with n pairs
the angle of pair j at position p is p / 10000^(j/n). Angles are computed in float64.
"""
from __future__ import annotations

import torch

MAX_POSITIONS = 1024   # length of the official per-axis RoPE table
THETA = 10000.0


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


class RopeCache:
    """The one RoPE provider: (cos, sin) tables [L, head_dim/2] for a token grid starting at a latent frame.

    Per-axis tables (frames: every position of the rotary table; height and width of the grid) are built once per
    (device, dtype, head_dim, grid height/width) from float64 angles and kept on the device; a call's table is
    assembled from them on the device (no host-to-device copy per chunk) and cached by (start frame, frames,
    padded length). Padded token rows (beyond the video tokens) get cos=1, sin=0: they are left unrotated, as in
    the original implementation.
    """

    def __init__(self, max_entries: int = 64):
        self.max_entries = max_entries
        self._axes: dict = {}
        self._tables: dict = {}

    def _axis_tables(self, head_dim: int, h: int, w: int, device, dtype):
        key = (str(device), dtype, head_dim, h, w)
        hit = self._axes.get(key)
        if hit is None:
            out = []
            c = head_dim // 2           # c pairs: c - 2 * (c // 3) frame pairs, c // 3 height and width pairs
            for n, count in zip((c - 2 * (c // 3), c // 3, c // 3), (MAX_POSITIONS, h, w)):
                ang = _axis_angles(torch.arange(count, dtype=torch.float64), n)
                out.append((torch.cos(ang).to(device=device, dtype=dtype),
                            torch.sin(ang).to(device=device, dtype=dtype)))
            if len(self._axes) >= 8:
                self._axes.clear()
            hit = self._axes[key] = out
        return hit

    def get(self, head_dim: int, grid: tuple[int, int, int], start_frame: int, device,
            dtype=torch.float32, padded_len: int | None = None):
        f, h, w = grid
        n = f * h * w
        padded_len = n if padded_len is None else padded_len
        key = (str(device), dtype, head_dim, f, h, w, start_frame, padded_len)
        hit = self._tables.get(key)
        if hit is not None:
            return hit
        check_positions(start_frame, f, h, w)
        axes = self._axis_tables(head_dim, h, w, device, dtype)
        tabs = []
        for i, fill in ((0, 1.0), (1, 0.0)):
            ft, ht, wt = axes[0][i][start_frame:start_frame + f], axes[1][i], axes[2][i]
            grid_tab = torch.cat([ft[:, None, None, :].expand(f, h, w, ft.shape[-1]),
                                  ht[None, :, None, :].expand(f, h, w, ht.shape[-1]),
                                  wt[None, None, :, :].expand(f, h, w, wt.shape[-1])], dim=-1).reshape(n, -1)
            if padded_len > n:
                grid_tab = torch.cat([grid_tab, grid_tab.new_full((padded_len - n, grid_tab.shape[-1]), fill)])
            tabs.append(grid_tab)
        if len(self._tables) >= self.max_entries:
            self._tables.clear()
        table = self._tables[key] = (tabs[0], tabs[1])
        return table


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
