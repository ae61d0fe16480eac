"""Matrix-Game-2: the action-conditioned causal Wan DiT.

It is the causal Wan model with three changes:
  * the cross-attention context is the CLIP image tokens passed through ``img_emb`` (no text branch, no
    Wan-i2v ``k_img`` branch): ``embed_text`` takes the visual context ``[B, tokens, clip_dim]``;
  * the input has 36 channels (16 noisy latent + 4 first-frame mask + 16 conditioning latent), passed as
    ``y`` to ``forward_chunk``;
  * the blocks listed in ``action_config.blocks`` own an ``action_model`` (wan/action.py) run between
    cross-attention and the FFN, fed by the per-run :class:`~.action.ActionCall` (``actions=``).
"""
from __future__ import annotations

import re

import torch

from .action import ACTION_HEAD_DIM, ActionCall, ActionConfig, ActionModule
from .config import WanConfig
from .layers import ImageProjection
from .dit import EmbeddedText, WanModel


class MatrixGameModel(WanModel):
    """WanModel with the Matrix-Game-2 image context and action modules (state dict key-identical)."""

    def __init__(self, config: WanConfig):
        action = config.extra.get("action_config")
        if action is None:
            raise ValueError("a Matrix-Game-2 config needs 'action_config' (blocks, action dims, window)")
        action = action if isinstance(action, ActionConfig) else ActionConfig.from_dict(action)
        bad = [b for b in action.blocks if not 0 <= b < config.num_layers]
        if bad:
            raise ValueError(f"action_config.blocks {bad} are outside the model's {config.num_layers} blocks")
        super().__init__(config.replace(model_type="t2v"))     # blocks without the Wan-i2v k_img branch
        self.config = config
        del self.text_embedding
        self.img_emb = ImageProjection(config.clip_dim, config.dim)
        self.action_config = action
        for slot, b in enumerate(action.blocks):
            self.blocks[b].action_model = ActionModule(config.dim, action, cache_slot=slot)

    def set_attention_backend(self, backend: str) -> "MatrixGameModel":
        super().set_attention_backend(backend)
        for b in self.action_config.blocks:
            self.blocks[b].action_model.attn_backend = backend
        return self

    def embed_text(self, context) -> EmbeddedText:
        """The cross-attention context: CLIP image tokens [B, tokens, clip_dim] -> img_emb -> [B, tokens, dim]."""
        if isinstance(context, EmbeddedText):
            return context
        c = self.config
        if not isinstance(context, torch.Tensor) or context.dim() != 3 or context.shape[-1] != c.clip_dim:
            shape = tuple(context.shape) if isinstance(context, torch.Tensor) else type(context).__name__
            raise ValueError(f"Matrix-Game-2 takes the CLIP vision tokens of the start image as context: "
                             f"[B, tokens, {c.clip_dim}] (penultimate hidden states), got {shape}")
        w = self.img_emb.proj[0].weight
        return EmbeddedText(self.img_emb(context.to(device=w.device)).to(self.compute_dtype))

    def embed_image(self, clip_fea):
        return None         # the image tokens are the cross-attention context (embed_text)

    def forward_full(self, *args, **kwargs):
        raise NotImplementedError("Matrix-Game-2 is a causal model: use forward_chunk / the MG2 sampler")

    def new_action_call(self, mouse, keyboard, window: int) -> ActionCall:
        """Action inputs + rolling caches (``window`` latent frames) for one sampling run."""
        return ActionCall(self.action_config, mouse, keyboard, window)


# --------------------------------------------------------------------------- config from checkpoint keys
def infer_action_config(shapes: dict, dim: int) -> dict:
    """``action_config`` dict from {official key: shape}: action blocks, dims, heads, window.

    The action head dim is 64 and the video/latent frame ratio 4 (fixed by the released model); the
    window size follows from ``keyboard_attn_kv`` (or ``mouse_mlp.0``) input width.
    """
    blocks = sorted({int(m.group(1)) for n in shapes for m in [re.match(r"blocks\.(\d+)\.action_model\.", n)] if m})
    if not blocks:
        raise ValueError("no action_model keys: not a Matrix-Game-2 checkpoint")
    a = f"blocks.{blocks[0]}.action_model."
    ratio = 4
    enable_mouse = a + "mouse_mlp.0.weight" in shapes
    enable_keyboard = a + "keyboard_embed.0.weight" in shapes
    cfg = {"blocks": blocks, "enable_mouse": enable_mouse, "enable_keyboard": enable_keyboard,
           "img_hidden_size": dim, "vae_time_compression_ratio": ratio,
           "qkv_bias": (a + "t_qkv.bias") in shapes or (a + "mouse_attn_q.bias") in shapes}
    window = None
    if enable_keyboard:
        hidden, kdim = shapes[a + "keyboard_embed.0.weight"]
        kv_out, kv_in = shapes[a + "keyboard_attn_kv.weight"]
        if kv_in % hidden:
            raise ValueError(f"{a}keyboard_attn_kv.weight input {kv_in} is not a multiple of the keyboard "
                             f"embedding width {hidden}")
        window = kv_in // hidden
        cfg.update(hidden_size=hidden, keyboard_dim_in=kdim, keyboard_hidden_dim=kv_out // 2)
        cfg["heads_num"] = (kv_out // 2) // ACTION_HEAD_DIM
    if enable_mouse:
        hm, m_in = shapes[a + "mouse_mlp.0.weight"]
        extra = m_in - dim
        if window is None:
            cfg["mouse_dim_in"] = 2
            window = extra // 2
        else:
            cfg["mouse_dim_in"] = extra // window
        if extra <= 0 or extra % window:
            raise ValueError(f"{a}mouse_mlp.0.weight input {m_in} does not fit dim {dim} + window x mouse dims")
        cfg.update(mouse_hidden_dim=hm, heads_num=hm // ACTION_HEAD_DIM)
        if not enable_keyboard:
            cfg["keyboard_hidden_dim"] = hm
    if window % ratio:
        raise ValueError(f"action window of {window} video frames is not a multiple of {ratio}")
    cfg["windows_size"] = window // ratio
    return cfg


# --------------------------------------------------------------------------- built-in tiny model
TINY_ACTION_CONFIG = {"blocks": [0], "mouse_dim_in": 2, "keyboard_dim_in": 4, "heads_num": 2,
                      "mouse_hidden_dim": 2 * ACTION_HEAD_DIM, "keyboard_hidden_dim": 2 * ACTION_HEAD_DIM,
                      "hidden_size": 16, "img_hidden_size": 64, "vae_time_compression_ratio": 4,
                      "windows_size": 3, "rope_theta": 256, "mouse_qk_dim_list": [8, 28, 28]}


TINY_MODES = {"universal": {"keyboard_dim_in": 4}, "gta_drive": {"keyboard_dim_in": 2},
              "templerun": {"keyboard_dim_in": 7, "enable_mouse": False}}


def tiny_mg2_config(mode: str = "universal") -> WanConfig:
    """Config of the tiny model with the action layout of ``mode`` (universal, gta_drive, templerun)."""
    if mode not in TINY_MODES:
        raise ValueError(f"mode must be one of {', '.join(TINY_MODES)}, got {mode!r}")
    action = dict(TINY_ACTION_CONFIG, **TINY_MODES[mode])
    return WanConfig(model_type="i2v", patch_size=(1, 2, 2), in_dim=36, dim=64, ffn_dim=256, freq_dim=32,
                     out_dim=16, num_heads=4, num_layers=2, clip_dim=32, clip_tokens=9, local_attn_size=6,
                     extra={"action_config": action})


def tiny_mg2_model(seed: int = 0, device="cpu", dtype=torch.float32, precision=None,
                   config: WanConfig | None = None, mode: str = "universal") -> MatrixGameModel:
    """Deterministic tiny Matrix-Game-2 model (random weights: for smoke runs, tests and demos)."""
    from .tiny import tiny_causal_model
    return tiny_causal_model(seed, device, dtype, precision, config or tiny_mg2_config(mode), MatrixGameModel)
