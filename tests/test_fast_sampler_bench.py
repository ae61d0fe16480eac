"""FLOP count, the sampler benchmark, and the user paths (generate job, CLI, sampler node, profiling)."""
import argparse
import json

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from wan_accel.bench import sampler as bench
from wan_accel.model import flops
from run_helpers import generate_latents
from wan_accel.model.tiny import TINY_CONFIG, tiny_causal_model


@pytest.mark.parametrize("path,skip", [("reference", False), ("optimized", True)])
def test_flop_formula_matches_torch_flop_counter(path, skip):
    model = tiny_causal_model()
    ctx = torch.zeros(1, 0, TINY_CONFIG.text_dim)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:   # math SDPA: counted bmm
        generate_latents(model, ctx, 9, 8, 8, seed=0, path=path, skip_last_refresh=skip)
    est = flops.run_flops(model.config, flops.Geometry(1, 9, 16), 4, optimized=path == "optimized",
                          skip_last_refresh=skip)
    assert counter.get_total_flops() == est["flops"]
    assert est["forwards"] == 3 * 5 - int(skip)


def test_peak_table_and_mfu():
    assert flops.peak_tflops("cpu")[0] is None and flops.mfu(1e12, 1.0, None) is None
    assert flops.peak_tflops("cpu", 100.0) == (100.0, "given")
    assert flops.mfu(5e13, 1.0, 100.0) == pytest.approx(0.5)
    assert flops.PEAK_TFLOPS[(9, 0)] > flops.PEAK_TFLOPS[(8, 0)]


def _bench(capsys, *argv):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.run(parser.parse_args(list(argv) + ["--json", "--device", "cpu", "--repeat", "1"])) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_tiny_reports_every_metric(capsys, cache_path):
    from wan_accel.profiling import history
    out = _bench(capsys, "--shape", "tiny", "--frames", "21", "--height", "32", "--width", "32")
    assert out["shape"] == "tiny" and out["peak_tflops"] is None and "MFU n/a" in out["peak_source"]
    ref, opt = out["rows"]
    assert (ref["variant"], ref["path"], opt["variant"], opt["path"]) == ("reference", "reference", "optimized",
                                                                          "optimized")
    for r in (ref, opt):
        assert len(r["chunk_ms"]) == 2 and r["steady_s"] > 0 and r["video_fps"] > 0 and r["mfu"] is None
        assert r["speedup_vs_first"] > 0
        # a chunk's latents are ready before its refresh pass ends the chunk (the first chunk always refreshes)
        assert len(r["denoise_ms"]) == 2 and 0 < r["denoise_ms"][0] < r["chunk_ms"][0]
        assert all(0 < d <= c for d, c in zip(r["denoise_ms"], r["chunk_ms"]))
        assert r["first_latents_ms"] == r["denoise_ms"][0]
        # the warm-up video's peak (one-time measuring included) apart from the timed runs'
        assert set(r["first_video_peak_memory"]) == set(r["peak_memory"]) and r["peak_memory"]
    assert opt["forwards"] == ref["forwards"] - 1 and opt["tflop"] < ref["tflop"]
    # The FLOP figure against an independent count: torch's FlopCounterMode on the same run (6 latent frames of
    # 4x4, i.e. 4 tokens a frame; math SDPA so attention is counted as its two bmm). model/flops.py counts exactly
    # the ops FlopCounterMode counts (matmul, conv, attention products; nothing element-wise), so the stated
    # tolerance is zero.
    for row, path in ((ref, "reference"), (opt, "optimized")):
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            generate_latents(tiny_causal_model(), torch.zeros(1, 3, TINY_CONFIG.text_dim), 6, 4, 4, path=path,
                             skip_last_refresh=row["variant"] == "optimized")
        assert row["flops"] == counter.get_total_flops(), path
        assert row["tflop"] == pytest.approx(counter.get_total_flops() / 1e12, abs=1e-6)
    records = history.read(cache_path.parent / history.FILE_NAME, kind="bench")
    assert {r["label"] for r in records} == {"sampler/reference", "sampler/optimized"}


def test_bench_reports_parity_ops_syncs_and_kv_bytes(capsys, monkeypatch):
    from wan_accel.kernels import _common
    # the op counts are the loop's structure, as on any CPU: under TRITON_INTERPRET=1 the fused kernels' torch
    # versions run, not the interpreter (whose own tensor copies would count as dispatches)
    monkeypatch.setattr(_common, "interpreter_usable", lambda: False)
    out = _bench(capsys, "--shape", "tiny", "--frames", "21", "--height", "32", "--width", "32")
    rows = {r["variant"]: r for r in out["rows"]}
    ref, opt = rows["reference"], rows["optimized"]
    assert ref["parity_max_abs"] == 0.0 and ref["parity_mean_abs"] == 0.0         # the reference against itself
    assert 0.0 <= opt["parity_mean_abs"] <= opt["parity_max_abs"] <= 1e-4          # float32 on the CPU
    # the one host read of a video: the finite check when the run ends (model/finite.check_output); none per step
    assert opt["host_syncs"] == 1 and opt["syncs_per_step"] == 0 and opt["host_sync_ops"] == {"tolist": 1}
    assert isinstance(ref["host_syncs"], int) and ref["host_syncs"] >= 0
    assert 0 < opt["ops_per_step"] < ref["ops_per_step"] and opt["ops_per_video"] > opt["ops_per_step"]
    # KV bytes per chunk, by hand: 6 latent frames of 4x4 (patch 2x2: 4 tokens a frame) in 2 chunks of 3 frames;
    # every forward of a chunk writes its 12 rows into each layer's k and v (heads x head_dim float32 values);
    # a chunk has 4 denoising forwards + 1 refresh, except the optimized path's last chunk (refresh skipped)
    c = TINY_CONFIG
    per_forward = 3 * 4 * c.num_layers * 2 * c.num_heads * c.head_dim * 4
    assert ref["kv_bytes_per_chunk"] == [5 * per_forward, 5 * per_forward]
    assert opt["kv_bytes_per_chunk"] == [5 * per_forward, 4 * per_forward]
    for r in (ref, opt):     # the plan agrees with the index_copy_ bytes counted while the run wrote them
        assert r["kv_write_bytes"] == r["kv_bytes_per_video"] == sum(r["kv_bytes_per_chunk"])
    table = bench.run(argparse.Namespace(**dict(vars(_args()), json=False)))
    text = capsys.readouterr().out
    assert table == 0 and "ops_per_step" in text and "host_syncs" in text and "parity_max_abs" in text


def _args():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(["--device", "cpu", "--repeat", "1", "--frames", "9", "--height", "32", "--width", "32"])


def test_bench_matrix_game2_tiny(capsys):
    out = _bench(capsys, "--model-kind", "matrix-game2", "--frames", "21", "--height", "32", "--width", "32",
                 "--variants", "reference,optimized-no-graphs")
    assert out["model_kind"] == "matrix-game2" and [r["variant"] for r in out["rows"]] == [
        "reference", "optimized-no-graphs"]
    assert all(r["steady_s"] > 0 and len(r["chunk_ms"]) == 2 for r in out["rows"])
    opt = out["rows"][1]
    assert opt["host_syncs"] == 1 and opt["ops_per_step"] > 0 and opt["parity_max_abs"] <= 1e-4
    assert opt["kv_write_bytes"] > opt["kv_bytes_per_video"] > 0      # plus the action modules' caches
    assert opt["attention_ran"] == "sdpa"       # what the run reported, not the variant's setting


def test_generate_job_uses_the_chosen_path_and_writes_history(tmp_path, cache_path):
    from wan_accel.profiling import history
    from wan_accel.app.jobs.generate import GenerateOptions, run_generate
    from safetensors.torch import load_file
    reports = {}
    for path in ("reference", "optimized"):
        reports[path] = run_generate(GenerateOptions(out_dir=str(tmp_path / path), frames=9, height=32, width=32,
                                                     device="cpu", sampler=path, preview=False), log=lambda *a: None)
        assert reports[path]["sampler"]["path"] == path
    assert reports["optimized"]["sampler"]["attention"] == "sdpa"
    a, b = (load_file(reports[p]["files"]["latents"])["latents"] for p in ("reference", "optimized"))
    assert (a - b).abs().max().item() <= 1e-5
    records = history.read(cache_path.parent / history.FILE_NAME, kind="generate")
    assert [r["settings"]["path"] for r in records] == ["reference", "optimized"]
    assert all(r["timings"]["total_s"] > 0 for r in records)


def test_generate_cli_flags(tmp_path, capsys):
    from wan_accel.cli import main
    code = main(["generate", "--out", str(tmp_path), "--frames", "9", "--height", "32", "--width", "32",
                 "--device", "cpu", "--sampler", "optimized", "--cuda-graphs", "off", "--no-fused-kernels",
                 "--no-preview", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["sampler"]["path"] == "optimized" and report["sampler"]["fused_kernels"] is False
    assert report["settings"]["cuda_graphs"] == "off"


def test_sampler_node_paths_and_profile_request(tmp_path):
    from wan_accel.nodes.model_nodes import CausalWanModelLoader, CausalWanSampler
    from wan_accel.profiling.session import ProfileRequest, attach_profile_request
    (handle,) = CausalWanModelLoader().load("(built-in tiny model)", "fp32", "float32", "auto")
    node = CausalWanSampler()
    ref, _ = node.sample(handle, 32, 32, 9, 1, "self_forcing", 3, -1, 0, sampler="reference")
    assert node.last_report["path"] == "reference"
    request = ProfileRequest(runs=1, out_dir=tmp_path, history=False)
    opt, _ = node.sample(attach_profile_request(handle, request), 32, 32, 9, 1, "self_forcing", 3, -1, 0,
                       sampler="optimized, no fused kernels")
    assert node.last_report["path"] == "optimized" and node.last_report["fused_kernels"] is False
    assert (ref["samples"] - opt["samples"]).abs().max().item() <= 1e-5
    assert request.latest is not None and request.remaining == 0      # the Wan Profile node sees this run
    assert "reference" in CausalWanSampler.INPUT_TYPES()["optional"]["sampler"][0]
    with pytest.raises(ValueError, match="sampler must be one of"):
        node.sample(handle, 32, 32, 9, 1, "self_forcing", 3, -1, 0, sampler="fastest")
    assert "fa3" in CausalWanModelLoader.INPUT_TYPES()["required"]["attention"][0]


def test_prepare_model_honours_compile_settings_and_reference_uncompiles():
    from wan_accel.compile import CompileSettings, compile_model
    from wan_accel.compile.apply import compile_handle
    from wan_accel.app.jobs.handle import load_model_handle
    from wan_accel.app.prepare import RunSpec, prepare_model
    settings = CompileSettings(backend="eager", warm_start=False)
    handle = load_model_handle(None, "fp32", device="cpu", compile_settings=settings)
    opts = prepare_model(handle.model, RunSpec.for_handle(handle, path="optimized", cuda_graphs="off",
                                                          fused_kernels=False)).options
    assert opts.cuda_graphs == "off" and opts.fused_kernels is False
    assert compile_handle(handle.model).settings == settings.replace(scope="blocks")   # compiled for the path
    prepare_model(handle.model, RunSpec.for_handle(handle, path="reference"))
    assert compile_handle(handle.model) is None              # the reference path runs eager
    with pytest.raises(ValueError, match="sampler must be one of"):
        prepare_model(handle.model, RunSpec.for_handle(handle, path="fastest"))


def test_a_model_switch_frees_the_previous_copy_at_once():
    """On an H200 the int8 row carried the previous copy (17.7 GB peak against 9.1 GB) although exact attention ran:
    the model and its runner reference each other, so dropping the name freed nothing until the cycle collector
    ran. The switch frees it at once."""
    import argparse
    import weakref

    from wan_accel.bench import sampler as bs

    args = argparse.Namespace(checkpoint=None, seed=0, repeat=1, shape="tiny", model_kind="wan")
    models = bs._Models(bs._base_model(args, "wan", "tiny"), torch.device("cpu"))
    bs._time_variant("optimized", args, models, "wan", "fp32", 9, 64, 64, None)
    old = weakref.ref(models.model)
    import gc
    gc.disable()            # as when the cycle collector has not come round yet
    try:
        models.get(torch.float64, "float32", "sdpa")
        assert old() is None
    finally:
        gc.enable()
