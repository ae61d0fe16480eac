"""WanModel: the Wan 2.1 DiT with a full-sequence forward (T2V) and a causal chunk forward (KV cache).

The state dict is key-identical to the official checkpoints. Precision policies:
  'float32'      everything float32 (parity with the reference fixtures)
  'wan21'        time embedding, modulation, residual stream, norms and head in float32; the matmuls of
                 patch/text embedding, attention and FFN in the load dtype (bf16/fp16)
  'self_forcing' the whole model in the load dtype, as causal checkpoints run (RMSNorm statistics in
                 float32, RoPE angles in float64)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .attachments import seq_parallel_of
from .attention import check_backend
from .blocks import BlockParts, LayerCall, WanBlock
from .config import WanConfig
from .layers import Head, ImageProjection, sinusoidal_embedding
from .quant import quantized_param_names
from .rope import RopeCache

PRECISIONS = ("float32", "wan21", "self_forcing")
_WAN21_FLOAT32 = ("time_embedding.", "time_projection.", "head.", "img_emb.proj.0.", "img_emb.proj.4.")
_WAN21_FLOAT32_PARTS = ("modulation", ".norm3.", ".norm_q.", ".norm_k.", ".norm_k_img.")


@dataclass
class EmbeddedText:
    """Text context already passed through text_embedding: [B, text_len, dim]."""
    tensor: torch.Tensor


def check_text_tokens(tokens: int, text_len: int, where: str = "the text context") -> None:
    """The one check of a text embedding's length: at most the model's ``text_len`` tokens (umt5-xxl's output is
    padded or cut to it); ValueError naming ``where`` and the fix."""
    if int(tokens) > int(text_len):
        raise ValueError(f"{where} has {int(tokens)} tokens but the model reads at most text_len={int(text_len)}; "
                         f"encode the prompt with the model's own text encoder (umt5-xxl, which gives at most "
                         f"{int(text_len)}), or keep only its first {int(text_len)} token rows")


def param_dtype(name: str, precision: str, dtype: torch.dtype) -> torch.dtype:
    """dtype a parameter takes under a precision policy with load dtype ``dtype``."""
    if precision == "float32":
        return torch.float32
    if precision == "self_forcing":
        return dtype
    if name.startswith(_WAN21_FLOAT32) or any(p in name for p in _WAN21_FLOAT32_PARTS):
        return torch.float32
    return dtype


class WanModel(nn.Module):
    def __init__(self, config: WanConfig):
        super().__init__()
        c = self.config = config
        self.patch_embedding = nn.Conv3d(c.in_dim, c.dim, kernel_size=c.patch_size, stride=c.patch_size)
        self.text_embedding = nn.Sequential(nn.Linear(c.text_dim, c.dim), nn.GELU(approximate="tanh"),
                                            nn.Linear(c.dim, c.dim))
        self.time_embedding = nn.Sequential(nn.Linear(c.freq_dim, c.dim), nn.SiLU(), nn.Linear(c.dim, c.dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(c.dim, 6 * c.dim))
        image = c.model_type == "i2v"
        self.blocks = nn.ModuleList(
            WanBlock(c.dim, c.ffn_dim, c.num_heads, c.qk_norm, c.cross_attn_norm, c.eps, image=image)
            for _ in range(c.num_layers))
        self.head = Head(c.dim, c.out_dim, c.patch_size, c.eps)
        if image:
            self.img_emb = ImageProjection(c.clip_dim, c.dim)
        self.precision = "float32"
        self.stream_dtype = torch.float32      # residual stream, modulation, time path, head
        self.compute_dtype = torch.float32     # matmul inputs of embeddings, attention, FFN
        self.attn_backend = "auto"
        self.rope = RopeCache()

    # ----------------------------------------------------------------- settings
    def set_precision(self, precision: str, dtype: torch.dtype = torch.bfloat16) -> "WanModel":
        """Cast parameters for a precision policy (see module doc); returns self."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        stored = quantized_param_names(self)       # fp8 weights and their float32 scales keep their dtype
        for name, p in self.named_parameters():
            want = p.dtype if name in stored else param_dtype(name, precision, dtype)
            if p.dtype != want:
                p.data = p.data.to(want)
        self.precision = precision
        self.compute_dtype = torch.float32 if precision == "float32" else dtype
        self.stream_dtype = dtype if precision == "self_forcing" else torch.float32
        for block in self.blocks:
            block.compute_dtype = self.compute_dtype
        self.head.compute_dtype = self.head.head.weight.dtype
        return self

    def set_attention_backend(self, backend: str) -> "WanModel":
        self.attn_backend = check_backend(backend)
        return self

    def reference_parts(self) -> BlockParts:
        """The parts of the plain forward: the model's attention backend, no fused kernels, separate q/k/v."""
        return BlockParts(self.attn_backend)

    @property
    def device(self) -> torch.device:
        return self.patch_embedding.weight.device

    # ----------------------------------------------------------------- embeddings
    def time_embed(self, t: torch.Tensor):
        """t [...] -> (e [..., dim], e0 [..., 6, dim]) in the stream dtype."""
        sin = sinusoidal_embedding(self.config.freq_dim, t).to(self.stream_dtype)
        e = self.time_embedding(sin)
        e0 = self.time_projection(e).unflatten(1, (6, self.config.dim))
        return e.reshape(*t.shape, -1), e0.reshape(*t.shape, 6, -1)

    def embed_text(self, context) -> EmbeddedText:
        """context [B, L, text_dim] or list of [L, text_dim] (L <= text_len) -> zero-padded, embedded."""
        if isinstance(context, EmbeddedText):
            return context
        rows = list(context) if isinstance(context, (list, tuple)) else list(context.unbind(0))
        c = self.config
        padded = []
        for u in rows:
            if u.dim() != 2 or u.shape[1] != c.text_dim:
                raise ValueError(f"text context rows must be [L, {c.text_dim}] (the model's text_dim), "
                                 f"got {tuple(u.shape)}")
            check_text_tokens(u.shape[0], c.text_len)
            padded.append(torch.cat([u, u.new_zeros(c.text_len - u.shape[0], u.shape[1])]))
        ctx = torch.stack(padded).to(device=self.device, dtype=self.compute_dtype)
        return EmbeddedText(self.text_embedding(ctx))

    def embed_image(self, clip_fea):
        if clip_fea is None or not hasattr(self, "img_emb"):
            return None
        return self.img_emb(clip_fea.to(self.device)).to(self.compute_dtype)

    def _patchify(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, F, H, W] -> [B, dim, F', H', W']"""
        pt, ph, pw = self.config.patch_size
        _, c, f, h, w = x.shape
        if c != self.config.in_dim:
            raise ValueError(f"latent has {c} channels, the model expects in_dim={self.config.in_dim}")
        if f % pt or h % ph or w % pw:
            raise ValueError(f"latent size F={f}, H={h}, W={w} is not divisible by the patch size "
                             f"{self.config.patch_size}")
        return self.patch_embedding(x.to(self.compute_dtype))

    def run_blocks(self, x, e0, rope, calls, actions=None, kv_only_last: bool = False):
        """The blocks over the residual stream x [B, L, dim] with one ``LayerCall`` per block. kv_only_last: the last
        block only writes its keys/values (a refresh pass whose output is unused); returns None then."""
        blocks = self.blocks
        n_full = len(blocks) - 1 if kv_only_last else len(blocks)
        for i in range(n_full):
            x = blocks[i](x, e0, rope, calls[i], actions)
        if kv_only_last:
            blocks[-1].kv_only(x, e0, rope, calls[-1])
            return None
        return x

    # ----------------------------------------------------------------- full sequence (Wan 2.1)
    def forward(self, x, t, context, seq_len=None, clip_fea=None, y=None):
        return self.forward_full(x, t, context, seq_len, clip_fea=clip_fea, y=y)

    def forward_full(self, x_list, t, context_list, seq_len=None, clip_fea=None, y=None):
        """Full-sequence forward. x_list: videos [C, F, H, W]; t [B]; context_list: [L, text_dim] each;
        seq_len >= tokens per video (extra rows are zero padding, masked as keys). Returns [C_out, F, H, W]
        per video."""
        if tuple(self.config.window_size) != (-1, -1):
            raise ValueError(f"local window attention (window_size={self.config.window_size}) is not supported; "
                             f"released Wan models use (-1, -1)")
        if y is not None:
            x_list = [torch.cat([u, v], dim=0) for u, v in zip(x_list, y)]
        patches = [self._patchify(u[None]) for u in x_list]
        grids = [tuple(p.shape[2:]) for p in patches]
        lens = [g[0] * g[1] * g[2] for g in grids]
        seq_len = max(lens) if seq_len is None else int(seq_len)
        if seq_len < max(lens):
            raise ValueError(f"seq_len={seq_len} is smaller than the {max(lens)} video tokens")
        x = torch.cat([self._pad_tokens(p.flatten(2).transpose(1, 2), seq_len) for p in patches])
        x = x.to(self.stream_dtype)
        key_mask = self._key_mask(lens, seq_len, x.device)
        e, e0 = self.time_embed(t.to(self.device))
        text = self.embed_text(context_list).tensor
        rope = self._rope_full(grids, seq_len, x.device)
        image, parts = self.embed_image(clip_fea), self.reference_parts()
        calls = [LayerCall(b.cross_attn.context_kv(text, image), parts, key_mask=key_mask) for b in self.blocks]
        x = self.run_blocks(x, e0[:, None], rope, calls)
        out = self.head(x, e[:, None])
        return [self._unpatchify_video(out[i, :n], g) for i, (n, g) in enumerate(zip(lens, grids))]

    @staticmethod
    def _pad_tokens(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
        pad = seq_len - tokens.shape[1]
        if pad == 0:
            return tokens
        return torch.cat([tokens, tokens.new_zeros(tokens.shape[0], pad, tokens.shape[2])], dim=1)

    @staticmethod
    def _key_mask(lens, seq_len, device):
        if all(n == seq_len for n in lens):
            return None
        positions = torch.arange(seq_len, device=device)
        return torch.stack([positions < n for n in lens])      # host ints: no host->device copy

    def _rope_full(self, grids, seq_len, device):
        tables = [self.rope.get(self.config.head_dim, g, 0, device, self.rope_dtype(), seq_len) for g in grids]
        if all(g == grids[0] for g in grids):
            return tables[0]
        return torch.stack([c for c, _ in tables]), torch.stack([s for _, s in tables])

    def _unpatchify_video(self, rows: torch.Tensor, grid) -> torch.Tensor:
        """[F'H'W', pt*ph*pw*C] -> [C, F, H, W]"""
        (pt, ph, pw), (f, h, w) = self.config.patch_size, grid
        u = rows.reshape(f, h, w, pt, ph, pw, self.config.out_dim)
        return u.permute(6, 0, 3, 1, 4, 2, 5).reshape(self.config.out_dim, f * pt, h * ph, w * pw)

    # ----------------------------------------------------------------- causal chunk
    def chunk_tokens(self, x: torch.Tensor, y: torch.Tensor | None = None):
        """Latent chunk x [B, Fb, C, H, W] (+ conditioning y on channels) -> (tokens [B, L, dim] in the stream dtype,
        token grid (f, h, w))."""
        pt = self.config.patch_size[0]
        if pt != 1:
            raise ValueError("the causal chunk forward needs a temporal patch size of 1")
        if y is not None:
            x = torch.cat([x, y], dim=2)
        patches = self._patchify(x.transpose(1, 2))
        grid = tuple(patches.shape[2:])
        return patches.flatten(2).transpose(1, 2).to(self.stream_dtype).contiguous(), grid

    def chunk_output(self, hidden: torch.Tensor, e: torch.Tensor, grid, seq=None) -> torch.Tensor:
        """Head and unpatchify: hidden [B, L, dim], e [B, G, dim] -> flow [B, Fb, C_out, H, W]. seq: the chunk's
        sequence-parallel split (hidden holds this rank's tokens; the head's output is gathered from every rank)."""
        out = self.head(hidden, e)
        return self._unpatchify_chunk(out if seq is None else seq.gather(out), grid)

    def shard_chunk(self, tokens: torch.Tensor, rope: tuple, grid):
        """(tokens, rope, seq): under sequence parallelism (``model/seq_parallel.py``) this rank's tokens and RoPE
        rows and the chunk's split; else the inputs unchanged and None."""
        sp = seq_parallel_of(self)
        if sp is None or sp.world == 1:
            return tokens, rope, None
        seq = sp.layout(grid[0], grid[1] * grid[2])
        return seq.shard(tokens), seq.shard_rope(rope), seq

    def rope_dtype(self) -> torch.dtype:
        return torch.float64 if self.stream_dtype == torch.float64 else torch.float32

    def forward_chunk(self, x, t, context, kv_cache=None, crossattn_cache=None, current_start: int = 0,
                      clip_fea=None, y=None, return_output: bool = True, actions=None, parts: BlockParts | None = None):
        """Causal chunk forward. x [B, Fb, C, H, W]; t [B, Fb] per-frame timesteps; context [B, L, text_dim]
        or an EmbeddedText; kv_cache: KVCache or None (plain attention over the chunk); crossattn_cache: a
        CrossAttnCache (prompt keys/values computed once) or None; current_start: token offset of the chunk (a host
        int, a multiple of the tokens per frame). Returns flow [B, Fb, C_out, H, W] (None with return_output=False,
        e.g. for a cache-refresh pass). actions: optional per-run state for blocks with an ``action_model``
        (Matrix-Game-2); its ``begin(start_frame, frames, batch, frame_tokens, device, dtype)`` is called once per
        forward before the blocks run. parts: the block parts (default: ``reference_parts()``)."""
        tokens, (f, h, w) = self.chunk_tokens(x, y)
        frame_tokens = h * w
        if current_start % frame_tokens:
            raise ValueError(f"current_start={current_start} is not a multiple of the {frame_tokens} tokens "
                             f"per latent frame")
        e, e0 = self.time_embed(t.to(self.device))
        text = self.embed_text(context).tensor
        rope = self.rope.get(self.config.head_dim, (f, h, w), current_start // frame_tokens, tokens.device,
                             self.rope_dtype())
        step = kv_cache.plan(current_start, tokens.shape[1]) if kv_cache is not None else None
        tokens, rope, seq = self.shard_chunk(tokens, rope, (f, h, w))
        if actions is not None:
            actions.begin(current_start // frame_tokens, f, tokens.shape[0], tokens.shape[1] // f, tokens.device,
                          self.compute_dtype)
        image = self.embed_image(clip_fea)
        parts = parts if parts is not None else self.reference_parts()
        calls = []
        for i, block in enumerate(self.blocks):
            ckv = crossattn_cache.layers[i] if crossattn_cache is not None else None
            if ckv is not None and ckv.tensors is not None:
                cross = ckv.tensors
            else:
                cross = block.cross_attn.context_kv(text, image)
                if ckv is not None:
                    ckv.tensors = cross
            if step is None:
                calls.append(LayerCall(cross, parts, seq=seq))
            else:
                layer = kv_cache.layers[i]
                calls.append(LayerCall(cross, parts, layer.k, layer.v, step.index, step.read_len, seq=seq,
                                       write_span=step.span, write_lens=step.seqlens))
        hidden = self.run_blocks(tokens, e0, rope, calls, actions)
        if not return_output:
            return None
        return self.chunk_output(hidden, e, (f, h, w), seq)

    def _unpatchify_chunk(self, out: torch.Tensor, grid) -> torch.Tensor:
        """[B, F'H'W', ph*pw*C] -> [B, F, C, H, W] (temporal patch 1)."""
        (_, ph, pw), (f, h, w) = self.config.patch_size, grid
        c = self.config.out_dim
        u = out.reshape(out.shape[0], f, h, w, ph, pw, c)
        return u.permute(0, 1, 6, 2, 4, 3, 5).reshape(out.shape[0], f, c, h * ph, w * pw)
