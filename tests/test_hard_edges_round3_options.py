"""Hard edges, round three (issue 32, classes 4 and 6-9): options that do not apply are refused instead of ignored,
the user's own files get their own reader and messages, LoRA and fp8 edges are named, the pack's files are cleaned
and bounded, and every name and figure in a message is the right one.

Each test drives the command line (``wan_accel.cli.main``, in process: one ``error:`` line and exit 2), the nodes or
the live session with the tiny built-in model.
"""
from __future__ import annotations

import json
import os
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from cli_run import WORLD_VARS, refused, run_cli
from wan_accel.app.validate import UsageError
from wan_accel.cli import main


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("WAN_ACCEL_CACHE", str(tmp_path / "cache" / "limits.json"))
    for k in WORLD_VARS:
        monkeypatch.delenv(k, raising=False)


def _refused(argv, *words) -> str:
    """The command exits 2 with one ``error:`` line holding every word (no traceback, no internal error)."""
    return refused(run_cli(*argv), *words)


GEN = ["generate", "--device", "cpu", "--frames", "9", "--height", "32", "--width", "32", "--no-preview"]


def _tiny_handle():
    from wan_accel.app.jobs.handle import load_model_handle
    return load_model_handle(None, "fp32", "float32", "sdpa", "cpu")


# ------------------------------------------------------------------------------- 4. options silently ignored
@pytest.mark.parametrize("extra", [["--preset", "krea", "--sink", "3"], ["--recache", "krea", "--sink", "1"],
                                   ["--recache", "krea", "--kv-window", "9", "--sink", "3"],
                                   ["--preset", "krea", "--kv-window", "8", "--sink", "2"]])
def test_sink_with_krea_is_refused_not_ignored(tmp_path, extra):
    line = _refused(GEN + ["--frames", "21", "--out", tmp_path / "o", *extra], "--sink", "krea",
                    "--sink 0")
    assert "no sink frames" in line
    assert not (tmp_path / "o" / "report.json").exists()


def test_krea_window_advice_passes_the_next_check(tmp_path):
    # kv_window 4 with sink 3 used to be told "sink at most 1", which krea refuses next; now one message whose
    # advice passes every check
    base = GEN + ["--recache", "krea", "--kv-window", "4", "--out", tmp_path / "o"]
    _refused(base + ["--sink", "3"], "--sink 3", "--sink 0")
    line = _refused(base + ["--sink", "0"], "--kv-window 4", "at least 5")
    assert main(GEN + ["--recache", "krea", "--kv-window", "5", "--out", str(tmp_path / "ok")]) == 0, line
    report = json.loads((tmp_path / "ok" / "report.json").read_text())
    assert report["settings"]["sink"] == 0 and report["settings"]["recache"] == "krea"


@pytest.mark.parametrize("extra, option", [(["--compile"], "--compile"), (["--cuda-graphs", "off"], "--cuda-graphs"),
                                           (["--no-fused-kernels"], "--no-fused-kernels"),
                                           (["--ops", "torch"], "--ops torch")])
@pytest.mark.parametrize("sampler", ["reference", "auto"])
def test_optimized_sampler_options_with_the_reference_sampler_are_refused(tmp_path, extra, option, sampler):
    _refused(GEN + ["--sampler", sampler, "--out", tmp_path / "o", *extra], option, "reference sampler",
             "--sampler optimized")
    assert not (tmp_path / "o").exists()
    if sampler == "reference" and option == "--compile":       # without it: the report records what ran
        assert main(GEN + ["--sampler", "reference", "--out", str(tmp_path / "o")]) == 0
        s = json.loads((tmp_path / "o" / "report.json").read_text())["settings"]
        assert s["compile"] is False and s["sampler"] == "reference"


@pytest.mark.parametrize("extra, words", [(["--recache", "none"], ["--recache none", "--prompt-schedule"]),
                                          (["--recache", "switch"], ["--recache switch", "--prompt-schedule"]),
                                          (["--num-heads", "4"], ["--num-heads 4", "--checkpoint"])])
def test_options_for_another_input_are_refused_without_it(tmp_path, extra, words):
    _refused(GEN + ["--out", tmp_path / "o", *extra], *words)


def test_bench_compile_refuses_stand_in_sizes_for_the_wan_model():
    _refused(["bench", "compile", "--blocks", "7", "--device", "cpu"], "--blocks", "--model standin")
    _refused(["bench", "compile", "--model", "wan", "--dim", "64", "--device", "cpu"], "--dim",
             "--model standin")


def test_sampler_node_refuses_sink_with_krea():
    from wan_accel.nodes.model_nodes import CausalWanSampler
    with pytest.raises(ValueError, match=r"^sink 3 does not apply to recache krea"):
        CausalWanSampler().sample(_tiny_handle(), 32, 32, 21, 0, "self_forcing", 3, 6, 3, recache="krea")


# ------------------------------------------------------------------- leftover: AR Sampler kv_window 0
@pytest.fixture
def fake_comfy(monkeypatch):
    comfy = types.ModuleType("comfy")
    samplers = types.ModuleType("comfy.samplers")

    class KSAMPLER:
        def __init__(self, fn, extra_options=None):
            self.fn, self.extra_options = fn, extra_options

    samplers.KSAMPLER = KSAMPLER
    comfy.samplers = samplers
    monkeypatch.setitem(sys.modules, "comfy", comfy)
    monkeypatch.setitem(sys.modules, "comfy.samplers", samplers)


@pytest.mark.parametrize("kw, says", [(dict(kv_window=0), "kv_window 0 is too small"),
                                      (dict(kv_window=2), "kv_window 2 is too small"),
                                      (dict(kv_window=-1, sink=2), "sink 2 needs a rolling window"),
                                      (dict(kv_window=6, sink=4), "sink at most 3"),
                                      (dict(frames_per_block=0), "frames_per_block must be between")])
def test_ar_sampler_node_checks_the_window_like_every_entry_point(fake_comfy, kw, says):
    from wan_accel.nodes.native_nodes import WanAccelARSampler
    with pytest.raises(ValueError, match=says):
        WanAccelARSampler().get_sampler(**kw)
    assert WanAccelARSampler().get_sampler(kv_window=6, sink=3)[0].extra_options["kv_window"] == 6


# ------------------------------------------------------------------------- 6. the user's own files
def _sched_cli(tmp_path, value, *words):
    return _refused(GEN + ["--out", tmp_path / "o", "--prompt-schedule", value], *words)


def test_schedule_that_is_a_folder_pipe_or_device_gets_its_own_message(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "zero").symlink_to("/dev/zero")
    (tmp_path / "folder").mkdir()
    for value, kind in ((tmp_path / "folder", "a folder"), (tmp_path / "fifo", "a pipe"),
                        (tmp_path / "zero", "a device"), ("~", "a folder")):
        line = _sched_cli(tmp_path, value, "--prompt-schedule", kind)
        assert "remove" not in line and "delete" not in line and "makes the file again" not in line, line
    assert (tmp_path / "folder").is_dir() and (tmp_path / "fifo").exists() and (tmp_path / "zero").is_symlink()


@pytest.mark.parametrize("value", ["./my:sched.txt", "notes/sched:v2.txt", "a cat walks", "~/missing.txt"])
def test_a_missing_schedule_file_is_not_parsed_as_schedule_text(tmp_path, capsys, value):
    line = _sched_cli(tmp_path, value, "--prompt-schedule", "no such file")
    assert "line 1" not in line
    if value.startswith("./"):            # the same name, once the file exists, is read as the file
        f = tmp_path / value[2:]
        f.write_text("0: a cat\n1: a dog (blend 1)\n")
        monkey_cwd = os.getcwd()
        os.chdir(tmp_path)
        try:
            for v in (value, "0: a cat\n1: a dog", "0: a cat"):
                assert main(GEN + ["--frames", "21", "--out", str(tmp_path / "o"), "--prompt-schedule", v]) == 0, \
                    capsys.readouterr().err
        finally:
            os.chdir(monkey_cwd)


def test_schedule_files_too_large_unreadable_or_not_utf8(tmp_path):
    big = tmp_path / "big.txt"
    big.write_bytes(b"0: a cat\n" + b"#" * (2 << 20))
    _sched_cli(tmp_path, big, "--prompt-schedule", "bytes")
    latin = tmp_path / "latin.txt"
    latin.write_bytes("0: caf\xe9".encode("latin-1"))
    _sched_cli(tmp_path, latin, "--prompt-schedule", "not UTF-8", "0xe9")
    if os.geteuid() != 0:
        locked = tmp_path / "locked.txt"
        locked.write_text("0: a cat")
        locked.chmod(0)
        _sched_cli(tmp_path, locked, "--prompt-schedule", "permission denied")


def test_a_non_utf8_prompt_on_the_command_line_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    import wan_accel.app.jobs.handle as handle
    monkeypatch.setattr(handle, "load_model_handle", lambda *a, **k: pytest.fail("the model was loaded"))
    text = b"0: caf\xe9 au lait".decode("utf-8", "surrogateescape")     # as Python passes such argv bytes
    _sched_cli(tmp_path, text, "--prompt-schedule", "not UTF-8")
    _refused(GEN + ["--out", tmp_path / "o", "--steps", b"1000,\xff".decode("utf-8", "surrogateescape")],
             "--steps", "not UTF-8")


@pytest.mark.parametrize("text, says, not_says", [
    ("0: a cat\nsix: a dog", "whole number", "blend"),
    ("0: a cat\n1.5: a dog", "whole number", "blend"),
    ("0: a cat\n3: a dog (blend two)", "(blend 2)", None),
    ("0: a cat\n" + "9" * 100_000 + ": a dog", "100,007 characters", None),
    ("0: a cat\n" + "7" * 5000 + ": a dog", "far larger", None),
    ("0: a cat\n3: a dog (blend " + "4" * 50_000 + ")", "far larger", None),
])
def test_bad_chunk_numbers_get_advice_that_fits_and_are_never_echoed_whole(tmp_path, text, says, not_says):
    f = tmp_path / "s.txt"
    f.write_text(text)
    line = _sched_cli(tmp_path, f, "--prompt-schedule", says)
    assert len(line) < 600
    if not_says:
        assert not_says not in line


# ----------------------------------------------------------------------------------- 7. LoRA and fp8 edges
def _lora(path, rank=2, alpha=None, dtype=torch.float32, layers=("blocks.0.ffn.0",)):
    from wan_accel.model.tiny import TINY_CONFIG
    d, f = TINY_CONFIG.dim, TINY_CONFIG.ffn_dim
    t = {}
    for layer in layers:
        t[f"diffusion_model.{layer}.lora_A.weight"] = (torch.randn(rank, d) * 0.01).to(dtype)
        t[f"diffusion_model.{layer}.lora_B.weight"] = (torch.randn(f, rank) * 0.01).to(dtype)
        if alpha is not None:
            t[f"diffusion_model.{layer}.alpha"] = torch.tensor(float(alpha))
    save_file(t, str(path))
    return path


def _tiny_checkpoint(path):
    from checkpoint_files import save_wan_checkpoint
    from wan_accel.model.tiny import tiny_causal_model
    save_wan_checkpoint(tiny_causal_model(seed=3), path)
    return path


@pytest.mark.parametrize("kind, says", [("rank0", "rank 0"), ("alpha0", "alpha 0"), ("alpha-neg", "alpha -2"),
                                        ("fp8", "float8_e4m3fn"), ("int", "int32")])
def test_bad_lora_files_are_refused_by_name_everywhere(tmp_path, kind, says):
    p = tmp_path / "l.safetensors"
    if kind == "int":
        save_file({"diffusion_model.blocks.0.ffn.0.lora_A.weight": torch.ones(2, 4, dtype=torch.int32),
                   "diffusion_model.blocks.0.ffn.0.lora_B.weight": torch.ones(4, 2, dtype=torch.int32)}, str(p))
    else:
        _lora(p, rank=0 if kind == "rank0" else 2,
              alpha={"alpha0": 0, "alpha-neg": -2}.get(kind),
              dtype=torch.float8_e4m3fn if kind == "fp8" else torch.float32)
    ckpt = _tiny_checkpoint(tmp_path / "m.safetensors")
    _refused(GEN + ["--checkpoint", ckpt, "--out", tmp_path / "o", "--lora", p], "l.safetensors", says)
    _refused(["convert-lora", p, tmp_path / "c.safetensors"], "l.safetensors", says)
    assert not (tmp_path / "c.safetensors").exists()
    from wan_accel.model.lora import LoraError, read_lora
    with pytest.raises(LoraError, match=says):
        read_lora(p)


def test_lora_pickle_is_told_convert_lora(tmp_path):
    p = tmp_path / "x.pt"
    torch.save({"generator_lora": {}}, p)
    line = _refused(GEN + ["--out", tmp_path / "o", "--lora", p], "--lora", "convert-lora")
    assert "wan_accel convert " not in line


@pytest.mark.parametrize("obj", [{0: torch.zeros(2)}, {"generator": {1: torch.zeros(2), "a": torch.zeros(2)}},
                                 {"generator_ema": {(1, 2): torch.zeros(2)}}])
def test_convert_a_pt_with_keys_that_are_not_names(tmp_path, obj):
    src = tmp_path / "c.pt"
    torch.save(obj, src)
    argv = ["convert", src, tmp_path / "o.safetensors"] + (["--ema"] if "generator_ema" in obj else [])
    _refused(argv, "c.pt", "not a tensor name")
    torch.save({"generator_lora": obj.get("generator", obj.get("generator_ema", obj))}, src)
    _refused(["convert-lora", src, tmp_path / "l.safetensors"], "c.pt", "not a tensor name")


def _fp8_file(path, extra=None, meta=None):
    from wan_accel.model.checkpoint import METADATA_KEY, keeps_fp8
    from wan_accel.model.tiny import TINY_CONFIG, tiny_causal_model
    out = {}
    for name, t in tiny_causal_model(seed=3).state_dict().items():
        t = t.detach().clone().contiguous()
        if keeps_fp8(name, "F8_E4M3", t.shape):
            scale = t.abs().max() / 448
            out[name] = (t / scale).to(torch.float8_e4m3fn)
            out[name[:-len(".weight")] + ".scale_weight"] = scale.reshape(())
        else:
            out[name] = t
    out.update(extra or {})
    save_file(out, str(path), metadata={METADATA_KEY: json.dumps(TINY_CONFIG.to_dict()), **(meta or {})})
    return path


@pytest.mark.parametrize("case, says", [
    ("blocks.99.ffn.0.scale_weight", "'blocks.99.ffn.0.scale_weight' belongs to no layer weight"),
    ("nothing.input_scale", "'nothing.input_scale' belongs to no layer weight"),
    ("meta-not-json", "_quantization_metadata' is not valid JSON"),
    ("meta-deep", "_quantization_metadata' is not valid JSON"),
    ("quant-deep", "comfy_quant' is not the JSON"),
    ("quant-not-json", "comfy_quant' is not the JSON"),
])
def test_fp8_side_data_errors_name_the_file_in_every_command(tmp_path, case, says):
    extra, meta = {}, {}
    if case.endswith(("scale_weight", "input_scale")):
        extra[case] = torch.tensor(1.0)
    elif case == "meta-not-json":
        meta["_quantization_metadata"] = "{not json"
    elif case == "meta-deep":
        meta["_quantization_metadata"] = "[" * 5000 + "]" * 5000
    else:
        data = b"[" * 5000 + b"]" * 5000 if case == "quant-deep" else b"{not json"
        extra["blocks.0.ffn.0.comfy_quant"] = torch.tensor(list(data), dtype=torch.uint8)
    ckpt = _fp8_file(tmp_path / "q8.safetensors", extra, meta)
    _refused(GEN + ["--checkpoint", ckpt, "--out", tmp_path / "o"], "q8.safetensors", says)
    if not case.startswith("quant-"):          # header-only commands see the header's problems too
        _refused(["plan", "--checkpoint", ckpt], "q8.safetensors", says)


# ----------------------------------------------------------------------------------------------- 8. files
def test_a_killed_writer_leaves_no_temporary_behind_for_good(tmp_path, capsys):
    import subprocess
    from wan_accel.cache import owned_files
    from wan_accel.cache.owned_files import write_text
    out = tmp_path / "o"
    out.mkdir()
    # a live writer holds the lock of its temporary (cache/owned_files.py: new_temporary); one in another pid
    # namespace too, where the pid in the name is not one this process can see
    holder = ("import fcntl, os, sys, time\nfor p in sys.argv[1:]:\n    fd = os.open(p, os.O_RDWR | os.O_CREAT)\n"
              "    fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(600)\n")
    pid_of = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])   # killed below
    left = out / f".report.json.wan_accel-{pid_of.pid}-abc123xy.tmp.json"
    left.write_text("{half")
    old = out / ".latents.safetensors.wan_accel-999999999-zz.tmp.safetensors"   # a pid no process has
    old.write_bytes(b"x")
    mine = out / ".notes.txt.abc.tmp"                 # not the pack's naming: a user's file, kept
    mine.write_text("mine")
    link = out / ".x.wan_accel-999999998-q.tmp"
    link.symlink_to(mine)
    fresh = out / ".y.json.wan_accel-999999997-f.tmp.json"     # a pid not seen here, but its lock is held: kept
    fresh.write_text("{")
    proc = subprocess.Popen([sys.executable, "-c", holder, str(left), str(fresh)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    hour_ago = time.time() - 3600
    for p in (left, old, mine):                 # as a run killed an hour ago leaves them
        os.utime(p, (hour_ago, hour_ago))
    # written by its live writer a little while ago: past the grace a new writer has to take its lock, within the
    # quiet minute (so only its lock tells whether it is alive, however fast the runs below are)
    recent = time.time() - 3 * owned_files.LOCK_GRACE_SECONDS
    os.utime(fresh, (recent, recent))
    try:
        write_text(out / "other.txt", "x")
        assert left.exists() and not old.exists()      # the writer is alive: its temporary stays
        assert main(GEN + ["--out", str(out)]) == 0, capsys.readouterr().err
        assert fresh.exists()
    finally:
        for p in (proc, pid_of):
            p.kill()
            p.wait()
    assert main(GEN + ["--out", str(out)]) == 0, capsys.readouterr().err
    assert not left.exists() and mine.read_text() == "mine" and link.is_symlink() and not fresh.exists()
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([".notes.txt.abc.tmp", ".x.wan_accel-999999998-q.tmp", "latents.safetensors",
                            "other.txt", "report.json"]), names


def test_the_writer_names_its_temporaries_as_its_own(tmp_path):
    from wan_accel.cache.owned_files import write_with
    seen = []
    write_with(tmp_path / "a.json", lambda tmp: (seen.append(Path(tmp).name), Path(tmp).write_text("{}")))
    assert seen[0].startswith(f".a.json.wan_accel-{os.getpid()}-") and seen[0].endswith(".tmp.json")


def test_bench_compile_children_keep_every_cache_in_the_removed_folder(tmp_path, monkeypatch):
    import subprocess
    from wan_accel.bench import compile as bench
    seen = {}

    def fake_run(argv, env=None, **kw):
        seen.update(env)
        line = bench.CHILD_MARK + json.dumps({"compile_s": 1.0})
        return types.SimpleNamespace(stdout=line, stderr="", returncode=0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    bench.run_child(tmp_path / "cold0")
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TMPDIR"):
        assert Path(seen[var]).is_relative_to(tmp_path / "cold0"), (var, seen[var])


@pytest.mark.parametrize("content", [b"{damaged", b"[1, 2]", b'{"kind": "x", "items": []}', b"\xff\xfe",
                                     b"[" * 100000])
def test_a_damaged_set_aside_file_is_reported_not_called_empty(tmp_path, content):
    from wan_accel.cache import LimitCache
    cache = LimitCache()
    cache.set_aside_path.parent.mkdir(parents=True, exist_ok=True)
    cache.set_aside_path.write_bytes(content)
    line = _refused(["cache", "set-aside"], "set-aside file", "cannot be read")
    assert "no entries" not in line
    assert cache.set_aside_path.read_bytes() == content
    assert any("set-aside file" in n for n in LimitCache().notices())


def test_a_huge_set_aside_file_is_not_read(tmp_path, monkeypatch):
    from wan_accel.cache import LimitCache, store
    cache = LimitCache()
    cache.set_aside_path.parent.mkdir(parents=True, exist_ok=True)
    with open(cache.set_aside_path, "wb") as fh:        # sparse: 3 GB on the disk's books, nothing written
        fh.truncate(3 << 30)
    reads = []
    real = store.read_regular
    monkeypatch.setattr(store, "read_regular", lambda p, limit=None: reads.append((p, limit)) or real(p, limit))
    t0 = time.perf_counter()
    _refused(["cache", "set-aside"], "larger than")
    assert time.perf_counter() - t0 < 5
    assert all(p != cache.set_aside_path for p, _ in reads)


def test_model_loader_lora_widget_does_not_follow_a_link_out_of_models_loras(tmp_path, monkeypatch):
    from wan_accel.nodes import model_nodes
    loras = tmp_path / "models" / "loras"
    loras.mkdir(parents=True)
    outside = _lora(tmp_path / "secret.safetensors")
    (loras / "link.safetensors").symlink_to(outside)
    (loras / "sub").mkdir()
    (loras / "sub" / "in.safetensors").write_bytes(outside.read_bytes())
    fake = types.ModuleType("folder_paths")

    def full_path(kind, name):
        p = tmp_path / "models" / kind / name
        return str(p) if p.is_file() else None

    fake.get_full_path = full_path
    monkeypatch.setitem(sys.modules, "folder_paths", fake)
    with pytest.raises(ValueError, match="lora 'link.safetensors' leads out of models/loras"):
        model_nodes._resolve_lora("link.safetensors")
    assert model_nodes._resolve_lora("sub/in.safetensors") == str(loras / "sub" / "in.safetensors")
    (tmp_path / "models" / "diffusion_models").mkdir()
    (tmp_path / "models" / "diffusion_models" / "m.safetensors").symlink_to(outside)
    with pytest.raises(ValueError, match="checkpoint 'm.safetensors' leads out"):
        model_nodes._resolve_checkpoint("m.safetensors")


# ---------------------------------------------------------------------------- 9. names and figures
def test_play_session_node_names_the_input_at_fault(monkeypatch):
    from wan_accel.nodes.comfy import streaming_decode
    from wan_accel.nodes.prompt_nodes import CausalWanPromptPlaySession
    monkeypatch.setattr(streaming_decode, "WanStreamDecoder", lambda vae: None)
    handle = _tiny_handle()
    start = CausalWanPromptPlaySession().start
    for kw, says in ((dict(kv_window=4, sink=3, recache="krea"), r"^sink 3 does not apply to recache krea"),
                     (dict(kv_window=4, sink=0, recache="krea"), r"^kv_window 4: recache krea"),
                     (dict(kv_window=4, sink=3, recache="switch"), r"^sink 3 .* use sink at most 1"),
                     (dict(kv_window=-1, sink=0, recache="bogus"), r"^recache must be one of")):
        with pytest.raises(ValueError, match=says) as err:
            start(handle, None, "a cat", width=32, height=32, **kw)
        assert not str(err.value).startswith("prompt:")
    # the advice passes: sink 1 in a window of 4 starts a session
    from wan_accel.app.play.registry import REGISTRY
    sid = start(handle, None, "a cat", width=32, height=32, kv_window=4, sink=1, recache="switch")["result"][0]
    try:
        REGISTRY.get(sid).step("")
    finally:
        REGISTRY.end(sid)
    with pytest.raises(ValueError, match=r"^prompt 'a :0' is not a schedule prompt"):
        start(handle, None, "a :0", width=32, height=32, kv_window=12, sink=3)


def test_live_session_refuses_sink_with_krea():
    from wan_accel.app.play.registry import PlayError
    from wan_accel.app.play.t2v import PromptPlaySession
    from wan_accel.model.tiny import tiny_causal_model, tiny_text_embedding
    model = tiny_causal_model(seed=3)
    with pytest.raises(PlayError, match="sink 2 does not apply to recache krea"):
        PromptPlaySession(model, lambda t: tiny_text_embedding(t, 8, model.config.text_dim), 4, 4, prompt="a",
                          kv_window=-1, sink=2, recache="krea")


@pytest.mark.parametrize("argv, words", [
    (["--vram-gb", "24", "--reserve-gb", "30"], ["--reserve-gb 30", "below"]),
    (["--vram-gb", "24", "--reserve-gb", "24"], ["--reserve-gb 24", "below"]),
    (["--vram-gb", "8", "--ram-gb", "64", "--reserve-gb", "7.9"], ["--reserve-gb 7.9"]),
    (["--ram-gb", "8", "--reserve-gb", "9"], ["--reserve-gb 9", "RAM"]),
    (["--model", "krea-14b", "--kv-window", "4"], ["--kv-window 4", "at least 5"]),
    (["--model", "krea-14b", "--kv-window", "3"], ["--kv-window 3", "at least 5"]),
    (["--model", "1.3b", "--kv-window", "0"], ["--kv-window 0"]),
])
def test_plan_refuses_what_no_run_can_do(argv, words):
    args = ["plan"] + (["--model", "1.3b"] if "--model" not in argv else []) + argv
    line = _refused(args, *words)
    assert "add RAM" not in line and "-" + "6.96" not in line


def test_plan_reserve_that_leaves_room_still_plans(capsys):
    _refused(["plan", "--model", "krea-14b", "--vram-gb", "80", "--reserve-gb", "80"], "--reserve-gb 80")
    assert main(["plan", "--model", "krea-14b", "--vram-gb", "80", "--reserve-gb", "4", "--kv-window", "6",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv_window"] == 6


def test_memory_plan_node_reserve_is_named():
    from wan_accel.nodes.memory_nodes import WanVRAMPlan as Node
    with pytest.raises(ValueError, match="^reserve_gb 1000 GiB leaves nothing"):
        Node().plan(model_source="1.3b", width=832, height=480, frames=81, reserve_gb=1000.0)


@pytest.mark.parametrize("value", ["-5", "0", "1e7"])
def test_bench_sampler_peak_tflops_must_be_positive(value):
    _refused(["bench", "sampler", "--device", "cpu", "--peak-tflops", value], "--peak-tflops")


@pytest.mark.parametrize("edit", ["nan-shift", "inf-weight", "deep"])
def test_bench_fidelity_on_a_fixture_with_nan_is_an_error(tmp_path, edit):
    import shutil
    src = Path(__file__).parent / "fixtures" / "wan_reference"
    fx = tmp_path / "fx"
    shutil.copytree(src, fx)
    cfg_path = fx / "causal_config.json"
    text = cfg_path.read_text()
    if edit == "deep":
        cfg_path.write_text("[" * 100000)
    else:
        cfg = json.loads(text)
        if edit == "nan-shift":
            cfg["sampler"]["timestep_shift"] = float("nan")
        else:
            cfg["config"]["eps"] = float("inf")
        cfg_path.write_text(json.dumps(cfg))
    _refused(["bench", "fidelity", "--fixture", fx], "--fixture", "causal_config.json")
