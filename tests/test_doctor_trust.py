"""The doctor trusts nothing stale and says exactly what ran: verdicts keyed by the pack's version and the code they
judged (a kernel changed by an update is probed again without --recheck; a fixed one is turned back on), damaged
verdicts ignored and probed again, the native MODEL path's probe registered wherever a doctor is made ("needs ComfyUI"
without it), report.json naming what ran and what was switched off, and the graph-safe compile settings applied."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from wan_accel.app.doctor import core as doc
from wan_accel.app.doctor import vocabulary as vocab
from wan_accel.app.doctor.core import Doctor, Feature, Probe, default_context
from wan_accel.app.doctor.report import doctor_rows, doctor_text, report
from wan_accel.cache import LimitCache

FP = {"device": "cuda", "gpu": "GPU A", "capability": "9.0", "total_memory": 80, "driver": "550.1",
      "cuda": "12.4", "torch": "2.13.0", "triton": "3.9.0"}
CTX = default_context("cpu", torch.float32, head_dim=16)


def _x():
    return torch.linspace(-2, 2, 64).reshape(4, 16)


# ------------------------------------------------------------------------------------- verdicts follow the code
def good_kernel(x):
    return x * 2


def planted_kernel(x):
    return x * 2 * 1.0001                      # wrong by far more than fp32's tolerance


def _kernel_feature(code: dict) -> dict:
    """A kernel feature whose code is ``code['fn']``: an update of the pack swaps it."""
    def check(ctx):
        fn = code["fn"]
        return Probe(lambda: fn(_x()), lambda: _x() * 2, torch.float32, judge_speed=False)
    return {"kernel.fake": Feature("kernel.fake", "a kernel", check, switches_off="this kernel",
                                   sources=lambda: (code["fn"],))}


def _doctor(cache_path, feats) -> Doctor:
    return Doctor(cache=LimitCache(cache_path, fingerprint=FP), context=CTX, features=feats)


def test_a_kernel_changed_by_an_update_is_probed_again_without_recheck(cache_path, monkeypatch):
    code = {"fn": good_kernel}
    feats = _kernel_feature(code)
    first = _doctor(cache_path, feats)
    assert first.why_off("kernel.fake") is None and first.probes == 1
    assert _doctor(cache_path, feats).check("kernel.fake")["probe"] == doc.PROBE_VERSION
    # the update: a new version of the pack whose kernel has a planted factor; no --recheck
    monkeypatch.setattr(doc, "pack_version", lambda: "9.9.9")
    code["fn"] = planted_kernel
    updated = _doctor(cache_path, feats)
    why = updated.why_off("kernel.fake")
    assert updated.probes == 1 and why and "wrong numbers" in why
    assert _doctor(cache_path, feats).why_off("kernel.fake") == why          # remembered, not probed again
    # the same version with other code (a local edit) is probed again too
    code["fn"] = good_kernel
    fixed = _doctor(cache_path, feats)
    assert fixed.why_off("kernel.fake") is None and fixed.probes == 1         # a fixed kernel is turned back on
    stored = LimitCache(cache_path, fingerprint=FP).get("doctor", fixed.key("kernel.fake"))
    assert stored["pack"] == "9.9.9" and stored["source"] == doc.feature_source(feats["kernel.fake"])


def test_a_new_pack_version_alone_probes_again(cache_path, monkeypatch):
    feats = _kernel_feature({"fn": good_kernel})
    _doctor(cache_path, feats).check("kernel.fake")
    same = _doctor(cache_path, feats)
    same.check("kernel.fake")
    assert same.probes == 0
    monkeypatch.setattr(doc, "pack_version", lambda: "0.0.0-other")
    other = _doctor(cache_path, feats)
    other.check("kernel.fake")
    assert other.probes == 1


def test_the_real_kernel_verdicts_follow_the_kernel_source(monkeypatch):
    """The gated-residual verdict's identity holds its Triton source hash (the operator store's) and its launcher."""
    from wan_accel.kernels import residual
    feature = doc.FEATURES["kernel.gated_residual"]
    before = doc.feature_source(feature)
    other = doc.FEATURES["kernel.layernorm_modulate"]
    other_before = doc.feature_source(other)
    monkeypatch.setattr(residual, "_KERNEL_NAME", residual.NAME + "@0badc0de")   # a new kernel source
    assert doc.feature_source(feature) != before
    assert doc.feature_source(other) == other_before                           # the other kernels keep theirs
    monkeypatch.undo()
    assert doc.feature_source(feature) == before
    real = residual._launcher

    def launcher(*args):                                  # the launcher with a planted factor
        launch, key, out = real(*args)
        return launch, key, out * 1.0001
    monkeypatch.setattr(residual, "_launcher", launcher)
    assert doc.feature_source(feature) != before
    identity = doc.verdict_identity(feature)
    assert identity["pack"] == doc.pack_version() and identity["pack"] != "unknown"


def test_pack_version_is_the_projects():
    import tomllib
    from pathlib import Path

    import wan_accel
    project = tomllib.loads((Path(wan_accel.__file__).parent / "pyproject.toml").read_text())["project"]
    assert doc.pack_version() == project["version"]


# ------------------------------------------------------------------------------------- damaged verdicts
def _good_feature(calls: list) -> dict:
    def check(ctx):
        calls.append(1)
        return Probe(lambda: _x() * 2, lambda: _x() * 2, torch.float32, judge_speed=False)
    return {"fake.good": Feature("fake.good", "good", check, switches_off="it")}


DAMAGED = [
    {"difference": "0.001"}, {"tolerance": [1e-6]}, {"feature_ms": "fast"}, {"fallback_ms": {"ms": 1}},
    {"difference": True}, {"status": "PASSED"}, {"probe": "1"}, {"error": 5}, {"speed_judged": "yes"},
    {"note": ["x"]}, {"status": "failed", "error": None}, {"checked": "yesterday"},
]


class _RawCache:
    """A cache that hands back whatever was stored, unchecked (as a damaged file read by an older store would)."""

    def __init__(self):
        self.data, self.fingerprint, self.fingerprint_id, self.path, self.writable_problem = {}, dict(FP), "x", "", None

    def get(self, namespace, key):
        return self.data.get((namespace, key))

    def put(self, namespace, key, value):
        self.data[(namespace, key)] = value


def _hand_edit(cache_path, prefix: str, value: dict) -> None:
    """Replace the stored value of the doctor's keys starting with ``prefix`` in the file, as an editor would."""
    data = json.loads(cache_path.read_text())
    for entries in data["namespaces"]["doctor"].values():
        for key, entry in entries.items():
            if key.startswith(prefix):
                entry["value"] = value
    cache_path.write_text(json.dumps(data))


@pytest.mark.parametrize("damage", DAMAGED, ids=[next(iter(d)) + "=" + repr(next(iter(d.values()))) for d in DAMAGED])
def test_damaged_verdicts_never_stop_the_doctor_and_are_probed_again(cache_path, damage, caplog):
    from wan_accel.server_routes import doctor_payload
    calls: list = []
    feats = _good_feature(calls)
    healthy = _doctor(cache_path, feats).check("fake.good")
    raw = _RawCache()
    raw.put("doctor", "fake.good:float32:16", dict(healthy, **damage))
    _hand_edit(cache_path, "fake.good:", dict(healthy, **damage))
    for cache in (LimitCache(cache_path, fingerprint=FP), raw):
        d = Doctor(cache=cache, context=CTX, features=feats)
        assert d.stored("fake.good") is None
        listing = doctor_payload(d)                                      # GET /wan_accel/doctor: never probes
        assert listing["features"][0]["verified"] == "not checked yet" and d.probes == 0
        rows = doctor_rows(d)                                            # probed again
        assert d.probes == 1 and rows[0]["status"] == "passed"
        doctor_text(d, rows)
        json.dumps(report(d, rows), default=str)
        assert doc.verdict_problem(d.stored("fake.good")) is None       # replaced by a sound verdict


def test_the_cache_sets_damaged_verdicts_aside_with_the_same_check(cache_path):
    from wan_accel.cache import entries
    assert entries._SHAPES["doctor"] is doc.verdict_problem
    feats = _good_feature([])
    d = _doctor(cache_path, feats)
    value = dict(d.check("fake.good"), difference="0.001")
    with pytest.raises(ValueError, match="'difference' is '0.001'"):
        LimitCache(cache_path, fingerprint=FP).put("doctor", d.key("fake.good"), value)
    _hand_edit(cache_path, "fake.good:", value)
    assert LimitCache(cache_path, fingerprint=FP).get("doctor", d.key("fake.good")) is None


def test_the_doctor_command_survives_a_damaged_verdict(cache_path, capsys):
    from wan_accel.cli import main
    assert main(["doctor", "--device", "cpu", "--head-dim", "16", "--feature", "fused_qkv"]) == 0
    capsys.readouterr()
    d = doc.doctor_for("cpu", torch.float32, 16)
    _hand_edit(cache_path, "fused_qkv:", dict(d.stored("fused_qkv"), difference="abc", feature_ms="x"))
    assert main(["doctor", "--device", "cpu", "--head-dim", "16", "--feature", "fused_qkv"]) == 0
    out = capsys.readouterr().out
    assert "fused_qkv" in out and "passed" in out


# ------------------------------------------------------------------------------------- the native MODEL path
def test_native_model_needs_comfyui_until_its_probe_is_registered(cache_path, monkeypatch):
    monkeypatch.setattr(vocab, "PROBES", {})
    d = doc.doctor_for("cpu", torch.float32, 16)
    reason, hint = d.unavailable("native_model")
    assert reason.startswith("needs ComfyUI") and "Wan Doctor node" in hint
    assert "not available in this build" not in reason
    row = doctor_rows(d, ["native_model"])[0]
    assert row["available"] is False and row["why_off"].startswith("needs ComfyUI")

    seen = []

    def fake(ctx):
        seen.append(ctx)
        return Probe(lambda: _x() * 3, lambda: _x() * 2, torch.float32, judge_speed=False)
    vocab.register_probe("native_model", fake, sources=lambda: (fake,))
    assert d.unavailable("native_model")[0] is None
    verdict = d.check("native_model")
    assert seen and verdict["status"] == "failed" and "wrong numbers" in verdict["error"]


def _doctor_text_from(where: str, capsys) -> str:
    if where == "node":
        from wan_accel.nodes import doctor_nodes
        return doctor_nodes.WanAccelDoctor().run(feature="native_model", dtype="fp32")["result"][0]
    if where == "route":
        from wan_accel.server_routes import doctor_payload
        return json.dumps(doctor_payload())
    from wan_accel.cli import main
    assert main(["doctor", "--device", "cpu", "--head-dim", "16", "--feature", "native_model"]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("where", ["node", "route", "command"])
def test_each_doctor_registers_the_native_probe_which_needs_comfyui_here(where, cache_path, monkeypatch, capsys):
    # the probe imports torch, so it registers where a doctor is made (never when the pack is imported): start
    # from a process where it never was imported
    import wan_accel.nodes.comfy as nodes_pkg
    for name in [m for m in sys.modules if m == "comfy" or m.startswith("comfy.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "comfy", None)                     # "import comfy" fails, as without ComfyUI
    monkeypatch.delitem(sys.modules, "wan_accel.nodes.comfy.native_probe", raising=False)
    monkeypatch.delattr(nodes_pkg, "native_probe", raising=False)
    monkeypatch.setattr(vocab, "PROBES", {})
    text = _doctor_text_from(where, capsys)
    native_probe = sys.modules["wan_accel.nodes.comfy.native_probe"]
    assert vocab.PROBES["native_model"].check is native_probe.check
    assert "needs ComfyUI (ComfyUI does not import here" in text, text


def _stand_in_comfy(monkeypatch):
    """ComfyUI's loader, model management and KSAMPLER as stand-ins (a WAN21_CausalAR over the pack's model)."""
    from wan_accel.model.config import WanConfig
    from wan_accel.model.tiny import TINY_CONFIG, tiny_causal_model

    class WAN21_CausalAR:                  # noqa: N801 - named as ComfyUI's class, which the sampler checks
        def __init__(self, dm, dtype):
            self.diffusion_model, self.dtype = dm, dtype
            self.model_sampling = types.SimpleNamespace(multiplier=1000.0)

        def get_dtype_inference(self):
            return self.dtype

    def load(sd, model_options=None, metadata=None):
        dtype = (model_options or {}).get("dtype", torch.float32)
        heads = json.loads(metadata["config"])["transformer"].get("num_heads", sd["patch_embedding.weight"].shape[0] // 128)
        dim = sd["patch_embedding.weight"].shape[0]
        cfg = WanConfig.from_dict(dict(TINY_CONFIG.to_dict(), dim=dim, ffn_dim=sd["blocks.0.ffn.0.weight"].shape[0],
                                       num_heads=heads, text_dim=sd["text_embedding.0.weight"].shape[1]))
        dm = tiny_causal_model(1, "cpu", dtype, config=cfg)
        dm.load_state_dict(sd)
        dm.model_type, dm.num_heads, dm.text_len = "t2v", cfg.num_heads, cfg.text_len
        return types.SimpleNamespace(model=WAN21_CausalAR(dm, dtype), load_device=torch.device("cpu"))

    class KSAMPLER:
        def __init__(self, fn, extra_options=None):
            self.sampler_function, self.extra_options = fn, dict(extra_options or {})
    comfy = types.ModuleType("comfy")
    comfy.sd = types.ModuleType("comfy.sd")
    comfy.sd.load_diffusion_model_state_dict = load
    comfy.model_management = types.ModuleType("comfy.model_management")
    comfy.model_management.load_models_gpu = lambda models: None
    comfy.samplers = types.ModuleType("comfy.samplers")
    comfy.samplers.KSAMPLER = KSAMPLER
    for name in ("sd", "model_management", "samplers"):
        monkeypatch.setitem(sys.modules, f"comfy.{name}", getattr(comfy, name))
    monkeypatch.setitem(sys.modules, "comfy", comfy)


def test_native_probe_runs_the_ar_sampler_on_a_native_model_against_the_engine(cache_path, monkeypatch):
    from wan_accel.nodes import doctor_nodes
    from wan_accel.nodes.comfy import native_probe
    native_probe.register()                    # whatever an earlier test left in the registry
    _stand_in_comfy(monkeypatch)
    text = doctor_nodes.WanAccelDoctor().run(feature="native_model", dtype="fp32")["result"][0]
    row = next(line for line in text.splitlines() if line.startswith("native_model"))
    assert " passed " in row
    from wan_accel.app import run
    from wan_accel.model.borrowed import BorrowedWanModel
    real = run.sample_causal                    # where both sides' prepared runs enter the loop

    def drifting(model, *args, **kwargs):      # the native path (the engine over ComfyUI's layers) a little off
        out = real(model, *args, **kwargs)
        return out * 1.001 if isinstance(model, BorrowedWanModel) else out
    monkeypatch.setattr(run, "sample_causal", drifting)
    d = doc.doctor_for("cpu", torch.float32, 16)
    verdict = d.check("native_model", recheck=True)
    assert verdict["status"] == "failed" and "wrong numbers" in verdict["error"]


# ------------------------------------------------------------------------------------- what a run says it ran
def _failing(name: str) -> Feature:
    def check(ctx):
        return Probe(lambda: _x() * 2 + 0.5, lambda: _x() * 2, torch.float32, judge_speed=False)
    return Feature(name, name, check, switches_off=name)


def test_report_json_lists_what_ran_and_what_was_switched_off(tmp_path, monkeypatch):
    from wan_accel.app.jobs.generate import GenerateOptions, run_generate
    from wan_accel.kernels import _common
    # the plain CPU run, whatever this process's TRITON_INTERPRET says (under it the fused kernels would run too)
    monkeypatch.setattr(_common, "interpreter_usable", lambda: False)
    monkeypatch.setitem(doc.FEATURES, "fused_qkv", _failing("fused_qkv"))
    monkeypatch.setitem(doc.FEATURES, "attention.sdpa", _failing("attention.sdpa"))
    said: list = []
    out = tmp_path / "run"
    run_generate(GenerateOptions(out_dir=str(out), frames=9, height=32, width=32, sampler="optimized",
                                 cuda_graphs="off", preview=False), log=said.append)
    data = json.loads((out / "report.json").read_text())
    features = data["features"]
    assert "wrong numbers" in features["switched_off"]["fused_qkv"]
    assert "fused_qkv" not in features["ran"] and features["enabled"]["fused_qkv"] is False
    assert data["sampler"]["fused_qkv_blocks"] == 0
    assert "wrong numbers" in features["failed_fallbacks"]["attention.sdpa"]
    assert features["ran"] == ["attention.sdpa"]                 # the plain CPU run: nothing else ran
    assert all(v is False for v in features["enabled"].values())
    lines = [s for s in said if s.startswith("wan_accel:")]
    assert any("fused_qkv is switched off" in s for s in lines)
    assert any("the fallback attention.sdpa failed its check" in s for s in lines)
    assert [n for n in data["notes"] if n.startswith("wan_accel:")] == lines


def test_features_summary_tells_which_kernels_ran(monkeypatch):
    from wan_accel.app.doctor.gate import features_summary, new_record
    from wan_accel.model.tiny import tiny_causal_model
    from wan_accel.sampling import runner
    monkeypatch.setattr(runner, "kernels_run_on", lambda device: True)
    model = tiny_causal_model()
    record = new_record()
    record["switched_off"]["kernel.gated_residual"] = "wrong numbers: ..."
    options = runner.FastOptions(switched_off={"kernel.gated_residual"})
    info = {"path": "optimized", "attention": "sdpa", "fused_kernels": True, "fused_qkv_blocks": 2,
            "cuda_graphs": False, "compile": None, "swapped_blocks": 0}
    s = features_summary(model, options, info, record)
    assert s["ran"] == ["attention.sdpa", "kernel.layernorm_modulate", "kernel.rmsnorm_rope", "kernel.rms_norm",
                        "kernel.residual_norm", "fused_qkv"]
    assert s["enabled"]["kernel.gated_residual"] is False and s["enabled"]["kernel.rmsnorm_rope"] is True
    assert s["switched_off"] == {"kernel.gated_residual": "wrong numbers: ..."}


# ------------------------------------------------------------------------------------- graph-safe compile settings
@pytest.mark.parametrize("mode,want", [("reduce-overhead", "default"), ("max-autotune", "max-autotune-no-cudagraphs")])
def test_prepare_model_compiles_with_the_graph_safe_settings(mode, want):
    from wan_accel.app.prepare import RunSpec, prepare_model
    from wan_accel.app.jobs.handle import load_model_handle
    from wan_accel.compile import CompileSettings, uncompile_model
    from wan_accel.compile.apply import compile_handle
    settings = CompileSettings(backend="inductor", mode=mode, warm_start=False)
    handle = load_model_handle(None, "fp32", device="cpu", compile_settings=settings)
    said: list = []
    try:
        prepare_model(handle.model, RunSpec.for_handle(handle, path="optimized", cuda_graphs="off",
                                                       fused_kernels=False), log=said.append)
        compiled = compile_handle(handle.model)
        assert compiled is not None and compiled.settings.mode == want and compiled.settings.scope == "blocks"
        assert any(f"compiled as '{want}'" in s for s in said)
    finally:
        uncompile_model(handle.model)
    graphs_backend = load_model_handle(None, "fp32", device="cpu",
                                       compile_settings=CompileSettings(backend="cudagraphs", warm_start=False))
    prepare_model(graphs_backend.model, RunSpec.for_handle(graphs_backend, path="optimized", cuda_graphs="off",
                                                           fused_kernels=False))
    assert compile_handle(graphs_backend.model) is None          # the sampler's own graphs replay eager blocks


def test_native_probe_starts_comfyuis_model_management_on_the_cpu_outside_a_server(tmp_path):
    """The doctor command run with ComfyUI's Python on a machine without CUDA: ComfyUI's model management is
    started as `main.py --cpu` would (it refuses to start without a GPU otherwise); inside a server (model
    management already imported) nothing is changed."""
    pkg = tmp_path / "comfy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "cli_args.py").write_text("import types\nargs = types.SimpleNamespace(cpu=False)\n")
    (pkg / "model_management.py").write_text(
        "from .cli_args import args\nif not args.cpu:\n    raise RuntimeError('Found no NVIDIA driver')\n")
    (pkg / "sd.py").write_text("def load_diffusion_model_state_dict(sd, **kwargs):\n    return None\n")
    code = ("import torch\nfrom wan_accel.nodes.comfy import native_probe\n"
            "torch.cuda.is_available = lambda: False\n"
            "sd, mm = native_probe._comfy()\nprint('cpu', mm.args.cpu)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and "cpu True" in out.stdout, out.stderr[-2000:]
