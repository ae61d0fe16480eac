"""Issue 43, class 4 (more of it): every command checks its outputs and its option combinations before any work.

An output folder or file whose folder cannot be written is refused up front by the pack's one output checks
(cache/owned_files.check_target, app/validate.check_output_dir); an option another option makes ignored is
refused with one line naming it, before anything is built, run or written."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from cli_run import refused, run_cli, run_cli_in

FIX = Path(__file__).resolve().parent / "fixtures"
CKPT = FIX / "wan_reference" / "causal_weights.safetensors"


# ============================================================================ (a) outputs checked up front
def test_bench_native_workdir_that_is_a_file_is_refused_before_anything(tmp_path):
    target = tmp_path / "taken"
    target.write_text("mine")
    result = run_cli("bench", "native", "--device", "cpu", "--workdir", target)
    refused(result, "--workdir", str(target))
    assert "skipped" not in result[1] and target.read_text() == "mine"


def _unwritable(monkeypatch, folder: Path) -> None:
    """os.access answers 'no' for ``folder`` (the tests run as root, where every folder is writable)."""
    real = os.access

    def access(path, mode, *a, **kw):
        if os.path.abspath(str(path)) == str(folder) and mode & os.W_OK:
            return False
        return real(path, mode, *a, **kw)
    monkeypatch.setattr(os, "access", access)


@pytest.mark.parametrize("command, option, inside", [("doctor", "--report", "report.json"),   # a file in it
                                                     ("profile", "--out", "traces")])            # a folder in it
def test_an_output_in_a_folder_that_cannot_be_written_is_refused_before_any_work(tmp_path, monkeypatch, command,
                                                                                 option, inside):
    locked = tmp_path / "locked"
    locked.mkdir()
    _unwritable(monkeypatch, locked)
    result = run_cli_in(tmp_path, command, "--device", "cpu", option, locked / inside)
    refused(result, option, str(locked), "not writable")
    assert f"{command}:" not in result[2] and list(locked.iterdir()) == []


# ============================================================================ (b) no option silently dropped
@pytest.mark.parametrize("argv, words", [
    (["bench", "native", "--device", "cpu", "--lora-rank", "4"], ["--lora-rank", "+lora", "--weights"]),
    (["bench", "native", "--device", "cpu", "--weights", "bf16,fp8_scaled", "--lora-strength", "0.5"],
     ["--lora-strength", "+lora"]),
    (["report", "--json", "--plain"], ["--plain", "--json"]),
    (["profile", "--device", "cpu", "--explain-scope", "model"], ["--explain-scope", "--explain"]),
    (["profile", "--device", "cpu", "--explain-only", "--explain-target", "x:y", "--explain-scope", "model"],
     ["--explain-scope", "--explain-target"]),
    (["profile", "--device", "cpu", "--explain-only", "--compile", "eager"], ["--compile", "--explain-only"]),
    (["profile", "--device", "cpu", "--explain-only", "--runs", "3"], ["--runs", "--explain-only"]),
    (["bench", "play", "--device", "cpu", "--dtype", "fp16"], ["--dtype fp16", "cpu"]),
    (["bench", "sampler", "--device", "cpu", "--checkpoint", CKPT, "--shape", "1.3b"], ["--shape 1.3b",
                                                                                        "--checkpoint"]),
    (["bench", "sampler", "--device", "cpu", "--shape", "14b", "--no-parity"], ["--no-parity", "14B"]),
    (["bench", "sampler", "--device", "cpu", "--memory-cap-gb", "8", "--no-parity"], ["--no-parity",
                                                                                      "--memory-cap-gb"]),
    (["bench", "sampler", "--device", "cpu", "--variants", "reference", "--dtype", "bf16"], ["--dtype bf16",
                                                                                             "--variants"]),
    (["doctor", "--device", "cpu", "--with-compile", "--feature", "fused_qkv"], ["--with-compile",
                                                                                "--feature compile"]),
    (["generate", "--device", "cpu", "--keep-slower"], ["--keep-slower", "--attention int8"]),
    (["plan", "--model", "1.3b", "--mode", "full", "--kv-window", "6"], ["--kv-window 6", "--mode full"]),
    (["plan", "--model", "1.3b", "--capability", "9.0"], ["--capability 9.0", "--vram-gb"]),
    (["bench", "sampler", "--device", "cpu", "--world-size", "2", "--attention", "fp8"], ["--attention",
                                                                                        "--world-size"]),
    (["bench", "sampler", "--device", "cpu", "--world-size", "2", "--weights", "fp8"], ["--weights", "--world-size"]),
    (["bench", "sampler", "--device", "cpu", "--world-size", "2", "--no-parity"], ["--no-parity", "--world-size"]),
    (["bench", "sampler", "--device", "cpu", "--world-size", "2", "--variants", "reference,optimized"],
     ["second variant", "--world-size"]),
    (["bench", "sampler", "--device", "cpu", "--world-size", "2", "--shape", "krea"], ["--shape krea", "tiny or 1.3b"]),
])
def test_an_option_another_one_makes_ignored_is_refused_before_any_work(argv, words, tmp_path):
    result = run_cli_in(tmp_path, *argv)
    refused(result, *words)
    assert "skipped" not in result[1]                       # bench native answered before its ComfyUI check
    assert not [ln for ln in result[2].splitlines() if not ln.startswith("error:")]   # no progress: nothing ran
    assert not (tmp_path / "wan_accel_profiles").exists()  # no trace folder made


def test_doctor_with_compile_on_a_cuda_device_is_refused_before_any_probe(tmp_path, monkeypatch):
    """A CUDA device always probes torch.compile: --with-compile would change nothing there."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    result = run_cli_in(tmp_path, "doctor", "--device", "cuda", "--with-compile")
    refused(result, "--with-compile", "cuda", "--device cpu")
    assert not (tmp_path / "cache").exists()                 # no verdict recorded: nothing probed
