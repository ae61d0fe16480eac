"""The standing guard: every command and node, fed bad inputs, answers with a clean error that names the input and
the fix, never a traceback, and changes no file outside the output and cache folders.

Each case is one row: missing, empty, damaged, wrong-kind and hostile files; zero, negative, huge and non-numeric
values; unwritable, read-only and odd cache locations. docs/reliability.md quotes the number of
cases (``python -m pytest tests/test_bad_inputs.py --collect-only -q``).
"""
from __future__ import annotations

import os
import pickle
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from wan_accel.cli import main

# ------------------------------------------------------------------------------------------------ the world
GEN = ["generate", "--out", "{out}", "--no-preview"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Bad (and a few good) input files, made once."""
    d = tmp_path_factory.mktemp("inputs")
    from wan_accel.model.tiny import tiny_causal_model

    sd = {k: v.clone().contiguous() for k, v in tiny_causal_model(0, "cpu", torch.float32, "float32").state_dict().items()}
    save_file(sd, str(d / "good.safetensors"))
    blob = (d / "good.safetensors").read_bytes()
    (d / "truncated.safetensors").write_bytes(blob[: len(blob) // 3])
    (d / "garbage.safetensors").write_bytes(b"\x00garbage, not a safetensors file" * 4)
    (d / "empty.safetensors").write_bytes(b"")
    (d / "huge_header.safetensors").write_bytes((2**62).to_bytes(8, "little") + b"{}")
    (d / "json.safetensors").write_text('{"not": "tensors"}')
    (d / "folder.safetensors").mkdir()
    (d / "settings.json").write_text('{"theme": "dark", broken')  # somebody else's JSON file
    (d / "dir.json").mkdir()
    save_file({"context": torch.zeros(5, 7)}, str(d / "embeds_wrong_dim.safetensors"))
    save_file({"a": torch.zeros(2), "b": torch.zeros(2)}, str(d / "embeds_two.safetensors"))
    save_file({"other": torch.zeros(3)}, str(d / "not_a_dit.safetensors"))
    torch.save({"generator": sd}, str(d / "good.pt"))
    bad = dict(sd, **{"patch_embedding.weight": torch.zeros(4)})
    torch.save({"generator": bad}, str(d / "wrong_rank.pt"))
    (d / "truncated.pt").write_bytes((d / "good.pt").read_bytes()[:2000])
    (d / "empty.pt").write_bytes(b"")

    class Evil:  # a pickle that would run code when loaded without weights_only
        def __reduce__(self):
            return (os.system, ("touch HACKED",))

    (d / "hostile.pt").write_bytes(pickle.dumps({"generator": Evil()}))
    (d / "link_to_passwd.safetensors").symlink_to("/etc/passwd")
    os.mkfifo(d / "pipe.safetensors")
    return d


@pytest.fixture
def world(tmp_path, monkeypatch, files):
    """cwd, output and cache folders; a snapshot of everything else that must not change."""
    work, out, cache = tmp_path / "work", tmp_path / "out", tmp_path / "cache"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("WAN_ACCEL_CACHE", str(cache))
    return {"work": work, "out": out, "cache": cache, "files": files, "tmp": tmp_path}


def _tree(*roots: Path, skip=()) -> dict:
    seen = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            if any(Path(dirpath) == s or s in Path(dirpath).parents for s in skip):
                continue
            for name in dirnames + filenames:
                p = Path(dirpath) / name
                if p in skip:
                    continue
                st = os.lstat(p)
                seen[str(p)] = (st.st_ino, st.st_mode, st.st_size if not stat.S_ISDIR(st.st_mode) else 0,
                                st.st_mtime_ns if not stat.S_ISDIR(st.st_mode) else 0)
    return seen


def _system_state() -> tuple:
    return (os.lstat("/dev/null").st_mode, sorted(n for n in os.listdir("/dev") if "limits" in n or "null." in n),
            os.path.exists("/etc/limits.json"))


def _fill(args, world) -> list[str]:
    f = world["files"]
    return [a.format(out=world["out"], f=f, cache=world["cache"], tmp=world["tmp"]) for a in args]


# ------------------------------------------------------------------------------------------------ CLI cases
# (id, argv, strings the error must contain (the input, the fix), cache setting or None)
F = "{f}"
CLI_CASES = [
    # --- values: zero, negative, huge, non-numeric, out of range
    ("frames-zero", GEN + ["--frames", "0"], ["--frames", "between 1 and 4093"]),
    ("frames-negative", GEN + ["--frames", "-9"], ["--frames", "between 1 and 4093"]),
    ("frames-huge", GEN + ["--frames", "99999999"], ["--frames", "between 1 and 4093"]),
    ("frames-text", GEN + ["--frames", "many"], ["--frames", "whole number"]),
    ("frames-not-4k1", GEN + ["--frames", "10"], ["--frames 10", "use 9 or 21"]),
    ("frames-not-blocks", GEN + ["--frames", "13"], ["--frames 13", "use 9 or 21"]),
    ("width-zero", GEN + ["--width", "0"], ["--width", "between 16 and 4096"]),
    ("height-negative", GEN + ["--height", "-16"], ["--height", "between 16 and 4096"]),
    ("width-huge", GEN + ["--width", "1000000"], ["--width", "between 16 and 4096"]),
    ("width-odd", GEN + ["--width", "100"], ["--width 100", "use 96 or 112"]),
    ("height-float", GEN + ["--height", "12.5"], ["--height", "whole number"]),
    ("fpb-zero", GEN + ["--frames-per-block", "0"], ["--frames-per-block", "between 1 and 64"]),
    ("fpb-huge", GEN + ["--frames-per-block", "1000"], ["--frames-per-block", "between 1 and 64"]),
    ("kv-window-zero", GEN + ["--kv-window", "0"], ["--kv-window 0", "use -1"]),
    ("kv-window-negative", GEN + ["--kv-window", "-5"], ["--kv-window", "between -1 and 1024"]),
    ("sink-without-window", GEN + ["--sink", "2"], ["--sink 2", "--kv-window"]),
    ("sink-over-window-one-chunk", GEN + ["--frames", "9", "--kv-window", "3", "--sink", "5"],
     ["--sink 5", "latent frames", "--kv-window at least 8"]),
    ("sink-over-window", GEN + ["--kv-window", "6", "--sink", "6"], ["--sink 6", "at most 3"]),
    ("sink-negative", GEN + ["--sink", "-1"], ["--sink", "between 0"]),
    ("seed-negative", GEN + ["--seed", "-1"], ["--seed", "between 0"]),
    ("seed-huge", GEN + ["--seed", str(2**70)], ["--seed", "between 0"]),
    ("steps-text", GEN + ["--steps", "fast"], ["--steps", "not a number", "1000,750"]),
    ("steps-out-of-range", GEN + ["--steps", "5000,100"], ["--steps", "(0, 1000]"]),
    ("steps-empty", GEN + ["--steps", ""], ["--steps", "empty"]),
    ("shift-zero", GEN + ["--shift", "0"], ["--shift", "greater than 0"]),
    ("shift-nan", GEN + ["--shift", "nan"], ["--shift", "finite"]),
    ("num-heads-zero", GEN + ["--num-heads", "0"], ["--num-heads", "between 1"]),
    ("dtype-bogus", GEN + ["--dtype", "int8"], ["--dtype", "bf16, fp16, fp32"]),
    ("device-bogus", GEN + ["--device", "tpu"], ["--device", "cpu, cuda"]),
    ("preset-bogus", GEN + ["--preset", "turbo"], ["preset", "self_forcing"]),
    ("mg2-window-small", GEN + ["--model-kind", "matrix-game2", "--window", "1"], ["--window", "between 3"]),
    ("mg2-frames-zero", GEN + ["--model-kind", "matrix-game2", "--frames", "0"], ["--frames", "between 1"]),
    ("mg2-height", GEN + ["--model-kind", "matrix-game2", "--height", "64"], ["--height", "leave it out"]),
    ("mg2-actions-bogus", GEN + ["--model-kind", "matrix-game2", "--actions", "JUMP*x"], ["jump*x", "whole number"]),
    ("actions-without-mg2", GEN + ["--actions", "W*4"], ["--actions", "matrix-game2"]),
    ("profile-frames-latent-units", ["profile", "--frames", "6", "--out", "{out}"], ["--frames 6", "use 9"]),
    ("profile-width-zero", ["profile", "--width", "0", "--out", "{out}"], ["--width", "between 16"]),
    ("profile-runs-zero", ["profile", "--runs", "0", "--out", "{out}"], ["--runs", "between 1"]),
    ("profile-warmup-negative", ["profile", "--warmup", "-1", "--out", "{out}"], ["--warmup", "between 0"]),
    ("profile-compile-bogus", ["profile", "--compile", "fastest", "--out", "{out}"], ["--compile", "one of"]),
    ("profile-dtype-bogus", ["profile", "--dtype", "double", "--out", "{out}"], ["--dtype", "bf16"]),
    ("bench-frames-zero", ["bench", "sampler", "--frames", "0"], ["--frames", "between 1"]),
    ("bench-width-zero", ["bench", "sampler", "--width", "0"], ["--width", "between 16"]),
    ("bench-repeat-zero", ["bench", "sampler", "--repeat", "0"], ["--repeat", "between 1"]),
    ("bench-repeat-text", ["bench", "sampler", "--repeat", "x"], ["--repeat", "whole number"]),
    ("bench-kernels-frames-zero", ["bench", "kernels", "--frames", "0"], ["--frames", "between 1"]),
    ("fidelity-numerics-without-fp8", ["bench", "fidelity", "--attention", "int8", "--fp8-numerics", "fa3"],
     ["--fp8-numerics fa3", "--attention fp8"]),
    ("bench-offload-width-odd", ["bench", "offload", "--width", "833"], ["--width 833", "use 832 or 848"]),
    ("plan-frames-zero", ["plan", "--model", "1.3b", "--frames", "0"], ["--frames", "between 1"]),
    ("plan-frames-odd", ["plan", "--model", "1.3b", "--frames", "10"], ["--frames 10", "use 9 or 21"]),
    ("plan-vram-zero", ["plan", "--model", "1.3b", "--vram-gb", "0"], ["--vram-gb", "greater than 0"]),
    ("plan-reserve-negative", ["plan", "--model", "1.3b", "--reserve-gb", "-1"], ["--reserve-gb", "at least 0"]),
    ("plan-batch-zero", ["plan", "--model", "1.3b", "--batch", "0"], ["--batch", "between 1"]),
    ("cache-namespace-bogus", ["cache", "clear", "--namespace", "bogus"], ["bogus", "operator, sampler"]),
    ("cache-show-namespace-bogus", ["cache", "show", "--namespace", "bogus"], ["bogus", "compile, doctor, memory"]),
    ("report-last-text", ["report", "--last", "x"], ["--last", "whole number"]),
    # --- files: missing, empty, damaged, wrong kind, hostile
    ("ckpt-missing", GEN + ["--checkpoint", F + "/nope.safetensors"], ["--checkpoint", "not found"]),
    ("ckpt-empty", GEN + ["--checkpoint", F + "/empty.safetensors"], ["--checkpoint", "empty (0 bytes)"]),
    ("ckpt-truncated", GEN + ["--checkpoint", F + "/truncated.safetensors"], ["--checkpoint", "not a readable safetensors"]),
    ("ckpt-garbage", GEN + ["--checkpoint", F + "/garbage.safetensors"], ["--checkpoint", "not a readable safetensors"]),
    ("ckpt-huge-header", GEN + ["--checkpoint", F + "/huge_header.safetensors"], ["--checkpoint", "not a readable"]),
    ("ckpt-json", GEN + ["--checkpoint", F + "/json.safetensors"], ["--checkpoint", "not a readable"]),
    ("ckpt-folder", GEN + ["--checkpoint", F + "/folder.safetensors"], ["--checkpoint", "is a folder"]),
    ("ckpt-device", GEN + ["--checkpoint", "/dev/null"], ["--checkpoint", "not a regular file"]),
    ("ckpt-pipe", GEN + ["--checkpoint", F + "/pipe.safetensors"], ["--checkpoint", "not a regular file"]),
    ("ckpt-pickle", GEN + ["--checkpoint", F + "/good.pt"], ["--checkpoint", "python -m wan_accel convert"]),
    ("ckpt-hostile-pickle", GEN + ["--checkpoint", F + "/hostile.pt"], ["--checkpoint", "convert"]),
    ("ckpt-symlink-passwd", GEN + ["--checkpoint", F + "/link_to_passwd.safetensors"], ["--checkpoint", "not a readable"]),
    ("ckpt-not-a-dit", GEN + ["--checkpoint", F + "/not_a_dit.safetensors"], ["patch_embedding.weight", "Wan 2.1"]),
    ("embeds-missing", GEN + ["--text-embeds", F + "/nope.safetensors"], ["--text-embeds", "not found"]),
    ("embeds-truncated", GEN + ["--text-embeds", F + "/truncated.safetensors"], ["--text-embeds", "not a readable"]),
    ("embeds-empty-path", GEN + ["--text-embeds", ""], None),  # an empty value means "none": must still run
    ("embeds-wrong-dim", GEN + ["--text-embeds", F + "/embeds_wrong_dim.safetensors"], ["embeds_wrong_dim", "[L,"]),
    ("embeds-two-tensors", GEN + ["--text-embeds", F + "/embeds_two.safetensors"], ["embeds_two", "'context'"]),
    ("mg2-conditioning-damaged", GEN + ["--model-kind", "matrix-game2", "--conditioning", F + "/truncated.safetensors"],
     ["--conditioning", "not a readable"]),
    ("profile-ckpt-damaged", ["profile", "--checkpoint", F + "/truncated.safetensors", "--out", "{out}"],
     ["--checkpoint", "not a readable"]),
    ("bench-ckpt-damaged", ["bench", "sampler", "--checkpoint", F + "/truncated.safetensors"],
     ["--checkpoint", "not a readable"]),
    ("plan-ckpt-damaged", ["plan", "--checkpoint", F + "/truncated.safetensors"], ["--checkpoint", "not a readable"]),
    ("plan-ckpt-device", ["plan", "--checkpoint", "/dev/null"], ["--checkpoint", "not a regular file"]),
    ("convert-wrong-rank", ["convert", F + "/wrong_rank.pt", "{out}/x.safetensors", "--num-heads", "2"],
     ["patch_embedding.weight", "5-D"]),
    ("convert-truncated-pt", ["convert", F + "/truncated.pt", "{out}/x.safetensors"], ["truncated.pt", "damaged"]),
    ("convert-empty-pt", ["convert", F + "/empty.pt", "{out}/x.safetensors"], ["SRC", "empty (0 bytes)"]),
    ("convert-hostile-pickle", ["convert", F + "/hostile.pt", "{out}/x.safetensors"], ["hostile.pt", "weights_only"]),
    ("convert-damaged-safetensors", ["convert", F + "/truncated.safetensors", "{out}/x.safetensors"],
     ["SRC", "not a readable safetensors"]),
    ("convert-safetensors-input", ["convert", F + "/good.safetensors", "{out}/x.safetensors"], ["already", "directly"]),
    ("convert-missing", ["convert", F + "/nope.pt", "{out}/x.safetensors"], ["SRC", "not found"]),
    ("convert-dst-not-safetensors", ["convert", F + "/good.pt", "{out}/x.pt"], ["DST", ".safetensors"]),
    ("convert-dst-system", ["convert", F + "/good.pt", "/etc/x.safetensors"], ["system folder /etc"]),
    ("check-reference-missing", ["check-reference", F + "/nope"], ["nope"]),
    ("report-history-folder", ["report", "--history", F], ["--history", "is a folder"]),
    ("report-last-zero", ["report", "--last", "0"], ["--last", "between 1"]),
    # --- output folders
    ("out-is-a-file", ["generate", "--out", F + "/good.pt"], ["--out", "is a file"]),
    ("out-system-folder", ["generate", "--out", "/etc/wan_out"], ["--out", "system folder /etc"]),
    ("out-device", ["generate", "--out", "/dev/null"], ["--out", "system folder /dev"]),
    ("profile-out-system", ["profile", "--out", "/usr/share/wan"], ["--out", "system folder"]),
]

# (id, WAN_ACCEL_CACHE value, argv, expect: "error" (strings) or "warn" (runs, one warning with the strings))
CACHE_CASES = [
    ("cache-device-clear", "/dev/null", ["cache", "clear"], "error", ["system folder /dev", "WAN_ACCEL_CACHE"]),
    ("cache-device-json-prune", "/dev/null.json", ["cache", "prune-stale"], "error", ["system folder /dev"]),
    ("cache-etc-clear", "/etc", ["cache", "clear"], "error", ["system folder /etc"]),
    ("cache-under-a-file-clear", "{f}/good.pt/cache", ["cache", "clear"], "error", ["good.pt", "folder is needed"]),
    ("cache-under-a-file-prune", "{f}/good.pt/cache", ["cache", "prune-stale"], "error", ["good.pt"]),
    ("cache-foreign-json-clear", "{f}/settings.json", ["cache", "clear"], "error",
     ["settings.json", "left untouched"]),
    ("cache-foreign-json-generate", "{f}/settings.json", GEN + ["--frames", "9", "--width", "32", "--height", "32"],
     "warn", ["settings.json", "left untouched"]),
    ("cache-folder-named-json-clear", "{f}/dir.json", ["cache", "clear"], "error", ["dir.json", "a folder"]),
    ("cache-device-show", "/dev/null", ["cache", "show"], "warn", ["system folder /dev"]),
    ("cache-device-generate", "/dev/null", GEN + ["--frames", "9", "--width", "32", "--height", "32"], "warn",
     ["/dev/null", "system folder"]),
    ("cache-under-a-file-generate", "{f}/good.pt/cache", GEN + ["--frames", "9", "--width", "32", "--height", "32"],
     "warn", ["good.pt"]),
    ("cache-unwritable-plan", "{f}/good.pt/cache", ["plan", "--model", "1.3b"], "ok", []),
]


def _run_cli(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    cap = capsys.readouterr()
    return code, cap.out, cap.err


@pytest.mark.parametrize("case", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input(case, world, capsys):
    _, argv, expect = case
    argv = _fill(argv, world)
    skip = {world["out"], world["cache"]}
    before, system = _tree(world["tmp"], world["files"], skip=skip), _system_state()
    code, out, err = _run_cli(argv, capsys)
    assert "Traceback" not in err + out
    assert not (world["work"] / "HACKED").exists()
    assert _tree(world["tmp"], world["files"], skip=skip) == before, "a file outside the output and cache folders changed"
    assert _system_state() == system
    if expect is None:  # accepted: must run (or report) cleanly
        assert code == 0, err
        return
    assert code not in (0, None), f"exit {code}: {out}{err}"
    assert "error" in err, err
    for text in expect:
        assert text in err, f"{text!r} not in: {err}"


@pytest.mark.parametrize("case", CACHE_CASES, ids=[c[0] for c in CACHE_CASES])
def test_cli_odd_cache_location(case, world, monkeypatch, capsys):
    _, where, argv, expect, strings = case
    monkeypatch.setenv("WAN_ACCEL_CACHE", where.format(f=world["files"]))
    argv = _fill(argv, world)
    before, system = _tree(world["tmp"], world["files"], skip={world["out"]}), _system_state()
    code, out, err = _run_cli(argv, capsys)
    assert "Traceback" not in err + out
    assert _tree(world["tmp"], world["files"], skip={world["out"]}) == before
    assert _system_state() == system
    if expect == "error":
        assert code == 2 and err.startswith("error: ") or "\nerror: " in err, err
    else:
        assert code == 0, err
        if expect == "warn":
            warns = [ln for ln in err.splitlines() if ln.startswith("warning:")]
            assert len(warns) == 1, err
    for text in strings:
        assert text in err, f"{text!r} not in: {err}"


# ------------------------------------------------------------------------------------------------ node cases
def _tiny_handle():
    from wan_accel.app.jobs.handle import load_model_handle

    return load_model_handle(None, "fp32", "float32", "sdpa", "cpu")


def _sample(**kw):
    from wan_accel.nodes.model_nodes import CausalWanSampler

    args = dict(width=32, height=32, num_frames=9, seed=0, preset="self_forcing", frames_per_block=3, kv_window=-1,
                sink=0)
    args.update(kw)
    return lambda: CausalWanSampler().sample(_tiny_handle(), **args)


def _load(checkpoint):
    from wan_accel.nodes.model_nodes import CausalWanModelLoader

    return lambda: CausalWanModelLoader().load(checkpoint, "fp32", "float32", "sdpa")


def _plan(**kw):
    from wan_accel.nodes.memory_nodes import WanVRAMPlan

    return lambda: WanVRAMPlan().plan(**kw)


def _decode_image_latent():
    from wan_accel.nodes.memory_nodes import WanChunkedVAEDecode

    class FakeVAE:
        def decode(self, x):
            raise IndexError("tuple index out of range")  # what comfy/sd.py does with a 4-D latent

    return lambda: WanChunkedVAEDecode().decode({"samples": torch.zeros(1, 16, 8, 8)}, FakeVAE())


def _limit_cache(**kw):
    from wan_accel.nodes.cache_nodes import WanAccelLimitCache

    return lambda: WanAccelLimitCache().run(**kw)


def _actions(script):
    from wan_accel.nodes.mg2_nodes import GameActions

    return lambda: GameActions().build(script)


def _mg2(**kw):
    from wan_accel.nodes.mg2_nodes import MatrixGame2Sampler

    class Net:
        action_config = object()

    class Actions:
        tensors = {}
        mode = "universal"

    args = dict(model=Net(), start_latent={"samples": torch.zeros(1, 16, 1, 4, 4)}, clip_vision_output=None,
                actions=Actions(), seed=0, num_frames=0, preset="universal", kv_window=0)
    args.update(kw)
    return lambda: MatrixGame2Sampler().sample(**args)


def _profile_subfolder(name):
    from wan_accel.nodes.profile_nodes import WanAccelProfile

    return lambda: WanAccelProfile().apply(_tiny_handle(), 1, True, name)


NODE_CASES = [
    ("sampler-frames-zero", lambda f: _sample(num_frames=0), ["num_frames", "between 1"]),
    ("sampler-frames-odd", lambda f: _sample(num_frames=10), ["num_frames 10", "use 9 or 21"]),
    ("sampler-width-zero", lambda f: _sample(width=0), ["width", "between 16"]),
    ("sampler-width-odd", lambda f: _sample(width=40), ["width 40", "use 32 or 48"]),
    ("sampler-fpb-zero", lambda f: _sample(frames_per_block=0), ["frames_per_block", "between 1"]),
    ("sampler-kv-window-zero", lambda f: _sample(kv_window=0), ["kv_window 0", "-1"]),
    ("sampler-sink-over-window", lambda f: _sample(kv_window=3, sink=5), ["sink 5", "latent frames"]),
    ("sampler-sink-without-window", lambda f: _sample(sink=1), ["sink 1", "kv_window"]),
    ("sampler-custom-steps-bogus", lambda f: _sample(preset="custom", custom_steps="fast"), ["steps"]),
    ("loader-missing", lambda f: _load(str(f / "nope.safetensors")), ["nope.safetensors", "not found"]),
    ("loader-truncated", lambda f: _load(str(f / "truncated.safetensors")), ["truncated.safetensors", "damaged"]),
    ("loader-pickle", lambda f: _load(str(f / "good.pt")), ["good.pt", "convert"]),
    ("loader-hostile", lambda f: _load(str(f / "hostile.pt")), ["hostile.pt", "convert"]),
    ("loader-not-a-dit", lambda f: _load(str(f / "not_a_dit.safetensors")), ["patch_embedding.weight"]),
    ("plan-frames-zero", lambda f: _plan(frames=0), ["frames", "between 1"]),
    ("plan-width-odd", lambda f: _plan(width=833), ["width 833", "use 832 or 848"]),
    ("plan-reserve-negative", lambda f: _plan(reserve_gb=-1.0), ["reserve_gb", "at least 0"]),
    ("plan-checkpoint-empty", lambda f: _plan(model_source="checkpoint", checkpoint=""), ["checkpoint", "selected"]),
    ("plan-checkpoint-damaged", lambda f: _plan(model_source="checkpoint", checkpoint=str(f / "truncated.safetensors")),
     ["truncated.safetensors"]),
    ("decode-image-latent", lambda f: _decode_image_latent(), ["samples", "image latent", "VAE Decode"]),
    ("limit-cache-bogus-namespace", lambda f: _limit_cache(namespace="bogus", action="clear", confirm_clear=True),
     ["bogus", "operator"]),
    ("actions-bogus", lambda f: _actions("JUMP*x"), ["jump*x", "whole number"]),
    ("actions-empty", lambda f: _actions(""), ["script"]),
    ("mg2-window-small", lambda f: _mg2(kv_window=1), ["kv_window 1", "at least 3"]),
    ("mg2-frames-odd", lambda f: _mg2(num_frames=4), ["num_frames 4", "use 3 or 6"]),
    ("profile-subfolder-escape", lambda f: _profile_subfolder("../../etc"), ["output_subfolder"]),
]

CLEAN_NODE_ERRORS = (ValueError, FileNotFoundError, PermissionError, OSError)


@pytest.mark.parametrize("case", NODE_CASES, ids=[c[0] for c in NODE_CASES])
def test_node_bad_input(case, world):
    _, make, expect = case
    call = make(world["files"])
    before, system = _tree(world["tmp"], world["files"], skip={world["cache"]}), _system_state()
    with pytest.raises(Exception) as info:
        call()
    assert isinstance(info.value, CLEAN_NODE_ERRORS), f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    for text in expect:
        assert text in message, f"{text!r} not in: {message}"
    assert _tree(world["tmp"], world["files"], skip={world["cache"]}) == before
    assert _system_state() == system


def test_case_count_is_in_the_reliability_page():
    from tests.conftest import REPO_ROOT

    total = len(CLI_CASES) + len(CACHE_CASES) + len(NODE_CASES)
    readme = (REPO_ROOT / "docs" / "reliability.md").read_text()
    assert f"{total} bad-input cases" in readme, f"docs/reliability.md should say {total} bad-input cases"
    files = sorted(str(p) for p in (REPO_ROOT / "tests").glob("test_hard_edges_*.py"))
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                         capture_output=True, text=True, cwd=str(REPO_ROOT), timeout=300)
    hard = sum(1 for line in out.stdout.splitlines() if "::" in line)
    assert hard and f"errors; {hard} tests)" in readme, f"docs/reliability.md should say {hard} tests"
