"""Model behaviour beyond the fixtures: padding, causal/full agreement, RoPE cache, precision, block wrapping."""
import pytest
import torch

from wan_accel.model.attention import attention, check_backend, fa_available
from wan_accel.model.config import WanConfig
from wan_accel.model.kv_cache import CrossAttnCache, KVCache
from wan_accel.model.dit import WanModel
from wan_accel.model.rope import MAX_POSITIONS, RopeCache, apply_rope
from wan_accel.model.tiny import init_tiny_weights, tiny_causal_model

CFG = WanConfig(dim=48, ffn_dim=96, num_heads=2, num_layers=2, text_dim=32, text_len=8, freq_dim=16)


def _model(seed=0, cfg=CFG):
    return init_tiny_weights(WanModel(cfg), seed).eval()


def _inputs(f=2, h=4, w=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, f, h, w, generator=g), torch.randn(5, CFG.text_dim, generator=g)


@torch.no_grad()
def test_padding_is_masked_and_dropped():
    model = _model()
    x, ctx = _inputs()
    t = torch.tensor([321.0])
    plain = model.forward_full([x], t, [ctx])[0]
    padded = model.forward_full([x], t, [ctx], seq_len=2 * 2 * 3 + 11)[0]
    assert padded.shape == x.shape
    torch.testing.assert_close(padded, plain, rtol=0, atol=1e-5)


@torch.no_grad()
def test_batch_with_different_grids():
    model = _model()
    x1, ctx = _inputs(2, 4, 6)
    x2, _ = _inputs(1, 6, 4, seed=2)
    t = torch.tensor([100.0, 700.0])
    both = model.forward_full([x1, x2], t, [ctx, ctx], seq_len=24)
    one = model.forward_full([x2], t[1:], [ctx])[0]
    torch.testing.assert_close(both[1], one, rtol=0, atol=1e-5)


@torch.no_grad()
def test_causal_first_chunk_equals_full_forward():
    model = _model()
    x, ctx = _inputs(3, 4, 6)
    full = model.forward_full([x], torch.tensor([640.0]), [ctx])[0]                  # [C, F, H, W]
    kv = KVCache.for_model(model, 1, 6, 3)
    chunk = model.forward_chunk(x.transpose(0, 1)[None], torch.full((1, 3), 640.0), ctx[None], kv,
                                CrossAttnCache(CFG.num_layers), 0)
    torch.testing.assert_close(chunk[0].transpose(0, 1), full, rtol=0, atol=1e-5)


@torch.no_grad()
def test_per_frame_timesteps_modulate_their_own_frames():
    model = _model()
    x, ctx = _inputs(2, 4, 6)
    xb = x.transpose(0, 1)[None]
    mixed = model.forward_chunk(xb, torch.tensor([[900.0, 100.0]]), ctx[None])
    same = model.forward_chunk(xb, torch.tensor([[900.0, 900.0]]), ctx[None])
    assert not torch.allclose(mixed[:, 1], same[:, 1], atol=1e-3)   # frame 1's own t matters


def test_rope_angles_follow_the_axis_split():
    hd = 16                                        # 8 pairs: 4 frame, 2 height, 2 width
    cos, sin = RopeCache().get(hd, (2, 3, 4), 5, "cpu", torch.float64)
    grid = torch.complex(cos, sin).reshape(2, 3, 4, 8)
    for got, angle in ((grid[1, 0, 0, :4], 6 / 10000 ** (torch.arange(4, dtype=torch.float64) / 4)),
                       (grid[0, 2, 0, 4:6], 2 / 10000 ** (torch.arange(2, dtype=torch.float64) / 2)),
                       (grid[0, 0, 3, 6:], 3 / 10000 ** (torch.arange(2, dtype=torch.float64) / 2))):
        assert torch.allclose(got, torch.polar(torch.ones_like(angle), angle))
    x = torch.randn(1, 24, 1, hd)
    out = apply_rope(x, cos.float(), sin.float())
    ref = torch.view_as_real(torch.view_as_complex(x.double().reshape(1, 24, 1, 8, 2))
                             * torch.complex(cos, sin)[None, :, None])
    torch.testing.assert_close(out, ref.reshape(1, 24, 1, hd).float(), rtol=0, atol=1e-6)


@torch.no_grad()
def test_rope_tables_are_cached_per_start_frame():
    model = _model()
    x, ctx = _inputs(2, 4, 6)
    xb = x.transpose(0, 1)[None]
    t = torch.full((1, 2), 500.0)
    model.forward_chunk(xb, t, ctx[None], current_start=0)
    n = len(model.rope._tables)
    first = next(iter(model.rope._tables.values()))
    model.forward_chunk(xb, t, ctx[None], current_start=0)
    assert len(model.rope._tables) == n and next(iter(model.rope._tables.values())) is first
    model.forward_chunk(xb, t, ctx[None], current_start=2 * 12)
    assert len(model.rope._tables) == n + 1


def test_rope_position_limit_is_a_clear_error():
    with pytest.raises(ValueError, match="rotary table has 1024 positions"):
        RopeCache().get(16, (3, 2, 2), MAX_POSITIONS - 2, "cpu")


@torch.no_grad()
def test_precision_policies_run_and_stay_close():
    ref_model = tiny_causal_model()
    x, _ = _inputs(3, 4, 6)
    ctx = torch.randn(1, 7, ref_model.config.text_dim)
    xb, t = x.transpose(0, 1)[None], torch.full((1, 3), 800.0)
    ref = ref_model.forward_chunk(xb, t, ctx)
    for precision in ("wan21", "self_forcing"):
        m = tiny_causal_model(dtype=torch.bfloat16, precision=precision)
        out = m.forward_chunk(xb, t, ctx)
        expect = torch.float32 if precision == "wan21" else torch.bfloat16
        assert out.dtype == expect and m.stream_dtype == expect and m.compute_dtype == torch.bfloat16
        err = (out.float() - ref).abs().max() / ref.abs().max()
        assert err < 0.08, (precision, float(err))


@torch.no_grad()
def test_blocks_can_be_wrapped_one_by_one():
    model = _model()
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == CFG.num_layers
    x, ctx = _inputs(3, 4, 6)
    xb, t = x.transpose(0, 1)[None], torch.full((1, 3), 300.0)
    base = model.forward_chunk(xb, t, ctx[None], KVCache.for_model(model, 1, 6, 3), CrossAttnCache(2), 0)
    calls = []
    handles = [b.register_forward_pre_hook(lambda mod, args, i=i: calls.append(i)) for i, b in enumerate(model.blocks)]
    original = model.blocks[1].forward
    model.blocks[1].forward = lambda *a, **k: original(*a, **k)       # e.g. a compiled or offloaded block
    out = model.forward_chunk(xb, t, ctx[None], KVCache.for_model(model, 1, 6, 3), CrossAttnCache(2), 0)
    for h in handles:
        h.remove()
    assert calls == [0, 1]
    assert torch.equal(out, base)


def test_attention_mask_and_backend_checks():
    q, k, v = torch.randn(2, 5, 3, 8), torch.randn(2, 7, 3, 8), torch.randn(2, 7, 3, 8)
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    out = attention(q, k, v, mask)
    w = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q[1:], k[1:, :4]) / 8 ** 0.5, dim=-1)
    torch.testing.assert_close(out[1:], torch.einsum("bhqk,bkhd->bqhd", w, v[1:, :4]), rtol=0, atol=1e-5)
    assert check_backend("sdpa") == "sdpa"
    with pytest.raises(ValueError, match="attention backend"):
        check_backend("xformers")
    if not (fa_available("fa3") or fa_available("fa2")):
        with pytest.raises(RuntimeError, match="flash-attn package is not installed"):
            check_backend("flash_attn")


def test_text_context_errors():
    model = _model()
    with pytest.raises(ValueError, match="text_dim"):
        model.embed_text(torch.zeros(1, 3, CFG.text_dim + 1))
    with pytest.raises(ValueError, match="at most text_len=8"):
        model.embed_text(torch.zeros(1, 9, CFG.text_dim))


def test_i2v_model_builds_and_runs():
    cfg = CFG.replace(model_type="i2v", in_dim=36, clip_dim=24)
    model = _model(cfg=cfg)
    keys = set(model.state_dict())
    assert {"img_emb.proj.0.weight", "img_emb.proj.1.weight", "img_emb.proj.3.weight", "img_emb.proj.4.bias",
            "blocks.0.cross_attn.k_img.weight", "blocks.0.cross_attn.v_img.bias",
            "blocks.0.cross_attn.norm_k_img.weight"} <= keys
    x, ctx = _inputs(2, 4, 6)
    with torch.no_grad():
        out = model.forward_full([x], torch.tensor([500.0]), [ctx], y=[torch.randn(20, 2, 4, 6)],
                                 clip_fea=torch.randn(1, 257, 24))[0]
    assert out.shape == (16, 2, 4, 6) and torch.isfinite(out).all()
