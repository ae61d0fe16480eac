"""Parity with the reference fixtures, and the check's config-driven behaviour on other configurations."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from wan_accel.cli import main as cli_main
from wan_accel.model.config import WanConfig
from checkpoint_files import save_wan_checkpoint
from wan_accel.app.jobs.reference import FORMATS, check_reference, survey, format_table
from run_helpers import run_causal
from wan_accel.sampling.scheduler import resolve_schedule
from wan_accel.model.tiny import init_tiny_weights
from wan_accel.model.dit import WanModel

FIXTURES = Path(__file__).parent / "fixtures" / "wan_reference"


def test_published_fixtures_pass():
    rows = check_reference(FIXTURES)
    names = {n for n, _ in rows}
    assert {"wan_t2v/output", "causal/output", "causal/kv_final.layer0.k", "causal/block1.context.flow"} <= names
    assert any(n.startswith("wan_t2v/inter.block") for n in names)
    worst = max(d for _, d in rows)
    assert worst <= 1e-4, format_table(rows)


def test_cli_check_reference_exit_codes(tmp_path, capsys):
    assert cli_main(["check-reference", str(FIXTURES)]) == 0
    assert "PASS" in capsys.readouterr().out
    bad = tmp_path / "bad"
    shutil.copytree(FIXTURES, bad)
    io = load_file(str(bad / "wan_t2v_io.safetensors"))
    io["output"] = io["output"] + 1e-3
    save_file(io, str(bad / "wan_t2v_io.safetensors"))
    assert cli_main(["check-reference", str(bad)]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_unknown_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no recognised fixture"):
        check_reference(tmp_path)


def test_formats_are_pluggable():
    assert {"wan_t2v_full", "causal_wan"} <= set(FORMATS)
    kinds = {name for name, _, _ in survey(FIXTURES)[0]}
    assert kinds == {"wan_t2v_full", "causal_wan"}


# --------------------------------------------------------------------- synthetic fixtures, other configs
def _float64_model(cfg: WanConfig, seed: int) -> WanModel:
    model = init_tiny_weights(WanModel(cfg), seed).double().eval()
    model.stream_dtype = model.compute_dtype = model.head.compute_dtype = torch.float64
    for block in model.blocks:
        block.compute_dtype = torch.float64
    return model


def _state_list(model):
    return [[n, list(t.shape)] for n, t in model.state_dict().items()]


def _write_full_fixture(d: Path, cfg: WanConfig, model, grid, seq_pad: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    f, h, w = grid
    x = torch.randn(cfg.in_dim, f, h, w, generator=gen)
    context = torch.randn(5, cfg.text_dim, generator=gen)
    t = torch.tensor([431.0])
    n = (f // cfg.patch_size[0]) * (h // cfg.patch_size[1]) * (w // cfg.patch_size[2])
    with torch.no_grad():
        out = model.forward_full([x.double()], t, [context.double()], seq_len=n + seq_pad)[0]
    save_wan_checkpoint(model.float(), d / "full_weights.safetensors")
    save_file({"x": x, "context": context, "t": t, "output": out.float()}, str(d / "full_io.safetensors"))
    cfg_json = {"fixture": "wan_t2v_full_sequence_forward", "config": cfg.to_dict(),
                "inputs": {"seq_len": n + seq_pad}, "weights_file": "full_weights.safetensors",
                "io_file": "full_io.safetensors", "state_dict": _state_list(model)}
    (d / "full_config.json").write_text(json.dumps(cfg_json))


def _write_causal_fixture(d: Path, cfg: WanConfig, model, shape, fpb: int, steps, warp: bool, shift: float):
    gen = torch.Generator().manual_seed(7)
    b, f, c, h, w = shape
    noise = torch.randn(shape, generator=gen)
    context = torch.randn(b, 6, cfg.text_dim, generator=gen)
    sched = resolve_schedule("custom", steps, shift, warp)
    extra = {f"extra_noise.block{ci}.step{k}": torch.randn(b * fpb, c, h, w, generator=gen)
             for ci in range(f // fpb) for k in range(len(steps) - 1)}
    records = []
    provide = lambda ci, k, shp, dt, dev: extra[f"extra_noise.block{ci}.step{k}"].reshape(shp).to(dt)
    out = run_causal(model, context.double(), noise.double(), sched, fpb, noise_provider=provide,
                        tracer=records.append)
    io = {"context": context, "initial_noise": noise, "output": out.float(), **extra,
          "denoising_step_list": torch.tensor(sched.timesteps, dtype=torch.float32)}   # as the producer records it
    for r in records:
        tag = "context" if r["kind"] == "context" else f"step{r['step']}"
        for part in ("xt", "flow", "x0"):
            io[f"block{r['chunk']}.{tag}.{part}"] = r[part].float()
    save_wan_checkpoint(model.float(), d / "causal_weights.safetensors")
    save_file({k: v.contiguous() for k, v in io.items()}, str(d / "causal_io.safetensors"))
    cfg_json = {"fixture": "causal_wan_kv_cached_sampling", "config": cfg.to_dict(),
                "frame_seq_length": (h // 2) * (w // 2),
                "sampler": {"num_frame_per_block": fpb, "denoising_step_list_config": list(steps),
                            "warp_denoising_step": warp, "timestep_shift": shift, "context_noise": 0},
                "calls": [{"kind": r["kind"], "current_start": r["current_start"], "timestep": r["t"]}
                          for r in records],
                "weights_file": "causal_weights.safetensors", "io_file": "causal_io.safetensors"}
    (d / "causal_config.json").write_text(json.dumps(cfg_json))


def test_other_configuration_is_read_from_the_config(tmp_path):
    """Another width/head/layer count, non-square latents, sequence padding, frames per block and an
    unwarped step list: the float32 check against a float64 run must pass, so nothing is hard-coded."""
    cfg = WanConfig(dim=96, ffn_dim=160, num_heads=3, num_layers=3, text_dim=40, text_len=12, freq_dim=24,
                    in_dim=16, out_dim=16)
    model = _float64_model(cfg, seed=3)
    _write_full_fixture(tmp_path, cfg, model, grid=(2, 6, 10), seq_pad=9, seed=1)
    model = _float64_model(cfg, seed=3)
    _write_causal_fixture(tmp_path, cfg, model, (1, 4, 16, 4, 6), fpb=2, steps=[1000, 800, 400],
                          warp=False, shift=3.0)
    rows = check_reference(tmp_path)
    assert any(n == "causal/block1.step2.x0" for n, _ in rows)
    assert max(d for _, d in rows) <= 1e-4, format_table(rows)
