"""Hard edges, round four (issue 43): a checker's verdict never contradicts its rows, refusals live in the mechanism
every face calls (the sampler's request, the schedule parser), messages name the input and the fix, nothing is
started that will be refused, and special files are refused before they are opened. Each case drives the command
line, the nodes, the live session and the library entry points."""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cli_run import refused, run_cli
from wan_accel.app.jobs import reference as R
from wan_accel.app.jobs.reference import TOLERANCE, check_reference, format_table
from wan_accel.app.play import registry as play_registry
from wan_accel.app.play.registry import PlayError, PlayRegistry
from wan_accel.app.play.t2v import PromptPlaySession
from wan_accel.model.tiny import TINY_CONFIG, tiny_text_embedding
from wan_accel.sampling.prompts import PromptSchedule

FIXTURES = Path(__file__).parent / "fixtures"
KREA = FIXTURES / "krea_realtime"
SMALL = ["--device", "cpu", "--frames", "9", "--height", "32", "--width", "32", "--no-preview"]
H = W = 4


@pytest.fixture(scope="module")
def handle():
    from wan_accel.app.jobs.handle import load_model_handle
    return load_model_handle(None, "fp32", "float32", "sdpa", device="cpu")


class Clip:
    """ComfyUI's CLIP interface, answering the tiny stand-in embedding."""

    def __init__(self, tokens=6):
        self.tokens, self.encoded = tokens, []

    def tokenize(self, text):
        return {"text": text}

    def encode_from_tokens(self, tokens):
        self.encoded.append(tokens["text"])
        return tiny_text_embedding(tokens["text"], self.tokens, TINY_CONFIG.text_dim)


# ============================================================================ 1. a verdict from every row
def _krea_copy(tmp_path, case: str = "") -> Path:
    """One Krea case (its config and io file) in a folder beside a copy of the base weights it names."""
    (tmp_path / "wan_reference").mkdir(exist_ok=True)
    shutil.copy(FIXTURES / "wan_reference" / "causal_weights.safetensors", tmp_path / "wan_reference")
    folder = tmp_path / "krea_realtime"
    folder.mkdir()
    stem = f"krea_{case}_" if case else "krea_"
    shutil.copy(KREA / f"{stem}config.json", folder)
    shutil.copy(KREA / json.loads((KREA / f"{stem}config.json").read_text())["io_file"], folder)
    return folder


def _edit_io(folder: Path, edit, name="krea_io.safetensors") -> None:
    io = load_file(str(folder / name))
    edit(io)
    save_file({k: v.contiguous() for k, v in io.items()}, str(folder / name))


def _json_check(folder):
    code, out, err = run_cli("check-reference", folder, "--json")
    return code, (json.loads(out) if out.strip() else None), err


@pytest.mark.parametrize("rows", [[("a", float("nan")), ("b", 1e-6)], [("b", 1e-6), ("a", float("nan"))],
                                  [("a", float("inf"))], [("a", 1e-6), ("b", 2 * TOLERANCE)], []])
def test_the_verdict_is_computed_from_every_row(rows):
    """Whatever the order, a NaN or inf row fails the verdict, and so does a row over the tolerance; no rows is no
    pass."""
    v = R.verdict(rows)
    assert v["pass"] is False
    table = format_table(rows) if rows else ""
    if rows:
        assert table.splitlines()[-1].endswith("FAIL")
        assert all(("FAIL" in ln) == (not R.row_ok(d)) for ln, (_, d) in zip(table.splitlines()[1:], rows))
    if any(math.isnan(d) for _, d in rows):
        assert math.isnan(v["worst"])


def test_rows_stay_pairs_with_a_note():
    row = R.Row("x", float("inf"), "missing")
    name, diff = row
    assert dict([row]) == {"x": float("inf")} and row.note == "missing" and (name, diff) == ("x", float("inf"))


@pytest.mark.parametrize("key", ["block4.step2.x0", "output", "block3.prompt_embeds"])
def test_a_nan_in_a_recorded_tensor_fails_the_check(key, tmp_path):
    folder = _krea_copy(tmp_path)
    _edit_io(folder, lambda io: io[key].view(-1).__setitem__(0, float("nan")))
    code, report, _err = _json_check(folder)
    assert code == 1 and report["pass"] is False and report["worst"] == "NaN"   # strict JSON: cache/json_out.py
    failed = set(report["failed"])
    assert failed and all(key in n for n in failed), failed
    code, out, _ = run_cli("check-reference", folder)
    assert code == 1 and out.splitlines()[-1].endswith("FAIL") and "nan" in out.splitlines()[-1]


@pytest.mark.parametrize("key", ["block4.step2.x0", "block6.step3.x0", "output", "block3.prompt_embeds",
                                 "reencode_input.0", "denoising_step_list"])
def test_a_recorded_tensor_removed_is_a_failing_row(key, tmp_path):
    folder = _krea_copy(tmp_path)
    _edit_io(folder, lambda io: io.pop(key))
    code, report, _ = _json_check(folder)
    assert code == 1 and report["pass"] is False
    missing = [r for r in report["rows"] if not r["ok"]]
    assert missing and all("krea_io.safetensors" in r["note"] for r in missing), missing
    assert all(key in r["tensor"] or r["tensor"].endswith("reencode_count") for r in missing)
    assert sum(key in r["tensor"] for r in missing) >= 1


@pytest.mark.parametrize("fixture, io_name, key", [
    ("wan_reference", "wan_t2v_io.safetensors", "inter.block1"),
    ("wan_reference", "causal_io.safetensors", "block1.step2.x0"),
    ("wan_reference", "causal_io.safetensors", "kv_final.layer1.v"),
    ("wan_reference", "causal_io.safetensors", "output"),
])
def test_a_recorded_tensor_removed_fails_every_format(fixture, io_name, key, tmp_path):
    folder = Path(shutil.copytree(FIXTURES / fixture, tmp_path / fixture))
    _edit_io(folder, lambda io: io.pop(key), io_name)
    rows = check_reference(folder)
    bad = [r for r in rows if not R.row_ok(r[1])]
    assert [r[0].split("/", 1)[1] for r in bad] == [key] and "missing" in bad[0].note
    assert R.verdict(rows)["pass"] is False


def test_the_shipped_krea_cases_all_run_and_pass(tmp_path):
    rows = check_reference(KREA)
    stems = {n.split("/", 1)[0] for n, _ in rows}
    assert stems == {"krea", "krea_interrupted", "krea_partial_block"}
    assert R.verdict(rows)["pass"], format_table(rows)
    interrupted = {n for n, _ in rows if n.startswith("krea_interrupted/")}
    cfg = json.loads((KREA / "krea_interrupted_config.json").read_text())["session"]
    for path in ("reference", "optimized"):
        for b in range(cfg["num_blocks"]):
            assert f"krea_interrupted/{path}.block{b}.step3.x0" in interrupted
    assert any("krea_stream_vae.json" in note for note in rows.notes)      # said, not silently skipped


@pytest.mark.parametrize("damage, words", [
    (lambda cfg: cfg.pop("session"), ["krea_config.json", "'session'"]),
    (lambda cfg: cfg["session"].pop("num_blocks"), ["krea_config.json", "'num_blocks'", "session"]),
    (lambda cfg: cfg.update(io_file="nope.safetensors"), ["nope.safetensors", "not found"]),
])
def test_a_config_it_cannot_use_is_said(damage, words, tmp_path):
    folder = _krea_copy(tmp_path)
    cfg = json.loads((folder / "krea_config.json").read_text())
    damage(cfg)
    (folder / "krea_config.json").write_text(json.dumps(cfg))
    code, out, err = run_cli("check-reference", folder)
    assert code == 1 and "internal error" not in err and "Traceback" not in err, err
    line = next(ln for ln in out.splitlines() if ln.startswith("krea/fixture"))
    assert "FAIL" in line and all(w in line for w in words), line
    assert out.splitlines()[-1].endswith("FAIL")


@pytest.mark.parametrize("cut", [100, 5000, -1000])
def test_a_truncated_io_file_is_named(cut, tmp_path):
    folder = _krea_copy(tmp_path)
    data = (folder / "krea_io.safetensors").read_bytes()
    (folder / "krea_io.safetensors").write_bytes(data[:cut])
    rows = check_reference(folder)
    assert len(rows) == 1 and rows[0][0] == "krea/fixture" and not R.row_ok(rows[0][1])
    assert "krea_io.safetensors" in rows[0].note and "damaged or truncated" in rows[0].note


def test_an_input_tensor_missing_names_the_file_and_key(tmp_path):
    folder = _krea_copy(tmp_path)
    _edit_io(folder, lambda io: io.pop("prompt1"))
    rows = check_reference(folder)
    assert [r[0] for r in rows] == ["krea/fixture"]
    assert "krea_io.safetensors" in rows[0].note and "'prompt1'" in rows[0].note


def test_an_unknown_fixture_config_beside_good_ones_fails_and_alone_is_an_error(tmp_path):
    folder = Path(shutil.copytree(FIXTURES / "wan_reference", tmp_path / "wan_reference"))
    (folder / "odd_config.json").write_text(json.dumps({"fixture": "something_else"}))
    rows = check_reference(folder)
    odd = [r for r in rows if r[0] == "odd/fixture"]
    assert odd and "something_else" in odd[0].note and not R.verdict(rows)["pass"]
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "odd_config.json").write_text(json.dumps({"fixture": "something_else"}))
    line = refused(run_cli("check-reference", alone), "no recognised fixture config", "odd_config.json")
    assert "something_else" in line


def test_the_fixture_error_is_a_value_error():
    assert issubclass(R.FixtureError, ValueError)


# ============================================================================ 3. refusals at the mechanism
def test_longlive_sink_larger_than_a_chunk_is_refused_by_the_library(handle):
    from run_helpers import sample_continuable
    from run_helpers import run_causal
    from wan_accel.sampling.scheduler import resolve_schedule
    model = handle.model
    ctx = torch.zeros(1, 4, model.config.text_dim)
    shape = (1, 6, model.config.out_dim, H, W)
    for schedule in ("longlive", {"preset": "longlive"}, resolve_schedule("longlive")):
        with pytest.raises(ValueError, match="sink 6 with schedule longlive"):
            run_causal(model, ctx, shape, schedule=schedule, sink=6, kv_window=15, frames_per_block=3)
    with pytest.raises(ValueError, match="LongLive"):
        sample_continuable(model, ctx, 6, H, W, schedule="longlive", sink=6, kv_window=15, frames_per_block=3)
    out = run_causal(model, ctx, shape, schedule="self_forcing", sink=6, kv_window=15, frames_per_block=3)
    assert out.shape == shape                           # the pack's own sink semantics under another preset
    run_causal(model, ctx, shape, schedule="longlive", sink=3, kv_window=12, frames_per_block=3)


@pytest.mark.parametrize("block, steps", [(1, 2), (2, 3), (5, 4), (0, 7)])
def test_krea_schedule_entry_and_line_are_one_implementation(block, steps):
    from wan_accel.sampling.krea import krea_schedule_entry, krea_schedule_line
    chunk, blend = krea_schedule_entry(block, steps)
    assert f"{chunk}: p (blend {blend})" == krea_schedule_line(block, "p", steps)
    for bad in (1, 0, 2.5):
        with pytest.raises(ValueError):
            krea_schedule_entry(block, bad)


def test_krea_schedule_entry_is_exact_for_an_interrupted_change():
    from wan_accel.sampling.krea import krea_schedule_entry
    cfg = json.loads((KREA / "krea_interrupted_config.json").read_text())
    io = load_file(str(KREA / cfg["io_file"]))
    lines = ["0: p0"] + [f"{c}: p{ch['prompt']} (blend {b})" for ch in cfg["prompt_changes"]
                         for c, b in [krea_schedule_entry(ch["block"], ch["interp_steps"])]]
    contexts = PromptSchedule.parse("\n".join(lines)).contexts({f"p{i}": io[f"prompt{i}"] for i in range(3)},
                                                               cfg["session"]["num_blocks"])
    for b, ctx in enumerate(contexts):
        assert (ctx - io[f"block{b}.prompt_embeds"]).abs().max() <= 1e-6, b


@pytest.fixture()
def env(monkeypatch):
    from wan_accel.nodes.comfy import streaming_decode
    registry = PlayRegistry(reaper=False)
    monkeypatch.setattr(play_registry, "REGISTRY", registry)
    monkeypatch.setattr(streaming_decode, "WanStreamDecoder", lambda vae: None)
    yield registry
    registry.clear()


def _start(handle, prompt="a cat"):
    from wan_accel.nodes.prompt_nodes import CausalWanPromptPlaySession
    out = CausalWanPromptPlaySession().start(handle, object(), prompt, width=32, height=32, seed=5,
                                             frames_per_block=3, kv_window=-1, sink=0)
    return out["result"][0]


AMBIGUOUS = {
    "blend without a length": ("a dog (blend)", ["(blend", "(blend 2)"]),
    "blend not at the end": ("a dog (blend 2) running", ["(blend", "end of the line"]),
    "two blends": ("a dog (blend 2) (blend 3)", ["(blend"]),
    "two weights": ("a cat :0.7 :0.3", ["one weight", "a cat :0.7"]),
    "colon without a weight": ("a cat :", ["no weight"]),
    "blend with an empty mode": ("a dog (blend 2,)", ["blend mode"]),
}
WEIGHTS_REFUSED = {
    "a weight past float": ("a :1e309 | b", ["finite"]),
    "a share that rounds to 0": ("a :1e-320 | b :1e300", ["rounds to 0"]),
    "a weight of 400 digits": ("a :" + "9" * 400 + " | b", ["finite"]),
}
WEIGHTS_TAKEN = ["a :1e308 | b :1e308", "a :1.7976931348623157e308 | b :1.7e308 | c :1e308", "a :5e-324 | b :5e-324"]


def _faces_refuse(text, words, tmp_path, handle):
    """The command line, the Prompt Schedule node, the CausalWan Sampler's schedule parser and the Prompt Play
    Session start all refuse ``0: a\\n1: <text>`` (or the first prompt) with the parser's reason."""
    from wan_accel.nodes.model_nodes import parse_schedule
    from wan_accel.nodes.prompt_nodes import WanAccelPromptSchedule
    schedule = f"0: a\n1: {text}"
    refused(run_cli("generate", "--prompt-schedule", schedule, "--out", tmp_path / "run", *SMALL,
                    "--frames", "21"), "--prompt-schedule", *words, longest=1200)
    assert not (tmp_path / "run" / "latents.safetensors").exists()
    clip = Clip()
    for call in (lambda: WanAccelPromptSchedule().encode(clip, schedule), lambda: parse_schedule(schedule, 2)):
        with pytest.raises(ValueError) as err:
            call()
        assert "prompt_schedule" in str(err.value) and all(w in str(err.value) for w in words), str(err.value)
    assert clip.encoded == []                           # refused before anything was encoded


@pytest.mark.parametrize("table,name", [("ambiguous", n) for n in AMBIGUOUS] +
                         [("weights", n) for n in WEIGHTS_REFUSED])
def test_ambiguous_text_and_weights_no_float_holds_are_refused_by_every_face(table, name, tmp_path, handle, env):
    text, words = (AMBIGUOUS if table == "ambiguous" else WEIGHTS_REFUSED)[name]
    _faces_refuse(text, words, tmp_path, handle)
    with pytest.raises(ValueError) as err:
        _start(handle, text)
    assert str(err.value).startswith("prompt") and len(env) == 0
    if table == "weights":
        assert all(w in str(err.value) for w in words)


@pytest.mark.parametrize("text", WEIGHTS_TAKEN)
def test_weights_whose_sum_overflows_are_taken_by_every_face(text, tmp_path, handle, env):
    from wan_accel.nodes.model_nodes import parse_schedule
    from wan_accel.nodes.prompt_nodes import WanAccelPromptSchedule
    schedule = f"0: a\n1: {text}"
    code, out, err = run_cli("generate", "--prompt-schedule", schedule, "--out", tmp_path / "run", "--json", *SMALL,
                             "--frames", "21")
    assert code == 0, err
    (cond,) = WanAccelPromptSchedule().encode(Clip(), schedule)
    assert bool(torch.isfinite(cond[0][0]).all())
    weights = parse_schedule(schedule, 2).entries[1].weights()
    assert abs(sum(weights) - 1) < 1e-12 and all(0 < w <= 1 for w in weights)
    sid = _start(handle, text)
    assert env.get(sid).prompt is None                  # started; the first step makes the first chunk


def test_a_live_session_refuses_every_bad_prompt_and_goes_on(handle, env):
    from wan_accel.nodes.prompt_nodes import CausalWanPromptPlayStep
    sid = _start(handle)
    step = CausalWanPromptPlayStep()
    step.step(sid, "")
    play = env.get(sid)
    bad = [t for t, _ in AMBIGUOUS.values()] + [t for t, _ in WEIGHTS_REFUSED.values()]
    for text in bad:
        before = (play.chunks, play.schedule_text, len(play.log), play.prompt)
        with pytest.raises(PlayError):
            step.step(sid, text)
        assert not play.ended and (play.chunks, play.schedule_text, len(play.log), play.prompt) == before, text
    step.step(sid, WEIGHTS_TAKEN[0])
    step.step(sid, "")
    assert play.chunks == 3 and not play.ended


def test_a_live_krea_session_refuses_an_ambiguous_prompt(handle):
    play = PromptPlaySession(handle.model, lambda t: tiny_text_embedding(t, 6, TINY_CONFIG.text_dim), H, W,
                             recache="krea", kv_window=6, prompt="a cat")
    play.step("")
    with pytest.raises(PlayError, match="blend"):
        play.step("a dog (blend)")                      # not a Krea default change of the text 'a dog (blend)'
    play.step("a dog")
    assert play.chunks == 2 and "(blend 4, krea)" in play.schedule_text


# ============================================================================ 6. messages: the input and the fix
@pytest.mark.parametrize("value, raises", [("false", False), ("off", False), ("no", False), ("0", False),
                                           ("", False), (" FALSE ", False), ("1", True), ("true", True),
                                           ("yes", True), ("ON", True)])
def test_only_a_truthy_debug_value_shows_tracebacks(value, raises, monkeypatch, capsys):
    from wan_accel.cli.errors import run_guarded
    from wan_accel.profiling.child import debug, worker_message

    def bug(_args):
        return [][1]
    monkeypatch.setenv("WAN_ACCEL_DEBUG", value)
    assert debug() is raises
    assert ("\n" in worker_message("w failed", "Traceback ...")) is raises
    if raises:
        with pytest.raises(IndexError):
            run_guarded(bug, None)
    else:
        assert run_guarded(bug, None) == 1
        assert capsys.readouterr().err.startswith("error: internal error IndexError")


def test_an_empty_file_option_is_refused_before_any_work(tmp_path):
    for argv, option in ((["bench", "sampler", "--decode", "tiny", "--vae", ""], "--vae"),
                         (["generate", "--checkpoint", "", "--out", tmp_path / "g", *SMALL], "--checkpoint"),
                         (["plan", "--checkpoint", ""], "--checkpoint")):
        result = run_cli(*argv)
        refused(result, option, "empty")
        assert "bench sampler [" not in result[2] and not (tmp_path / "g" / "latents.safetensors").exists()


def test_a_pickle_that_no_command_converts_is_not_told_to_convert(tmp_path):
    pt = tmp_path / "decoder.pt"
    torch.save({"w": torch.zeros(2)}, pt)
    for argv, option in ((["bench", "sampler", "--decode", "tiny", "--vae", pt], "--vae"),
                         (["generate", "--text-embeds", pt, "--out", tmp_path / "g", *SMALL], "--text-embeds")):
        line = refused(run_cli(*argv), option, "pickle", ".safetensors")
        assert "convert" not in line.replace("converts", ""), line
    line = refused(run_cli("generate", "--checkpoint", pt, "--out", tmp_path / "g", *SMALL), "--checkpoint")
    assert "python -m wan_accel convert" in line                   # a DiT .pt: convert is the right advice


def test_a_prompt_embedding_longer_than_text_len_names_the_input_and_the_fix(tmp_path, handle, env):
    from wan_accel.nodes.model_nodes import conditioning_to_context
    cfg = TINY_CONFIG
    long = torch.randn(cfg.text_len + 5, cfg.text_dim)
    save_file({"context": long}, str(tmp_path / "long.safetensors"))
    refused(run_cli("generate", "--text-embeds", tmp_path / "long.safetensors", "--out", tmp_path / "g", *SMALL),
            "long.safetensors", f"text_len={cfg.text_len}", "first")
    with pytest.raises(ValueError, match=r"positive \(the CONDITIONING\) has .* text_len=.*umt5"):
        conditioning_to_context([[long[None], {}]], cfg.text_dim, cfg.text_len)
    play = PromptPlaySession(handle.model, lambda t: tiny_text_embedding(t, cfg.text_len + (5 if t == "long" else 0),
                                                                         cfg.text_dim), H, W, prompt="a cat")
    play.step("")
    with pytest.raises(PlayError, match="text_len"):
        play.step("long")
    play.step("")
    assert play.chunks == 2 and not play.ended
    with pytest.raises(ValueError, match="text_len=.*text encoder"):
        handle.model.embed_text(long[None])


# ============================================================================ 4. options checked before any work
@pytest.mark.parametrize("argv, words", [
    (["bench", "sampler", "--variants", "reference", "--linear", "fp8"], ["--linear fp8", "--variants"]),
    (["bench", "sampler", "--variants", "reference,reference-same-dtype", "--linear", "fp8"], ["--linear fp8"]),
    (["bench", "attention", "--calls", "all", "--lq", "16", "--lk", "16"], ["--calls", "--lq"]),
    (["bench", "attention", "--calls", "largest", "--lq", "16", "--lk", "16"], ["--calls", "--lq"]),
])
def test_a_dropped_option_is_refused_before_any_work(argv, words):
    result = run_cli(*argv)
    refused(result, *words)
    assert f"bench {argv[1]} [" not in result[2]           # no progress: nothing was started


# ============================================================================ 7. special files never opened
def test_special_files_among_schedule_inputs_are_refused_before_they_are_opened(tmp_path, monkeypatch):
    from wan_accel.app.validate import UsageError, read_user_file
    from wan_accel.cache.owned_files import read_regular
    fifo = tmp_path / "schedule.txt"
    os.mkfifo(fifo)
    link = tmp_path / "link.txt"
    link.symlink_to("/dev/null")
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **k: (opened.append(str(p)), real_open(p, *a, **k))[1])
    for path, kind in ((fifo, "pipe"), (link, "device"), (Path("/dev/zero"), "device")):
        with pytest.raises(UsageError, match=kind):
            read_user_file("--prompt-schedule", str(path), what="a prompt schedule file")
        with pytest.raises(ValueError):
            read_regular(path)
    assert opened == []
    monkeypatch.undo()
    refused(run_cli("generate", "--prompt-schedule", fifo, "--out", tmp_path / "g", *SMALL), "--prompt-schedule",
            "pipe")


# ============================================================================ 2. decoder files checked like checkpoints
def _tiny_decoder_file(path, edit=None):
    from wan_accel.vae import taehv
    state = {k: v.clone().contiguous() for k, v in taehv.TinyVideoDecoder(taehv.REDUCED).state_dict().items()}
    if edit is not None:
        edit(state)
    save_file(state, str(path))
    return path


@pytest.mark.parametrize("key, value", [("decoder.1.bias", float("nan")), ("decoder.3.conv.0.weight", float("inf")),
                                        ("decoder.1.weight", float("-inf"))])
def test_a_decoder_file_with_non_finite_weights_is_refused_where_it_loads(key, value, tmp_path):
    from wan_accel.vae.build import build_decoder
    from wan_accel.vae.weights import DecoderWeightsError
    path = _tiny_decoder_file(tmp_path / "bad.safetensors", lambda s: s[key].view(-1).__setitem__(0, value))
    with pytest.raises(DecoderWeightsError, match=key.replace(".", r"\.") + " holds NaN or inf"):
        build_decoder("tiny", path)
    result = run_cli("bench", "sampler", "--decode", "tiny", "--vae", path, "--variants", "optimized", "--repeat", "1",
                     "--no-parity", "--frames", "9", "--height", "32", "--width", "32")
    refused(result, "bad.safetensors", key, "NaN or inf")
    assert "timed run" not in result[2] and "warm-up run" not in result[2]      # refused before any run


def test_a_decoder_whose_finite_weights_overflow_gives_no_timing(tmp_path):
    path = _tiny_decoder_file(tmp_path / "huge.safetensors",
                              lambda s: s.__setitem__("decoder.1.weight", torch.full_like(s["decoder.1.weight"], 3e38)))
    code, out, err = run_cli("bench", "sampler", "--decode", "tiny", "--vae", path, "--variants", "optimized",
                             "--repeat", "1", "--no-parity", "--frames", "9", "--height", "32", "--width", "32",
                             "--json")
    assert code != 0 and "NaN or inf pixels" in err and "Traceback" not in err, err
    assert "decode_s" not in out                         # no figure for frames that are not numbers


@pytest.mark.parametrize("kind", ["tiny", "wan"])
def test_a_small_file_claiming_a_wide_decoder_is_refused_from_its_header(kind, tmp_path, monkeypatch):
    """A few KB whose header claims the widest decoder: refused as missing keys from a meta-device copy, never a
    decoder of real tensors built first."""
    from wan_accel.vae import taehv, wan21
    from wan_accel.vae.build import build_decoder
    from wan_accel.vae.weights import DecoderWeightsError
    if kind == "tiny":
        cls = taehv.TinyVideoDecoder
        tensors = {f"decoder.{i}.conv.0.weight": torch.zeros(taehv.MAX_WIDTH, 1, 1, 1, dtype=torch.float16)
                   for i in taehv.STAGE_BLOCKS}
        tensors[f"decoder.{taehv.LAST_CONV}.weight"] = torch.zeros(taehv.MAX_WIDTH, 1, 1, 1, dtype=torch.float16)
    else:
        cls = wan21.WanVAEDecoder
        tensors = {"decoder.head.0.gamma": torch.zeros(wan21.MAX_DIM, 1, 1, 1, dtype=torch.float16)}
    path = tmp_path / "claims.safetensors"
    save_file(tensors, str(path))
    assert path.stat().st_size < 64 * 1024
    built = []
    real_init = cls.__init__

    def spy(self, *a, **k):
        real_init(self, *a, **k)
        built.append(next(self.parameters()).device.type)
    monkeypatch.setattr(cls, "__init__", spy)
    with pytest.raises(DecoderWeightsError, match="missing"):
        build_decoder(kind, path)
    assert built == ["meta"]                             # only the shape-only copy was made


# ============================================================================ 5. compiled ops keep their declared layout
def test_an_opaque_op_returns_the_layout_its_fake_declares():
    from wan_accel.kernels import _common

    def impl(x: torch.Tensor) -> torch.Tensor:          # values right, another layout (a chosen extension's output)
        return (x * 2).transpose(0, 1).contiguous().transpose(0, 1)

    def fake(x):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    op = _common.register_op("round4_layout_probe", impl, fake)
    x = torch.randn(6, 4)
    assert not impl(x).is_contiguous()
    out = op(x)
    assert out.is_contiguous() and torch.equal(out, 2 * x)


def test_any_failure_of_the_first_compiled_call_falls_back_to_eager_with_one_line(caplog):
    import logging

    from wan_accel.compile import CompileSettings
    from wan_accel.compile.apply import CompileHandle

    def compiled(x):
        raise AssertionError("expected size 192==192, stride 72==64 at dim=0; incorrect fake (aka meta) kernel")

    handle = CompileHandle(CompileSettings(backend="eager", warm_start=False), {}, {}, None)
    eager = lambda x: x + 1                              # noqa: E731
    with caplog.at_level(logging.WARNING, logger="wan_accel.compile"):
        assert handle.call(compiled, (torch.zeros(2),), {}, eager).tolist() == [1.0, 1.0]
        assert handle.call(compiled, (torch.ones(2),), {}, eager).tolist() == [2.0, 2.0]
    lines = [r.getMessage() for r in caplog.records if "failed, running them eagerly" in r.getMessage()]
    assert len(lines) == 1 and "AssertionError" in lines[0] and handle.failed
    later = CompileHandle(CompileSettings(backend="eager", warm_start=False), {}, {}, None)
    later.calls = 3                                      # after the first call: a region's own error is the run's
    with pytest.raises(AssertionError):
        later.call(compiled, (torch.zeros(2),), {}, eager)


def test_every_opaque_op_is_registered():
    """A registration that fails returns None and the compile loses its opaque op: every one of the pack's is there."""
    from wan_accel.kernels import (candidates, fp8_linear, norm_modulate, qk_norm_rope, residual, residual_layernorm,
                                   rms_norm)
    ops = list(candidates.OPAQUE.values()) + [fp8_linear._QUANT_OP] + [
        m._OP for m in (norm_modulate, qk_norm_rope, residual, residual_layernorm, rms_norm)]
    assert all(op is not None for op in ops), ops
