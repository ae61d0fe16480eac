"""Hard edges, round five (A): no non-finite or substituted result is reported as a success, every input is parsed
and checked once where it is read (on every device), and every JSON the pack prints or writes is strict JSON."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cli_run import refused, run_cli, run_cli_in
from wan_accel.model.tiny import TINY_CONFIG

FIXTURES = Path(__file__).parent / "fixtures"
KREA = FIXTURES / "krea_realtime"
SMALL = ["--device", "cpu", "--frames", "9", "--height", "32", "--width", "32", "--no-preview"]


def strict_json(text: str):
    """``text`` read as a strict reader (jq, JSON.parse) reads it: the bare words NaN / Infinity are refused."""
    def refuse(word):
        raise AssertionError(f"not JSON: the bare word {word} in the output")
    return json.loads(text, parse_constant=refuse)


# ============================================================================ 4. strict JSON everywhere
def test_the_json_writer_encodes_non_finite_numbers_as_strings():
    from wan_accel.cache.json_out import to_json
    text = to_json({"a": float("nan"), "b": [float("inf"), -float("inf"), 0.5], "c": (1, "NaN"), "d": None})
    assert strict_json(text) == {"a": "NaN", "b": ["Infinity", "-Infinity", 0.5], "c": [1, "NaN"], "d": None}
    assert [float(v) for v in strict_json(text)["b"][:2]] == [float("inf"), -float("inf")]   # read back


def _krea_copy(tmp_path) -> Path:
    (tmp_path / "wan_reference").mkdir(exist_ok=True)
    shutil.copy(FIXTURES / "wan_reference" / "causal_weights.safetensors", tmp_path / "wan_reference")
    folder = tmp_path / "krea_realtime"
    folder.mkdir()
    shutil.copy(KREA / "krea_config.json", folder)
    shutil.copy(KREA / json.loads((KREA / "krea_config.json").read_text())["io_file"], folder)
    return folder


def test_check_reference_json_with_a_nan_row_is_strict_json(tmp_path):
    folder = _krea_copy(tmp_path)
    io = load_file(str(folder / "krea_io.safetensors"))
    io["output"].view(-1)[0] = float("nan")
    save_file({k: v.contiguous() for k, v in io.items()}, str(folder / "krea_io.safetensors"))
    code, out, err = run_cli("check-reference", folder, "--json")
    report = strict_json(out)
    assert code == 1 and report["pass"] is False and report["worst"] == "NaN", err
    assert any(r["max_abs_diff"] == "NaN" and r["ok"] is False for r in report["rows"])


def test_report_json_with_non_finite_figures_is_strict_json(tmp_path):
    history = tmp_path / "history.jsonl"     # written by an older pack, or by hand: NaN and Infinity in it
    history.write_text('{"kind": "bench", "ts": 1.0, "metrics": {"fps": NaN, "peak": Infinity}}\n')
    code, out, err = run_cli("report", "--history", history, "--json")
    assert code == 0, err
    assert strict_json(out)[0]["metrics"] == {"fps": "NaN", "peak": "Infinity"}


def test_json_files_the_pack_writes_are_strict(tmp_path):
    from wan_accel.cache.owned_files import write_json
    path = write_json(tmp_path / "x.json", {"diff": float("nan")})
    assert strict_json(path.read_text()) == {"diff": "NaN"}


def test_no_command_prints_or_writes_json_around_the_writer():
    """Every JSON a command prints (``print(json.dumps(...))``, ``json.dump(..., sys.stdout)``) or writes as a file
    (``write_text(..., json.dumps(...))``) goes through cache/json_out.py. Left alone: a child process's message
    to its parent (a marked line), and checks/selftest.py's file (another change routes it)."""
    import re
    root = Path(__file__).resolve().parent.parent
    printed = re.compile(r"(print|out|write_text|write)\(.*\bjson\.dumps?\(|json\.dump\(.*sys\.std")
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.split("/")[0] in ("tests", "tools", ".venv", "build") or rel == "checks/selftest.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if printed.search(line) and "_MARK +" not in line:
                found.append(f"{rel}:{n}")
    assert found == [], f"JSON printed or written without cache/json_out.py: {found}"


# ============================================================================ 1. no non-finite or substituted result
def _overflowing_tiny_decoder(path):
    """taew2_1's reduced decoder whose finite weights overflow float32 in its first layer: NaN / inf frames."""
    from wan_accel.vae import taehv
    state = {k: v.clone().contiguous() for k, v in taehv.TinyVideoDecoder(taehv.REDUCED).state_dict().items()}
    state["decoder.1.weight"] = torch.full_like(state["decoder.1.weight"], 3e38)
    save_file(state, str(path))
    return path


def test_generate_never_writes_a_video_of_nan_frames(tmp_path):
    vae = _overflowing_tiny_decoder(tmp_path / "huge.safetensors")
    out = tmp_path / "run"
    result = run_cli("generate", "--decode", "tiny", "--vae", vae, "--out", out, *SMALL)
    line = refused(result, "video.", "frame 0", "NaN", "decoder", "No video was written")
    assert "float32" in line
    assert not list(out.glob("video.*")) and not (out / "latents.safetensors").exists(), sorted(out.iterdir())
    assert not [p for p in out.iterdir() if p.name.startswith(".")]          # no temporary left


def test_a_video_file_refuses_non_finite_frames_whoever_writes_it(tmp_path):
    from wan_accel.cache.video_file import NonFiniteFramesError, VideoFile
    video = VideoFile(tmp_path / "v.webp", purpose="the saved play video")
    frames = torch.rand(3, 16, 16, 3)
    video.write(frames)
    frames[1, 2, 3, 0] = float("inf")
    with pytest.raises(NonFiniteFramesError, match=r"the saved play video \(v.webp\): frame 4 .*1 infinite"):
        video.write(frames)
    assert list(tmp_path.iterdir()) == []


def _training_pt(path, edit=None):
    from wan_accel.model.tiny import tiny_causal_model
    sd = {f"model.{k}": v.clone() for k, v in tiny_causal_model().state_dict().items()}
    if edit:
        edit(sd)
    torch.save({"generator": sd}, str(path))
    return path


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_convert_never_writes_a_checkpoint_holding_a_non_finite_weight(tmp_path, value):
    key = "model.blocks.0.ffn.0.weight"
    src = _training_pt(tmp_path / "dmd.pt", lambda sd: sd[key].view(-1).__setitem__(7, value))
    dst = tmp_path / "out.safetensors"
    heads = ("--num-heads", TINY_CONFIG.num_heads)
    line = refused(run_cli("convert", src, dst, *heads), "dmd.pt", key, "nothing was written", "--ema")
    assert ("1 NaN" if value != value else "1 infinite") in line
    assert not dst.exists() and list(tmp_path.iterdir()) == [src]
    code, _, err = run_cli("convert", _training_pt(tmp_path / "ok.pt"), dst, *heads)     # a finite one converts
    assert code == 0 and dst.is_file(), err


@pytest.fixture
def fa3_that_cannot_run(monkeypatch):
    """A FlashAttention 3 module that imports but whose kernel cannot run here."""
    import sys
    import types

    from wan_accel.model import attention as att

    def flash_attn_func(*_a, **_k):
        raise RuntimeError("no kernel image is available for execution on the device")
    mod = types.ModuleType("fa3_fwd_interface")
    mod.flash_attn_func = flash_attn_func

    def forget():
        for d in (att._FUNCS, att._FROM, att._NO_FP16, att._BUILD):
            d.clear()
        att.resolve_backend.cache_clear()
    forget()
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", mod)
    yield
    forget()


def test_bench_fidelity_of_fa3_where_sdpa_runs_instead_is_a_failed_row(fa3_that_cannot_run):
    code, out, err = run_cli("bench", "fidelity", "--attention", "fa3", "--fixture", FIXTURES / "wan_reference",
                             "--json")
    result = strict_json(out)
    assert code == 1, err
    assert [r["status"] for r in result["rows"]] == ["failed", "failed"]
    for r in result["rows"]:
        assert "final" not in r and "steps" not in r                     # no figure of a run that was not fa3
        assert r["why"].startswith("sdpa ran in place of 'fa3'") and "needs a CUDA device" in r["why"], r["why"]
    code, out, _ = run_cli("bench", "fidelity", "--attention", "fa3", "--fixture", FIXTURES / "wan_reference")
    assert code == 1 and out.count("FAILED: sdpa ran in place of 'fa3'") == 2, out


def test_bench_fidelity_rows_of_non_finite_runs_are_failed_rows(monkeypatch):
    from wan_accel.bench import fidelity
    real = fidelity._run

    def poisoned(*a, **k):
        out, steps, instead = real(*a, **k)
        if a[1] != "sdpa":
            out = out.clone()
            out.view(-1)[0] = float("nan")
        return out, steps, instead
    monkeypatch.setattr(fidelity, "_run", poisoned)
    rows = fidelity.measure(FIXTURES / "wan_reference", "int8")
    assert [r["status"] for r in rows] == ["failed", "failed"]
    assert all("final latents" in r["why"] and "final" not in r for r in rows)


# ============================================================================ 3. inputs checked once, where read
CKPT = FIXTURES / "wan_reference" / "causal_weights.safetensors"
BAD_GIB = ["abc", "-1", "0", "nan", "inf"]


@pytest.mark.parametrize("raw", BAD_GIB)
@pytest.mark.parametrize("var", ["WAN_ACCEL_VRAM_CAP_GB", "WAN_ACCEL_MEMORY_LIMIT_GB"])
def test_a_bad_memory_variable_is_refused_on_a_cpu_too(var, raw, monkeypatch, tmp_path):
    from wan_accel.memory import system as msys
    monkeypatch.setenv(var, raw)
    with pytest.raises(ValueError, match=f"^{var} must be a positive number of GiB"):
        msys.detect_system("cpu")
    refused(run_cli_in(tmp_path, "plan", "--model", "1.3b", env={var: raw}), var, repr(raw))
    refused(run_cli_in(tmp_path, "generate", "--out", tmp_path / "run", *SMALL, env={var: raw}), var)
    assert not (tmp_path / "run").exists()


def test_plan_for_a_simulated_card_sees_the_vram_cap(tmp_path):
    code, out, err = run_cli_in(tmp_path, "plan", "--model", "1.3b", "--vram-gb", "24", "--json",
                                env={"WAN_ACCEL_VRAM_CAP_GB": "8"})
    system = strict_json(out)["system"]
    assert code == 0 and system["total_vram"] == 8 * 1024 ** 3 and system["vram_cap"] == 8 * 1024 ** 3, err
    code, out, _ = run_cli_in(tmp_path, "plan", "--model", "1.3b", "--vram-gb", "6", "--json",
                              env={"WAN_ACCEL_VRAM_CAP_GB": "8"})          # a cap above the card: the card
    assert code == 0 and strict_json(out)["system"]["total_vram"] == 6 * 1024 ** 3


def test_a_refused_vram_cap_leaves_nothing_set(monkeypatch):
    from wan_accel.memory import system as msys
    monkeypatch.delenv(msys.VRAM_CAP_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for cap in (8, "abc", -1, float("nan")):
        with pytest.raises(ValueError):
            msys.apply_vram_cap(cap)
        assert msys.VRAM_CAP_ENV not in os.environ, cap


def test_a_cpu_bench_under_a_memory_limit_is_estimated_before_its_model_is_built(tmp_path, monkeypatch):
    from wan_accel.bench import sampler as bs
    monkeypatch.setattr(bs, "_base_model", lambda *a, **k: pytest.fail("the model was built"))
    line = refused(run_cli_in(tmp_path, "bench", "sampler", "--shape", "1.3b", "--device", "cpu", "--variants",
                              "reference", "--repeat", "1", env={"WAN_ACCEL_MEMORY_LIMIT_GB": "2"}),
                   "--frames 81", "WAN_ACCEL_MEMORY_LIMIT_GB 2", "Nothing was allocated")
    assert "weights 5.29 GiB" in line          # the 1.3B model's float32 weights counted
    refused(run_cli_in(tmp_path, "bench", "sampler", "--world-size", "2", "--shape", "1.3b", "--device", "cpu",
                       "--repeat", "1", env={"WAN_ACCEL_MEMORY_LIMIT_GB": "2"}), "WAN_ACCEL_MEMORY_LIMIT_GB 2")


@pytest.mark.parametrize("argv, words", [
    (["--variants", "reference", "--dtype", "bf16"], ["--dtype bf16", "runs in its own float32"]),
    (["--checkpoint", CKPT, "--shape", "tiny"], ["--shape tiny", "--checkpoint"])])
def test_bench_sampler_with_world_size_keeps_the_one_process_rules(argv, words):
    for world in ([], ["--world-size", "2"]):
        refused(run_cli("bench", "sampler", "--device", "cpu", *world, *argv), *words)


@pytest.mark.parametrize("field, value", [
    ("fused_kernels", "false"), ("fused_qkv", 0), ("doctor", None), ("keep_slower", "yes"),
    ("skip_last_refresh", 1), ("frames_per_block", 0), ("batch", 2.0), ("seed", "7"), ("kv_window", -2),
    ("sink", -1), ("path", "fast"), ("cuda_graphs", "on"), ("oom_retry", "sometimes"), ("ops", "turbo"),
    ("linear", "int4"), ("swap", "abc"), ("swap", 3), ("compile", "max"), ("plan", "abc"),
    ("plan", {"blocks_to_swap": "3"})])
def test_a_run_spec_field_of_the_wrong_kind_is_refused_where_the_spec_is_made(field, value):
    from wan_accel.app.prepare import RunSpec
    with pytest.raises(ValueError, match=field):
        RunSpec(**{field: value})
    with pytest.raises(ValueError, match=field):
        RunSpec().replace(**{field: value})


def test_valid_run_specs_still_build():
    from wan_accel.app.prepare import KEEP, RunSpec
    from wan_accel.memory.block_swap import SwapSettings
    for fields in ({}, {"swap": None, "compile": None}, {"swap": SwapSettings(2, 1), "compile": {"mode": "default"}},
                   {"swap": KEEP, "plan": {"blocks_to_swap": 2}}, {"fused_kernels": False, "seed": -3}):
        assert RunSpec(**fields).replace(**fields) == RunSpec(**fields)


@pytest.fixture(scope="module")
def tiny():
    from wan_accel.model.tiny import TINY_CONFIG, tiny_causal_model, tiny_text_embedding
    return tiny_causal_model(), tiny_text_embedding("a cat", 6, TINY_CONFIG.text_dim)[None]


@pytest.mark.parametrize("shape", [(1, 0, 16, 4, 4), (0, 3, 16, 4, 4), (1, 3, 16, 4), (1, 3, 16, 0, 4)])
def test_prepare_refuses_a_run_of_no_latent_frames(tiny, shape):
    from wan_accel.app.prepare import RunSpec, prepare
    from wan_accel.sampling.request import RunInputs
    model, context = tiny
    with pytest.raises(ValueError, match="every size at least 1"):
        prepare(model, RunSpec(path="reference"), RunInputs(context=context, noise=shape))
    with pytest.raises(ValueError, match="every size at least 1"):
        prepare(model, RunSpec(path="reference"), RunInputs(context=context, noise=torch.zeros(shape)))


def test_nan_noise_is_refused_before_sampling_naming_the_noise(tiny, monkeypatch):
    from wan_accel.app import prepare as P
    from wan_accel.model.finite import NonFiniteError
    model, context = tiny
    noise = torch.randn(1, 3, 16, 4, 4)
    noise[0, 1, 2, 3, 0] = float("nan")
    from wan_accel.sampling.request import RunInputs
    from wan_accel.app import run
    monkeypatch.setattr(run, "build_request", lambda *a, **k: pytest.fail("sampling was prepared"))
    with pytest.raises(NonFiniteError, match=r"^the initial noise holds non-finite values \(1 NaN of 768\)"):
        P.prepare(model, P.RunSpec(path="reference"), RunInputs(context=context, noise=noise))


# ============================================================================ 8. tolerances from the dtype compared
def test_a_float16_copy_one_rounding_apart_is_within_the_dtype_tolerance():
    """Two correct float32 results a few float32 steps apart that straddle a float16 rounding boundary (what
    another CPU's vector width gives) round to neighbouring float16 numbers: a step apart, which a fixed 1e-4 does
    not allow at these magnitudes and ``step(float16, magnitude)`` does."""
    from tolerances import step, within
    lo = torch.tensor([0.1, 0.7, 3.5, 4.0], dtype=torch.float16)
    mid = (lo.double() + torch.nextafter(lo, torch.tensor(8.0, dtype=torch.float16)).double()) / 2   # the boundary
    ours, theirs = (mid * (1 + 2 ** -20)).float(), (mid * (1 - 2 ** -20)).float()
    want = theirs.half().float()
    assert bool((ours.half() != theirs.half()).all())                # every value rounds the other way
    assert not within(ours.half(), want, 1e-4)                       # the fixed tolerance: a CPU-bound test
    assert within(ours.half(), want, 1e-6 + step(torch.float16, want))
    assert step(torch.bfloat16, 4.0) == 4.0 * 2 ** -7 and step(torch.float32, 0.0) == torch.finfo(torch.float32).eps \
        * torch.finfo(torch.float32).tiny
