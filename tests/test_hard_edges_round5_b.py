"""Hard edges, round five (issue 50, part B): stops that stop (the self-test's stage and everything it started, its
work folder, an earlier run's verdict), outside modules that end the process while imported, messages, exit codes
and overwrites, inputs validated before a child starts or a model is built, a killed writer's temporaries, and
the test failures that must say why.

Each test drives the command line (in process, or as a user types it where a signal or a second interpreter is
the point), the carry tools or the mechanism itself."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from cli_run import WORLD_VARS, failure_report, refused, run_cli, run_cli_in
from wan_accel.cache import owned_files
from wan_accel.checks import selftest

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
TOOLS = REPO / "tools"
GEN = ["generate", "--device", "cpu", "--frames", "9", "--height", "32", "--width", "32", "--no-preview"]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("WAN_ACCEL_CACHE", str(tmp_path / "cache" / "limits.json"))
    for k in WORLD_VARS:
        monkeypatch.delenv(k, raising=False)


def _env(**extra) -> dict:
    """The environment of a child ``python``: this test's ``wan_accel`` importable, no debug tracebacks."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and Path(p).is_dir())
    env.pop("WAN_ACCEL_DEBUG", None)
    return env


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie no one reaped has ended too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def _wait_until(cond, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


# ============================================================================ 2. stops that stop
STAGE_CODE = r"""
import os, pathlib, subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
pathlib.Path("written_by_the_stage.txt").write_text("x")        # in the stage's work folder
pathlib.Path(sys.argv[1]).write_text(f"{os.getpid()} {grandchild.pid} {os.getcwd()}")
time.sleep(600)
"""

DRIVER = r"""
import sys
from wan_accel.checks import selftest
from wan_accel.cli import main
selftest.STAGES[:] = [selftest.Stage("sleeper", lambda ctx: ["-c", sys.argv[2], sys.argv[3]], 600, pytest=True)]
sys.exit(main(["selftest", "--out", sys.argv[1], "--json"]))
"""


@pytest.fixture
def reaped(tmp_path):
    """The stage processes a test starts (their pids in ``pids.txt``) are killed afterwards, whatever it found."""
    pids = tmp_path / "pids.txt"
    yield pids
    if pids.exists():
        for pid in pids.read_text().split(" ")[:2]:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


def test_sigterm_ends_the_stage_its_children_and_its_work_folder(tmp_path, reaped):
    """SIGTERM to a self-test in its stage: the stage's process and the process it started end, the work folder
    goes, selftest.json says unfinished, and the command exits 128 + SIGTERM with a line saying so."""
    out, pids = tmp_path / "st", reaped
    (out / "stages").mkdir(parents=True)
    (out / "selftest.json").write_text(json.dumps({"kind": "wan_accel.selftest", "passed": True, "finished": True}))
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(out), STAGE_CODE, str(pids)], cwd=tmp_path,
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert _wait_until(lambda: pids.exists() and pids.read_text().count(" ") == 2, 240), \
            failure_report(driver.communicate(timeout=1) if driver.poll() is not None else ("", "(still running)"))
        stage_pid, grandchild_pid, work = pids.read_text().split(" ")
        assert (Path(work) / "written_by_the_stage.txt").is_file()
        marked = json.loads((out / "selftest.json").read_text())      # before the first stage: not the old verdict
        assert marked["finished"] is False and marked["passed"] is False and marked["not_run"] == ["sleeper"]
        driver.send_signal(signal.SIGTERM)
        stdout, stderr = driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.communicate()
    assert driver.returncode == 128 + signal.SIGTERM, failure_report((driver.returncode, stdout, stderr))
    assert "stopped (SIGTERM)" in stderr and "Traceback" not in stderr, stderr
    assert _wait_until(lambda: _gone(int(stage_pid)) and _gone(int(grandchild_pid)), 15), \
        f"still running: stage {stage_pid} {not _gone(int(stage_pid))}, its child {not _gone(int(grandchild_pid))}"
    assert not Path(work).exists(), work
    saved = json.loads((out / "selftest.json").read_text())
    assert saved["finished"] is False and saved["stages"] == [] and saved["not_run"] == ["sleeper"]


def test_a_run_stopped_in_its_first_stage_leaves_no_earlier_verdict(tmp_path, monkeypatch):
    out = tmp_path / "st"
    (out / "stages").mkdir(parents=True)
    earlier = {"kind": "wan_accel.selftest", "passed": True, "finished": True, "stages": [{"stage": "one"}]}
    (out / "selftest.json").write_text(json.dumps(earlier))
    (out / "selftest.md").write_text("PASSED: an earlier run")
    old_log = out / "stages" / selftest.stage_file("one")
    old_log.write_text("$ one\nthe earlier run's output")
    mine = out / "stages" / "notes.txt"                  # not a name the self-test writes: kept
    mine.write_text("mine")

    def run_stage(stage, ctx, log=None):
        raise KeyboardInterrupt                          # stopped in the first stage
    monkeypatch.setattr(selftest, "STAGES", [selftest.Stage("one", lambda ctx: [], 10),
                                             selftest.Stage("two", lambda ctx: [], 10)])
    monkeypatch.setattr(selftest, "run_stage", run_stage)
    with pytest.raises(KeyboardInterrupt):
        selftest.run_selftest(out, log=lambda *_: None)
    saved = json.loads((out / "selftest.json").read_text())
    assert saved["passed"] is False and saved["finished"] is False and saved["stages"] == []
    assert saved["not_run"] == ["one", "two"]
    assert "UNFINISHED" in (out / "selftest.md").read_text()
    assert not old_log.exists() and mine.read_text() == "mine"


def test_an_empty_out_is_refused_never_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(selftest, "run_stage", lambda *a, **k: pytest.fail("a stage ran"))
    refused(run_cli_in(tmp_path, "selftest", "--out", ""), "--out is empty", "give an output folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_stage_is_stopped_with_its_process_group(tmp_path, reaped):
    """The mechanism alone: stop_group ends a stage started in its own session and the process it started."""
    pids = reaped
    proc = subprocess.Popen([sys.executable, "-c", STAGE_CODE, str(pids)], cwd=tmp_path, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert _wait_until(lambda: pids.exists() and pids.read_text().count(" ") == 2, 60)
        grandchild = int(pids.read_text().split(" ")[1])
        selftest.stop_group(proc, grace=5)
        assert proc.returncode is not None and _wait_until(lambda: _gone(grandchild), 10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ============================================================================ 5. outside modules that end the process
@pytest.fixture
def fresh_flash(monkeypatch):
    """FlashAttention looked up again (nothing remembered from an earlier test)."""
    from wan_accel.model import attention as att
    monkeypatch.setattr(att, "_FUNCS", {})
    monkeypatch.setattr(att, "_FROM", {})
    monkeypatch.setattr(att, "_PROBLEMS", {})
    for name in ("flash_attn_interface", "fa3_fwd_interface"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return att


def _modules(folder: Path, **sources) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in sources.items():
        (folder / f"{name}.py").write_text(text)
    return folder


def test_an_fa3_module_that_exits_while_imported_is_named_and_never_told_to_install(tmp_path, monkeypatch,
                                                                                     fresh_flash):
    monkeypatch.syspath_prepend(str(_modules(tmp_path / "mods", flash_attn_interface="import sys\nsys.exit(3)\n",
                                             fa3_fwd_interface="import missing_cuda_part_xyz\n")))
    line = refused(run_cli_in(tmp_path, *GEN, "--attention", "fa3", "--out", "o"), "flash_attn_interface",
                   "installed but fails", "SystemExit", "sys.exit(3)")
    assert "fa3_fwd_interface is installed but fails (ModuleNotFoundError: No module named 'missing_cuda_part_xyz')" \
        in line
    assert "pip install" not in line and "install fa3-fwd" not in line
    assert not (tmp_path / "o").exists()


def test_a_requested_backend_that_is_not_installed_is_a_usage_error(tmp_path, fresh_flash):
    from wan_accel.cache.guarded_import import installed
    if installed("flash_attn_interface") or installed("fa3_fwd_interface"):
        pytest.skip("a FlashAttention 3 package is installed here")
    line = refused(run_cli_in(tmp_path, *GEN, "--attention", "fa3", "--out", "o"), "attention backend 'fa3'",
                   "not installed", "install fa3-fwd")
    assert "installed but" not in line


def test_xformers_that_exits_while_imported_is_not_a_candidate_and_says_why(tmp_path, monkeypatch):
    from wan_accel.kernels import fa3_packages
    pkg = tmp_path / "mods" / "xformers"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("import sys\nsys.exit('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    monkeypatch.setattr(fa3_packages, "_LOADED", {})
    for name in [m for m in sys.modules if m == "xformers" or m.startswith("xformers.")]:
        monkeypatch.delitem(sys.modules, name)
    fn, why = fa3_packages.load("fa3_xformers")
    assert fn is None and "xformers is installed but does not import" in why and "sys.exit('no GPU here')" in why


def test_a_comfyui_module_that_exits_under_bench_native_is_a_skip_naming_it(tmp_path):
    comfy = tmp_path / "ComfyUI"
    (comfy / "comfy").mkdir(parents=True)
    (comfy / "comfy" / "__init__.py").write_text("")
    (comfy / "comfy" / "cli_args.py").write_text("import sys\nsys.exit(0)\n")
    proc = subprocess.run([sys.executable, "-m", "wan_accel", "bench", "native", "--comfyui", str(comfy), "--json",
                           "--repeat", "1"], cwd=tmp_path, env=_env(WAN_ACCEL_CACHE=str(tmp_path / "c.json")),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, failure_report(proc)
    data = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert data["skipped"] is True, data
    assert "comfy.cli_args is installed but does not import" in data["detail"] and "sys.exit(0)" in data["detail"]


def test_a_broken_matplotlib_is_named_never_told_to_install(tmp_path, monkeypatch):
    from wan_accel.profiling.history_view import PlotUnavailable, plot_history
    (tmp_path / "mods" / "matplotlib").mkdir(parents=True)
    (tmp_path / "mods" / "matplotlib" / "__init__.py").write_text("import sys\nsys.exit(4)\n")
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(PlotUnavailable) as info:
        plot_history([{"kind": "generate"}], tmp_path / "x.png")
    assert "matplotlib is installed but does not import (SystemExit" in str(info.value)
    assert "pip install" not in str(info.value) and not (tmp_path / "x.png").exists()


def test_the_guarded_import_lets_ctrl_c_through_and_keeps_no_half_module(tmp_path, monkeypatch):
    from wan_accel.cache.guarded_import import ImportProblem, guarded_import, try_import
    monkeypatch.syspath_prepend(str(_modules(tmp_path / "mods", r5_interrupts="raise KeyboardInterrupt\n",
                                             r5_exits="import sys\nsys.exit(2)\n",
                                             r5_raises="raise RuntimeError('no device\\nsecond line')\n")))
    with pytest.raises(KeyboardInterrupt):
        guarded_import("r5_interrupts")
    module, problem = try_import("r5_exits")
    assert module is None and problem.installed and "sys.exit(2)" in problem.reason and "r5_exits" not in sys.modules
    with pytest.raises(ImportProblem, match=r"r5_raises is installed but does not import \(RuntimeError: no device\)"):
        guarded_import("r5_raises")
    module, problem = try_import("r5_not_there_at_all")
    assert module is None and not problem.installed and "not installed" in str(problem)


# ============================================================================ 6. messages, exit codes, overwrites
def test_a_bad_out_is_named_as_typed(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (tmp_path / "elsewhere").write_text("keep")
    for name in ("video.webp", "video.mp4"):
        (out / name).symlink_to(tmp_path / "elsewhere")
    line = refused(run_cli_in(tmp_path, *GEN, "--out", "o", "--decode", "tiny"), "--out: o/video.", "symbolic link")
    assert "out_dir" not in line and (tmp_path / "elsewhere").read_text() == "keep"


LORA = FIXTURES / "longlive" / "lora_peft.safetensors"


@pytest.mark.parametrize("how", ["same path", "hard link", "linked folder", "dotted path"])
def test_convert_lora_never_writes_over_its_input(tmp_path, how):
    src = tmp_path / "lora.safetensors"
    shutil.copy(LORA, src)
    before = src.read_bytes()
    dst = {"same path": src, "dotted path": tmp_path / "." / "sub" / ".." / "lora.safetensors"}.get(how)
    (tmp_path / "sub").mkdir()
    if how == "hard link":
        dst = tmp_path / "other.safetensors"
        os.link(src, dst)
    elif how == "linked folder":
        (tmp_path / "alias").symlink_to(tmp_path, target_is_directory=True)
        dst = tmp_path / "alias" / "lora.safetensors"
    refused(run_cli("convert-lora", src, dst), "is the input SRC", "never writes over its input",
            "choose another DST")
    assert src.read_bytes() == before


def test_convert_never_writes_over_its_input(tmp_path):
    import torch
    from wan_accel.model.tiny import tiny_causal_model
    src = tmp_path / "tiny.pt"
    torch.save({"generator": tiny_causal_model(0, "cpu").state_dict()}, str(src))
    before = src.read_bytes()
    os.link(src, tmp_path / "tiny.safetensors")         # another name of the .pt
    refused(run_cli("convert", src, tmp_path / "tiny.safetensors", "--num-heads", "4"), "is the input SRC")
    assert src.read_bytes() == before


def test_a_krea_config_without_its_fixture_key_is_named(tmp_path):
    from test_hard_edges_round4 import _krea_copy
    folder = _krea_copy(tmp_path)
    cfg = json.loads((folder / "krea_config.json").read_text())
    del cfg["fixture"]
    (folder / "krea_config.json").write_text(json.dumps(cfg))
    refused(run_cli("check-reference", folder), "krea_config.json: no 'fixture' key", "incomplete")


# ---------------------------------------------------------------------------- the carry tools
def _tool(name: str, *args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOLS / f"{name}.py"), *map(str, args)], capture_output=True,
                          text=True, timeout=120, cwd=cwd, env={k: v for k, v in os.environ.items()
                                                                if k != "PYTHONPATH"})


def _one_error(proc, *words) -> str:
    assert proc.returncode == 2, failure_report(proc)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def _archive(path: Path, members: dict, links: dict | None = None, manifest: bool = True) -> Path:
    """A carry-like archive: ``members`` {name: text}, ``links`` {name: target} as symbolic links."""
    import io
    with tarfile.open(path, "w:xz") as tar:
        entries = dict(members, **({"manifest.json": json.dumps({"comfyui": {"version": "9"}})} if manifest else {}))
        for name, text in entries.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return path


GOOD = {"ComfyUI/comfy/sd.py": "X = 1\n", "site/tqdm/__init__.py": ""}


def test_unpack_refuses_a_file_as_dest(tmp_path):
    (tmp_path / "f").write_text("mine")
    _one_error(_tool("unpack_comfyui", "--archive", _archive(tmp_path / "a.tar.xz", GOOD), "--dest", tmp_path / "f"),
               "--dest", "is a file, not a folder")
    assert (tmp_path / "f").read_text() == "mine"


def test_unpack_refuses_an_archive_without_manifest(tmp_path):
    _one_error(_tool("unpack_comfyui", "--archive", _archive(tmp_path / "a.tar.xz", GOOD, manifest=False), "--dest",
                     tmp_path / "d"), "holds no manifest.json")


def test_unpack_refuses_a_truncated_archive(tmp_path):
    data = _archive(tmp_path / "a.tar.xz", {**GOOD, "ComfyUI/big.py": os.urandom(200000).hex()}).read_bytes()
    (tmp_path / "cut.tar.xz").write_bytes(data[: len(data) // 2])
    _one_error(_tool("unpack_comfyui", "--archive", tmp_path / "cut.tar.xz", "--dest", tmp_path / "d"),
               "not a complete carry archive", "copy it again")


@pytest.mark.parametrize("member", ["../escape.py", "/abs/escape.py", "pkg/wan_accel/__init__.py", "stubs/av/x.py",
                                    "ComfyUI/../../escape.py", "link"])
def test_unpack_refuses_a_hostile_member_and_unpacks_nothing(tmp_path, member):
    links = {"ComfyUI/link": "/etc"} if member == "link" else None
    members = dict(GOOD) if member == "link" else dict(GOOD, **{member: "print('replaced')\n"})
    archive = _archive(tmp_path / "a.tar.xz", members, links)
    _one_error(_tool("unpack_comfyui", "--archive", archive, "--dest", tmp_path / "d"), "which a carry archive never "
               "holds", "nothing was unpacked")
    assert not (tmp_path / "d" / "ComfyUI").exists() and not (tmp_path / "escape.py").exists()


def test_unpack_keeps_the_link_it_promises(tmp_path):
    """A second unpack into the same folder keeps pkg/wan_accel the link to this repository; something else there
    is refused, never used."""
    archive = _archive(tmp_path / "a.tar.xz", GOOD)
    first = _tool("unpack_comfyui", "--archive", archive, "--dest", tmp_path / "d")
    assert first.returncode == 0, failure_report(first)
    assert (tmp_path / "d" / "pkg" / "wan_accel").resolve() == REPO
    again = _tool("unpack_comfyui", "--archive", archive, "--dest", tmp_path / "d")
    assert again.returncode == 0, failure_report(again)
    (tmp_path / "d" / "pkg" / "wan_accel").unlink()
    (tmp_path / "d" / "pkg" / "wan_accel").mkdir()
    _one_error(_tool("unpack_comfyui", "--archive", archive, "--dest", tmp_path / "d"), "is not the link to this "
               "repository")


def test_carry_refuses_a_file_as_out(tmp_path):
    (tmp_path / "ComfyUI" / "comfy").mkdir(parents=True)
    (tmp_path / "ComfyUI" / "comfy" / "sd.py").write_text("")
    (tmp_path / "f").write_text("mine")
    _one_error(_tool("carry_comfyui", "--comfyui", tmp_path / "ComfyUI", "--out", tmp_path / "f", "--no-wheels"),
               "--out", "is a file, not a folder")
    _one_error(_tool("carry_comfyui", "--comfyui", tmp_path / "nothing", "--out", tmp_path / "o", "--no-wheels"),
               "--comfyui", "not found")
    assert (tmp_path / "f").read_text() == "mine"


# ============================================================================ 7. checked before a child or a model
def test_bench_compile_checks_the_stand_in_width_before_a_child(monkeypatch):
    from wan_accel.bench import compile as bench
    monkeypatch.setattr(bench, "run_child", lambda *a, **k: pytest.fail("a child was started"))
    line = refused(run_cli("bench", "compile", "--model", "standin", "--dim", "7", "--device", "cpu"), "--dim 7",
                   "multiple of 2", "e.g. 6 or 8")
    assert "shape" not in line


def test_bench_fidelity_sizes_a_fixture_before_building_it(tmp_path, monkeypatch):
    from wan_accel.bench import fidelity
    monkeypatch.setattr(fidelity, "_run", lambda *a, **k: pytest.fail("a model was built"))
    folder = Path(shutil.copytree(FIXTURES / "wan_reference", tmp_path / "fx"))
    cfg = json.loads((folder / "causal_config.json").read_text())
    cfg["config"]["dim"] = 10 ** 9
    (folder / "causal_config.json").write_text(json.dumps(cfg))
    line = refused(run_cli("bench", "fidelity", "--fixture", folder, "--json"), "causal_config.json",
                   "config.dim is 1000000000", "nothing was built")
    assert "overflow" not in line


def test_the_config_estimate_is_the_built_model_size():
    """The arithmetic estimate against the model built on the meta device, for the fixtures and the 1.3B and i2v
    14B presets (Wan's t2v and i2v blocks): within 1 %."""
    import math
    from wan_accel.memory.weights import config_parameters
    from wan_accel.model.checkpoint import expected_shapes
    from wan_accel.model.config import PRESETS, WanConfig
    configs = [json.loads((FIXTURES / "wan_reference" / "causal_config.json").read_text())["config"],
               PRESETS["wan2.1-1.3b"].to_dict(), PRESETS["wan2.1-i2v-14b"].to_dict()]
    for c in configs:
        built = sum(math.prod(s) for s in expected_shapes(WanConfig.from_dict(c)).values())
        assert abs(config_parameters(c) / built - 1) < 0.01, (c.get("dim"), config_parameters(c), built)


KILLED_WRITER = r"""
import sys, time
from wan_accel.cache.owned_files import new_temporary
print(new_temporary(sys.argv[1]), flush=True)
time.sleep(600)
"""


def _writer(tmp_path, target):
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(target)], stdout=subprocess.PIPE, text=True,
                            env=_env(), cwd=tmp_path)
    return proc, Path(proc.stdout.readline().strip())


def test_a_killed_writers_temporary_goes_with_the_next_write(tmp_path, monkeypatch):
    """A writer killed with SIGKILL leaves its temporary; the next write in that folder removes it at once (its
    lock is gone with the process), while a live writer's stays."""
    out = tmp_path / "o"
    out.mkdir()
    monkeypatch.setattr(owned_files, "LOCK_GRACE_SECONDS", 0.0)     # no wait for the lock-taking moment
    killed, left = _writer(tmp_path, out / "video.webp")
    alive, kept = _writer(tmp_path, out / "latents.safetensors")
    try:
        killed.kill()
        killed.wait()
        assert left.is_file() and kept.is_file()
        owned_files.write_text(out / "report.json", "{}")
        assert not left.exists(), sorted(p.name for p in out.iterdir())
        assert kept.exists()                      # its writer lives and holds the lock
    finally:
        for p in (killed, alive):
            p.kill()
            p.wait()
    owned_files.write_text(out / "report.json", "{}")
    assert sorted(p.name for p in out.iterdir()) == ["report.json"]


# ============================================================================ 8. what a failure says; PyAV's stand-in
def test_a_failure_report_keeps_the_part_that_says_why():
    noise = "".join(f"progress line {i}\n" for i in range(2000))
    proc = subprocess.CompletedProcess(["x"], 0, "{}", noise[:20000] + "Traceback (most recent call last):\n"
                                       "  File 'x.py'\nZeroDivisionError: the cause\n" + noise)
    text = failure_report(proc)
    assert "exit 0" in text and "ZeroDivisionError: the cause" in text and text.count("\n") < 400
    timed = subprocess.TimeoutExpired(["python", "-m", "wan_accel"], 300, output=b"rows", stderr=b"a slow row\n")
    text = failure_report(timed)
    assert "did not finish within 300 s" in text and "a slow row" in text


def test_the_pyav_stand_in_never_passes_for_pyav(tmp_path):
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import av; "
            "from wan_accel.cache.video_file import have_av, video_format_for; "
            "print(av.__name__, have_av(), video_format_for('mp4'))")
    proc = subprocess.run([sys.executable, "-c", code, str(TOOLS / "comfy_stubs")], capture_output=True, text=True,
                          env=_env(), timeout=120)
    assert proc.returncode == 0, failure_report(proc)
    assert proc.stdout.split() == ["av", "False", "webp"], proc.stdout
