"""The generate job end to end on CPU (tiny model), its CLI, the preview and geometry errors."""
import json

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from wan_accel.cli import main as cli_main
from wan_accel.app.jobs.generate import GenerateOptions, run_generate
from wan_accel.app.prepare import latent_frames, latent_size
from wan_accel.app.jobs.preview import latents_to_rgb
from wan_accel.vae.latents import to_vae_latents


def test_generate_tiny_end_to_end(tmp_path):
    steps = []
    report = run_generate(GenerateOptions(out_dir=str(tmp_path), frames=21, height=64, width=96, seed=3,
                                          device="cpu"), progress=lambda *a: steps.append(a), log=lambda *a: None)
    assert report["tiny_random_model"] and report["device"] == "cpu"
    assert report["latent_shape"] == [1, 6, 16, 8, 12]
    assert steps == [(c, k, 2, 4) for c in range(2) for k in range(4)]
    on_disk = json.loads((tmp_path / "report.json").read_text())
    for key in ("chunk_seconds", "peak_memory", "device", "settings", "schedule", "precision", "dtype"):
        assert key in on_disk
    lat = load_file(str(tmp_path / "latents.safetensors"))
    assert lat["latents"].shape == (1, 6, 16, 8, 12) and lat["vae_latents"].shape == (1, 16, 6, 8, 12)
    with Image.open(report["files"]["preview"]) as im:
        assert im.n_frames == 6 and im.size == (48, 32)


def test_generate_chunks_are_timed(tmp_path):
    report = run_generate(GenerateOptions(out_dir=str(tmp_path), frames=21, height=32, width=32, device="cpu",
                                          preview=False), log=lambda *a: None)
    assert report["latent_shape"] == [1, 6, 16, 4, 4]
    assert len(report["chunk_seconds"]) == 2 and all(s > 0 for s in report["chunk_seconds"])
    assert "preview" not in report["files"]


def test_generate_is_seeded(tmp_path):
    outs = []
    for i, seed in enumerate([7, 7, 8]):
        d = tmp_path / str(i)
        run_generate(GenerateOptions(out_dir=str(d), frames=9, height=32, width=32, seed=seed, device="cpu",
                                     preview=False), log=lambda *a: None)
        outs.append(load_file(str(d / "latents.safetensors"))["latents"])
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


def test_generate_cli(tmp_path, capsys):
    assert cli_main(["generate", "--out", str(tmp_path), "--frames", "9", "--height", "32", "--width", "48",
                     "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["latent_shape"] == [1, 3, 16, 4, 6]
    assert "tiny random model" in captured.err
    assert cli_main(["generate", "--out", str(tmp_path), "--frames", "10"]) == 2
    assert "4k+1" in capsys.readouterr().err
    assert cli_main(["generate", "--out", str(tmp_path), "--frames", "17"]) == 2
    assert "use 9 or 21" in capsys.readouterr().err


def test_geometry_errors():
    assert latent_frames(81) == 21 and latent_frames(1) == 1
    with pytest.raises(ValueError, match="use 81 or 85"):
        latent_frames(83)
    assert latent_size(480, 832) == (60, 104)
    with pytest.raises(ValueError, match="multiples of 16"):
        latent_size(480, 830)


def test_preview_projection():
    lat = torch.zeros(1, 2, 16, 3, 4)
    rgb = latents_to_rgb(lat)
    assert rgb.shape == (1, 2, 3, 4, 3) and rgb.dtype == torch.uint8
    # zero latents give the bias colour: ((bias + 1) / 2) * 255
    assert rgb[0, 0, 0, 0].tolist() == [104, 116, 85]
    vae = to_vae_latents(lat)
    assert vae.shape == (1, 16, 2, 3, 4) and vae[0, 0, 0, 0, 0].item() == pytest.approx(-0.7571)


def test_sampler_bench_runs_both_variants(capsys):
    import argparse
    from wan_accel.bench import sampler as bench
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--frames", "9", "--height", "32", "--width", "32", "--repeat", "1", "--json",
                              "--device", "cpu"])
    assert bench.run(args) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["variant"] for r in rows] == ["reference", "optimized"]
    assert rows[0]["precision"] == "float32" and rows[1]["attention"] == "auto"
    assert all(r["steady_s"] > 0 and r["speedup_vs_first"] > 0 for r in rows)
    from wan_accel.app.validate import UsageError
    with pytest.raises(UsageError, match="--variants: unknown fastest"):
        bench.run(parser.parse_args(["--variants", "fastest"]))
