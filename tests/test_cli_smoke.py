"""Every command and every bench target, run the way a user types it (``python -m wan_accel ...`` in a new
process) on the tiny model with the smallest real settings: exit 0 and the output it promises.

The cases are checked against the command line's own tables (the parser built from cli/__init__.py's
COMMAND_MODULES, and cli/bench.py's BENCHES and ROUTES): a new command or bench without a case here fails
``test_every_command_and_bench_has_a_smoke_case``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cli_run import failure_report
from wan_accel.cli import build_parser
from wan_accel.cli.bench import BENCHES, ROUTES

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TINY = ["--device", "cpu", "--frames", "9", "--height", "32", "--width", "32"]


def _keys(*names):
    def check(out: str, tmp: Path) -> None:
        data = json.loads(out)
        missing = [n for n in names if n not in data]
        assert not missing, f"JSON output lacks {missing}: {sorted(data)[:20]}"
    return check


def _contains(*texts):
    def check(out: str, tmp: Path) -> None:
        for text in texts:
            assert text.format(tmp=tmp) in out, f"{text!r} not in the output:\n{out[-2000:]}"
    return check


def _generate_wrote(out: str, tmp: Path) -> None:
    report = json.loads(out)
    assert report["latent_shape"][1] == 3 and report["files"], report
    assert all(Path(p).is_file() for p in report["files"].values()), report["files"]


def _switched(out: str, tmp: Path) -> None:
    report = json.loads(out)
    assert [s["chunk"] for s in report["sampler"]["prompt_switches"]] == [1], report["sampler"]
    assert report["latent_shape"][1] == 6 and Path(report["files"]["latents"]).is_file(), report


def _krea(out: str, tmp: Path) -> None:
    report = json.loads(out)
    assert report["settings"]["recache"] == "krea" and report["settings"]["kv_window"] == 6, report["settings"]
    assert report["schedule"]["preset"] == "krea" and report["schedule"]["timesteps"][-1] == 0, report["schedule"]
    assert any("no VAE at hand" in n for n in report["notes"]) and report["latent_shape"][1] == 12, report


def _alternatives(out: str, tmp: Path) -> None:
    plan = json.loads(out)
    assert "fits" in plan and "kv_window" in plan, sorted(plan)
    kinds = {a["kind"]: a for a in plan["alternatives"]}
    assert kinds["fp8 weights"]["recommended"] and kinds["fp8 weights"]["fits"], plan["alternatives"]


def _lora_generated(out: str, tmp: Path) -> None:
    report = json.loads(out)
    assert report["settings"]["lora"].endswith("lora_peft.safetensors") and report["settings"]["lora_strength"] == 0.5
    assert Path(report["files"]["latents"]).is_file(), report["files"]


def _sampler_rows(out: str, tmp: Path) -> None:
    rows = {r["variant"]: r for r in json.loads(out)["rows"]}
    assert "reference" in rows, sorted(rows)
    assert rows["optimized"]["ops"] == "auto" and rows["optimized-ops-torch"]["ops"] == "torch", sorted(rows)


def _decoded(out: str, tmp: Path) -> None:
    (row,) = json.loads(out)["rows"]
    assert row["decode"] == "tiny" and row["decoded_frames"] == 9 and row["video_fps_with_decode"] > 0, row
    assert row["parity_max_abs"] is None            # --no-parity: no float32 reference run


def _sampler_table(out: str, tmp: Path) -> None:
    assert "parity_max_abs" in out and "n/a" in out and "optimized" in out, out


def _fp8_generated(out: str, tmp: Path) -> None:
    report = json.loads(out)
    assert report["sampler"]["linear"] == "fp8" and report["sampler"]["linear_path"] == "emulated", report["sampler"]
    assert report["sampler"]["path"] == "optimized" and Path(report["files"]["latents"]).is_file(), report


def _fp8_rows(out: str, tmp: Path) -> None:
    rows = {r["variant"]: r for r in json.loads(out)["rows"]}
    assert rows["optimized-fp8"]["linear_ran"] == "fp8" and rows["optimized-fp8"]["vs_exact_max_abs"] > 0, rows
    assert rows["optimized"]["linear_ran"] == "exact", sorted(rows)


def _fp8_fidelity(out: str, tmp: Path) -> None:
    data = json.loads(out)
    assert data["linear"] == "fp8" and [r["path"] for r in data["rows"]] == ["optimized"], data["rows"]
    assert data["rows"][0]["final"]["max_abs"] > 0, data["rows"][0]["final"]


def _converted(out: str, tmp: Path) -> None:
    summary = json.loads(out)
    assert Path(summary["output"]).is_file() and summary["tensors"] > 0, summary


def _lora_converted(out: str, tmp: Path) -> None:
    from safetensors import safe_open
    assert "LoRA layers written to" in out, out
    with safe_open(str(tmp / "lora_comfy.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith("diffusion_model.") for k in keys), keys[:5]


def _reference_passed(out: str, tmp: Path) -> None:
    result = json.loads(out)
    assert result["pass"] is True and result["rows"], result


def _sanity_ran(out: str, tmp: Path) -> None:
    data = json.loads(out)
    rows = data.get("sanity", data.get("rows"))
    assert rows and all("error" not in r for r in rows), rows      # the interpreter child ran (or was skipped)


def _ranks_ran(out: str, tmp: Path) -> None:
    data = json.loads(out)
    assert "world_size" in json.dumps(data), sorted(data)


def _tiny_pt(tmp: Path) -> None:
    import torch

    from wan_accel.model.tiny import tiny_causal_model

    sd = {k: v.clone().contiguous() for k, v in tiny_causal_model(0, "cpu", torch.float32, "float32")
          .state_dict().items()}
    torch.save({"generator": sd}, str(tmp / "tiny.pt"))


# case -> (arguments, check of stdout, set-up in tmp); "{tmp}" is the test's folder
def _selftest(out: str, tmp: Path) -> None:
    data = json.loads(out)
    by = {r["stage"]: r for r in data["stages"]}
    assert by["doctor"]["status"] == "passed" and by["fp8 checkpoint"]["status"] == "passed", data["stages"]
    assert by["bench sampler"]["status"] in ("needs a CUDA GPU", "passed"), by["bench sampler"]
    assert (tmp / "st" / "selftest.md").is_file() and data["passed"] is True
    kept = (tmp / "st" / by["fp8 checkpoint"]["output"]).read_text()     # each stage's whole output is kept
    assert kept.startswith("$ fp8 checkpoint") and '"relative_rms"' in kept


def _native(out: str, tmp: Path) -> None:
    """Without ComfyUI (this suite's Python): the skipped JSON; with it, the tiny shape ran (tests/test_bench_native.py
    checks both further)."""
    data = json.loads(out)
    assert data["bench"] == "native"
    assert data["skipped"] or {v["weights"] for v in data["variants"]} == {"bf16"}, data


CASES = {
    "selftest": (["selftest", "--out", "{tmp}/st", "--json", "--only", "doctor", "--only", "fp8 checkpoint",
                  "--only", "bench sampler"], _selftest, None),
    "generate": (["generate", "--out", "{tmp}/out", "--no-preview", "--json", *TINY], _generate_wrote, None),
    "generate_fp8": (["generate", "--out", "{tmp}/out", "--no-preview", "--json", "--linear", "fp8", *TINY],
                     _fp8_generated, None),
    "generate_prompt_schedule": (["generate", "--out", "{tmp}/out", "--no-preview", "--json", "--preset", "longlive",
                                  "--prompt-schedule", "0: a cat walks\n1: the cat runs (blend 1, slerp)",
                                  "--device", "cpu", "--frames", "21", "--height", "32", "--width", "32"],
                                 _switched, None),
    "generate_krea": (["generate", "--out", "{tmp}/out", "--no-preview", "--json", "--preset", "krea", "--device",
                       "cpu", "--frames", "45", "--height", "32", "--width", "32"], _krea, None),
    "plan_krea": (["plan", "--model", "krea-14b", "--vram-gb", "32", "--ram-gb", "64", "--no-learned", "--json"],
                  _alternatives, None),
    "generate_lora": (["generate", "--out", "{tmp}/out", "--no-preview", "--json", "--checkpoint",
                       str(FIXTURES / "wan_reference" / "causal_weights.safetensors"), "--num-heads", "4", "--lora",
                       str(FIXTURES / "longlive" / "lora_peft.safetensors"), "--lora-strength", "0.5", *TINY],
                      _lora_generated, None),
    "convert": (["convert", "{tmp}/tiny.pt", "{tmp}/tiny.safetensors", "--num-heads", "4", "--json"], _converted,
                _tiny_pt),
    "convert-lora": (["convert-lora", str(FIXTURES / "longlive" / "lora_peft.safetensors"),
                      "{tmp}/lora_comfy.safetensors"], _lora_converted, None),
    "check-reference": (["check-reference", str(FIXTURES / "wan_reference"), "--json"], _reference_passed, None),
    "cache show": (["cache", "show"], _contains("limit cache:", "{tmp}"), None),
    "cache path": (["cache", "path"], _contains("{tmp}"), None),
    "cache clear": (["cache", "clear", "--json"], lambda out, tmp: json.loads(out), None),
    "cache prune-stale": (["cache", "prune-stale", "--json"], lambda out, tmp: json.loads(out), None),
    "cache set-aside": (["cache", "set-aside"], _contains("{tmp}"), None),
    "nodes": (["nodes"], _contains("Wan Doctor", "-> "), None),
    "plan": (["plan", "--model", "1.3b", "--frames", "9", "--json"], _keys("fits", "blocks_to_swap"), None),
    "profile": (["profile", "--runs", "1", "--warmup", "0", "--out", "{tmp}/prof", "--no-history", "--json",
                 "--explain", *TINY], _keys("explain"), None),
    "report": (["report", "--history", "{tmp}/history.jsonl", "--json"], lambda out, tmp: json.loads(out), None),
    "doctor": (["doctor", "--device", "cpu", "--feature", "kernel.gated_residual", "--json",
                "--report", "{tmp}/doctor.json"], _contains("kernel.gated_residual"), None),
    "bench sampler": (["bench", "sampler", "--repeat", "1", "--variants", "reference,optimized,optimized-ops-torch",
                       "--json", *TINY], _sampler_rows, None),
    "bench sampler_decode": (["bench", "sampler", "--repeat", "1", "--variants", "optimized", "--decode", "tiny",
                              "--no-parity", "--json", *TINY], _decoded, None),
    "bench sampler_table": (["bench", "sampler", "--repeat", "1", "--variants", "optimized", "--no-parity", *TINY],
                            _sampler_table, None),
    "bench sampler_fp8": (["bench", "sampler", "--repeat", "1", "--shape", "tiny", "--linear", "fp8", "--variants",
                           "optimized", "--json", *TINY], _fp8_rows, None),
    "bench sampler --world-size": (["bench", "sampler", "--world-size", "2", "--repeat", "1", "--json", *TINY],
                                   _ranks_ran, None),
    "bench compile": (["bench", "compile", "--model", "standin", "--blocks", "1", "--dim", "16", "--device", "cpu",
                       "--json"], _keys("cold_compile_s", "warm_compile_s", "warm_counters"), None),
    "bench kernels": (["bench", "kernels", "--json"], _sanity_ran, None),
    "bench attention": (["bench", "attention", "--json"], _keys("rows", "largest_call", "fastest_exact"), None),
    "bench offload": (["bench", "offload", "--blocks", "1", "--repeats", "1", "--warmup", "0", "--json"],
                      _keys("rows"), None),
    "bench play": (["bench", "play", "--device", "cpu", "--chunks", "1", "--warmup", "0", "--json"],
                   _keys("rows", "same_frames"), None),
    "bench fidelity": (["bench", "fidelity", "--fixture", str(FIXTURES / "wan_reference"), "--json"],
                       _keys("rows", "speed"), None),
    "bench fidelity_fp8": (["bench", "fidelity", "--fixture", str(FIXTURES / "wan_reference"), "--linear", "fp8",
                            "--json"], _fp8_fidelity, None),
    "bench native": (["bench", "native", "--repeat", "1", "--json"], _native, None),
}


def _commands() -> set:
    """Every command of the parser (a command with actions of its own: each action), and every bench target."""
    names = set()
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        names |= {f"{name} {action}" for a in nested for action in a.choices} if nested else {name}
    names.discard("bench")
    names |= {f"bench {what}" for what in BENCHES} | {f"bench {what} {option}" for what, option in ROUTES}
    return names


def test_every_command_and_bench_has_a_smoke_case():
    # a case named '<command>_<variant>' is one more case of <command> (a variant of a command that has its own)
    assert _commands() == {name.split("_", 1)[0] for name in CASES}


CASE_TIMEOUT_S = 900        # a limit against a hung case, not a speed test: interpreted kernels on a loaded machine


def run_cli(args: list, tmp: Path, timeout: float = CASE_TIMEOUT_S):
    """The finished process, or the TimeoutExpired of one that did not finish (with what it printed until then)."""
    env = dict(os.environ, WAN_ACCEL_CACHE=str(tmp / "cache" / "limits.json"))
    env.pop("WAN_ACCEL_DEBUG", None)
    try:
        return subprocess.run([sys.executable, "-m", "wan_accel", *args], capture_output=True, text=True, env=env,
                              cwd=tmp, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return exc


# the cases that take longest start first; the others fill the remaining workers
SLOW_FIRST = ("bench compile", "selftest", "bench kernels", "profile", "bench sampler --world-size")


def _selected(session) -> set:
    """The cases this session runs (``-k`` or a node id may pick a few): only those are started."""
    return {item.callspec.params["case"] for item in session.items
            if item.name.startswith("test_command_runs[") and hasattr(item, "callspec")}


@pytest.fixture(scope="module")
def launched(tmp_path_factory, request):
    """Every selected case started at once, a few processes at a time (each is one new interpreter: most of a case is
    its start-up, which a second core overlaps), each in its own folder with its own limit cache:
    {case: (folder, future of the finished process)}."""
    chosen = _selected(request.session) or set(CASES)
    order = [c for c in SLOW_FIRST if c in chosen] + sorted(c for c in chosen if c not in SLOW_FIRST)
    workers = max(2, min(4, (os.cpu_count() or 1) + 1))
    started = {}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for case in order:
            args, _, setup = CASES[case]
            tmp = tmp_path_factory.mktemp(case.replace(" ", "_").replace("-", ""))
            if setup:
                setup(tmp)
            started[case] = (tmp, pool.submit(run_cli, [a.format(tmp=tmp) for a in args], tmp))
        yield started
        for _, future in started.values():     # a failed case has not stopped the others: let them end
            future.cancel()


@pytest.mark.parametrize("case", sorted(CASES))
def test_command_runs(case, launched):
    tmp, future = launched[case]
    _, check, _ = CASES[case]
    proc = future.result()
    assert isinstance(proc, subprocess.CompletedProcess), f"{case}: {failure_report(proc)}"
    assert proc.returncode == 0, f"{case}: {failure_report(proc)}"
    assert "Traceback" not in proc.stderr, f"{case}: a traceback on stderr\n{failure_report(proc)}"
    try:
        check(proc.stdout, tmp)
    except AssertionError as exc:           # what the check found, then what the command said
        raise AssertionError(f"{case}: {exc}\n{failure_report(proc)}") from None
