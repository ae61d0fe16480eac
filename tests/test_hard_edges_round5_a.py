"""Hard edges, round five (A): no non-finite or substituted result is reported as a success, every input is parsed
and checked once where it is read (on every device), and every JSON the pack prints or writes is strict JSON."""
from __future__ import annotations

import json
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
    from wan_accel.cache.video_file import NonFiniteFramesError, open_video_file
    video = open_video_file(tmp_path / "v.webp", purpose="the saved play video")
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
        if a[3] != "sdpa":
            out = out.clone()
            out.view(-1)[0] = float("nan")
        return out, steps, instead
    monkeypatch.setattr(fidelity, "_run", poisoned)
    rows = fidelity.measure(FIXTURES / "wan_reference", "int8")
    assert [r["status"] for r in rows] == ["failed", "failed"]
    assert all("final latents" in r["why"] and "final" not in r for r in rows)
