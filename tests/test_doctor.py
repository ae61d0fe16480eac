"""The doctor: fault injection (wrong numbers, raising, slower), verdicts in the limit cache, the engine gated by
them, probes counted across processes and fingerprints, and damaged or unwritable caches."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from wan_accel.app.doctor import core as doc
from wan_accel.app.doctor.core import Doctor, Feature, NotAvailable, Probe, default_context
from wan_accel.app.doctor.report import doctor_rows, doctor_text
from wan_accel.cache import LimitCache

FP = {"device": "cuda", "gpu": "GPU A", "capability": "9.0", "total_memory": 80, "driver": "550.1",
      "cuda": "12.4", "torch": "2.13.0", "triton": "3.9.0"}
CTX = default_context("cpu", torch.float32, head_dim=16)


def _x():
    return torch.linspace(-2, 2, 64).reshape(4, 16)


def _fakes(calls: dict) -> dict:
    """Features: one right, one with wrong numbers, one that raises, one that is slower (by the fake timer)."""
    def probe(feature):
        def check(ctx):
            calls[feature.__name__] = calls.get(feature.__name__, 0) + 1
            return Probe(feature, lambda: _x() * 2, torch.float32, judge_speed=True)
        return check

    def good():
        return _x() * 2

    def wrong():
        return _x() * 2 + 0.01

    def raises():
        raise RuntimeError("PTXAS error: unsupported instruction on this GPU")

    def slow():
        return _x() * 2
    names = {"good": good, "wrong": wrong, "raises": raises, "slow": slow}
    out = {f"fake.{n}": Feature(f"fake.{n}", n, probe(fn), switches_off=n) for n, fn in names.items()}
    out["fake.absent"] = Feature("fake.absent", "absent", lambda ctx: (_ for _ in ()).throw(
        NotAvailable("needs hardware this machine lacks", "install the thing")))
    return out


def _timer(fn, device):
    return 0.5 if fn.__name__ == "slow" else 0.01


def test_fault_injection_detected_recorded_reported(cache_path):
    calls: dict = {}
    cache = LimitCache(cache_path, fingerprint=FP)
    d = Doctor(cache=cache, context=CTX, timer=_timer, features=_fakes(calls))
    rows = {r["feature"]: r for r in doctor_rows(d)}
    assert rows["fake.good"]["status"] == "passed" and rows["fake.good"]["why_off"] == ""
    assert rows["fake.wrong"]["status"] == "failed" and "wrong numbers" in rows["fake.wrong"]["why_off"]
    tol = doc.tolerance(torch.float32, 4.0)        # derived from fp32's resolution at the output's magnitude
    assert rows["fake.wrong"]["verdict"]["tolerance"] == pytest.approx(tol) and tol < 0.01
    assert rows["fake.raises"]["status"] == "failed" and "PTXAS" in rows["fake.raises"]["why_off"]
    assert rows["fake.slow"]["status"] == "slower"
    assert "500.000 ms against 10.000 ms" in rows["fake.slow"]["why_off"]
    assert rows["fake.absent"]["available"] is False and rows["fake.absent"]["fix"] == "install the thing"
    assert rows["fake.absent"]["why_off"] == "needs hardware this machine lacks"
    # recorded in the limit cache's own namespace, with the reason
    stored = {r["key"].split(":")[0]: r["value"] for r in cache.entries("doctor")}
    assert stored["fake.wrong"]["status"] == "failed" and stored["fake.slow"]["fallback_ms"] == 10.0
    assert "fake.absent" not in stored
    # switched off: the doctor says so, everything else stays on
    assert {n for n in calls if d.why_off(f"fake.{n}")} == {"wrong", "raises", "slow"}
    text = doctor_text(d, list(rows.values()))
    assert "switched off on this machine: fake.wrong, fake.raises, fake.slow" in text


def test_verdicts_are_reused_and_a_new_fingerprint_or_library_probes_again(cache_path, monkeypatch):
    calls: dict = {}
    feats = _fakes(calls)
    first = Doctor(cache=LimitCache(cache_path, fingerprint=FP), context=CTX, timer=_timer, features=feats)
    assert first.check("fake.wrong")["status"] == "failed" and first.probes == 1
    again = Doctor(cache=LimitCache(cache_path, fingerprint=FP), context=CTX, timer=_timer, features=feats)
    assert again.check("fake.wrong")["status"] == "failed" and again.probes == 0
    for change in ({"driver": "560.0"}, {"torch": "2.14.0"}, {"triton": "3.10.0"}, {"gpu": "GPU B"}):
        other = Doctor(cache=LimitCache(cache_path, fingerprint=dict(FP, **change)), context=CTX, timer=_timer,
                       features=feats)
        other.check("fake.wrong")
        assert other.probes == 1, change
    monkeypatch.setattr(doc, "library_version", lambda feature: "fake-lib 9.9")   # the feature's own library
    newlib = Doctor(cache=LimitCache(cache_path, fingerprint=FP), context=CTX, timer=_timer, features=feats)
    newlib.check("fake.wrong")
    assert newlib.probes == 1
    assert again.check("fake.wrong", recheck=True) and again.probes == 1


def test_damaged_or_unwritable_cache_never_stops_a_check(tmp_path, cache_path, caplog):
    calls: dict = {}
    feats = _fakes(calls)
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    cache_path.write_text("{ not json")
    with pytest.warns(RuntimeWarning, match="damaged"):
        d = Doctor(cache=LimitCache(cache_path, fingerprint=FP), context=CTX, timer=_timer, features=feats)
        assert d.check("fake.good")["status"] == "passed"
    d2 = Doctor(cache=LimitCache(cache_path, fingerprint=FP), context=CTX, timer=_timer, features=feats)
    assert d2.check("fake.good")["status"] == "passed" and d2.probes == 0          # rewritten cleanly

    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    bad = blocker / "limits.json"                         # its folder is a file: nothing can be written
    with caplog.at_level(logging.WARNING, logger="wan_accel"), pytest.warns(RuntimeWarning, match="cannot be written"):
        d3 = Doctor(cache=LimitCache(bad, fingerprint=FP), context=CTX, timer=_timer, features=feats)
        assert d3.check("fake.slow")["status"] == "slower" and d3.probes == 1
    assert "runs again next time" in caplog.text
    d4 = Doctor(cache=LimitCache(bad, fingerprint=FP), context=CTX, timer=_timer, features=feats)
    assert d4.check("fake.slow")["status"] == "slower" and d4.probes == 0            # kept for this process
    doc._UNSAVED.clear()                                                             # as in a new process
    d5 = Doctor(cache=LimitCache(bad, fingerprint=FP), context=CTX, timer=_timer, features=feats)
    assert d5.check("fake.slow")["status"] == "slower" and d5.probes == 1


def test_no_probe_inside_a_compile_or_capture(cache_path, monkeypatch):
    d = Doctor(cache=LimitCache(cache_path, fingerprint=FP), context=CTX, timer=_timer, features=_fakes({}))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert d.check("fake.wrong") is None and d.why_off("fake.wrong") is None and d.probes == 0
    monkeypatch.undo()
    assert d.why_off("fake.wrong") and d.probes == 1


# ------------------------------------------------------------------------------------------- the engine gated
def _sabotage_fused_qkv(monkeypatch, mode: str):
    """Make the real fused q/k/v give wrong numbers, or raise, wherever it is used."""
    from wan_accel.model import fused_qkv as fq
    from wan_accel.sampling import runner
    real = fq.ensure_fused_qkv

    def broken(sa):
        if mode == "raise":
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED in the fused GEMM")
        ok = real(sa)
        sa._buffers[fq.QKV_WEIGHT] = sa._buffers[fq.QKV_WEIGHT] * 1.05      # no longer the q/k/v weights
        return ok
    monkeypatch.setattr(fq, "ensure_fused_qkv", broken)
    monkeypatch.setattr(runner, "ensure_fused_qkv", broken)


def _run(model, options):
    from run_helpers import generate_latents
    ctx = torch.randn(1, model.config.text_len, model.config.text_dim, generator=torch.Generator().manual_seed(3))
    return generate_latents(model, ctx, 3, 8, 8, seed=1, path="optimized", fast_options=options)


@pytest.mark.parametrize("mode", ["wrong", "raise"])
def test_broken_fused_qkv_is_switched_off_and_the_run_equals_the_fallback(monkeypatch, mode, caplog):
    from wan_accel.app.jobs.handle import load_model_handle
    from wan_accel.app.prepare import RunSpec, prepare_model
    from wan_accel.sampling.runner import FastOptions
    handle = load_model_handle(None, "fp32", device="cpu")
    fallback = _run(handle.model, FastOptions(cuda_graphs="off", fused_kernels=False, fused_qkv=False))
    _sabotage_fused_qkv(monkeypatch, mode)
    if mode == "wrong":       # the sabotage matters: unchecked, the run's numbers change
        unchecked = load_model_handle(None, "fp32", device="cpu")
        assert not torch.equal(_run(unchecked.model, FastOptions(cuda_graphs="off", fused_kernels=False)), fallback)
    notes: list = []
    with caplog.at_level(logging.WARNING, logger="wan_accel"):
        options = prepare_model(handle.model, RunSpec.for_handle(handle, path="optimized", cuda_graphs="off",
                                                                 fused_kernels=False), notes=notes).options
    assert options.switched_off == {"fused_qkv"}
    assert len(notes) == 1 and "fused_qkv is switched off on this machine" in notes[0]
    assert ("wrong numbers" if mode == "wrong" else "CUBLAS_STATUS_NOT_SUPPORTED") in notes[0]
    assert "fused_qkv is switched off" in caplog.text
    report: dict = {}
    out = _run(handle.model, options)
    assert torch.equal(out, fallback)
    value = LimitCache().get("doctor", "fused_qkv:float32:16")
    assert value["status"] == "failed"
    again_handle = load_model_handle(None, "fp32", device="cpu")
    again = prepare_model(again_handle.model, RunSpec.for_handle(again_handle, path="optimized", cuda_graphs="off",
                                                                 fused_kernels=False)).options
    assert again.switched_off == {"fused_qkv"}
    del report


def test_slower_fused_qkv_is_switched_off_by_the_pluggable_timer():
    from wan_accel.app.doctor.gate import gate_options
    from wan_accel.app.jobs.handle import load_model_handle
    from wan_accel.sampling.runner import FastOptions
    model = load_model_handle(None, "fp32", device="cpu").model
    times = iter([0.004, 0.001])          # feature, then fallback
    d = doc.doctor_for("cpu", torch.float32, model.config.head_dim, timer=lambda fn, dev: next(times))
    d.judge_speed = True
    options, lines = gate_options(model, FastOptions(cuda_graphs="off", fused_kernels=False), doctor=d)
    assert options.switched_off == {"fused_qkv"} and "4.000 ms against 1.000 ms" in lines[0]
    assert torch.equal(_run(model, options), _run(model, FastOptions(cuda_graphs="off", fused_kernels=False,
                                                                    fused_qkv=False)))


def test_runner_skips_switched_off_attention_and_kernels(monkeypatch):
    from wan_accel.model.blocks import KERNEL_NAMES, uses_kernel
    from wan_accel.sampling import runner
    from wan_accel.model.attention import explain_backend
    from wan_accel.sampling.runner import FastOptions, kernels_part
    assert explain_backend("sdpa", "cpu", torch.float32, 16, off=frozenset({"attention.fa3"}))[0] == "sdpa"
    opts = FastOptions(switched_off={"kernel.rmsnorm_rope"})
    assert isinstance(opts.switched_off, frozenset)
    kept = tuple(k for k in KERNEL_NAMES if k != "rmsnorm_rope")
    # the kernels run on a CPU only under TRITON_INTERPRET=1 (documented): this process may have either
    assert kernels_part(opts, "cpu") == (kept if runner.kernels_run_on("cpu") else False)
    with monkeypatch.context() as m:                   # both cases, whatever the environment
        m.setattr(runner, "kernels_run_on", lambda device: False)
        assert kernels_part(opts, "cpu") is False
        m.setattr(runner, "kernels_run_on", lambda device: True)
        assert kernels_part(opts, "cpu") == kept
        assert kernels_part(FastOptions(), "cpu") is True
        assert kernels_part(FastOptions(fused_kernels=False), "cpu") is False
        assert kernels_part(FastOptions(switched_off={f"kernel.{k}" for k in KERNEL_NAMES}), "cpu") is False
    assert uses_kernel(kept, "gated_residual") and not uses_kernel(kept, "rmsnorm_rope")
    assert uses_kernel(True, "rmsnorm_rope") and not uses_kernel(False, "rmsnorm_rope")
    # the cross-attention's query norm kernel answers to its own verdict (kernel.rms_norm), in every ops mode
    from wan_accel.model.blocks import BlockParts, pack_kernel_runs

    def fused_q_norm(parts):
        return pack_kernel_runs(parts, "rms_norm")

    without = tuple(k for k in KERNEL_NAMES if k != "rms_norm")
    assert fused_q_norm(BlockParts(fused_kernels=True)) and not fused_q_norm(BlockParts(fused_kernels=without))
    assert fused_q_norm(BlockParts(fused_kernels=True, ops=("auto",)))
    assert not fused_q_norm(BlockParts(fused_kernels=without, ops=("auto",)))
    assert not fused_q_norm(BlockParts(fused_kernels=True, ops=("torch",)))
    assert fused_q_norm(BlockParts(fused_kernels=kept))            # RMSNorm+RoPE off: this one is judged alone


# ------------------------------------------------------------------------------------------- processes, command
CHILD = """
import json, torch
from wan_accel.app.doctor.core import doctor_for
d = doctor_for('cpu', torch.float32, 16)
v = d.check('fused_qkv')
print('DOCTOR', json.dumps({'probes': d.probes, 'status': v['status']}))
"""


def _child_env(cache_file: Path) -> dict:
    import wan_accel
    env = dict(os.environ, WAN_ACCEL_CACHE=str(cache_file))
    parent = str(Path(wan_accel.__path__[0]).parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (parent, env.get("PYTHONPATH", "")) if p)
    return env


def test_a_second_process_does_not_probe_again(tmp_path):
    env = _child_env(tmp_path / "c" / "limits.json")
    seen = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        line = next(x for x in proc.stdout.splitlines() if x.startswith("DOCTOR "))
        seen.append(json.loads(line[7:]))
    assert seen == [{"probes": 1, "status": "passed"}, {"probes": 0, "status": "passed"}]


def test_doctor_command_table_json_and_report(tmp_path, capsys):
    from wan_accel.cli import main
    assert main(["doctor", "--device", "cpu", "--head-dim", "16", "--feature", "fused_qkv",
                 "--feature", "cuda_graphs", "--feature", "native_model", "--feature", "compile"]) == 0
    out = capsys.readouterr().out
    assert "fused_qkv" in out and "passed" in out and "CUDA graphs need a CUDA GPU" in out
    assert "needs ComfyUI" in out and "--with-compile" in out
    report = tmp_path / "report.json"
    assert main(["doctor", "--device", "cpu", "--head-dim", "16", "--json", "--report", str(report)]) == 0
    data = json.loads(capsys.readouterr().out)
    names = [f["feature"] for f in data["features"]]
    assert names == list(doc.FEATURES) and len(names) >= 11
    for f in data["features"]:
        assert f["available"] or f["why_off"], f          # every unavailable feature says why
    saved = json.loads(report.read_text())
    assert saved["fingerprint"]["device"] == "cpu" and saved["versions"]["torch"] == torch.__version__
    text = report.read_text()
    assert str(Path.home()) not in text and str(tmp_path) not in text     # nothing personal
    assert main(["doctor", "--feature", "nope"]) == 2


def test_matrix_game2_runs_with_the_verdicts(monkeypatch):
    """The Matrix-Game-2 loop takes no FastOptions: the one prepare step (its run's spec, or the setup a face made
    with prepare_model) routes the verdicts to it."""
    from wan_accel.app.jobs.mg2 import generate_mg2
    from wan_accel.app.prepare import RunSpec, Setup, prepare_model
    from wan_accel.model.mg2_model import tiny_mg2_model
    from wan_accel.sampling.runner import FastOptions
    model = tiny_mg2_model()
    cfg, a = model.config, model.action_config
    g = torch.Generator().manual_seed(0)
    image, visual = torch.randn(1, 16, 1, 4, 4, generator=g), torch.randn(1, cfg.clip_tokens, cfg.clip_dim, generator=g)
    mouse = 0.1 * torch.randn(1, 9, a.mouse_dim_in, generator=g) if a.enable_mouse else None
    keyboard = (torch.rand(1, 9, a.keyboard_dim_in, generator=g) > 0.5).float() if a.enable_keyboard else None
    optimized = RunSpec(path="optimized")

    def run(setup=None):
        return generate_mg2(model, image, visual, (mouse, keyboard), num_frames=3, steps=[1000, 500], spec=optimized,
                            setup=setup)
    fallback = run(Setup("optimized", FastOptions(fused_qkv=False), [], {}))
    _sabotage_fused_qkv(monkeypatch, "wrong")
    assert not torch.equal(run(Setup("optimized", FastOptions(), [], {})), fallback)   # unchecked, the sabotage shows
    setup = prepare_model(model, RunSpec())             # CPU: 'auto' stays the reference, nothing judged
    assert setup.options is None and not setup.switched_off
    notes: list = []
    setup = prepare_model(model, optimized, notes=notes)    # the optimized path (CUDA's)
    assert torch.equal(run(setup), fallback) and "fused_qkv" in setup.switched_off
    assert len(notes) == 1 and "fused_qkv" in notes[0]
    assert torch.equal(run(), fallback)                 # prepared by the run itself: the same verdicts


def test_failed_compile_and_block_swap_are_switched_off_alone(cache_path):
    """gate_compile drops the compile, gate_swap keeps the swap without its prefetch stream; a passing verdict
    changes nothing."""
    from wan_accel.app.doctor.gate import gate_compile, gate_swap
    from wan_accel.compile import CompileSettings
    from wan_accel.memory.block_swap import SwapSettings
    from wan_accel.model.tiny import tiny_causal_model
    fakes = _fakes({})
    bad = {"compile": Feature("compile", "c", fakes["fake.raises"].check),
           "block_swap": Feature("block_swap", "s", fakes["fake.wrong"].check)}
    good = {"compile": Feature("compile", "c", fakes["fake.good"].check),
            "block_swap": Feature("block_swap", "s", fakes["fake.good"].check)}
    model = tiny_causal_model()
    settings, swap = CompileSettings(backend="eager"), SwapSettings(blocks_to_swap=1, prefetch=2)
    for feats, off in ((good, False), (bad, True)):
        d = Doctor(cache=LimitCache(cache_path, fingerprint=dict(FP, gpu=str(off))), context=CTX, timer=_timer,
                   features=feats)
        lines: list = []
        assert (gate_compile(model, settings, doctor=d, lines=lines) is None) is off
        kept = gate_swap(model, swap, doctor=d, lines=lines)
        assert kept.blocks_to_swap == 1 and kept.prefetch == (0 if off else 2)
        assert len(lines) == (2 if off else 0)
    assert "compile is switched off" in lines[0] and "PTXAS" in lines[0] and "prefetch stream" in lines[1]
