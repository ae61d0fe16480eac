"""One writer for every file the pack writes (cache/owned_files.py), and node inputs that name files stay inside
ComfyUI's folders.

The writer writes only a regular file (or a new name) that is not one of the limit cache's files, through a
temporary file and a rename (appends: without following a link); links, pipes, devices and folders are refused
before anything is opened. The command line refuses such a target before any work with ``error: --OPTION: ...``
and exit 2.
"""
from __future__ import annotations

import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

from cli_run import run_cli_in
from wan_accel.cache import LimitCache
from wan_accel.cache.owned_files import (OwnedFileError, append_line, check_target, write_json, write_text,
                                         write_with)
from wan_accel.cli import main

CLI_TIMEOUT_S = 120     # a command that blocks on a pipe fails the test instead of hanging it


def _cli(args, tmp_path, env_cache=True, **env):
    full = dict(os.environ, **env)
    if env_cache:
        full["WAN_ACCEL_CACHE"] = str(tmp_path / "cache")
    else:
        full.pop("WAN_ACCEL_CACHE", None)
    return subprocess.run([sys.executable, "-m", "wan_accel", *map(str, args)], capture_output=True, text=True,
                          timeout=CLI_TIMEOUT_S, env=full, cwd=str(tmp_path))


def _filled_cache(path: Path) -> bytes:
    cache = LimitCache(path)
    cache.put("memory", "learned", {"limit": 123})
    return path.read_bytes()


# ------------------------------------------------------------------------------------ doctor --report
@pytest.mark.parametrize("target", ["cache", "cache_default_place", "lock", "set_aside", "corrupt_copy", "fifo",
                                    "folder", "symlink"])
def test_doctor_report_is_refused_before_any_probe(tmp_path, target):
    env_cache = target != "cache_default_place"
    cache = (tmp_path / "cache" / "limits.json" if env_cache
             else tmp_path / "xdg" / "wan_accel" / "limits.json")   # platformdirs' place under XDG_CACHE_HOME
    before = _filled_cache(cache)
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("somebody else's file")
    path = {"cache": cache, "cache_default_place": cache, "lock": Path(str(cache) + ".lock"),
            "set_aside": Path(str(cache) + ".set-aside.json"),
            "corrupt_copy": Path(str(cache) + ".corrupt-20250101-000000"), "fifo": tmp_path / "pipe",
            "folder": tmp_path / "folder", "symlink": tmp_path / "link.json"}[target]
    if target in ("set_aside", "corrupt_copy"):
        path.write_bytes(b'{"kept": "for the user"}')
    elif target == "fifo":
        os.mkfifo(path)
    elif target == "folder":
        path.mkdir()
    elif target == "symlink":
        path.symlink_to(elsewhere)
    kept = {p: p.read_bytes() for p in path.parent.iterdir() if p.is_file() and not p.is_symlink()}
    argv = ["doctor", "--report", path, "--device", "cpu", "--feature", "block_swap"]
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg"), "WAN_ACCEL_CACHE": str(tmp_path / "cache") if env_cache else None}
    if target == "fifo":          # a pipe opened by mistake would block: in a child with a time limit
        r = _cli(argv, tmp_path, env_cache=env_cache, XDG_CACHE_HOME=env["XDG_CACHE_HOME"])
        code, out, err = r.returncode, r.stdout, r.stderr
    else:
        code, out, err = run_cli_in(tmp_path, *argv, env=env)
    assert code == 2, err
    assert err.startswith("error: --report: "), err
    assert "Traceback" not in err and str(path.name) in err
    assert cache.read_bytes() == before                        # every learned limit kept, byte for byte
    assert elsewhere.read_text() == "somebody else's file"
    assert {p: p.read_bytes() for p in kept} == kept
    assert out == ""                                           # refused before any probe printed its table


def test_doctor_report_api_refuses_the_cache_and_writes_a_regular_file(tmp_path, cache_path):
    from wan_accel.app.doctor.core import doctor_for
    from wan_accel.app.doctor.report import write_report

    before = _filled_cache(cache_path)
    doctor = doctor_for("cpu", torch.float32, 128, cache=LimitCache(cache_path))
    with pytest.raises(OwnedFileError, match="the limit cache file"):
        write_report(cache_path, doctor, [])
    assert cache_path.read_bytes() == before
    out = tmp_path / "report.json"
    out.write_text("an old report")
    write_report(out, doctor, [])
    assert out.read_text().startswith("{") and '"wan_accel.doctor_report"' in out.read_text()


# ------------------------------------------------------------------------------------ generate --out
def test_generate_out_with_a_symlinked_report_is_refused_before_work(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text("not the pack's")
    (out / "report.json").symlink_to(elsewhere)
    code, _out, err = run_cli_in(tmp_path, "generate", "--out", out, "--frames", "9", "--height", "32", "--width",
                                 "32", "--no-preview")
    assert code == 2, err
    assert err.startswith("error: --out: ") and "report.json" in err and "symbolic link" in err
    assert elsewhere.read_text() == "not the pack's"
    assert sorted(p.name for p in out.iterdir()) == ["report.json"]    # no latents: nothing ran


@pytest.mark.parametrize("name", ["latents.safetensors", "preview.webp", "report.json"])
@pytest.mark.parametrize("kind", ["symlink", "folder", "fifo"])
def test_generate_api_checks_every_output_before_loading(tmp_path, name, kind, monkeypatch):
    from wan_accel.app.jobs import generate

    out = tmp_path / "out"
    out.mkdir()
    elsewhere = tmp_path / "elsewhere.bin"
    elsewhere.write_bytes(b"keep")
    {"symlink": lambda p: p.symlink_to(elsewhere), "folder": lambda p: p.mkdir(),
     "fifo": lambda p: os.mkfifo(p)}[kind](out / name)
    loaded = []
    monkeypatch.setattr("wan_accel.app.jobs.handle.load_model_handle", lambda *a, **k: loaded.append(1))
    with pytest.raises(OwnedFileError, match=f"out_dir: .*{name}"):
        generate.run_generate(generate.GenerateOptions(out_dir=str(out), frames=9, height=32, width=32,
                                                       preview=False), log=lambda *_: None)
    assert not loaded and elsewhere.read_bytes() == b"keep"


# ------------------------------------------------------------------------------------ metrics history
def _record():
    from wan_accel.profiling import history

    return history.make_record("bench", label="x", fingerprint="test")


def test_history_symlinked_elsewhere_drops_the_line_with_one_warning(tmp_path, cache_path):
    from wan_accel.profiling import history

    elsewhere = tmp_path / "elsewhere.jsonl"
    elsewhere.write_text("somebody's lines\n")
    cache_path.parent.mkdir(parents=True)
    (cache_path.parent / "history.jsonl").symlink_to(elsewhere)
    with pytest.warns(history.HistoryWarning, match=r"history\.jsonl: this run's line was dropped .*symbolic link"):
        assert history.append(_record()) is None
    assert elsewhere.read_text() == "somebody's lines\n"


def test_generate_runs_on_with_a_symlinked_history(tmp_path, cache_path, capsys):
    elsewhere = tmp_path / "elsewhere.jsonl"
    elsewhere.write_text("somebody's lines\n")
    cache_path.parent.mkdir(parents=True)
    (cache_path.parent / "history.jsonl").symlink_to(elsewhere)
    out = tmp_path / "out"
    assert main(["generate", "--out", str(out), "--frames", "9", "--height", "32", "--width", "32",
                 "--no-preview"]) == 0
    err = capsys.readouterr().err
    dropped = [ln for ln in err.splitlines() if "history.jsonl" in ln]
    assert len(dropped) == 1 and dropped[0].startswith("warning:") and "dropped" in dropped[0], err
    assert elsewhere.read_text() == "somebody's lines\n"
    assert (out / "report.json").is_file()


def test_history_line_dropped_on_lock_timeout_is_announced(tmp_path, monkeypatch):
    from filelock import FileLock

    from wan_accel.profiling import history

    path = tmp_path / "h.jsonl"
    history.append(_record(), path=path)
    before = path.read_bytes()
    monkeypatch.setattr(history, "LOCK_TIMEOUT_S", 0.05)
    holder = FileLock(str(path) + ".lock")
    with holder:
        # another thread's lock object: filelock locks are per object, so this one must wait
        import threading

        result, caught = [], []

        def other():
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                result.append(history.append(_record(), path=path))
            caught.extend(w)

        t = threading.Thread(target=other)
        t.start()
        t.join(30)
    assert result == [None]
    texts = [str(w.message) for w in caught if issubclass(w.category, history.HistoryWarning)]
    assert len(texts) == 1 and str(path) in texts[0] and "dropped" in texts[0] and "lock" in texts[0]
    assert path.read_bytes() == before


# ------------------------------------------------------------------------------------ the writer itself
def test_a_write_that_fails_midway_leaves_the_old_file_intact(tmp_path):
    target = tmp_path / "report.json"
    target.write_text("the old, complete report")

    def half(tmp):
        Path(tmp).write_text("half a rep")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        write_with(target, half)
    assert target.read_text() == "the old, complete report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]     # no temporary file left behind
    write_json(target, {"a": 1})
    assert target.read_text() == '{\n  "a": 1\n}\n'


@pytest.mark.parametrize("writer", ["write_text", "append_line"])
@pytest.mark.parametrize("kind", ["symlink", "dangling_symlink", "fifo", "folder", "device"])
def test_links_pipes_devices_and_folders_are_refused(tmp_path, writer, kind):
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("keep")
    path = tmp_path / "target"
    if kind == "symlink":
        path.symlink_to(elsewhere)
    elif kind == "dangling_symlink":
        path.symlink_to(tmp_path / "would_be_created")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    else:
        path = Path(os.devnull)
    call = (lambda: write_text(path, "x", option="--thing")) if writer == "write_text" else \
        (lambda: append_line(path, "x", option="--thing"))
    with pytest.raises(OwnedFileError, match=r"^--thing: ") as exc:
        call()
    assert {"symlink": "symbolic link", "dangling_symlink": "symbolic link", "fifo": "a pipe",
            "folder": "a folder", "device": "a device"}[kind] in str(exc.value) or "system folder" in str(exc.value)
    assert elsewhere.read_text() == "keep" and not (tmp_path / "would_be_created").exists()


@pytest.mark.parametrize("name", ["limits.json", "limits.json.lock", "limits.json.set-aside.json",
                                  "limits.json.corrupt-20250101-000000", ".limits.json.abc.tmp", "history.jsonl",
                                  "history.jsonl.lock", "inductor/fx.bin", "compile_artifacts/x.bin"])
def test_the_limit_cache_files_are_never_a_target(cache_path, name):
    with pytest.raises(OwnedFileError, match="limit cache|metrics history"):
        check_target(cache_path.parent / name, option="--report", purpose="the report")
    other = cache_path.parent.parent / "mine" / "limits.json"          # a cache in use that is not the default
    with pytest.raises(OwnedFileError, match="limit cache"):
        check_target(other.parent / name, option="--report", cache_path=other)
    check_target(cache_path.parent / "report.json", option="--report")   # the folder itself is fine


def test_append_adds_one_line_to_a_regular_file_and_ends_a_torn_one(tmp_path):
    path = tmp_path / "log.jsonl"
    append_line(path, '{"a":1}')
    path.write_bytes(path.read_bytes() + b'{"torn')
    append_line(path, b'{"b":2}\n')
    assert path.read_bytes() == b'{"a":1}\n{"torn\n{"b":2}\n'
    hard = tmp_path / "hard.jsonl"
    os.link(path, hard)
    with pytest.raises(OwnedFileError, match="hard links"):
        append_line(path, "x")
    write_text(tmp_path / "new" / "deep.txt", "made")                  # folders are created
    assert (tmp_path / "new" / "deep.txt").read_text() == "made"


def test_history_plot_target_is_checked_up_front(tmp_path, capsys):
    os.mkfifo(tmp_path / "plot.png")
    assert main(["report", "--plot", str(tmp_path / "plot.png")]) == 2
    assert capsys.readouterr().err.startswith("error: --plot: ")


# ------------------------------------------------------------------------------------ nodes stay inside
@pytest.fixture
def comfy_folders(tmp_path, monkeypatch):
    inp, models = tmp_path / "input", tmp_path / "models"
    inp.mkdir()
    models.mkdir()
    fake = types.ModuleType("folder_paths")
    fake.get_input_directory = lambda: str(inp)
    fake.get_output_directory = lambda: str(tmp_path / "output")

    def full_path(kind, name):   # as ComfyUI: the name is taken relative to the folder
        p = models / os.path.relpath(os.path.join("/", name), "/")
        return str(p) if p.is_file() else None

    fake.get_full_path = full_path
    monkeypatch.setitem(sys.modules, "folder_paths", fake)
    return inp, models


class _Model:
    def __init__(self):
        self.model_options = {}

    def clone(self):
        return _Model()


@pytest.mark.parametrize("name, reason", [("../secret.safetensors", "climbs out"),
                                          ("{outside}", "absolute path"),
                                          ("link.safetensors", "leads out of ComfyUI's input folder"),
                                          ("sub/../../secret.safetensors", "climbs out"),
                                          ("missing.safetensors", "no file")])
def test_recorded_run_node_reads_only_inside_the_input_folder(tmp_path, comfy_folders, name, reason):
    from safetensors.torch import save_file

    from wan_accel.nodes.native_nodes import WanRecordedRun

    inp, _ = comfy_folders
    secret = tmp_path / "secret.safetensors"
    save_file({"initial_noise": torch.zeros(1, 2, 16, 2, 2), "context": torch.zeros(1, 3, 8)}, str(secret))
    (inp / "link.safetensors").symlink_to(secret)
    with pytest.raises(ValueError, match=reason):
        WanRecordedRun().load(_Model(), name.format(outside=secret))
    (inp / "inside.safetensors").write_bytes(secret.read_bytes())
    _, noise, _, latent = WanRecordedRun().load(_Model(), "inside.safetensors")
    assert latent["samples"].shape == (1, 16, 2, 2, 2)


@pytest.mark.parametrize("module", ["model_nodes", "memory_nodes"])
def test_checkpoint_names_resolve_only_inside_the_models_folder(tmp_path, comfy_folders, module):
    import importlib

    resolve = importlib.import_module(f"wan_accel.nodes.{module}")._resolve_checkpoint
    _, models = comfy_folders
    (models / "a.safetensors").write_bytes(b"x")
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"x")
    assert resolve("a.safetensors") == str(models / "a.safetensors")
    for name, reason in ((str(outside), "absolute path"), ("../outside.safetensors", "climbs out"),
                         ("nope.safetensors", "no file")):
        with pytest.raises(ValueError, match=f"checkpoint.*{reason}"):
            resolve(name)


def test_profile_node_subfolder_may_not_lead_out_through_a_link(tmp_path, comfy_folders):
    from wan_accel.nodes.profile_nodes import _out_dir

    (tmp_path / "output").mkdir()
    (tmp_path / "output" / "traces").symlink_to(tmp_path)
    with pytest.raises(ValueError, match="leads out of the output folder"):
        _out_dir("traces")
    assert _out_dir("wan_accel_profiles") == tmp_path / "output" / "wan_accel_profiles"


# ----------------------------------------------------------------------------------------------- compile artifacts
def test_compile_artifacts_never_follow_a_link(tmp_path, monkeypatch):
    """The warm start's artifact file beside the cache: saving replaces a planted link instead of writing through
    it, and loading reads only the regular file the pack wrote (a link to another file is ignored)."""
    import torch

    from wan_accel.cache import LimitCache
    from wan_accel.compile import warm_start as ws

    cache = LimitCache(tmp_path / "cache" / "limits.json")
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"not the pack's")
    w = ws.WarmStart(cache, "key-a")
    w.path.parent.mkdir(parents=True)
    w.path.symlink_to(victim)
    monkeypatch.setattr(ws.compat, "has_mega_cache", lambda: True)
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts", None), raising=False)
    monkeypatch.setattr(ws.compat, "cache_info_counts", lambda info: {"inductor": 1})
    assert w.save() == {"inductor": 1}
    assert victim.read_bytes() == b"not the pack's"                   # the link was replaced, not written through
    assert not w.path.is_symlink() and w.path.read_bytes() == b"artifacts"

    loaded = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda blob: loaded.append(blob) or None,
                        raising=False)
    w.path.unlink()
    w.path.symlink_to(victim)                                         # a link planted after the save
    ws._LOADED.discard("key-a")
    assert ws.WarmStart(cache, "key-a").load() == {} and loaded == []
    w.path.unlink()
    w.path.write_bytes(b"artifacts")
    ws._LOADED.discard("key-a")
    ws.WarmStart(cache, "key-a").load()
    assert loaded == [b"artifacts"]


def test_pipes_where_the_pack_keeps_its_files_never_block_a_read(tmp_path):
    """A FIFO planted as the metrics history or the lock's owner note: `report` answers at once (one error line,
    exit 2) and a cache write goes on (the owner note is skipped) instead of waiting for a writer forever."""
    folder = tmp_path / "cache"
    folder.mkdir()
    os.mkfifo(folder / "history.jsonl")
    out = _cli(["report"], tmp_path)
    assert out.returncode == 2 and "history.jsonl" in out.stderr and "Traceback" not in out.stderr, out.stderr
    os.mkfifo(folder / "limits.json.lock.owner")
    code = ("import sys\nfrom wan_accel.cache import LimitCache\n"
            "c = LimitCache(sys.argv[1]); c.put('memory', 'k', {'size': 1}); print(c.get('memory', 'k'))")
    done = subprocess.run([sys.executable, "-c", code, str(folder / "limits.json")], capture_output=True, text=True,
                          timeout=CLI_TIMEOUT_S)
    assert done.returncode == 0 and "'size': 1" in done.stdout, done.stderr


# ----------------------------------------------------------------------------------- JSON nested too deeply
_DEEP = "[" * 100_000 + "]" * 100_000     # past any recursion limit of the json module


def test_json_readers_turn_deep_nesting_into_a_damaged_file_error():
    import json

    from wan_accel.cache.owned_files import loads_json
    with pytest.raises(json.JSONDecodeError, match="nested too deeply"):
        loads_json('{"a": ' + _DEEP + "}")
    assert loads_json('{"a": [[1]]}') == {"a": [[1]]}


def _deep_checkpoint(tmp_path) -> Path:
    from safetensors.torch import save_file

    from wan_accel.model.checkpoint import COMFY_METADATA_KEY
    path = tmp_path / "deep.safetensors"
    save_file({"x": torch.zeros(2)}, str(path), metadata={COMFY_METADATA_KEY: '{"dim": ' + _DEEP + "}"})
    return path


@pytest.mark.parametrize("case", ["checkpoint", "history", "cache", "fixtures"])
def test_deeply_nested_json_in_an_input_file_is_one_error_line(tmp_path, case):
    """Every file the command line reads as JSON (a checkpoint's metadata, the metrics history, the limit cache,
    reference fixtures): nesting deeper than the parser follows names the file as damaged, never 'maximum
    recursion depth' with exit 1."""
    if case == "checkpoint":
        proc = _cli(["plan", "--checkpoint", _deep_checkpoint(tmp_path)], tmp_path)
    elif case == "history":
        (tmp_path / "h.jsonl").write_text('{"kind": "generate", "a": ' + _DEEP + "}\n")
        proc = _cli(["report", "--history", tmp_path / "h.jsonl"], tmp_path)
    elif case == "cache":       # not named limits.json: its content is read to tell whether it is a cache
        (tmp_path / "mine.json").write_text('{"kind": ' + _DEEP + "}")
        proc = subprocess.run([sys.executable, "-m", "wan_accel", "cache", "show"], capture_output=True, text=True,
                              timeout=CLI_TIMEOUT_S, cwd=str(tmp_path),
                              env=dict(os.environ, WAN_ACCEL_CACHE=str(tmp_path / "mine.json")))
    else:
        (tmp_path / "fx").mkdir()
        (tmp_path / "fx" / "a_config.json").write_text('{"dim": ' + _DEEP + "}")
        proc = _cli(["check-reference", tmp_path / "fx"], tmp_path)
    err = proc.stderr
    assert "Traceback" not in err and "recursion" not in err and "internal error" not in err, err
    if case == "history":       # a damaged line of the history is skipped with a warning
        assert proc.returncode == 0 and "skipped 1 corrupt line" in err, err
    elif case == "cache":       # not the pack's file: left untouched, the command goes on without a cache
        assert proc.returncode == 0 and "nested too deeply" in err, err
        assert (tmp_path / "mine.json").read_text().startswith('{"kind": [[[')
    else:
        assert proc.returncode == 2 and len([ln for ln in err.splitlines() if ln.startswith("error:")]) == 1, err


def test_a_pipe_named_like_a_fixture_config_never_blocks(tmp_path):
    if not hasattr(os, "mkfifo"):
        pytest.skip("no named pipes here")
    (tmp_path / "fx").mkdir()
    os.mkfifo(tmp_path / "fx" / "a_config.json")
    proc = _cli(["check-reference", tmp_path / "fx"], tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: no recognised fixture config"), proc.stderr
