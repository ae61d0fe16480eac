"""Defects found on the first real GPU, reproduced on a CPU: speed verdicts only at the run's own shapes."""
from __future__ import annotations

import pytest
import torch

import attention_cases as cases
from wan_accel.app.doctor import core as doc
from wan_accel.app.doctor.core import Doctor, Feature, Probe, default_context
from wan_accel.app.doctor.report import doctor_rows
from wan_accel.cache import LimitCache

FP = {"device": "cuda", "gpu": "GPU A", "capability": "9.0", "total_memory": 80, "driver": "550.1",
      "cuda": "12.4", "torch": "2.13.0", "triton": "3.9.0"}


def _x():
    return torch.linspace(-2, 2, 64).reshape(4, 16)


def _slow_at_the_probe(fn, device, **_):
    return 0.004 if fn.__name__ == "feature" else 0.001


def test_a_probe_shape_never_switches_a_feature_off_for_speed(cache_path, monkeypatch):
    """On a GPU the doctor used to judge speed at its 256-token probe: fused q/k/v was switched off there while
    whole runs at the real shape took the same time. Now the timing is shown with its shape, never judged."""
    monkeypatch.setattr(doc, "sync_device", lambda device: None)      # a CUDA context on a CPU machine: nothing to sync
    ctx = default_context("cpu", torch.float32, head_dim=16)
    ctx = type(ctx)(device=torch.device("cuda", 0), dtype=torch.float32, head_dim=16)

    def check(c):
        def feature():
            return _x() * 2
        return Probe(feature, lambda: _x() * 2, torch.float32)
    feats = {"fake.fused": Feature("fake.fused", "fused", check, switches_off="fused")}
    d = Doctor(cache=LimitCache(cache_path, fingerprint=FP), context=ctx, features=feats, timer=_slow_at_the_probe)
    value = d.check("fake.fused")
    assert value["status"] == "passed" and value["speed_judged"] is False
    assert value["feature_ms"] == 4.0 and value["shape"] == "256 tokens, 2 heads x 16, float32"
    assert d.why_off("fake.fused") is None
    row = doctor_rows(d, ["fake.fused"])[0]
    assert "timed at 256 tokens" in row["speed"] and "decided at the run's shapes" in row["speed"]
    # a probe that runs the real call's shapes may still be judged
    feats["fake.real"] = Feature("fake.real", "real", lambda c: Probe(check(c).feature, lambda: _x() * 2,
                                                                     torch.float32, judge_speed=True))
    assert d.check("fake.real")["status"] == "slower"


def test_verdicts_of_the_old_probe_version_are_probed_again(cache_path):
    cache = LimitCache(cache_path, fingerprint=FP)
    ctx = default_context("cpu", torch.float32, head_dim=16)
    feats = {"fake.f": Feature("fake.f", "f", lambda c: Probe(lambda: _x(), lambda: _x(), torch.float32))}
    d = Doctor(cache=cache, context=ctx, features=feats)
    d.check("fake.f")
    assert d.probes == 1
    stored = cache.get("doctor", d.key("fake.f"))
    cache.put("doctor", d.key("fake.f"), dict(stored, probe=1, status="slower", error="slower at 256 tokens"))
    d2 = Doctor(cache=LimitCache(cache_path, fingerprint=FP), context=ctx, features=feats)
    assert d2.check("fake.f")["status"] == "passed" and d2.probes == 1


# ----------------------------------------------------------------------------- attention: SDPA's kernels, plans
def test_sdpa_kernels_are_candidates_of_their_own_and_override_an_outer_priority():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from wan_accel.model import attention as att
    for name in ("sdpa.cudnn", "sdpa.flash", "sdpa.efficient"):
        assert name in att.AUTO_CANDIDATES and att.AUTO_CANDIDATES[name].group == "sdpa"
        assert att.AUTO_CANDIDATES[name].rejected("cpu", torch.float32, 64) == "needs a CUDA device, not cpu"
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, 2, 32, generator=g) for _ in range(3))

    def ran(fn):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with sdpa_kernel([SDPBackend.MATH]):          # an outer priority, as ComfyUI sets one
                out = fn()
        return out, " ".join(e.name for e in prof.events())

    out, names = ran(lambda: att.AUTO_CANDIDATES["sdpa.flash"].fn(q, k, v))
    assert "flash" in names and "_math" not in names      # the candidate's own kernel, not the outer choice
    ref, names = ran(lambda: att.AUTO_CANDIDATES["sdpa"].fn(q, k, v))
    assert "_math" in names
    assert (out - att.attention_reference(q, k, v)).abs().max().item() <= 1e-5


def test_the_plan_lists_every_length_bucket_a_run_meets():
    from wan_accel.model.attention import length_bucket, plan_shapes
    chunks = [(0, 3), (3, 3), (6, 3), (9, 3)]
    shapes = plan_shapes(10, chunks, -1, 12, text_len=512)
    buckets = {(length_bucket(q), length_bucket(k)) for q, k in shapes}
    assert buckets == {(32, 32), (32, 64), (32, 128), (32, 512)}
    rolling = plan_shapes(10, chunks, 6, 12)              # a rolling cache of 6 frames reads at most 60 keys
    assert max(k for _, k in rolling) == 60


def test_attention_plans_are_made_before_the_first_chunk(monkeypatch):
    """With every plan warmed, no call of the run measures (the store's timer is never called again)."""
    from wan_accel.cache.autotune import get_autotuner
    from wan_accel.model import attention as att
    cases.forget_choices()
    tuner = get_autotuner()
    timed = []
    monkeypatch.setattr(tuner, "timer", lambda fn, *a, **kw: (timed.append(1), fn(), 0.001)[2])
    shapes = att.plan_shapes(8, [(0, 2), (2, 2), (4, 2)], -1, 6, text_len=16)
    chosen = att.warm_plans(shapes, 1, 2, 16, torch.float32, "cpu", "auto")
    assert len(chosen) == len(shapes) and all(name in att.AUTO_CANDIDATES for _, name in chosen)
    assert timed
    timed.clear()
    g = torch.Generator().manual_seed(1)
    for q_len, k_len in shapes:
        q = torch.randn(1, q_len, 2, 16, generator=g)
        kv = torch.randn(1, k_len, 2, 16, generator=g)
        att.attention(q, kv, kv, backend="auto")
    assert timed == []
    cases.forget_choices()


# ----------------------------------------------------------------------------- int8: a speed verdict at the run's shape
def _int8_run(monkeypatch, slow: bool, **fast):
    import speed_timer
    from wan_accel.kernels import registry
    from wan_accel.model.tiny import tiny_causal_model
    from run_helpers import generate_latents
    monkeypatch.setattr(registry, "SPEED_DEVICES", ("cuda", "cpu"))   # judge speed here, with the store's timer
    speed_timer.install(monkeypatch, slow)                       # int8 timed first, then exact
    model = tiny_causal_model()
    ctx = torch.randn(1, 4, model.config.text_dim, generator=torch.Generator().manual_seed(0))
    report = {}
    out = generate_latents(model, ctx, 6, 4, 6, seed=1, path="optimized", report=report,
                           fast_options={"attention": "int8", "cuda_graphs": "off", **fast})
    exact = generate_latents(model, ctx, 6, 4, 6, seed=1, path="optimized",
                             fast_options={"attention": "sdpa", "cuda_graphs": "off"})
    return out, exact, report


def test_int8_measured_slower_at_the_runs_shape_keeps_the_exact_path(monkeypatch):
    out, exact, report = _int8_run(monkeypatch, slow=True)
    assert report["int8_speed"]["slower"] is True and "queries x" in report["int8_speed"]["why"]
    assert report["attention"] == "exact (int8 measured slower)"
    assert any("int8 attention is slower" in n and "--keep-slower" in n for n in report["notes"])
    assert torch.equal(out, exact)


def test_int8_kept_where_faster(monkeypatch):
    out, exact, report = _int8_run(monkeypatch, slow=False)
    assert report["int8_speed"]["slower"] is False and report["attention"] == "int8"
    assert not torch.equal(out, exact)                                  # int8 numerics: it ran


def test_int8_kept_where_the_user_insists(monkeypatch):
    out, exact, report = _int8_run(monkeypatch, slow=True, keep_slower=True)
    assert report["int8_speed"]["slower"] is True and report["attention"] == "int8"
    assert not torch.equal(out, exact)


# ----------------------------------------------------------------------------- the first run's one-time work
def test_the_run_report_breaks_down_the_one_time_work(tmp_path):
    from wan_accel.app.jobs.generate import GenerateOptions, run_generate
    lines = []
    first = run_generate(GenerateOptions(out_dir=str(tmp_path / "a"), device="cpu", sampler="optimized",
                                         preview=False), log=lines.append)
    costs = first["sampler"]["one_time_s"]
    assert costs.get("doctor", 0) > 0                       # the first process probes its features
    assert any(line.startswith("one-time work in this run: doctor") for line in lines)
    second = run_generate(GenerateOptions(out_dir=str(tmp_path / "b"), device="cpu", sampler="optimized",
                                          preview=False), log=lambda *_: None)
    assert "doctor" not in second["sampler"]["one_time_s"]  # verdicts stored: nothing probed again


def test_nested_one_time_work_is_counted_once():
    from wan_accel.cache import warmup
    before = warmup.snapshot()
    with warmup.spent("doctor"):
        with warmup.spent("autotune"):
            sum(range(10000))
    got = warmup.since(before)
    assert "doctor" in got and "autotune" not in got
    with pytest.raises(ValueError, match="warm-up kind"):
        with warmup.spent("nothing"):
            pass


# ----------------------------------------------------------------------------- selftest
def test_selftest_without_a_gpu_lists_the_gpu_parts_and_require_gpu_makes_it_an_error(tmp_path):
    from wan_accel.checks import selftest
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the GPU stages run")
    result = selftest.run_selftest(tmp_path / "st", stages=["bench kernels", "block swap"], log=lambda *_: None)
    assert result["passed"] and result["needs_gpu"] == ["bench kernels", "block swap"]
    assert "| bench kernels | needs a CUDA GPU |" in (tmp_path / "st" / "selftest.md").read_text()
    with pytest.raises(ValueError, match="--require-gpu: no CUDA GPU"):     # refused before any stage runs
        selftest.run_selftest(tmp_path / "st2", stages=["bench kernels"], require_gpu=True, log=lambda *_: None)
    assert not (tmp_path / "st2").exists()
    names = {s.name for s in selftest.STAGES if s.gpu}
    assert {"bench sampler", "bench kernels", "block swap", "generate compiled", "tests marked cuda"} <= names


def test_selftest_judges_a_slower_path_kept_on_and_a_compile_that_fell_back():
    from wan_accel.checks import selftest
    rows = [{"variant": "optimized", "steady_s": 2.0}, {"variant": "optimized-int8", "steady_s": 2.5,
                                                         "attention_ran": "int8"}]
    assert "int8 attention stayed on" in selftest.judge_bench_sampler({"rows": rows})[0]
    rows[1]["attention_ran"] = "exact (int8 measured slower)"
    assert selftest.judge_bench_sampler({"rows": rows}) == []
    rows.append({"variant": "optimized-compiled", "steady_s": 1.9, "compile_failed": "TorchRuntimeError: x"})
    assert "compiling failed" in selftest.judge_bench_sampler({"rows": rows})[0]
    report = {"files": {"latents": "x"}, "sampler": {"compile": {"failed": "Unsupported: y"}}}
    assert "fell back to eager" in selftest.judge_generate(report)[0]
    assert selftest.judge_check_reference({"pass": False, "worst": 0.1, "tolerance": 1e-4})


def test_a_crashing_or_hanging_stage_fails_alone(tmp_path, monkeypatch):
    from wan_accel.checks import selftest
    crash = selftest.Stage("crash", lambda ctx: ["generate", "--frames", "-1"], 60)
    hang = selftest.Stage("hang", lambda ctx: ["-c", "import time; time.sleep(30)"], 0.5, pytest=True)
    monkeypatch.setattr(selftest, "STAGES", [crash, hang, *[s for s in selftest.STAGES if s.name == "doctor"]])
    monkeypatch.setattr(selftest, "CPU_FACTOR", 1.0)
    result = selftest.run_selftest(tmp_path / "st", log=lambda *_: None)
    by = {r["stage"]: r for r in result["stages"]}
    assert by["crash"]["status"] == "failed" and by["crash"]["detail"].startswith("exit 2")
    assert by["hang"]["status"] == "failed" and "did not finish" in by["hang"]["detail"]
    assert by["doctor"]["status"] == "passed" and not result["passed"]


def test_a_modules_run_time_state_is_not_part_of_its_code_digest(tmp_path):
    """Verdicts hold for the code they judged: a memo filled in by running (the interpreter check's state) must not
    make a verdict look stale, or every run in a long-lived process probes again."""
    import importlib.util
    from wan_accel.kernels._common import code_digest
    (tmp_path / "fake_kernels.py").write_text("LIMIT = 3\n_STATE = {}\n\n\ndef f(x):\n    return x + LIMIT\n")
    spec = importlib.util.spec_from_file_location("fake_kernels", tmp_path / "fake_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    before = code_digest(mod)
    mod._STATE["usable"] = True                     # filled in at run time
    assert code_digest(mod) == before
    mod.LIMIT = 4                                    # a constant of the code: a new digest
    assert code_digest(mod) != before


# ---------------------------------------------------------------------- per-run cost of the attention plans
# (on an H200 the plans of a 1.3B run drew and copied a random Q per shape before looking up the stored choice:
# about 170 ms of host work at the start of every video)
def _count_randn(monkeypatch):
    calls = []
    real = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *a, **k: calls.append(a) or real(*a, **k))
    return calls


def test_attention_plans_of_a_second_run_make_no_tensors(monkeypatch):
    from wan_accel.model import attention as att
    shapes = att.plan_shapes(16, [(0, 3), (3, 3), (6, 3)], -1, 9, 7)
    att.warm_plans(shapes, 1, 2, 8, torch.float32, "cpu")
    calls = _count_randn(monkeypatch)
    again = att.warm_plans(shapes, 1, 2, 8, torch.float32, "cpu")
    assert calls == [] and len(again) == len(shapes)


def test_plan_shapes_keep_the_largest_call_of_each_bucket():
    from wan_accel.model.attention import length_bucket, plan_shapes
    chunks = [(f0, 3) for f0 in range(0, 21, 3)]
    shapes = plan_shapes(1560, chunks, -1, 21, 512)
    assert (4680, 32760) in shapes                       # the last chunk reads the whole cache
    for q, k in shapes:                                  # nothing larger in the same bucket is left out
        same = [(4680, min(f0 + 3, 21) * 1560) for f0, _ in chunks
                if (length_bucket(4680), length_bucket(min(f0 + 3, 21) * 1560)) == (length_bucket(q), length_bucket(k))]
        assert all(a * b <= q * k for a, b in same)


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_a_stored_speed_verdict_makes_no_tensors(monkeypatch, mode):
    """The first verdict times both paths on inputs it makes; the next run reads the stored verdict and makes none."""
    import speed_timer
    from wan_accel.kernels import registry
    from wan_accel.model import attention_approx as approx
    from wan_accel.model import fp8_linear
    monkeypatch.setattr(registry, "SPEED_DEVICES", ("cuda", "cpu"))
    speed_timer.install(monkeypatch, slow=True)

    def judge():
        if mode == "int8":
            return approx.attention_speed("int8", 64, 96, 1, 2, 16, torch.float32, "cpu")
        return fp8_linear.fp8_speed(32, 64, 128, torch.float32, "cpu")

    first = _count_randn(monkeypatch)
    assert judge()[0] is True and first
    again = _count_randn(monkeypatch)
    assert judge()[0] is True and again == []
