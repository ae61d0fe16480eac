"""Matrix-Game-2 action module: mouse and keyboard branches with temporal attention over rolling caches.

Layout conventions (see docs/matrix_game2.md): the residual stream is ``[B, T*S, dim]`` in frame-major token
order (T latent frames of the chunk, S tokens per frame); mouse and keyboard inputs are video-frame
sequences ``[B, Nv, mouse_dim_in]`` / ``[B, Nv, keyboard_dim_in]``.

Every latent frame ``f`` reads a window of ``P = r * windows_size`` video frames ``r*f - P .. r*f - 1``
(indices below 0 clamp to video frame 0). The mouse branch gives every spatial position its own temporal
sequence (cache rows ``B*S``); the keyboard branch keeps one sequence per batch element (cache rows ``B``).
Action q/k use a weightless RMSNorm (eps 1e-6) and a temporal RoPE over the first
``mouse_qk_dim_list[0]`` head dims at absolute latent-frame positions.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .attention import attention
from .config import DictConfig

ACTION_HEAD_DIM = 64        # fixed by the official action RoPE table
ACTION_NORM_EPS = 1e-6
MOUSE_MLP_LN_EPS = 1e-5


@dataclass
class ActionConfig(DictConfig):
    """The ``action_config`` of a Matrix-Game-2 checkpoint (released names)."""
    blocks: tuple = ()
    mouse_dim_in: int = 2
    keyboard_dim_in: int = 4
    heads_num: int = 16
    mouse_hidden_dim: int = 1024
    keyboard_hidden_dim: int = 1024
    hidden_size: int = 128
    img_hidden_size: int = 1536
    vae_time_compression_ratio: int = 4
    windows_size: int = 3
    rope_theta: float = 256.0
    mouse_qk_dim_list: tuple = (8, 28, 28)
    rope_dim_list: tuple = (8, 28, 28)
    patch_size: tuple = (1, 2, 2)
    qk_norm: bool = True
    qkv_bias: bool = False
    enable_mouse: bool = True
    enable_keyboard: bool = True
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.blocks = tuple(int(b) for b in self.blocks)
        self.mouse_qk_dim_list = tuple(int(d) for d in self.mouse_qk_dim_list)
        self.rope_dim_list = tuple(int(d) for d in self.rope_dim_list)
        self.patch_size = tuple(int(p) for p in self.patch_size)
        if not (self.enable_mouse or self.enable_keyboard):
            raise ValueError("action_config enables neither the mouse nor the keyboard branch")
        for name, on in (("mouse_hidden_dim", self.enable_mouse), ("keyboard_hidden_dim", self.enable_keyboard)):
            width = getattr(self, name)
            if not on:
                continue
            if self.heads_num <= 0 or width % self.heads_num:
                raise ValueError(f"action_config.{name} {width} is not divisible by heads_num {self.heads_num}")
        if self.rope_frame_dims % 2 or self.rope_frame_dims > self.head_dim:
            raise ValueError(f"action RoPE frame dims {self.rope_frame_dims} must be even and at most the "
                             f"action head dim {self.head_dim}")

    @property
    def window_frames(self) -> int:
        """P: video frames in one latent frame's action window."""
        return self.vae_time_compression_ratio * self.windows_size

    @property
    def head_dim(self) -> int:
        width = self.mouse_hidden_dim if self.enable_mouse else self.keyboard_hidden_dim
        return width // self.heads_num

    @property
    def rope_frame_dims(self) -> int:
        return self.mouse_qk_dim_list[0]


# ---------------------------------------------------------------------------------------------- helpers
def window_indices(frames: torch.Tensor, ratio: int, window: int) -> torch.Tensor:
    """Video-frame indices ``[T, P]`` of each latent frame's action window (oldest first, clamped at 0)."""
    offs = torch.arange(-window, 0, device=frames.device)
    return (frames[:, None] * ratio + offs[None, :]).clamp_min(0)


def action_rope_tables(frames: torch.Tensor, dims: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[T, dims/2]`` (float32) of the temporal action RoPE at absolute latent frames."""
    exps = torch.arange(0, dims, 2, device=frames.device, dtype=torch.float32) / dims
    freqs = 1.0 / (theta ** exps)
    ang = frames.to(torch.float32)[:, None] * freqs[None, :]
    return torch.cos(ang), torch.sin(ang)


def apply_action_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of the first ``2*cos.shape[-1]`` head dims; x ``[..., L, H, D]``, tables ``[L, n]``."""
    n = cos.shape[-1]
    head, tail = x[..., : 2 * n].float(), x[..., 2 * n:]
    pairs = head.unflatten(-1, (n, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    rot = torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([rot, tail], dim=-1)


def action_rms_norm(x: torch.Tensor) -> torch.Tensor:
    """Weightless RMSNorm over the head dim, statistics in float32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + ACTION_NORM_EPS)).to(x.dtype)


class _UnusedNormWeight(nn.Module):
    """Holds a checkpoint norm weight that the official model stores but never applies."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


# ------------------------------------------------------------------------------------------------ module
class ActionModule(nn.Module):
    """``blocks.{a}.action_model``: x -> x + mouse branch, then + keyboard branch.

    ``cache_slot`` is the module's index among the action blocks (its layer in the action caches)."""

    def __init__(self, dim: int, cfg: ActionConfig, cache_slot: int = 0):
        super().__init__()
        self.cfg = cfg
        self.cache_slot = cache_slot
        p, hd = cfg.window_frames, cfg.head_dim
        bias = cfg.qkv_bias
        if cfg.enable_mouse:
            hm = cfg.mouse_hidden_dim
            self.mouse_mlp = nn.Sequential(
                nn.Linear(dim + p * cfg.mouse_dim_in, hm), nn.GELU(approximate="tanh"),
                nn.Linear(hm, hm), nn.LayerNorm(hm, eps=MOUSE_MLP_LN_EPS))
            self.t_qkv = nn.Linear(hm, 3 * hm, bias=bias)
            self.img_attn_q_norm = _UnusedNormWeight(hd)
            self.img_attn_k_norm = _UnusedNormWeight(hd)
            self.proj_mouse = nn.Linear(hm, dim, bias=bias)
        if cfg.enable_keyboard:
            hk, hs = cfg.keyboard_hidden_dim, cfg.hidden_size
            self.keyboard_embed = nn.Sequential(nn.Linear(cfg.keyboard_dim_in, hs), nn.SiLU(), nn.Linear(hs, hs))
            self.key_attn_q_norm = _UnusedNormWeight(hd)
            self.key_attn_k_norm = _UnusedNormWeight(hd)
            self.mouse_attn_q = nn.Linear(dim, hk, bias=bias)
            self.keyboard_attn_kv = nn.Linear(p * hs, 2 * hk, bias=bias)
            self.proj_keyboard = nn.Linear(hk, dim, bias=bias)
        self.attn_backend = "auto"

    def _qk(self, q, k, q_tab, k_tab):
        if self.cfg.qk_norm:
            q, k = action_rms_norm(q), action_rms_norm(k)
        return apply_action_rope(q, *q_tab), apply_action_rope(k, *k_tab)

    def forward(self, x: torch.Tensor, call: "ActionCall") -> torch.Tensor:
        """x ``[B, T*S, dim]``: the chunk's residual stream after cross-attention -> same shape."""
        cfg = self.cfg
        b, l, dim = x.shape
        t = call.num_frames
        s = l // t
        h, hd = cfg.heads_num, cfg.head_dim
        cd = (self.t_qkv if cfg.enable_mouse else self.mouse_attn_q).weight.dtype
        frames = torch.arange(call.start_frame, call.start_frame + t, device=x.device)
        idx = window_indices(frames, cfg.vae_time_compression_ratio, cfg.window_frames)   # [T, P]
        tab = action_rope_tables(frames, cfg.rope_frame_dims, cfg.rope_theta)             # [T, n] each

        if cfg.enable_mouse:
            win = call.mouse.to(device=x.device, dtype=cd)[:, idx].flatten(2)                 # [B, T, P*md]
            u = torch.cat([x.to(cd).view(b, t, s, dim), win[:, :, None].expand(b, t, s, win.shape[-1])], -1)
            qkv = self.t_qkv(self.mouse_mlp(u))                                              # [B, T, S, 3Hm]
            qkv = qkv.permute(0, 2, 1, 3).reshape(b * s, t, 3, h, hd)                        # rows = (batch, pos)
            q, k = self._qk(qkv[:, :, 0], qkv[:, :, 1], tab, tab)
            kc, vc = call.mouse_cache.layers[self.cache_slot].update(k, qkv[:, :, 2], call.mouse_step)
            out = attention(q, kc, vc, backend=self.attn_backend)                            # [B*S, T, h, hd]
            out = out.reshape(b, s, t, h * hd).permute(0, 2, 1, 3).reshape(b, l, h * hd)
            x = x + self.proj_mouse(out).to(x.dtype)

        if cfg.enable_keyboard:
            g = self.keyboard_embed(call.keyboard.to(device=x.device, dtype=cd)[:, idx]).flatten(2)  # [B,T,P*hs]
            kv = self.keyboard_attn_kv(g).view(b, t, 2, h, hd)
            q = self.mouse_attn_q(x.to(cd)).view(b, l, h, hd)
            q_tab = tuple(z.repeat_interleave(s, dim=0) for z in tab)                        # per token
            q, k = self._qk(q, kv[:, :, 0], q_tab, tab)
            kc, vc = call.keyboard_cache.layers[self.cache_slot].update(k, kv[:, :, 1], call.keyboard_step)
            out = attention(q, kc, vc, backend=self.attn_backend).reshape(b, l, h * hd)
            x = x + self.proj_keyboard(out).to(x.dtype)
        return x


class ActionCall:
    """Action inputs and rolling caches of one sampling run, shared by every action block.

    mouse ``[B, Nv, mouse_dim_in]`` and keyboard ``[B, Nv, keyboard_dim_in]`` are video-frame sequences
    (at least ``1 + 4*(last latent frame)`` frames). The caches hold ``window`` latent frames: the mouse
    cache has one row per (batch element, spatial position), the keyboard cache one row per batch element.
    Call :meth:`begin` before each model call (the model's ``forward_chunk`` does it).
    """

    def __init__(self, cfg: ActionConfig, mouse, keyboard, window: int, dtype=None):
        if window < 1:
            raise ValueError(f"the action cache window must be at least 1 latent frame, got {window}")
        for name, on, given, dims in (("mouse", cfg.enable_mouse, mouse, cfg.mouse_dim_in),
                                      ("keyboard", cfg.enable_keyboard, keyboard, cfg.keyboard_dim_in)):
            if on and given is None:
                raise ValueError(f"this model has a {name} branch: pass {name} actions [B, video frames, {dims}]")
        self.cfg, self.window, self.dtype = cfg, int(window), dtype
        self.mouse = mouse if cfg.enable_mouse else None
        self.keyboard = keyboard if cfg.enable_keyboard else None
        self.mouse_cache = self.keyboard_cache = None
        self.start_frame = self.num_frames = 0
        self.mouse_step = self.keyboard_step = None

    def _check_inputs(self, batch: int, last_frame: int) -> None:
        need = max(1, self.cfg.vae_time_compression_ratio * last_frame)   # windows end at r*f - 1
        for name, seq, dims in (("mouse", self.mouse, self.cfg.mouse_dim_in),
                                ("keyboard", self.keyboard, self.cfg.keyboard_dim_in)):
            if seq is None:
                continue
            if seq.dim() != 3 or seq.shape[0] not in (1, batch) or seq.shape[2] != dims:
                raise ValueError(f"{name} actions must be [B, video frames, {dims}] with B = {batch} or 1, "
                                 f"got {tuple(seq.shape)}")
            if seq.shape[1] < need:
                raise ValueError(f"{name} actions cover {seq.shape[1]} video frames; latent frame {last_frame} "
                                 f"needs {need} (give 1 + 4 * (latent frames - 1) video frames)")

    def _alloc(self, batch: int, frame_tokens: int, device, dtype) -> None:
        from .kv_cache import KVCache
        c, n = self.cfg, len(self.cfg.blocks)
        make = lambda rows: KVCache(n, rows, self.window, c.heads_num, c.head_dim, device=device, dtype=dtype,
                                    rolling=True)
        self.adopt_caches(make(batch * frame_tokens) if c.enable_mouse else None,
                          make(batch) if c.enable_keyboard else None, batch, frame_tokens)

    def adopt_caches(self, mouse_cache, keyboard_cache, batch: int, frame_tokens: int) -> None:
        """Use these caches (new ones, or those of an earlier call with the same layout: a continued run that owns
        them goes on in place) for a batch of ``batch`` with ``frame_tokens`` tokens per frame."""
        if self.mouse is not None and self.mouse.shape[0] != batch:
            self.mouse = self.mouse.expand(batch, -1, -1)
        if self.keyboard is not None and self.keyboard.shape[0] != batch:
            self.keyboard = self.keyboard.expand(batch, -1, -1)
        self.mouse_cache, self.keyboard_cache = mouse_cache, keyboard_cache
        self._shape = (batch, frame_tokens)

    def begin(self, start_frame: int, num_frames: int, batch: int, frame_tokens: int, device, dtype) -> None:
        """Plan the cache writes of a model call over latent frames [start_frame, start_frame + num_frames)."""
        if self.mouse_cache is None and self.keyboard_cache is None:
            self._check_inputs(batch, 0)
            self._alloc(batch, frame_tokens, device, self.dtype or dtype)
        elif self._shape != (batch, frame_tokens):
            raise ValueError(f"action caches were built for batch {self._shape[0]} with {self._shape[1]} tokens "
                             f"per frame; this call has batch {batch} with {frame_tokens}")
        self._check_inputs(batch, start_frame + num_frames - 1)
        self.start_frame, self.num_frames = int(start_frame), int(num_frames)
        if self.mouse_cache is not None:
            self.mouse_step = self.mouse_cache.plan(start_frame, num_frames)
        if self.keyboard_cache is not None:
            self.keyboard_step = self.keyboard_cache.plan(start_frame, num_frames)
