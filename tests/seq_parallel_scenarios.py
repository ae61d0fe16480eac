"""Sampling runs for the sequence-parallel tests: each runs in a worker rank (``sp`` its group) or, with sp=None,
in one process; they return the latents, the rank's KV cache and its bytes."""
from __future__ import annotations

import os
from pathlib import Path

import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _enable(model, sp):
    if sp is not None:
        from wan_accel.model.seq_parallel import enable
        enable(model, sp)
    return model


def _kv(kv) -> dict:
    k, v = kv.ordered(0)
    return {"kv_bytes": sum(t.k.nbytes + t.v.nbytes for t in kv.layers), "k0": k.clone(), "v0": v.clone()}


def t2v_fixture(sp, kv_window: int = -1, path: str = "reference") -> dict:
    """The public causal fixture (4 heads): its weights, noise and re-noising draws; global or rolling cache."""
    import json
    from safetensors.torch import load_file
    from wan_accel.app.jobs.replay import Fixture
    from wan_accel.model.kv_cache import KVCache
    from run_helpers import run_causal
    d = FIXTURES / "wan_reference"
    cfg = json.loads((d / "causal_config.json").read_text())
    fx = Fixture(d, cfg)
    model = _enable(fx.model("cpu"), sp)
    io = load_file(str(d / cfg["io_file"]))
    noise = io["initial_noise"]
    kv = KVCache.for_model(model, 1, cfg["frame_seq_length"], noise.shape[1], kv_window, 1 if kv_window > 0 else 0)

    def provide(ci, k, shape, dtype, dev):
        return io[f"extra_noise.block{ci}.step{k}"].reshape(shape).to(dev, dtype)

    if sp is not None:
        sp.reset_stats()
    out = run_causal(model, io["context"], noise, fx.schedule(), 3, noise_provider=provide, kv_cache=kv,
                        path=path, fast_options={"cuda_graphs": "off"} if path == "optimized" else None)
    res = dict(_kv(kv), out=out, fixture=io["output"])
    if sp is not None:
        res["stats"] = dict(sp.stats)
    return res


def tiny6(sp, kv_window: int = -1, sink: int = 0, path: str = "reference") -> dict:
    """A tiny 6-head model (splits over 2 and 3 ranks) on a 5x6 token grid (30 tokens a frame, uneven over 4)."""
    from wan_accel.model.tiny import TINY_CONFIG, tiny_causal_model
    from wan_accel.model.kv_cache import KVCache
    from run_helpers import run_causal
    model = _enable(tiny_causal_model(seed=5, config=TINY_CONFIG.replace(dim=96, num_heads=6)), sp)
    gen = torch.Generator().manual_seed(7)
    ctx = torch.randn(1, 5, model.config.text_dim, generator=gen)
    shape = (1, 9, 16, 10, 12)
    kv = KVCache.for_model(model, 1, 30, 9, kv_window, sink)
    out = run_causal(model, ctx, shape, "self_forcing", 3, generator=torch.Generator().manual_seed(11),
                        kv_cache=kv, kv_window=kv_window, sink=sink, path=path,
                        fast_options={"cuda_graphs": "off"} if path == "optimized" else None)
    return dict(_kv(kv), out=out)


def mg2(sp, heads: int = 4) -> dict:
    """Matrix-Game-2: the public fixture (4 heads) or the tiny model with ``heads`` heads; rolling caches."""
    import json
    from safetensors.torch import load_file
    from wan_accel.app.jobs.replay import Fixture
    from wan_accel.model.kv_cache import KVCache
    from wan_accel.app.jobs.mg2 import sample_mg2
    d = FIXTURES / "matrix_game2"
    cfg = json.loads((d / "mg2_config.json").read_text())
    io, fx = load_file(str(d / cfg["io_file"])), Fixture(d, cfg)
    if heads == 4:
        model = fx.model("cpu")
    else:
        from wan_accel.model.mg2_model import tiny_mg2_config, tiny_mg2_model
        c = tiny_mg2_config()
        model = tiny_mg2_model(seed=3, config=c.replace(dim=16 * heads, num_heads=heads, clip_dim=32))
    _enable(model, sp)
    noise = io["initial_noise"]
    window = int(cfg["config"]["local_attn_size"])
    kv = KVCache.for_model(model, 1, cfg["frame_seq_length"], noise.shape[2], window, 0)
    actions = model.new_action_call(io["mouse_cond"], io["keyboard_cond"], window)

    def provide(ci, k, shape, dtype, dev):
        return io[f"extra_noise.chunk{ci}.step{k}"].reshape(shape).to(dev, dtype)

    out = sample_mg2(model, noise, io["cond_concat"], io["visual_context"], actions.mouse, actions.keyboard,
                     fx.schedule(), window, noise_provider=provide, kv_cache=kv, actions=actions)
    res = dict(_kv(kv), out=out, fixture=io["output"] if heads == 4 else None)
    res["mouse_bytes"] = sum(t.k.nbytes + t.v.nbytes for t in actions.mouse_cache.layers)
    return res


def several(sp, jobs) -> dict:
    """Run several scenarios in one start of the ranks: jobs = [(name, function name, kwargs), ...]."""
    return {name: globals()[fn](sp, **kw) for name, fn, kw in jobs}


def dies_mid_run(sp, dying_rank: int = 1) -> dict:
    """Rank ``dying_rank`` exits hard after its first chunk; the others must stop with a ParallelError."""
    from wan_accel.model.tiny import TINY_CONFIG, tiny_causal_model
    from run_helpers import generate_latents
    model = _enable(tiny_causal_model(seed=5, config=TINY_CONFIG.replace(dim=96, num_heads=6)), sp)

    def on_chunk(ci, n):
        if sp.rank == dying_rank:
            os._exit(17)

    generate_latents(model, torch.zeros(1, 4, model.config.text_dim), 9, 10, 12, on_chunk=on_chunk)
    return {"finished": True}




def bench_rank(sp) -> dict:
    """One rank of ``bench sampler --world-size N`` (tiny model, CPU, 9 frames 64x64, one timed run)."""
    from wan_accel.bench import parallel as bench_parallel
    opts = dict(checkpoint=None, seed=0, repeat=1, kind="wan", shape="tiny", geometry=(9, 64, 64),
                run_dtype="fp32", variant="reference", devices=["cpu"] * (1 if sp is None else sp.world))
    return bench_parallel._rank_run(sp, opts)

def cli_generate(sp, argv, out) -> dict:
    """``python -m wan_accel generate ... --out OUT`` in one process or as one rank of a torchrun launch (its
    environment variables; the command ends the group, so this runs last); rank 0's latents and report."""
    import json
    from safetensors.torch import load_file
    from wan_accel.cli import main
    if sp is not None:
        os.environ.update(WORLD_SIZE=str(sp.world), RANK=str(sp.rank), LOCAL_RANK=str(sp.rank))
    out = Path(out) / ("one" if sp is None else f"ranks{sp.world}")
    code = main(list(argv) + ["--out", str(out)])
    if sp is not None and sp.rank != 0:
        return {"code": code}
    report = json.loads((out / "report.json").read_text())
    return {"code": code, "out": load_file(str(out / "latents.safetensors"))["latents"],
            "parallel": report.get("parallel")}
