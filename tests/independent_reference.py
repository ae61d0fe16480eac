"""A second, independent float64 implementation of the reference math.

Written only from the fixture specifications (Wan 2.1 full forward, the causal KV-cached sampler with its
rolling / sink cache bookkeeping, and the Matrix-Game-2 action model and sampler). It imports nothing from the
package: tests feed the same random weights (official key names) to both and compare.
Weights ``W`` are a dict name -> tensor; ``cfg`` is the plain config dict of the fixtures.
"""
from __future__ import annotations

import math

import torch

D = torch.float64


# ----------------------------------------------------------------------------- building blocks
def layer_norm(x, eps, w=None, b=None):
    mu = x.mean(-1, keepdim=True)
    y = (x - mu) / torch.sqrt(((x - mu) ** 2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w + b


def rms_norm(x, w, eps):
    y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def gelu_erf(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def silu(x):
    return x * torch.sigmoid(x)


def lin(W, name, x, bias=True):
    y = x @ W[name + ".weight"].T
    return y + W[name + ".bias"] if bias else y


def attention(q, k, v):
    """q [B, Lq, H, d], k/v [B, Lk, H, d] -> [B, Lq, H*d]; plain softmax attention."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    o = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)
    return o.flatten(2)


def rotate_pairs(x, ang):
    """Rotate adjacent pairs (x[2j], x[2j+1]) of the last dim by ang (broadcast over the leading dims)."""
    xr = x.reshape(*x.shape[:-1], -1, 2)
    a, b = xr[..., 0], xr[..., 1]
    c, s = torch.cos(ang), torch.sin(ang)
    return torch.stack([a * c - b * s, b * c + a * s], -1).flatten(-2)


def dit_rope_angles(pos, head_dim):
    """pos [N, 3] (frame, row, column) -> angles [N, head_dim/2]."""
    c = head_dim // 2
    n_hw = c // 3
    parts = []
    for axis, n in enumerate((c - 2 * n_hw, n_hw, n_hw)):
        j = torch.arange(n, dtype=D)
        parts.append(pos[:, axis:axis + 1].to(D) / 10000.0 ** (j / n))
    return torch.cat(parts, 1)


def grid_positions(frames, rows, cols, frame0=0):
    f, h, w = torch.meshgrid(torch.arange(frames) + frame0, torch.arange(rows), torch.arange(cols), indexing="ij")
    return torch.stack([f.flatten(), h.flatten(), w.flatten()], 1)


def sinusoid(t, freq_dim):
    half = freq_dim // 2
    a = t.to(D).reshape(-1, 1) * 10000.0 ** (-torch.arange(half, dtype=D) / half)
    return torch.cat([torch.cos(a), torch.sin(a)], 1)


def time_path(W, cfg, t):
    """t [n] -> e [n, dim], e0 [n, 6, dim]."""
    e = lin(W, "time_embedding.2", silu(lin(W, "time_embedding.0", sinusoid(t, cfg["freq_dim"]))))
    e0 = lin(W, "time_projection.1", silu(e)).reshape(-1, 6, cfg["dim"])
    return e, e0


def patchify(W, cfg, x):
    """x [B, C, F, H, W] -> tokens [B, F'H'W', dim] in (f, h, w) row-major order, grid (F', H', W')."""
    pt, ph, pw = cfg["patch_size"]
    b, c, f, h, w = x.shape
    g = (f // pt, h // ph, w // pw)
    p = x.reshape(b, c, g[0], pt, g[1], ph, g[2], pw).permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(b, -1, c * pt * ph * pw)
    wt = W["patch_embedding.weight"].reshape(cfg["dim"], -1)
    return p @ wt.T + W["patch_embedding.bias"], g


def unpatchify(cfg, y, g):
    """y [B, N, pt*ph*pw*C] -> [B, C, F, H, W]."""
    pt, ph, pw = cfg["patch_size"]
    b = y.shape[0]
    c = y.shape[-1] // (pt * ph * pw)
    y = y.reshape(b, g[0], g[1], g[2], pt, ph, pw, c).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return y.reshape(b, c, g[0] * pt, g[1] * ph, g[2] * pw)


def block(W, cfg, i, x, m_tok, ctx, ang, self_kv, action=None):
    """One DiT block. x [B, N, dim]; m_tok [B, N, 6, dim] (per-token e0); ctx [B, L, dim]."""
    p, eps, nh = f"blocks.{i}.", cfg["eps"], cfg["num_heads"]
    b, n, dim = x.shape
    d = dim // nh
    m = W[p + "modulation"][0] + m_tok
    m0, m1, m2, m3, m4, m5 = m.unbind(2)
    qk_norm = cfg.get("qk_norm", True)
    nq = lambda name, y: rms_norm(y, W[p + name + ".weight"], eps) if qk_norm else y
    h = layer_norm(x, eps) * (1 + m1) + m0
    q = nq("self_attn.norm_q", lin(W, p + "self_attn.q", h)).reshape(b, n, nh, d)
    k = nq("self_attn.norm_k", lin(W, p + "self_attn.k", h)).reshape(b, n, nh, d)
    v = lin(W, p + "self_attn.v", h).reshape(b, n, nh, d)
    q, k = rotate_pairs(q, ang[None, :, None]), rotate_pairs(k, ang[None, :, None])
    kk, vv = self_kv(i, k, v)
    x = x + lin(W, p + "self_attn.o", attention(q, kk, vv)) * m2
    c = layer_norm(x, eps, W[p + "norm3.weight"], W[p + "norm3.bias"]) if cfg.get("cross_attn_norm", True) else x
    lc = ctx.shape[1]
    q = nq("cross_attn.norm_q", lin(W, p + "cross_attn.q", c)).reshape(b, n, nh, d)
    k = nq("cross_attn.norm_k", lin(W, p + "cross_attn.k", ctx)).reshape(b, lc, nh, d)
    v = lin(W, p + "cross_attn.v", ctx).reshape(b, lc, nh, d)
    x = x + lin(W, p + "cross_attn.o", attention(q, k, v))
    if action is not None:
        x = action(i, x)
    y = lin(W, p + "ffn.2", gelu_tanh(lin(W, p + "ffn.0", layer_norm(x, eps) * (1 + m4) + m3)))
    return x + y * m5


def head(W, cfg, x, e_tok):
    s = W["head.modulation"][0] + e_tok[:, :, None]          # [B, N, 2, dim]
    return lin(W, "head.head", layer_norm(x, cfg["eps"]) * (1 + s[:, :, 1]) + s[:, :, 0])


def text_embed(W, cfg, context):
    """context [B, L, text_dim] -> [B, text_len, dim] (zero-padded rows included)."""
    b, n, td = context.shape
    pad = torch.zeros(b, cfg["text_len"], td, dtype=D)
    pad[:, :n] = context
    return lin(W, "text_embedding.2", gelu_tanh(lin(W, "text_embedding.0", pad)))


def image_embed(W, context):
    y = layer_norm(context, 1e-5, W["img_emb.proj.0.weight"], W["img_emb.proj.0.bias"])
    y = lin(W, "img_emb.proj.3", gelu_erf(lin(W, "img_emb.proj.1", y)))
    return layer_norm(y, 1e-5, W["img_emb.proj.4.weight"], W["img_emb.proj.4.bias"])


def as64(W):
    return {k: v.to(D) for k, v in W.items()}


# ----------------------------------------------------------------------------- fixture A: full forward
def full_forward(W, cfg, x, t, context):
    """x [C, F, H, W], t: float, context [L, text_dim] -> [C_out, F, H, W]. Sequence padding is masked as keys
    in the original, so the video tokens alone give the same result."""
    tok, g = patchify(W, cfg, x.to(D)[None])
    e, e0 = time_path(W, cfg, torch.tensor([float(t)], dtype=torch.float32))
    n = tok.shape[1]
    ctx = text_embed(W, cfg, context.to(D)[None])
    ang = dit_rope_angles(grid_positions(*g), cfg["dim"] // cfg["num_heads"])
    m_tok = e0[:, None].expand(1, n, 6, cfg["dim"])
    for i in range(cfg["num_layers"]):
        tok = block(W, cfg, i, tok, m_tok, ctx, ang, lambda _i, k, v: (k, v))
    return unpatchify(cfg, head(W, cfg, tok, e[:, None].expand(1, n, -1)), g)[0]


# ----------------------------------------------------------------------------- caches (spec bookkeeping)
class Cache:
    """Slot cache with global end G, local end L, capacity N, sink slots kept forever (rolling rule)."""

    def __init__(self, capacity, sink=0):
        self.cap, self.sink, self.G, self.L, self.k, self.v = capacity, sink, 0, 0, None, None

    def update(self, k, v, start):
        """k/v [B, n, ...] for absolute positions [start, start+n); returns the valid slots [0, L')."""
        n = k.shape[1]
        end = start + n
        if self.k is None:
            self.k = torch.zeros((k.shape[0], self.cap) + k.shape[2:], dtype=D)
            self.v = torch.zeros_like(self.k)
        if end > self.G and self.L + n > self.cap:
            ev = self.L + n - self.cap
            keep = self.L - ev - self.sink
            s = self.sink
            self.k[:, s:s + keep] = self.k[:, s + ev:s + ev + keep].clone()
            self.v[:, s:s + keep] = self.v[:, s + ev:s + ev + keep].clone()
            new_l = self.L + (end - self.G) - ev
        else:
            new_l = self.L + (end - self.G)
        self.k[:, new_l - n:new_l] = k
        self.v[:, new_l - n:new_l] = v
        self.G, self.L = end, new_l
        return self.k[:, :new_l], self.v[:, :new_l]


# ----------------------------------------------------------------------------- scheduler
class Sched:
    def __init__(self, steps, shift, warp=True):
        u = torch.linspace(1, 0, 1001, dtype=torch.float32)[:-1]
        self.sigmas = shift * u / (1 + (shift - 1) * u)
        self.timesteps = 1000 * self.sigmas
        if warp:
            ext = torch.cat([self.timesteps, torch.zeros(1)])
            self.t = [float(ext[1000 - int(s)]) for s in steps]
        else:
            self.t = [float(torch.tensor(float(s), dtype=torch.float32)) for s in steps]

    def sigma(self, t):
        return float(self.sigmas[(self.timesteps.to(D) - t).abs().argmin()])


# ----------------------------------------------------------------------------- causal model + sampler
def causal_call(W, cfg, x, t, ctx, caches, start_frame, action=None):
    """x [B, Fb, C, H, W] (frames first), t: float for every frame, ctx [B, L, dim] -> flow like x."""
    b, fb = x.shape[:2]
    tok, g = patchify(W, cfg, x.to(D).transpose(1, 2))
    s_tok = g[1] * g[2]
    e, e0 = time_path(W, cfg, torch.full((b * fb,), t, dtype=torch.float32))
    m_tok = e0.reshape(b, fb, 1, 6, -1).expand(b, fb, s_tok, 6, cfg["dim"]).reshape(b, fb * s_tok, 6, -1)
    e_tok = e.reshape(b, fb, 1, -1).expand(b, fb, s_tok, cfg["dim"]).reshape(b, fb * s_tok, -1)
    ang = dit_rope_angles(grid_positions(g[0], g[1], g[2], start_frame), cfg["dim"] // cfg["num_heads"])
    kv = lambda i, k, v: caches[i].update(k, v, start_frame * s_tok)
    for i in range(cfg["num_layers"]):
        tok = block(W, cfg, i, tok, m_tok, ctx, ang, kv, action)
    return unpatchify(cfg, head(W, cfg, tok, e_tok), g).transpose(1, 2)


def sample_causal(W, cfg, context, noise, sched, fpb, eps, window=-1, sink=0, trace=None):
    """noise [B, F, C, H, W]; eps(chunk, step) -> [B, fpb, C, H, W]; window/sink in latent frames.
    Returns x0 [B, F, C, H, W] and the caches; trace(chunk, step, xt, flow, x0) receives every model call
    (step None for the cache-refresh pass)."""
    b, f, _, h, w = noise.shape
    s_tok = (h // cfg["patch_size"][1]) * (w // cfg["patch_size"][2])
    frames = window if 0 < window < f else f
    caches = [Cache(frames * s_tok, sink * s_tok if frames < f else 0) for _ in range(cfg["num_layers"])]
    ctx = text_embed(W, cfg, context.to(D))
    out = torch.zeros(noise.shape, dtype=D)
    for ci in range(f // fpb):
        s = ci * fpb
        xt = noise[:, s:s + fpb].to(D)
        for k, tk in enumerate(sched.t):
            flow = causal_call(W, cfg, xt, tk, ctx, caches, s)
            x0 = xt - sched.sigma(tk) * flow
            if trace is not None:
                trace(ci, k, xt, flow, x0)
            if k < len(sched.t) - 1:
                sg = sched.sigma(sched.t[k + 1])
                xt = (1 - sg) * x0 + sg * eps(ci, k).to(D)
        out[:, s:s + fpb] = x0
        flow = causal_call(W, cfg, x0, 0.0, ctx, caches, s)
        if trace is not None:
            trace(ci, None, x0, flow, x0 - sched.sigma(0.0) * flow)
    return out, caches


# ----------------------------------------------------------------------------- Matrix-Game-2
class Actions:
    """Action modules of the blocks in action_config['blocks'] with their mouse / keyboard caches."""

    def __init__(self, W, acfg, mouse, keyboard, window, frame_tokens):
        self.W, self.a = W, acfg
        self.mouse, self.keyboard = mouse.to(D), keyboard.to(D)
        self.S = frame_tokens
        self.mc = {i: Cache(window) for i in acfg["blocks"]}
        self.kc = {i: Cache(window) for i in acfg["blocks"]}
        self.start, self.T = 0, 0

    def _window(self, f):
        r = self.a["vae_time_compression_ratio"]
        p = r * self.a["windows_size"]
        return [max(0, r * f - p + j) for j in range(p)]

    def _rope(self, x, frames):          # x [..., T, heads, 64]; frames: absolute latent frames of the T axis
        dt = self.a["mouse_qk_dim_list"][0]
        j = torch.arange(dt // 2, dtype=D)
        ang = torch.tensor(frames, dtype=D)[:, None] * self.a["rope_theta"] ** (-2 * j / dt)
        rot = rotate_pairs(x[..., :dt], ang[:, None, :])
        return torch.cat([rot, x[..., dt:]], -1)

    def __call__(self, i, x):
        if i not in self.mc:
            return x
        W, p, nh, S, T = self.W, f"blocks.{i}.action_model.", self.a["heads_num"], self.S, self.T
        b = x.shape[0]
        frames = [self.start + j for j in range(T)]
        anorm = lambda y: rms_norm(y, None, 1e-6)
        # mouse branch
        mw = torch.stack([self.mouse[:, self._window(f)].flatten(1) for f in frames], 1)     # [B, T, P*md]
        u = torch.cat([x.reshape(b, T, S, -1), mw[:, :, None].expand(b, T, S, mw.shape[-1])], -1)
        hm = lin(W, p + "mouse_mlp.2", gelu_tanh(lin(W, p + "mouse_mlp.0", u)))
        hm = layer_norm(hm, 1e-5, W[p + "mouse_mlp.3.weight"], W[p + "mouse_mlp.3.bias"])
        q, k, v = lin(W, p + "t_qkv", hm, bias=False).reshape(b, T, S, 3, nh, 64).unbind(3)
        q, k = self._rope(anorm(q).transpose(1, 2), frames), self._rope(anorm(k).transpose(1, 2), frames)
        seq = lambda y: y.reshape(b * S, T, nh, 64)                                         # [B*S, T, nh, 64]
        kk, vv = self.mc[i].update(seq(k), seq(v.transpose(1, 2)), self.start)
        o = attention(seq(q), kk, vv).reshape(b, S, T, -1).transpose(1, 2).reshape(b, T * S, -1)
        x1 = x + lin(W, p + "proj_mouse", o, bias=False)
        # keyboard branch
        emb = lin(W, p + "keyboard_embed.2", silu(lin(W, p + "keyboard_embed.0", self.keyboard)))
        g = torch.stack([emb[:, self._window(f)].flatten(1) for f in frames], 1)             # [B, T, P*hs]
        kb, vb = lin(W, p + "keyboard_attn_kv", g, bias=False).reshape(b, T, 2, nh, 64).unbind(2)
        kb = self._rope(anorm(kb), frames)
        qk = anorm(lin(W, p + "mouse_attn_q", x1, bias=False).reshape(b, T, S, nh, 64))
        qk = self._rope(qk.transpose(1, 2), frames).transpose(1, 2).reshape(b, T * S, nh, 64)
        kk, vv = self.kc[i].update(kb, vb, self.start)
        return x1 + lin(W, p + "proj_keyboard", attention(qk, kk, vv), bias=False)


def sample_mg2(W, cfg, noise, cond, visual_context, mouse, keyboard, sched, window, eps, trace=None, state=None):
    """noise [B, 16, F, H, W]; cond [B, 20, F, H, W]; eps(chunk, step) -> [B, 16, 3, H, W].
    Returns x0 [B, 16, F, H, W] and (self caches, Actions); ``state`` (a dict) receives them at the start."""
    b, _, f, h, w = noise.shape
    s_tok = (h // cfg["patch_size"][1]) * (w // cfg["patch_size"][2])
    caches = [Cache(window * s_tok) for _ in range(cfg["num_layers"])]
    act = Actions(W, cfg["action_config"], mouse, keyboard, window, s_tok)
    if state is not None:
        state.update(caches=caches, act=act)
    ctx = image_embed(W, visual_context.to(D))
    out = torch.zeros(noise.shape, dtype=D)

    def call(xt, t, s):
        act.start, act.T = s, 3
        x = torch.cat([xt, cond[:, :, s:s + 3].to(D)], 1).transpose(1, 2)
        return causal_call(W, cfg, x, t, ctx, caches, s, act).transpose(1, 2)

    for ci in range(f // 3):
        s = 3 * ci
        xt = noise[:, :, s:s + 3].to(D)
        for k, tk in enumerate(sched.t):
            flow = call(xt, tk, s)
            x0 = xt - sched.sigma(tk) * flow
            if trace is not None:
                trace(ci, k, xt, flow, x0)
            if k < len(sched.t) - 1:
                sg = sched.sigma(sched.t[k + 1])
                xt = (1 - sg) * x0 + sg * eps(ci, k).to(D)
        out[:, :, s:s + 3] = x0
        flow = call(x0, 0.0, s)
        if trace is not None:
            trace(ci, None, x0, flow, x0 - sched.sigma(0.0) * flow)
    return out, (caches, act)
