"""Every implementation of LayerNorm+modulate and RMSNorm+RoPE (the pack's kernel, comfy-kitchen per backend, plain
torch) verified against the torch reference, chosen through the operator store, and switched off alone when wrong."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from wan_accel.app.doctor.core import doctor_for
from wan_accel.app.doctor.gate import gate_options
from wan_accel.app.doctor import ops as doctor_ops
from wan_accel.cache import LimitCache
from wan_accel.cache.autotune import Autotuner
from wan_accel.kernels import candidates as C
from wan_accel.kernels import kitchen
from wan_accel.model.rope import RopeCache
from wan_accel.model.tiny import tiny_causal_model
from wan_accel.sampling.runner import FastOptions, ops_part

pytestmark = pytest.mark.skipif(not kitchen.available(), reason="comfy-kitchen is not installed (the 'test' extra)")
MARK = "KITCHEN_CHILD "
# (heads, head_dim): the tiny model's layout and Wan 1.3B's (12 heads of 128; Wan 2.1's 3-axis RoPE split)
LAYOUTS = ((4, 16), (12, 128))


def _args(op, heads, hd, dtype=torch.float32, frames=2, h=2, w=3):
    g = torch.Generator().manual_seed(3)
    d, n = heads * hd, frames * h * w
    x = torch.randn(1, n, d, generator=g).to(dtype)
    if op == "layernorm_modulate":
        return x, 0.1 * torch.randn(1, frames, d, generator=g), 0.1 * torch.randn(1, frames, d, generator=g), 1e-6
    cos, sin = RopeCache().get(hd, (frames, h, w), 0, "cpu")
    return x, (1 + 0.1 * torch.randn(d, generator=g)).to(dtype), cos, sin, heads, 1e-6


def _child(code: str, env_extra: dict, timeout: float = 600) -> dict:
    import wan_accel
    env = dict(os.environ, **env_extra)
    parent = str(Path(wan_accel.__path__[0]).parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (parent, str(Path(__file__).parent), env.get("PYTHONPATH", ""))
                                        if p)             # the tests' run_helpers too
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    pytest.fail(f"child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


@pytest.mark.parametrize("heads,hd", LAYOUTS)
@pytest.mark.parametrize("op", C.OPS)
def test_every_available_candidate_equals_the_reference(op, heads, hd):
    args = _args(op, heads, hd)
    ref = C.REFERENCES[op](*args)
    ran = []
    for cand, why in C.listing(op, "cpu"):
        if why is None:
            out = cand.fn(*args)
            tol = 8 * torch.finfo(torch.float32).eps * max(1.0, float(ref.abs().max()))
            assert (out - ref).abs().max().item() <= tol, cand.name
            ran.append(cand.name)
    assert {"kitchen.eager", "torch"} <= set(ran)


def test_comfy_kitchen_triton_under_the_interpreter(tmp_path):
    """comfy-kitchen's Triton kernels run under TRITON_INTERPRET=1 (a process of their own) and match too."""
    got = _child(f"""
        import json, torch
        from wan_accel.kernels import candidates as C
        from wan_accel.model.rope import RopeCache
        out = {{}}
        for op in C.OPS:
            for heads, hd in {LAYOUTS!r}:
                g = torch.Generator().manual_seed(3)
                d = heads * hd
                x = torch.randn(1, 12, d, generator=g)
                if op == "layernorm_modulate":
                    args = (x, 0.1 * torch.randn(1, 2, d, generator=g), 0.1 * torch.randn(1, 2, d, generator=g), 1e-6)
                else:
                    args = (x, 1 + 0.1 * torch.randn(d, generator=g), *RopeCache().get(hd, (2, 2, 3), 0, "cpu"),
                            heads, 1e-6)
                cand = C.CANDIDATES[op]["kitchen.triton"]
                why = cand.problem(torch.device("cpu"))
                out[f"{{op}}/{{heads}}"] = why or C.verify(cand, args)
        print({MARK!r} + json.dumps(out))
    """, {"TRITON_INTERPRET": "1", "WAN_ACCEL_CACHE": str(tmp_path / "limits.json")})
    assert len(got) == 4
    for name, diff in got.items():
        assert isinstance(diff, float) and diff <= 1e-5, (name, diff)


def test_store_records_the_choice_and_a_second_process_times_nothing(tmp_path):
    code = f"""
        import json, torch
        from wan_accel.kernels import candidates as C
        from wan_accel.cache.autotune import get_autotuner
        x = torch.randn(1, 24, 256)
        chosen = [C.choose("layernorm_modulate", (x, torch.randn(1, 2, 256), torch.randn(1, 2, 256), 1e-6))[0]]
        tuner = get_autotuner()
        entry = tuner.entry(C.store_kernel("layernorm_modulate"), C.call_key("layernorm_modulate",
                            (x, torch.randn(1, 2, 256), torch.randn(1, 2, 256), 1e-6)))
        print({MARK!r} + json.dumps({{"chosen": chosen[0], "benchmarks": tuner.stats["benchmarks"],
                                     "timed": sorted(entry["timings"])}}))
    """
    env = {"WAN_ACCEL_CACHE": str(tmp_path / "limits.json")}
    first, second = _child(code, env), _child(code, env)
    timed = sorted(f"impl={n}" for n in _runnable("layernorm_modulate"))    # the interpreter adds Triton ones
    # every candidate timed once (the pack's Triton kernel, where the interpreter runs it, also tunes its own tiles)
    assert first["timed"] == timed and first["benchmarks"] >= len(timed)
    assert second["benchmarks"] == 0 and second["chosen"] == first["chosen"]


def _runnable(op: str) -> list:
    """The candidates of ``op`` that run on this CPU now (TRITON_INTERPRET=1 adds the Triton ones)."""
    return [c.name for c, why in C.listing(op, "cpu") if why is None]


def _garbage(*args, **kw):
    return torch.full_like(args[0], 7.0)


def test_a_wrong_candidate_is_failed_by_the_doctor_and_switched_off_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(kitchen, "adaln", lambda x, shift, scale, eps, backend: _garbage(x))
    doc = doctor_for("cpu", torch.float32, 16, cache=LimitCache(tmp_path / "limits.json"), heads=4, tokens=24)
    assert doc.check("op.layernorm_modulate.kitchen.eager")["status"] == "failed"
    assert doc.check("op.rmsnorm_rope.kitchen.eager")["status"] == "passed"
    wrong = sorted(n for n in _runnable("layernorm_modulate") if n.startswith("kitchen."))   # all call adaln
    assert sorted(doctor_ops.switched_off(doc)) == [f"layernorm_modulate:{n}" for n in wrong]
    # the run's gate switches off that one alone, and the run's parts carry it
    model = tiny_causal_model(0, "cpu", torch.float32)
    opts, lines = gate_options(model, FastOptions(ops="kitchen"), doctor=doc)
    assert {n for n in opts.switched_off if n.startswith("op.")} == {f"op.layernorm_modulate.{n}" for n in wrong}
    assert ops_part(opts, "cpu", False) == ("kitchen", *(f"layernorm_modulate:{n}" for n in wrong))
    rows = {r["op"]: r for r in doctor_ops.implementations(doc)}
    assert rows["layernorm_modulate"]["uses"] == "torch" and "switched off" in \
        rows["layernorm_modulate"]["candidates"]["kitchen.eager"]
    assert rows["rmsnorm_rope"]["candidates"]["kitchen.eager"] == "available"


def test_the_store_fails_a_wrong_candidate_alone(monkeypatch):
    monkeypatch.setattr(kitchen, "adaln", lambda x, shift, scale, eps, backend: _garbage(x))
    tuner = Autotuner(None, timer=lambda fn: (fn(), 1.0)[1])
    args = _args("layernorm_modulate", 4, 16)
    assert C.choose("layernorm_modulate", args, "kitchen", tuner=tuner)[0] == "torch"
    entry = tuner.entry(C.store_kernel("layernorm_modulate"), C.call_key("layernorm_modulate", args))
    assert sorted(entry["failed"]) == sorted(f"impl={n}" for n in _runnable("layernorm_modulate")
                                             if n.startswith("kitchen."))
    assert "wrong numbers" in entry["failed"]["impl=kitchen.eager"]["error"]["message"]
    args = _args("rmsnorm_rope", 4, 16)
    assert C.choose("rmsnorm_rope", args, "kitchen", tuner=tuner)[0] in [
        n for n in _runnable("rmsnorm_rope") if n.startswith("kitchen.")]


def spy_kitchen(monkeypatch) -> dict:
    """Count the calls of comfy-kitchen's two wrappers (and forget the remembered choices, so they are made again)."""
    calls = {"adaln": 0, "norm_rope": 0}
    for name in calls:
        real = getattr(kitchen, name)

        def spy(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(kitchen, name, spy)
    C._CHOSEN.clear()
    return calls


def test_optimized_path_with_kitchen_ops_matches_the_fixture(monkeypatch):
    from tests.test_fast_sampler_parity import WAN, _model, _run
    from wan_accel.app.jobs.replay import Fixture
    cfg = json.loads((WAN / "causal_config.json").read_text())
    fx = Fixture(WAN, cfg)
    io, sched = fx.io, fx.schedule()
    calls = spy_kitchen(monkeypatch)
    out, report = _run(_model(cfg), io, sched, "optimized", fast_options={"ops": "kitchen"})
    assert report["path"] == "optimized"
    assert calls["adaln"] > 10 and calls["norm_rope"] > 10
    assert (out - io["output"]).abs().max().item() <= 1e-4


def test_without_comfy_kitchen_everything_works_as_before(tmp_path):
    got = _child(f"""
        import sys, json
        sys.modules["comfy_kitchen"] = None          # the import is blocked: as if it were not installed
        import torch
        from wan_accel.kernels import candidates as C, kitchen
        from wan_accel.model.tiny import tiny_causal_model
        from run_helpers import generate_latents
        from wan_accel.sampling.runner import FastOptions
        model = tiny_causal_model(0, "cpu", torch.float32)
        ctx = torch.randn(1, model.config.text_len, model.config.text_dim, generator=torch.Generator().manual_seed(1))
        run = lambda path, **o: generate_latents(model, ctx, 3, 8, 8, seed=0, frames_per_block=3, path=path,
                                                 fast_options=FastOptions(**o) if o else None)
        ref, opt = run("reference"), run("optimized")
        try:
            run("optimized", ops="kitchen")
            error = None
        except ValueError as exc:
            error = str(exc)
        print({MARK!r} + json.dumps({{"available": kitchen.available(), "diff": (ref - opt).abs().max().item(),
              "why": kitchen.backend_problem("eager", "adaln", "cpu"), "error": error,
              "listing": [c.name for c, why in C.listing("layernorm_modulate", "cpu") if why is None]}}))
    """, {"WAN_ACCEL_CACHE": str(tmp_path / "limits.json")})
    assert got["available"] is False and got["why"].startswith("comfy-kitchen is not installed")
    assert got["diff"] <= 1e-4 and got["listing"] == [n for n in _runnable("layernorm_modulate")
                                                       if not n.startswith("kitchen.")]
    assert "ops='kitchen'" in got["error"] and "comfyui-wan-accel[kitchen]" in got["error"]


def test_every_candidate_is_checked_against_one_reference_output(monkeypatch):
    """The reference of a choice (plain softmax attention in float32 at a long call is the costliest thing the
    store runs) is made once for all the candidates it checks, not once per candidate."""
    from wan_accel.cache.autotune import Autotuner
    made = []

    def reference(x, shift, scale, eps=1e-6):
        made.append(1)
        return C.layernorm_modulate_reference(x, shift, scale, eps)

    x = torch.randn(1, 8, 32)
    shift, scale = torch.zeros(1, 1, 32), torch.zeros(1, 1, 32)
    cands = [C.Candidate("layernorm_modulate", name, "torch", C.layernorm_modulate_reference, lambda d: None, name)
             for name in ("a", "b", "c")]
    best, why = C.pick("layernorm_modulate", cands, [], (x, shift, scale, 1e-6), reference=reference,
                       tuner=Autotuner(timer=lambda fn: (fn(), 1.0)[1]), key="test")
    assert best in ("a", "b", "c") and "fastest verified" in why
    assert len(made) == 1
