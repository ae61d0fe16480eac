"""Long commands say what they do, on stderr, while stdout keeps their JSON; the self-test writes selftest.json and
selftest.md after every finished stage, and refuses a run it could not finish or record before any stage runs
(``--require-gpu`` without a GPU, a link or a folder where its files go, ``--out`` naming a file)."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from cli_run import refused, run_cli_in
from wan_accel.app import progress as progress_mod
from wan_accel.checks import selftest

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present: --require-gpu is met")


@pytest.fixture
def loud(monkeypatch):
    monkeypatch.delenv(progress_mod.QUIET_ENV, raising=False)


@pytest.fixture
def no_stage_runs(monkeypatch):
    """Any stage that starts fails the test (the refusals come before the first one)."""
    def run_stage(*_a, **_k):
        raise AssertionError("a stage ran")
    monkeypatch.setattr(selftest, "run_stage", run_stage)


# ----------------------------------------------------------------------------------------- refused up front
@NO_GPU
def test_require_gpu_without_one_is_refused_before_any_stage(tmp_path, no_stage_runs):
    line = refused(run_cli_in(tmp_path, "selftest", "--require-gpu", "--out", "st"), "--require-gpu",
                   "no CUDA GPU")
    assert "run without --require-gpu" in line
    assert not (tmp_path / "st").exists()                 # nothing made, nothing written
    with pytest.raises(ValueError, match="--require-gpu"):
        selftest.run_selftest(tmp_path / "st2", require_gpu=True, log=lambda *_: None)


def test_a_link_at_selftest_json_is_refused_up_front(tmp_path, no_stage_runs):
    out = tmp_path / "st"
    out.mkdir()
    (tmp_path / "elsewhere.json").write_text("keep me")
    (out / "selftest.json").symlink_to(tmp_path / "elsewhere.json")
    line = refused(run_cli_in(tmp_path, "selftest", "--out", "st"), "selftest.json", "symbolic link",
                   "remove the link or choose another file")
    assert "--out st: st/selftest.json is a symbolic link" in line      # the path as it was given
    assert (tmp_path / "elsewhere.json").read_text() == "keep me"


def test_a_folder_at_selftest_md_is_refused_up_front(tmp_path, no_stage_runs):
    (tmp_path / "st" / "selftest.md").mkdir(parents=True)
    line = refused(run_cli_in(tmp_path, "selftest", "--out", "st"), "selftest.md", "is a folder",
                   "choose another file")
    assert "st/selftest.md is a folder" in line


def test_out_naming_a_regular_file_is_refused_up_front(tmp_path, no_stage_runs):
    (tmp_path / "report.txt").write_text("mine")
    refused(run_cli_in(tmp_path, "selftest", "--out", "report.txt"), "--out", "report.txt", "not a folder",
            "choose another --out")
    assert (tmp_path / "report.txt").read_text() == "mine"


def test_a_file_where_the_stages_folder_goes_is_refused_up_front(tmp_path, no_stage_runs):
    (tmp_path / "st").mkdir()
    (tmp_path / "st" / "stages").write_text("x")
    refused(run_cli_in(tmp_path, "selftest", "--out", "st"), "stages", "not a folder", "choose another --out")


# ----------------------------------------------------------------------------------------- written as it goes
def _fake_stages(monkeypatch, names, stop_at=None):
    """Stages that pass at once; the one named ``stop_at`` is interrupted (Ctrl-C) instead. Returns, per stage
    started, what selftest.json held when it started (before the first: the run's own "unfinished" file)."""
    seen = []
    stages = [selftest.Stage(n, lambda ctx: [], 10) for n in names]

    def run_stage(stage, ctx, log=None):
        path = ctx.out / "selftest.json"
        seen.append(json.loads(path.read_text()) if path.exists() else None)
        if stage.name == stop_at:
            raise KeyboardInterrupt
        return {"stage": stage.name, "status": "passed", "seconds": 0.5, "detail": "ok", "gpu": False}

    monkeypatch.setattr(selftest, "STAGES", stages)
    monkeypatch.setattr(selftest, "run_stage", run_stage)
    return seen


def test_the_files_are_written_after_every_finished_stage(tmp_path, monkeypatch):
    seen = _fake_stages(monkeypatch, ["one", "two", "three"])
    result = selftest.run_selftest(tmp_path / "st", log=lambda *_: None)
    assert seen[0]["stages"] == [] and seen[0]["not_run"] == ["one", "two", "three"] and not seen[0]["finished"]
    assert [r["stage"] for r in seen[1]["stages"]] == ["one"] and seen[1]["not_run"] == ["two", "three"]
    assert [r["stage"] for r in seen[2]["stages"]] == ["one", "two"] and not seen[2]["finished"]
    assert not seen[2]["passed"] and "not run yet: three" in seen[2]["summary"]
    assert result["finished"] and result["passed"] and result["not_run"] == []
    saved = json.loads((tmp_path / "st" / "selftest.json").read_text())
    assert [r["stage"] for r in saved["stages"]] == ["one", "two", "three"] and saved["passed"]


def test_a_stopped_selftest_leaves_the_table_of_its_finished_stages(tmp_path, monkeypatch):
    _fake_stages(monkeypatch, ["one", "two", "three"], stop_at="three")
    with pytest.raises(KeyboardInterrupt):
        selftest.run_selftest(tmp_path / "st", log=lambda *_: None)
    saved = json.loads((tmp_path / "st" / "selftest.json").read_text())
    assert [r["stage"] for r in saved["stages"]] == ["one", "two"] and saved["not_run"] == ["three"]
    assert saved["finished"] is False and saved["passed"] is False
    md = (tmp_path / "st" / "selftest.md").read_text()
    assert "| one | passed |" in md and "| two | passed |" in md and "UNFINISHED" in md and "three" in md
    assert not [p for p in (tmp_path / "st").iterdir() if p.name not in ("selftest.json", "selftest.md")]


def test_the_files_go_through_the_atomic_writer(tmp_path, monkeypatch):
    from wan_accel.cache import owned_files
    _fake_stages(monkeypatch, ["one", "two"])
    written = []
    real = owned_files.write_with
    monkeypatch.setattr(owned_files, "write_with", lambda path, write, **kw: written.append(path.name) or
                        real(path, write, **kw))
    selftest.run_selftest(tmp_path / "st", log=lambda *_: None)
    assert written == ["selftest.json", "selftest.md"] * 3      # unfinished first, after stage one, at the end


def test_the_cli_shows_progress_on_stderr_and_keeps_stdout_json(tmp_path, monkeypatch, loud):
    _fake_stages(monkeypatch, ["one", "two"])
    code, out, err = run_cli_in(tmp_path, "selftest", "--json", "--out", "st")
    assert code == 0, err
    assert [r["stage"] for r in json.loads(out)["stages"]] == ["one", "two"]
    assert "[1/2] one ..." in err and "[2/2] two: passed" in err and "selftest [" in err


def test_a_long_stage_says_it_still_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(selftest, "HEARTBEAT_S", 0.3)
    ctx = selftest.Context(out=tmp_path / "st", work=tmp_path, gpu=False, device="cpu")
    stage = selftest.Stage("sleeper", lambda ctx: ["-c", "import time; time.sleep(1.5); print('{}')"], 10,
                           pytest=True)
    said = []
    row = selftest.run_stage(stage, ctx, said.append)
    assert row["status"] == "passed", row
    assert any("sleeper: still running" in s for s in said), said
    hang = selftest.Stage("hang", lambda ctx: ["-c", "import time; time.sleep(30)"], 0.5, pytest=True)
    monkeypatch.setattr(selftest, "CPU_FACTOR", 1.0)
    row = selftest.run_stage(hang, ctx, said.append)
    assert row["status"] == "failed" and "did not finish within" in row["detail"] and row["seconds"] < 10


# ----------------------------------------------------------------------------------------- bench sampler
def test_bench_sampler_tells_each_run_and_chunk_on_stderr_and_leaves_it_out_of_the_figures(capsys, monkeypatch,
                                                                                            loud):
    """stdout is the JSON alone; a slow progress line (PAUSE s after each chunk here) is in no figure: the timed
    run's wall time (between its progress lines) holds both pauses, its steady_s and its chunks neither."""
    import time

    from wan_accel.bench import sampler as bench

    pause, marks = 0.5, {}
    real = progress_mod.Progress.__call__

    def slow(self, what):
        real(self, what)
        if "timed run 1/1" in what and "chunk" not in what:
            marks["start"] = time.perf_counter()
        if "one more untimed run" in what:
            marks["end"] = time.perf_counter()
        if "chunk" in what:
            time.sleep(pause)

    monkeypatch.setattr(progress_mod.Progress, "__call__", slow)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--json", "--device", "cpu", "--repeat", "1", "--variants", "optimized", "--no-parity",
                              "--frames", "21", "--height", "32", "--width", "32"])
    assert bench.run(args) == 0
    out, err = capsys.readouterr()
    row = json.loads(out)["rows"][0]
    for text in ("bench sampler [", "[1/1] optimized: warm-up run", "[1/1] optimized: timed run 1/1: chunk 1/2 done",
                 "timed run 1/1: chunk 2/2 done", "building the random tiny wan model"):
        assert text in err, err
    wall = marks["end"] - marks["start"]                  # the timed run, both pauses included
    assert len(row["chunk_ms"]) == 2 and row["steady_s"] < wall - 1.5 * pause, (row["steady_s"], wall)
    assert abs(sum(row["chunk_ms"]) / 1e3 - row["steady_s"]) < pause / 2, row


def test_quiet_silences_the_progress(capsys, monkeypatch):
    monkeypatch.setenv(progress_mod.QUIET_ENV, "1")
    progress_mod.Progress("x")("something")
    assert capsys.readouterr().err == ""
    monkeypatch.setenv(progress_mod.QUIET_ENV, "0")
    progress_mod.Progress("x")("something")
    assert "x [" in capsys.readouterr().err

