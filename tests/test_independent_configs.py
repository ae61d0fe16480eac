"""Cross-check the float32 model and samplers against an independent float64 implementation of the fixture
specifications (tests/independent_reference.py) on configurations other than the published fixtures: other
widths, head and layer counts, frame counts, non-square latents, sequence padding, step lists, shifts,
warping, rolling KV windows (with sinks, not multiples of the chunk) and Matrix-Game-2 action blocks."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
import independent_reference as R  # noqa: E402

from wan_accel.model.config import WanConfig  # noqa: E402
from wan_accel.model.kv_cache import KVCache  # noqa: E402
from wan_accel.model.loader import load_wan_checkpoint  # noqa: E402
from wan_accel.sampling.scheduler import resolve_schedule  # noqa: E402

TOL = 1e-4


# ----------------------------------------------------------------------------- random weights, official keys
def _keys(c: dict) -> dict:
    dim, ffn, pt, ph, pw = c["dim"], c["ffn_dim"], *c["patch_size"]
    k = {"patch_embedding.weight": (dim, c["in_dim"], pt, ph, pw), "patch_embedding.bias": (dim,),
         "time_embedding.0.weight": (dim, c["freq_dim"]), "time_embedding.0.bias": (dim,),
         "time_embedding.2.weight": (dim, dim), "time_embedding.2.bias": (dim,),
         "time_projection.1.weight": (6 * dim, dim), "time_projection.1.bias": (6 * dim,),
         "head.modulation": (1, 2, dim), "head.head.weight": (pt * ph * pw * c["out_dim"], dim),
         "head.head.bias": (pt * ph * pw * c["out_dim"],)}
    if "action_config" in c:
        cd = c["clip_dim"]
        k.update({"img_emb.proj.0.weight": (cd,), "img_emb.proj.0.bias": (cd,), "img_emb.proj.1.weight": (cd, cd),
                  "img_emb.proj.1.bias": (cd,), "img_emb.proj.3.weight": (dim, cd), "img_emb.proj.3.bias": (dim,),
                  "img_emb.proj.4.weight": (dim,), "img_emb.proj.4.bias": (dim,)})
    else:
        k.update({"text_embedding.0.weight": (dim, c["text_dim"]), "text_embedding.0.bias": (dim,),
                  "text_embedding.2.weight": (dim, dim), "text_embedding.2.bias": (dim,)})
    for i in range(c["num_layers"]):
        p = f"blocks.{i}."
        k[p + "modulation"] = (1, 6, dim)
        for a in ("self_attn", "cross_attn"):
            for n in "qkvo":
                k[f"{p}{a}.{n}.weight"], k[f"{p}{a}.{n}.bias"] = (dim, dim), (dim,)
            k[f"{p}{a}.norm_q.weight"] = k[f"{p}{a}.norm_k.weight"] = (dim,)
        k[p + "norm3.weight"] = k[p + "norm3.bias"] = (dim,)
        k.update({p + "ffn.0.weight": (ffn, dim), p + "ffn.0.bias": (ffn,), p + "ffn.2.weight": (dim, ffn),
                  p + "ffn.2.bias": (dim,)})
    a = c.get("action_config")
    for i in (a["blocks"] if a else ()):
        p, hs, hm, hk = f"blocks.{i}.action_model.", a["hidden_size"], a["mouse_hidden_dim"], a["keyboard_hidden_dim"]
        pv = a["vae_time_compression_ratio"] * a["windows_size"]
        k.update({p + "keyboard_embed.0.weight": (hs, a["keyboard_dim_in"]), p + "keyboard_embed.0.bias": (hs,),
                  p + "keyboard_embed.2.weight": (hs, hs), p + "keyboard_embed.2.bias": (hs,),
                  p + "mouse_mlp.0.weight": (hm, dim + pv * a["mouse_dim_in"]), p + "mouse_mlp.0.bias": (hm,),
                  p + "mouse_mlp.2.weight": (hm, hm), p + "mouse_mlp.2.bias": (hm,),
                  p + "mouse_mlp.3.weight": (hm,), p + "mouse_mlp.3.bias": (hm,),
                  p + "t_qkv.weight": (3 * hm, hm), p + "proj_mouse.weight": (dim, hm),
                  p + "mouse_attn_q.weight": (hk, dim), p + "keyboard_attn_kv.weight": (2 * hk, pv * hs),
                  p + "proj_keyboard.weight": (dim, hk)})
        for n in ("img_attn_q_norm", "img_attn_k_norm", "key_attn_q_norm", "key_attn_k_norm"):
            k[f"{p}{n}.weight"] = (64,)
    return k


def _weights(c: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(_keys(c).items()):
        r = torch.randn(shape, generator=g)
        if "modulation" in name:
            r = 0.3 * r
        elif len(shape) == 1 and ("norm" in name or name.endswith((".0.weight", ".4.weight", ".3.weight"))):
            r = 1 + 0.2 * r if name.endswith("weight") else 0.1 * r
        elif name.endswith("bias"):
            r = 0.1 * r
        else:
            r = r / (torch.tensor(shape[1:]).prod().item() ** 0.5)
        out[name] = r.contiguous()
    return out


def _model(c: dict, weights: dict, tmp_path):
    path = tmp_path / "w.safetensors"
    save_file(weights, str(path))
    return load_wan_checkpoint(path, device="cpu", dtype=torch.float32, precision="float32",
                               config=WanConfig.from_dict(c), attention="sdpa")


def _maxdiff(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def _base(dim, heads, layers, **kw) -> dict:
    c = {"model_type": "t2v", "patch_size": [1, 2, 2], "text_len": 12, "in_dim": 8, "out_dim": 8, "dim": dim,
         "ffn_dim": 2 * dim - 16, "freq_dim": 24, "text_dim": 40, "num_heads": heads, "num_layers": layers,
         "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6}
    c.update(kw)
    return c


# ----------------------------------------------------------------------------- fixture A style: full forward
FULL = [
    # (config, list of (C, F, H, W) videos, t values, text lengths, seq_len padding)
    (_base(96, 3, 1), [(8, 3, 6, 10)], [700.0], [7], 9),
    (_base(80, 5, 3, text_len=8), [(8, 2, 10, 4)], [13.5], [8], 0),
    (_base(60, 3, 2, patch_size=[2, 2, 2], in_dim=6, out_dim=4), [(6, 4, 6, 4)], [999.0], [3], 5),
    (_base(48, 2, 2), [(8, 3, 4, 6), (8, 1, 6, 6)], [250.0, 875.25], [5, 12], 4),
]


@pytest.mark.parametrize("case", range(len(FULL)))
def test_full_forward_matches_independent_float64(case, tmp_path):
    c, shapes, ts, lens, pad = FULL[case]
    w = _weights(c, 100 + case)
    model = _model(c, w, tmp_path)
    g = torch.Generator().manual_seed(7 + case)
    xs = [torch.randn(s, generator=g) for s in shapes]
    ctx = [torch.randn(n, c["text_dim"], generator=g) for n in lens]
    pt, ph, pw = c["patch_size"]
    seq_len = max(s[1] // pt * (s[2] // ph) * (s[3] // pw) for s in shapes) + pad
    with torch.no_grad():
        ours = model.forward_full(xs, torch.tensor(ts), ctx, seq_len=seq_len)
    w64 = R.as64(w)
    for x, t, cx, o in zip(xs, ts, ctx, ours):
        ref = R.full_forward(w64, c, x, t, cx)
        assert o.shape == ref.shape
        assert ref.abs().max() > 0.1
        assert _maxdiff(o, ref) <= TOL, (case, _maxdiff(o, ref))


# ----------------------------------------------------------------------------- fixture B style: causal sampler
CAUSAL = [
    # config, (B, F, H, W), frames_per_block, steps, shift, warp, kv_window, sink, text length
    (_base(96, 3, 1), (1, 6, 6, 10), 3, [1000, 750, 500], 5.0, True, -1, 0, 7),
    (_base(80, 5, 3, text_len=8), (1, 6, 10, 4), 2, [1000, 500], 3.0, True, 3, 1, 8),
    (_base(60, 3, 2, freq_dim=16), (1, 9, 4, 6), 3, [1000, 800, 600, 400, 200], 8.0, False, 4, 0, 5),
    (_base(64, 2, 2), (2, 6, 6, 6), 1, [1000, 757, 522], 8.0, False, 5, 2, 12),
    (_base(48, 2, 2), (1, 9, 4, 4), 3, [1000, 750, 500, 250], 5.0, True, 7, 1, 6),
]


@pytest.mark.parametrize("case", range(len(CAUSAL)))
def test_causal_sampler_matches_independent_float64(case, tmp_path):
    from run_helpers import run_causal
    c, (b, f, h, wd), fpb, steps, shift, warp, window, sink, lt = CAUSAL[case]
    w = _weights(c, 200 + case)
    model = _model(c, w, tmp_path)
    g = torch.Generator().manual_seed(30 + case)
    noise = torch.randn(b, f, c["in_dim"], h, wd, generator=g)
    context = torch.randn(b, lt, c["text_dim"], generator=g)
    eps = {(ci, k): torch.randn(b, fpb, c["in_dim"], h, wd, generator=g)
           for ci in range(f // fpb) for k in range(len(steps) - 1)}
    sched = resolve_schedule("custom", steps=steps, shift=shift, warp=warp)
    ref_sched = R.Sched(steps, shift, warp)
    assert sched.timesteps == ref_sched.t
    frame_tokens = (h // 2) * (wd // 2)
    kv = KVCache.for_model(model, b, frame_tokens, f, window, sink)
    records = []
    out = run_causal(model, context, noise, sched, fpb, kv_window=window, sink=sink, kv_cache=kv,
                        noise_provider=lambda ci, k, shape, dtype, dev: eps[(ci, k)].reshape(shape).to(dev, dtype),
                        tracer=records.append)
    ref_calls = []
    ref_out, caches = R.sample_causal(R.as64(w), c, context, noise, ref_sched, fpb, lambda ci, k: eps[(ci, k)],
                                      window, sink, trace=lambda *a: ref_calls.append(a) if a[1] is not None else None)
    ours = [r for r in records if r["kind"] == "denoise"]
    assert len(ours) == len(ref_calls) == f // fpb * len(steps)
    for r, (ci, k, xt, flow, x0) in zip(ours, ref_calls):
        assert (r["chunk"], r["step"]) == (ci, k)
        for name, ref in (("xt", xt), ("flow", flow), ("x0", x0)):
            assert _maxdiff(r[name], ref) <= TOL, (case, ci, k, name, _maxdiff(r[name], ref))
    assert ref_out.abs().max() > 0.1
    assert _maxdiff(out, ref_out) <= TOL, (case, _maxdiff(out, ref_out))
    fast = run_causal(model, context, noise, sched, fpb, kv_window=window, sink=sink, path="optimized",
                         noise_provider=lambda ci, k, shape, dtype, dev: eps[(ci, k)].reshape(shape).to(dev, dtype))
    assert _maxdiff(fast, ref_out) <= TOL, (case, "optimized path", _maxdiff(fast, ref_out))
    for i, cache in enumerate(caches):
        k, v = kv.ordered(i)
        assert k.shape[1] == cache.L
        assert _maxdiff(k, cache.k[:, :cache.L]) <= TOL and _maxdiff(v, cache.v[:, :cache.L]) <= TOL, (case, i)


# ----------------------------------------------------------------------------- Matrix-Game-2
def _mg2(dim, heads, layers, blocks, action_heads, hidden, kb_dim, win_size=3, **kw) -> dict:
    c = _base(dim, heads, layers, model_type="i2v", in_dim=36, out_dim=16, text_len=512, clip_dim=24)
    c.update(kw)
    c["action_config"] = {"blocks": blocks, "enable_keyboard": True, "enable_mouse": True, "heads_num": action_heads,
                          "hidden_size": hidden, "img_hidden_size": dim, "keyboard_dim_in": kb_dim,
                          "keyboard_hidden_dim": 64 * action_heads, "mouse_dim_in": 2,
                          "mouse_hidden_dim": 64 * action_heads, "mouse_qk_dim_list": [8, 28, 28],
                          "patch_size": [1, 2, 2], "qk_norm": True, "qkv_bias": False, "rope_dim_list": [8, 28, 28],
                          "rope_theta": 256, "vae_time_compression_ratio": 4, "windows_size": win_size}
    return c


MG2 = [
    # config, (F, H, W), window, steps, clip tokens
    (_mg2(64, 2, 2, [0, 1], 1, 8, 4), (9, 4, 6), 4, [1000, 500], 5),
    (_mg2(48, 3, 3, [1], 2, 16, 7), (9, 6, 4), 5, [1000, 750, 500, 250], 3),
    (_mg2(40, 2, 1, [0], 1, 8, 2, win_size=2), (6, 4, 4), 3, [1000, 666, 333], 4),
]


@pytest.mark.parametrize("case", range(len(MG2)))
def test_mg2_sampler_matches_independent_float64(case, tmp_path):
    from wan_accel.app.jobs.mg2 import sample_mg2
    from wan_accel.sampling.request import SamplingHooks
    c, (f, h, wd), window, steps, lc = MG2[case]
    w = _weights(c, 300 + case)
    model = _model(c, w, tmp_path)
    g = torch.Generator().manual_seed(50 + case)
    a = c["action_config"]
    nv = 1 + 4 * (f - 1)
    noise = torch.randn(1, 16, f, h, wd, generator=g)
    cond = torch.randn(1, 20, f, h, wd, generator=g)
    cond[:, :4] = 0
    cond[:, :4, 0] = 1
    vis = torch.randn(1, lc, c["clip_dim"], generator=g)
    mouse = 0.5 * torch.randn(1, nv, a["mouse_dim_in"], generator=g)
    keyboard = (torch.rand(1, nv, a["keyboard_dim_in"], generator=g) < 0.35).float()
    eps = {(ci, k): torch.randn(1, 3, 16, h, wd, generator=g) for ci in range(f // 3) for k in range(len(steps) - 1)}
    sched = resolve_schedule("custom", steps=steps, shift=5.0, warp=True)
    ref_sched = R.Sched(steps, 5.0, True)
    assert sched.timesteps == ref_sched.t
    frame_tokens = (h // 2) * (wd // 2)
    kv = KVCache.for_model(model, 1, frame_tokens, f, window, 0)
    actions = model.new_action_call(mouse, keyboard, window)
    records = []
    out = sample_mg2(model, noise, cond, vis, mouse, keyboard, sched, window, kv_cache=kv, actions=actions,
                     noise_provider=lambda ci, k, shape, dtype, dev: eps[(ci, k)].reshape(shape).to(dev, dtype),
                     hooks=SamplingHooks(tracer=records.append))
    ref_calls = []
    ref_out, (caches, act) = R.sample_mg2(R.as64(w), c, noise, cond, vis, mouse, keyboard, ref_sched, window,
                                          lambda ci, k: eps[(ci, k)].transpose(1, 2),
                                          trace=lambda *x: ref_calls.append(x) if x[1] is not None else None)
    ours = [r for r in records if r["kind"] == "denoise"]
    assert len(ours) == len(ref_calls) == f // 3 * len(steps)
    for r, (ci, k, xt, flow, x0) in zip(ours, ref_calls):
        for name, ref in (("flow", flow), ("x0", x0)):
            got = r[name].transpose(1, 2)
            assert _maxdiff(got, ref) <= TOL, (case, ci, k, name, _maxdiff(got, ref))
    assert ref_out.abs().max() > 0.1
    assert _maxdiff(out, ref_out) <= TOL, (case, _maxdiff(out, ref_out))
    from wan_accel.app.prepare import RunSpec
    fast = sample_mg2(model, noise, cond, vis, mouse, keyboard, sched, window,
                      noise_provider=lambda ci, k, shape, dtype, dev: eps[(ci, k)].reshape(shape).to(dev, dtype),
                      spec=RunSpec(path="optimized", doctor=False))
    assert _maxdiff(fast, ref_out) <= TOL, (case, "optimized path", _maxdiff(fast, ref_out))
    for i, cache in enumerate(caches):
        k, v = kv.ordered(i)
        assert _maxdiff(k, cache.k[:, :cache.L]) <= TOL and _maxdiff(v, cache.v[:, :cache.L]) <= TOL, (case, i)
    for slot, blk in enumerate(a["blocks"]):
        for ours_cache, ref_cache in ((actions.mouse_cache, act.mc[blk]), (actions.keyboard_cache, act.kc[blk])):
            k, v = ours_cache.ordered(slot)
            assert k.shape[1] == ref_cache.L
            assert _maxdiff(k, ref_cache.k[:, :ref_cache.L]) <= TOL, (case, blk)
            assert _maxdiff(v, ref_cache.v[:, :ref_cache.L]) <= TOL, (case, blk)


# ----------------------------------------------------------------------------- check-reference on new fixtures
def _write_fixture(d: Path, stem: str, cfg: dict, weights: dict, io: dict) -> None:
    import json
    cfg.update(weights_file=f"{stem}_weights.safetensors", io_file=f"{stem}_io.safetensors",
               state_dict=[[k, list(v.shape)] for k, v in weights.items()])
    save_file(weights, str(d / cfg["weights_file"]))
    save_file({k: v.float().contiguous() for k, v in io.items()}, str(d / cfg["io_file"]))
    (d / f"{stem}_config.json").write_text(json.dumps(cfg))


def _calls(records, frames_per_block, frame_tokens, ends=None):
    out = []
    for n, (ci, k, t) in enumerate(records):
        rec = {"call": n, "chunk": ci, "block": ci, "kind": "context" if k is None else "denoise", "step": k,
               "current_start": ci * frames_per_block * frame_tokens, "start_frame": ci * frames_per_block,
               "timestep": t}
        if ends is not None:
            rec["cache_ends_after_call"] = ends[n]
        out.append(rec)
    return out


def test_check_reference_on_unpublished_style_fixtures(tmp_path):
    """Fixture directories in the published formats, with other sizes, produced by the float64 reference,
    pass the package's check-reference at the acceptance tolerance."""
    from wan_accel.app.jobs.reference import check_reference
    g = torch.Generator().manual_seed(99)
    # full forward, non-square, sequence padding
    c = _base(80, 5, 2)
    w = _weights(c, 400)
    x, ctx = torch.randn(8, 3, 6, 10, generator=g), torch.randn(5, c["text_dim"], generator=g)
    out = R.full_forward(R.as64(w), c, x, 611.0, ctx)
    _write_fixture(tmp_path, "wan_t2v", {"fixture": "wan_t2v_full_sequence_forward", "config": c,
                                         "inputs": {"seq_len": 3 * 3 * 5 + 6}},
                   w, {"x": x, "context": ctx, "t": torch.tensor([611.0]), "output": out})
    # causal sampler, rolling window of 4 frames (not a multiple of the 3-frame chunk) with a 1-frame sink
    c = _base(64, 2, 2, local_attn_size=4, sink_size=1)
    w = _weights(c, 401)
    steps, (b, f, h, wd) = [1000, 600, 300], (1, 9, 4, 6)
    noise, ctx = torch.randn(b, f, 8, h, wd, generator=g), torch.randn(b, 6, c["text_dim"], generator=g)
    eps = {(ci, k): torch.randn(b * 3, 8, h, wd, generator=g) for ci in range(3) for k in range(2)}
    sched, rec, io = R.Sched(steps, 7.0, True), [], {"initial_noise": noise, "context": ctx}

    def keep(ci, k, xt, flow, x0, prefix="block"):
        name = f"{prefix}{ci}." + ("context" if k is None else f"step{k}")
        io.update({f"{name}.xt": xt, f"{name}.flow": flow, f"{name}.x0": x0})
        rec.append((ci, k, 0.0 if k is None else sched.t[k]))

    out, caches = R.sample_causal(R.as64(w), c, ctx, noise, sched, 3,
                                  lambda ci, k: eps[(ci, k)].reshape(b, 3, 8, h, wd), 4, 1, trace=keep)
    io.update({f"extra_noise.block{ci}.step{k}": v for (ci, k), v in eps.items()})
    io.update({f"kv_final.layer{i}.{n}": getattr(cc, n) for i, cc in enumerate(caches) for n in "kv"})
    io.update({"output": out, "scheduler.sigmas": sched.sigmas, "scheduler.timesteps": sched.timesteps,
               "denoising_step_list": torch.tensor(sched.t)})
    sampler = {"batch_size": b, "num_frames": f, "height": h, "width": wd, "num_frame_per_block": 3,
               "denoising_step_list_config": steps, "warp_denoising_step": True, "timestep_shift": 7.0,
               "context_noise": 0}
    _write_fixture(tmp_path, "causal", {"fixture": "causal_wan_kv_cached_sampling", "config": c,
                                        "frame_seq_length": 6, "sampler": sampler, "calls": _calls(rec, 3, 6)}, w, io)
    # Matrix-Game-2: window 4, two action blocks, two steps
    c = _mg2(48, 3, 2, [0, 1], 1, 8, 4, local_attn_size=4, sink_size=0)
    w = _weights(c, 402)
    steps, (f, h, wd), nv = [1000, 500], (9, 4, 4), 33
    io = {"initial_noise": torch.randn(1, 16, f, h, wd, generator=g),
          "cond_concat": torch.randn(1, 20, f, h, wd, generator=g),
          "visual_context": torch.randn(1, 3, c["clip_dim"], generator=g),
          "mouse_cond": 0.5 * torch.randn(1, nv, 2, generator=g),
          "keyboard_cond": (torch.rand(1, nv, 4, generator=g) < 0.35).float()}
    eps = {(ci, k): torch.randn(3, 16, h, wd, generator=g) for ci in range(3) for k in range(1)}
    sched, rec, ends, state = R.Sched(steps, 5.0, True), [], [], {}

    def keep_mg2(ci, k, xt, flow, x0):
        keep(ci, k, xt, flow, x0, prefix="chunk")
        a, blocks = state["act"], c["action_config"]["blocks"]
        ends.append({"self_attn": [[cc.G, cc.L] for cc in state["caches"]],
                     "mouse": [[a.mc[i].G, a.mc[i].L] for i in blocks],
                     "keyboard": [[a.kc[i].G, a.kc[i].L] for i in blocks]})

    cfg = dict(c)
    clip_dim = cfg.pop("clip_dim")
    out, (caches, act) = R.sample_mg2(R.as64(w), c, io["initial_noise"], io["cond_concat"], io["visual_context"],
                                      io["mouse_cond"], io["keyboard_cond"], sched, 4,
                                      lambda ci, k: eps[(ci, k)].reshape(1, 3, 16, h, wd).transpose(1, 2),
                                      trace=keep_mg2, state=state)
    io.update({f"extra_noise.chunk{ci}.step{k}": v for (ci, k), v in eps.items()})
    io.update({f"kv_final.layer{i}.{n}": getattr(cc, n) for i, cc in enumerate(caches) for n in "kv"})
    for i in c["action_config"]["blocks"]:
        io.update({f"mouse_kv_final.layer{i}.{n}": getattr(act.mc[i], n) for n in "kv"})
        io.update({f"keyboard_kv_final.layer{i}.{n}": getattr(act.kc[i], n) for n in "kv"})
    io.update({"output": out, "scheduler.sigmas": sched.sigmas, "scheduler.timesteps": sched.timesteps,
               "denoising_step_list": torch.tensor(sched.t)})
    sampler = {"batch_size": 1, "num_frames": f, "height": h, "width": wd, "num_frame_per_block": 3,
               "denoising_step_list_config": steps, "warp_denoising_step": True, "timestep_shift": 5.0,
               "context_noise": 0}
    _write_fixture(tmp_path, "mg2", {"fixture": "matrix_game2_causal_action_sampling", "config": cfg,
                                     "clip_dim": clip_dim, "frame_seq_length": 4, "sampler": sampler,
                                     "calls": _calls(rec, 3, 4, ends)}, w, io)
    rows = check_reference(tmp_path)
    names = {n for n, _ in rows}
    for must in ("wan_t2v/output", "causal/output", "causal/block2.step2.x0", "causal/kv_final.layer1.k",
                 "causal/calls", "mg2/output", "mg2/calls", "mg2/chunk2.context.flow", "mg2/mouse_kv_final.layer1.k",
                 "mg2/keyboard_kv_final.layer0.v", "mg2/kv_final.layer1.v"):
        assert must in names, must
    bad = [(n, d) for n, d in rows if not d <= TOL]
    assert not bad, bad


def test_independent_reference_reproduces_published_fixtures():
    """The float64 reference itself lands on the recorded outputs of the official implementations."""
    import json
    from safetensors.torch import load_file
    d = Path(__file__).parent / "fixtures" / "wan_reference"
    cfg = json.loads((d / "wan_t2v_config.json").read_text())
    io = load_file(str(d / cfg["io_file"]))
    out = R.full_forward(R.as64(load_file(str(d / cfg["weights_file"]))), cfg["config"], io["x"],
                         float(io["t"][0]), io["context"])
    assert _maxdiff(out, io["output"]) <= 1e-5
    cfg = json.loads((d / "causal_config.json").read_text())
    io, s = load_file(str(d / cfg["io_file"])), cfg["sampler"]
    noise = io["initial_noise"]
    fpb = s["num_frame_per_block"]
    shape = (noise.shape[0], fpb) + tuple(noise.shape[2:])
    out, caches = R.sample_causal(R.as64(load_file(str(d / cfg["weights_file"]))), cfg["config"], io["context"], noise,
                                  R.Sched(s["denoising_step_list_config"], s["timestep_shift"],
                                          s["warp_denoising_step"]),
                                  fpb, lambda ci, k: io[f"extra_noise.block{ci}.step{k}"].reshape(shape))
    assert _maxdiff(out, io["output"]) <= 1e-5
    assert _maxdiff(caches[-1].k, io[f"kv_final.layer{len(caches) - 1}.k"]) <= 1e-5
    d = Path(__file__).parent / "fixtures" / "matrix_game2"
    cfg = json.loads((d / "mg2_config.json").read_text())
    io, s = load_file(str(d / cfg["io_file"])), cfg["sampler"]
    c = dict(cfg["config"], clip_dim=cfg["clip_dim"])
    noise = io["initial_noise"]
    out, _ = R.sample_mg2(R.as64(load_file(str(d / cfg["weights_file"]))), c, noise, io["cond_concat"],
                          io["visual_context"], io["mouse_cond"], io["keyboard_cond"],
                          R.Sched(s["denoising_step_list_config"], s["timestep_shift"], s["warp_denoising_step"]),
                          c["local_attn_size"], lambda ci, k: io[f"extra_noise.chunk{ci}.step{k}"].reshape(
                              1, 3, 16, *noise.shape[3:]).transpose(1, 2))
    assert _maxdiff(out, io["output"]) <= 1e-5
