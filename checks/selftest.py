"""``python -m wan_accel selftest``: every fast path run on this machine, one JSON and one markdown table.

Each stage is a command of the pack run the way a user types it (``python -m wan_accel ...`` in a new process, with
its own time limit), so one stage that crashes or hangs costs only itself. Stages that need a CUDA GPU are listed
as "needs a CUDA GPU" on a machine without one (and the run still exits 0, unless ``--require-gpu``). A stage
fails on a crash (non-zero exit, a traceback, a time-out), a parity over its tolerance (``check-reference``, the
bench's parity column, the fp8 bound), a ``bench native`` row that errored or whose parity is not a finite number, or
a path that stays on although it was measured slower than its fallback (int8 attention or fp8 linear layers kept
where slower than exact). All stages share one limit cache made for the self-test, so
the doctor and the operator store start cold, as on a new machine; the first-run costs are then part of the table.

The stages (``STAGES``): the doctor (every feature, cold); ``check-reference`` in float32 for every fixture folder
of a source checkout (Wan, causal, Matrix-Game-2, rolling, LongLive, Krea); ``generate`` on the tiny model; an fp8
checkpoint through the pack's loader; and on a GPU: ``bench sampler`` at the 1.3B shape (reference in the run
dtype, optimized, without CUDA graphs, compiled, int8 attention, fp8 linear, fp8 attention, fp8 both),
``bench attention`` (every implementation at the
run's calls), the optimized sampler with every chunk decoded by the Wan 2.1 VAE and by the tiny decoder, ``bench
kernels``, block swap under a VRAM cap (``bench offload``), the tests marked ``cuda``; and where ComfyUI imports,
ComfyUI's own loader (the doctor's native probe) and ``bench native`` (ComfyUI's MODEL through core's
SamplerARVideo, the Wan Accel AR Sampler and the pack's own path on the same file: the tiny shape on a CPU or with
``--quick``, else the 1.3B shape; bf16, fp8_scaled and bf16 with a LoRA). The speed goals (``checks/goals.py``) are
read from the bench stages' output and written beside the table (``--goals``: only the stages they are read from).

``--out``, the files written there and ``--require-gpu`` are checked before the first stage (``check_outputs``,
``check_gpu``). selftest.json and selftest.md say "unfinished" before the first stage and are written again after
every finished stage, so a run stopped half-way leaves the table of what it finished (``finished`` false,
``not_run`` the stages left), never an earlier run's. Each stage runs in its own process group: a stop (Ctrl-C,
SIGTERM, SIGHUP, a time-out) ends the stage and whatever it started, and the work folder is removed. Progress goes to
``log`` (the command line: stderr), with a line every HEARTBEAT_S while a stage runs.
"""
from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import goals

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
FIXTURES = PACKAGE_ROOT / "tests" / "fixtures"
NEEDS_GPU = "needs a CUDA GPU"
SLOWER_MARGIN = 1.05       # int8 / fp8 kept although its steady time is more than 5 % above exact's: a failure
OUTPUT = "_output"         # a stage row's parsed JSON output while the goal table is made
NATIVE_WEIGHTS = "bf16,fp8_scaled,bf16+lora"    # bench native's variants: plain, ComfyUI's scaled fp8, a LoRA
NATIVE_PARITY = (("native_vs_own_max_abs", {"native", "own"}),       # bench native's parity figures: the rows each
                 ("native_vs_core_max_abs", {"native", "core"}))     # compares
KEPT_TWINS = (("optimized-int8", "attention_ran", "int8", "int8 attention"),     # twin, what ran, its mode, words
              ("optimized-fp8att", "attention_ran", "fp8", "fp8 attention"),
              ("optimized-fp8", "linear_ran", "fp8", "fp8 linear"))


@dataclass
class Stage:
    name: str
    argv: Callable[["Context"], list]          # the command line after ``python -m wan_accel``
    timeout: float                             # seconds (on a GPU; the CPU stages are given CPU_FACTOR more)
    gpu: bool = False                          # needs a CUDA GPU
    judge: Callable[[dict], list] | None = None  # problems found in the JSON a run printed on its stdout
    available: Callable[["Context"], str | None] | None = None   # why it is skipped here, or None
    pytest: bool = False                       # run with ``python -m pytest`` instead of the pack's CLI


@dataclass
class Context:
    out: Path
    work: Path
    gpu: bool
    device: str
    quick: bool = False
    env: dict = field(default_factory=dict)


CPU_FACTOR = 3.0


# ----------------------------------------------------------------------------------------------- judges
def _json(stdout: str):
    start = stdout.find("{")
    if start < 0:
        raise ValueError("no JSON in the output")
    return json.loads(stdout[start:])


def judge_check_reference(data: dict) -> list:
    return [] if data.get("pass") else [f"parity {data.get('worst')} over the tolerance {data.get('tolerance')}"]


def judge_doctor(data: dict) -> list:
    rows = data.get("features") or []
    failed = [r.get("feature") for r in rows if isinstance(r, dict) and r.get("status") == "failed"]
    return [f"failed its self-check: {', '.join(map(str, failed))}"] if failed else []


def judge_generate(data: dict) -> list:
    problems = []
    if not data.get("files", {}).get("latents"):
        problems.append("no latents written")
    compile_info = (data.get("sampler") or {}).get("compile") or {}
    if compile_info.get("failed"):
        problems.append(f"compile fell back to eager: {compile_info['failed']}")
    return problems


def judge_bench_sampler(data: dict) -> list:
    """Every variant ran what it names (the compiled one compiled), and neither int8 attention nor fp8 linear layers
    are kept where slower than exact (their parity against exact is the fidelity bench's and the doctor's: a bound
    from their quantization)."""
    rows = {r["variant"]: r for r in data.get("rows", [])}
    problems = [f"{name}: compiling failed ({r['compile_failed']})" for name, r in rows.items()
                if r.get("compile_failed")]
    exact = rows.get("optimized")
    for name, ran, mode, words in KEPT_TWINS:
        twin = rows.get(name)
        if exact and twin and exact.get("steady_s") and twin.get("steady_s"):
            kept = twin.get(ran, mode) == mode
            if kept and twin["steady_s"] > SLOWER_MARGIN * exact["steady_s"]:
                problems.append(f"{words} stayed on although slower ({twin['steady_s']:.3f} s against "
                                f"{exact['steady_s']:.3f} s exact)")
    return problems


class Skipped(Exception):
    """A stage that found what it checks absent here (e.g. ComfyUI): listed as skipped, with the reason."""


def judge_native(data: dict) -> list:
    row = next((r for r in data.get("features", []) if r.get("feature") == "native_model"), None)
    if row is not None and row.get("status") == "unavailable":
        raise Skipped(f"ComfyUI does not import here ({str(row.get('why_off') or '')[:120]})")
    if row is None or row.get("status") != "passed":
        return [f"native_model: {row.get('status') if row else 'not checked'} "
                f"({(row or {}).get('why_off') or ''})".rstrip(" ()")]
    return []


def judge_bench_native(data: dict) -> list:
    """Skipped where the bench says ComfyUI does not import; else every variant and every sampler row ran (an error
    is the row's own line), and each parity figure whose two rows ran is a finite number. ``bench native`` states
    no parity tolerance (its figures are reported, never bounded), so a figure is judged only for being there and
    finite; ``native_vs_core_own_draws_max_abs`` compares different re-noising draws by design and is not judged."""
    if data.get("skipped"):
        raise Skipped(f"ComfyUI does not import here ({str(data.get('detail') or '')[:120]}); run the self-test "
                      "with ComfyUI's Python, or set COMFYUI_DIR to ComfyUI's folder")
    variants = [v for v in data.get("variants", []) if isinstance(v, dict)]
    if not variants:
        return ["no weights variant ran"]
    problems = []
    for v in variants:
        name, rows, parity = v.get("weights"), v.get("rows") or {}, v.get("parity") or {}
        if v.get("error"):
            problems.append(f"{name}: {v['error']}")
        problems += [f"{name} {key}: {r['error']}" for key, r in rows.items() if isinstance(r, dict) and r.get("error")]
        ran = {key for key, r in rows.items() if isinstance(r, dict) and not r.get("error")}
        for key, pair in NATIVE_PARITY:
            value = parity.get(key)
            if value is None:
                if pair <= ran and not v.get("error"):
                    problems.append(f"{name}: no {key} although {' and '.join(sorted(pair))} ran")
            elif not math.isfinite(value):
                problems.append(f"{name}: {key} is {value} (a video that is not finite)")
    return problems


def judge_fp8(data: dict) -> list:
    return [] if data.get("pass") else [data.get("why", "fp8 over its bound")]


# ----------------------------------------------------------------------------------------------- stages
def _bench_sampler(*options: str):
    """The argv of ``bench sampler`` with ``options``: one timed run with ``--quick``, else two at the 1.3B shape."""
    def argv(ctx: Context) -> list:
        return (["bench", "sampler", *options, "--repeat", "1" if ctx.quick else "2", "--json"]
                + ([] if ctx.quick else ["--shape", "1.3b"]))
    return argv


_sampler_argv = _bench_sampler("--variants", "reference-same-dtype,optimized,optimized-no-graphs,optimized-compiled,"
                               "optimized-int8,optimized-fp8,optimized-fp8att,optimized-fp8att-fp8")


def _native_argv(ctx: Context) -> list:
    """``bench native``: the tiny shape on a CPU or with ``--quick`` (it runs end to end where ComfyUI imports), else
    the 1.3B shape the native goals are read from; the three weights variants either way."""
    small = ctx.quick or not ctx.gpu
    return ["bench", "native", "--shape", "tiny" if small else "1.3b", "--weights", NATIVE_WEIGHTS,
            "--repeat", "1" if small else "3", "--device", ctx.device, "--json"]


STAGES: list = [
    Stage("doctor", lambda ctx: ["doctor", "--json", "--device", ctx.device], 120, judge=judge_doctor),
    *(Stage(f"check-reference {kind}",
            lambda ctx, k=kind: ["check-reference", str(FIXTURES / k), "--device", ctx.device, "--json"],
            120, judge=judge_check_reference,
            available=lambda ctx, k=kind: None if (FIXTURES / k).is_dir() else
            "the fixtures ship with a source checkout (tests/fixtures), not with an installed wheel")
      for kind in ("wan_reference", "matrix_game2", "longlive", "krea_realtime")),
    Stage("generate", lambda ctx: ["generate", "--out", str(ctx.work / "generate"), "--json", "--device", ctx.device],
          120, judge=judge_generate),
    Stage("generate compiled", lambda ctx: ["generate", "--out", str(ctx.work / "generate-compiled"), "--json",
                                            "--device", ctx.device, "--compile", "--sampler", "optimized"],
          240, gpu=True, judge=judge_generate),
    Stage("fp8 checkpoint", lambda ctx: ["selftest", "--stage", "fp8", "--device", ctx.device,
                                         "--out", str(ctx.work / "fp8")], 120, judge=judge_fp8),
    Stage("bench sampler", _sampler_argv, 300, gpu=True, judge=judge_bench_sampler),
    Stage("bench attention", lambda ctx: ["bench", "attention", "--calls", "all", "--json"]
          + (["--shape", "tiny"] if ctx.quick else []), 120, gpu=True),
    # the optimized path, every chunk decoded as it is made: video FPS with decode (parity is the sampler stage's)
    Stage("bench decode wan", _bench_sampler("--variants", "optimized", "--decode", "wan", "--no-parity"), 180,
          gpu=True),
    Stage("bench decode tiny", _bench_sampler("--variants", "optimized", "--decode", "tiny", "--no-parity"), 150,
          gpu=True),
    Stage("bench kernels", lambda ctx: ["bench", "kernels", "--json"], 120, gpu=True),
    Stage("block swap", lambda ctx: ["bench", "offload", "--json"] + (["--blocks", "4"] if ctx.quick else []),
          150, gpu=True),
    Stage("native model", lambda ctx: ["doctor", "--json", "--feature", "native_model", "--device", ctx.device],
          120, judge=judge_native),
    # three variants of three samplers each at 1.3B (a cold limit cache, ComfyUI's load, the dispatch counts)
    Stage("bench native", _native_argv, 600, judge=judge_bench_native),
    Stage("tests marked cuda", lambda ctx: ["-m", "pytest", "-q", "-m", "cuda", str(PACKAGE_ROOT / "tests")], 240,
          gpu=True, pytest=True, available=lambda ctx: None if (PACKAGE_ROOT / "tests").is_dir() else
          "the tests ship with a source checkout, not a wheel"),
]


# ----------------------------------------------------------------------------------------------- running
def _env(ctx: Context) -> dict:
    env = dict(os.environ)
    env["WAN_ACCEL_CACHE"] = str(ctx.work / "cache" / "limits.json")    # cold: a new machine's first run
    paths = [p for p in sys.path if p and Path(p).is_dir()]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.pop("WAN_ACCEL_DEBUG", None)
    env.update(ctx.env)
    return env


def stage_file(name: str) -> str:
    """The file name of a stage's full output under ``<out>/stages/``."""
    return "".join(c if c.isalnum() else "_" for c in name).strip("_") + ".log"


def _keep_output(stage: Stage, ctx: Context, proc) -> str:
    """A stage's whole stdout and stderr, kept beside the table (the table holds one line of it)."""
    from ..cache.owned_files import write_text
    path = ctx.out / "stages" / stage_file(stage.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, f"$ {stage.name}\n--- stdout\n{proc.stdout or ''}\n--- stderr\n{proc.stderr or ''}",
               option="--out", purpose="a stage's output")
    return str(path.relative_to(ctx.out))


def _tail(text: str, n: int = 400) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:n]


HEARTBEAT_S = 30.0         # a stage still running says so this often (the stage's own output is kept for its log)


def _communicate(proc, timeout: float, log, name: str) -> tuple:
    """(stdout, stderr) of ``proc``, saying every HEARTBEAT_S that ``name`` still runs; TimeoutExpired after
    ``timeout`` seconds (the process killed)."""
    t0 = time.perf_counter()
    while True:
        left = timeout - (time.perf_counter() - t0)
        try:
            return proc.communicate(timeout=max(0.01, min(left, HEARTBEAT_S)))
        except subprocess.TimeoutExpired:
            if time.perf_counter() - t0 >= timeout:
                stop_group(proc)
                proc.communicate()
                raise
            if log is not None:
                log(f"    {name}: still running, {time.perf_counter() - t0:.0f} s of at most {timeout:.0f} s")
        except BaseException:            # Ctrl-C, SIGTERM: the stage and what it started end with the self-test
            stop_group(proc)
            raise


STOP_GRACE_S = 5.0         # a stage asked to stop (SIGTERM) has this long before it is killed


def stop_group(proc, grace: float = STOP_GRACE_S) -> None:
    """End a stage and every process it started: SIGTERM to its process group (each stage runs in a new session,
    so the group is the stage's own), SIGKILL to what is left after ``grace`` seconds."""
    import signal
    if not hasattr(os, "killpg"):        # no process groups here (Windows): the stage alone
        proc.kill()
        proc.wait()
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        try:                             # the stage ended: its children too, before its work folder goes
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return


def run_stage(stage: Stage, ctx: Context, log=None) -> dict:
    """The row of one stage, run in a new process; ``log(text)`` hears every HEARTBEAT_S that it still runs."""
    row = {"stage": stage.name, "status": "passed", "seconds": 0.0, "detail": "", "gpu": stage.gpu}
    if stage.gpu and not ctx.gpu:
        return dict(row, status=NEEDS_GPU, detail="no CUDA GPU on this machine")
    why = stage.available(ctx) if stage.available is not None else None
    if why:
        return dict(row, status="skipped", detail=why)
    argv = stage.argv(ctx)
    cmd = [sys.executable, *argv] if stage.pytest else [sys.executable, "-m", "wan_accel", *argv]
    row["command"] = ("python " if stage.pytest else "python -m wan_accel ") + " ".join(argv)
    timeout = stage.timeout * (1.0 if ctx.gpu else CPU_FACTOR)
    t0 = time.perf_counter()
    try:
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(ctx),
                              cwd=str(ctx.work), start_new_session=True) as child:     # its own process group
            stdout, stderr = _communicate(child, timeout, log, stage.name)
            proc = subprocess.CompletedProcess(cmd, child.returncode, stdout, stderr)
    except subprocess.TimeoutExpired:
        return dict(row, status="failed", seconds=round(time.perf_counter() - t0, 2),
                    detail=f"did not finish within {timeout:.0f} s")
    row["seconds"] = round(time.perf_counter() - t0, 2)
    row["output"] = _keep_output(stage, ctx, proc)
    problems = []
    if proc.returncode != 0:
        problems.append(f"exit {proc.returncode}: {_tail(proc.stderr) or _tail(proc.stdout)}")
    if "Traceback (most recent call last)" in proc.stderr:
        problems.append("a traceback on stderr")
    if not problems and stage.judge is not None:
        try:
            problems += stage.judge(_json(proc.stdout))
        except Skipped as why:
            return dict(row, status="skipped", detail=str(why))
        except Exception as exc:  # noqa: BLE001 - output the judge cannot read is a failure of the stage
            problems.append(f"unreadable output ({type(exc).__name__}: {exc})"[:300])
    if not problems and stage.pytest:
        row["detail"] = _tail(proc.stdout)
    if problems:
        row.update(status="failed", detail="; ".join(problems)[:600])
    else:
        if not row["detail"]:
            row["detail"] = _summary(stage, proc.stdout)
        if stage.name in goals.STAGES:
            try:
                row[OUTPUT] = _json(proc.stdout)       # read by the goal table, then dropped from the row
            except ValueError:
                pass
    return row


def _summary(stage: Stage, stdout: str) -> str:
    try:
        data = _json(stdout)
    except Exception:  # noqa: BLE001 - a command without JSON: its last line
        return _tail(stdout, 200)
    if stage.judge is judge_check_reference:
        return f"worst {data.get('worst', float('nan')):.3g} over {len(data.get('rows', []))} tensors"
    if stage.judge is judge_generate:
        s = data.get("sampler") or {}
        return f"{data.get('sample_seconds', 0):.2f} s sampling, path {s.get('path')}, one-time {s.get('one_time_s')}"
    if stage.judge is judge_bench_sampler:
        return "; ".join(f"{r['variant']} {r.get('steady_s')} s" for r in data.get("rows", []))
    if stage.judge is judge_fp8:
        return data.get("why", "")
    if stage.judge is judge_bench_native:
        return f"shape {data.get('shape')}: " + "; ".join(
            f"{v.get('weights')} " + ", ".join(f"{k} {(v.get('rows') or {}).get(k, {}).get('seconds_per_video')} s"
                                               for k in ("core", "native", "own"))
            for v in data.get("variants", []))
    return ""


def machine() -> dict:
    import torch
    from ..app.doctor.versions import known_breaks, stack, versions
    info = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "torch": torch.__version__,
            "cuda": torch.version.cuda or "none", "python": platform.python_version()}
    info.update({k: v for k, v in versions().items() if k in ("triton", "comfy-kitchen", "flash-attn")})
    info["stack"] = stack()                 # what the pack runs in: core, frontend, kitchen, aimdo, torch, triton
    info["known_breaks"] = known_breaks(info["stack"])
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    else:
        from ..cache.fingerprint import cpu_name
        info["device"] = f"CPU ({cpu_name()})"
    return info


def _stack_lines(m: dict) -> str:
    from ..app.doctor.versions import stack_text
    return stack_text(m["stack"]) + "\n" if "stack" in m else ""


def markdown(result: dict) -> str:
    m = result["machine"]
    head = (f"selftest on {m['device']}, {m['date']}: torch {m['torch']} (CUDA {m['cuda']}), "
            f"triton {m.get('triton', 'none')}, comfy-kitchen {m.get('comfy-kitchen', 'none')}, "
            f"flash-attn {m.get('flash-attn', 'none')}\n{_stack_lines(m)}\n")
    lines = ["| stage | status | seconds | detail |", "|---|---|---|---|"]
    for r in result["stages"]:
        detail = str(r.get("detail", "")).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r['stage']} | {r['status']} | {r['seconds']:.1f} | {detail} |")
    verdict = "PASSED" if result["passed"] else "FAILED" if result.get("finished", True) else \
        "UNFINISHED (written after each stage; the stages not run yet are named below)"
    text = head + "\n".join(lines) + f"\n\n{verdict}: {result['summary']}\n"
    if result.get("goals"):
        text += "\nSpeed goals (1.3B causal video, 480x832, 81 frames, bf16; targets for one H100 or H200):\n\n"
        text += goals.markdown(result["goals"])
    return text


FILES = (("selftest.json", "the self-test's JSON"), ("selftest.md", "the self-test's table"))


def check_outputs(out) -> Path:
    """``--out`` as a folder the self-test can write selftest.json, selftest.md and stages/ into, checked before any
    stage runs; else UsageError (OwnedFileError for the files) naming the path and the fix (a link or a folder where
    one of the files goes, a file where the folder goes)."""
    from ..app.validate import UsageError, check_output_dir
    from ..cache.owned_files import check_target
    out = check_output_dir("--out", out)
    for name, purpose in FILES:     # a link or no regular file there, a system folder, the limit cache's own files
        check_target(out / name, option=f"--out {out}", purpose=purpose)
    stages = out / "stages"
    if os.path.lexists(stages) and (os.path.islink(stages) or not os.path.isdir(stages)):
        raise UsageError(f"--out {out}: {stages} is not a folder; the self-test keeps each stage's output in "
                         f"{stages}/: remove it or choose another --out")
    return out


def check_gpu(require_gpu: bool) -> bool:
    """Whether a CUDA GPU is here; with ``require_gpu`` and none, UsageError before any stage runs."""
    import torch
    from ..app.validate import UsageError
    gpu = torch.cuda.is_available()
    if require_gpu and not gpu:
        raise UsageError("--require-gpu: no CUDA GPU on this machine (torch.cuda.is_available() is False, torch "
                         f"{torch.__version__}); run without --require-gpu to list the GPU stages as needing one")
    return gpu


def _result(rows: list, chosen: list, gpu: bool, info: dict, goal_rows: list) -> dict:
    """The result of the stages run so far (``rows``) out of ``chosen``: finished when every one ran."""
    rows = [{k: v for k, v in r.items() if k != OUTPUT} for r in rows]
    failed = [r["stage"] for r in rows if r["status"] == "failed"]
    gpu_only = [r["stage"] for r in rows if r["status"] == NEEDS_GPU]
    left = [s.name for s in chosen[len(rows):]]
    summary = (f"{sum(r['status'] == 'passed' for r in rows)} passed, {len(failed)} failed"
               + (f", {len(gpu_only)} need a CUDA GPU ({', '.join(gpu_only)})" if gpu_only else "")
               + (f"; failed: {', '.join(failed)}" if failed else "")
               + (f"; not run yet: {', '.join(left)}" if left else ""))
    return {"kind": "wan_accel.selftest", "schema": 1, "machine": info, "gpu": gpu, "stages": rows,
            "needs_gpu": gpu_only, "passed": not failed and not left, "finished": not left, "not_run": left,
            "summary": summary, "goals": goal_rows}


def _write(out: Path, result: dict) -> dict:
    """selftest.json and selftest.md written atomically (cache/owned_files.py: a reader sees the old file or the new
    one, never a part); the result with their paths."""
    from ..cache.owned_files import write_text
    write_text(out / "selftest.json", json.dumps(result, indent=2) + "\n", option="--out", purpose=FILES[0][1])
    write_text(out / "selftest.md", markdown(result), option="--out", purpose=FILES[1][1])
    return dict(result, files={"json": str(out / "selftest.json"), "markdown": str(out / "selftest.md")})


class Stopped(KeyboardInterrupt):
    """The self-test was asked to stop by a signal (SIGTERM, SIGHUP): ``signum``; it stops as on Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stopped(signum, frame):
    raise Stopped(signum)


@contextmanager
def stop_on_signals():
    """SIGTERM and SIGHUP raise :class:`Stopped` in the main thread while the self-test runs, so the running stage's
    process group is stopped and the work folder removed on the way out (the signals' own handlers come back
    afterwards; outside the main thread nothing is changed)."""
    import signal
    import threading
    saved = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
            if sig is not None:
                saved[sig] = signal.signal(sig, _stopped)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _clear_previous(out: Path) -> None:
    """What an earlier run left in ``out`` that this one replaces: the stage logs of the pack's own names (nothing
    else in the folder is touched), so this run's table never points at an earlier run's output."""
    for stage in STAGES:
        path = out / "stages" / stage_file(stage.name)
        if path.is_file() and not path.is_symlink():
            path.unlink()


def run_selftest(out, *, require_gpu: bool = False, quick: bool = False, stages: list | None = None,
                 log=print, only_goals: bool = False) -> dict:
    """Run the chosen stages; selftest.json and selftest.md say "unfinished" before the first stage (never an
    earlier run's verdict) and are written again after every finished stage (a run stopped half-way leaves the
    table of the stages it finished). ``--out`` and ``--require-gpu`` are checked first. SIGTERM or SIGHUP stop
    it as Ctrl-C does (:class:`Stopped`): the running stage and every process it started end, its work folder
    goes."""
    out = check_outputs(out)
    gpu = check_gpu(require_gpu)
    wanted = set(stages or ()) | (set(goals.STAGES) if only_goals else set())
    chosen = STAGES if not wanted else [s for s in STAGES if s.name in wanted]
    out.mkdir(parents=True, exist_ok=True)
    info = machine()
    _write(out, _result([], chosen, gpu, info, []))       # unfinished from the start: an earlier verdict is gone
    _clear_previous(out)
    with stop_on_signals(), tempfile.TemporaryDirectory(prefix="wan_accel_selftest_") as work:
        ctx = Context(out=out, work=Path(work), gpu=gpu, device="cuda" if gpu else "cpu", quick=quick)
        rows = []
        for i, stage in enumerate(chosen):
            log(f"[{i + 1}/{len(chosen)}] {stage.name} ...")
            row = run_stage(stage, ctx, log)
            rows.append(row)
            log(f"[{i + 1}/{len(chosen)}] {stage.name}: {row['status']} ({row['seconds']:.1f} s) {row['detail']}"
                .rstrip())
            if i + 1 < len(chosen):
                _write(out, _result(rows, chosen, gpu, info, []))
    outputs = {r["stage"]: r.pop(OUTPUT) for r in rows if OUTPUT in r}
    goal_rows = goals.judge(outputs) if any(r["stage"] in goals.STAGES for r in rows) else []
    return _write(out, _result(rows, chosen, gpu, info, goal_rows))


# ----------------------------------------------------------------------------------------------- fp8 stage
FP8_RMS_BOUND = 2.0 ** -4     # e4m3 rounds a value by at most 2^-4 of itself; weights and (on the GPU's scaled
#                               matmul) activations are rounded independently, so the relative RMS error of the
#                               whole sampled video stays below one such step


def fp8_stage(device: str, out: Path) -> dict:
    """A scaled e4m3 checkpoint of the tiny model through the pack's loader (its linear layers kept in fp8; on a GPU
    the scaled matmul) against the same weights dequantized, on this device: relative RMS error of the video."""
    import torch
    from safetensors.torch import save_file
    from ..model.checkpoint import METADATA_KEY
    from ..model.loader import load_wan_checkpoint
    from ..model.quant import FP8Linear, fp8_matmul_path
    from ..model.random_checkpoint import fp8_scaled
    from ..model.tiny import TINY_CONFIG, tiny_causal_model
    from ..app.prepare import RunInputs, RunSpec, prepare

    state = {n: t.detach().clone().contiguous() for n, t in tiny_causal_model(seed=3).state_dict().items()}
    fp8, _meta = fp8_scaled(state, legacy=True)     # the block linears in e4m3, ComfyUI's legacy scale_weight layout
    scales = {n: fp8.get(n[:-len(".weight")] + ".scale_weight") for n in state}
    deq = {n: t if scales[n] is None else fp8[n].float() * scales[n] for n, t in state.items()}
    out.mkdir(parents=True, exist_ok=True)
    meta = {METADATA_KEY: json.dumps(TINY_CONFIG.to_dict())}
    for name, tensors in (("fp8", fp8), ("deq", deq)):
        save_file(tensors, str(out / f"{name}.safetensors"), metadata=meta)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    a, b = (load_wan_checkpoint(out / f"{name}.safetensors", device=device, dtype=dtype) for name in ("fp8", "deq"))
    layers = [m for m in a.modules() if isinstance(m, FP8Linear)]
    g = torch.Generator().manual_seed(0)
    ctx = torch.randn(1, 7, TINY_CONFIG.text_dim, generator=g)
    noise = torch.randn(1, 6, TINY_CONFIG.in_dim, 4, 6, generator=g)
    spec = RunSpec(path="optimized" if device.startswith("cuda") else "reference", doctor=False, oom_retry="off")
    x, y = (prepare(m, spec, RunInputs(context=ctx, noise=noise, generator=torch.Generator().manual_seed(1))
                    ).latents().float() for m in (a, b))
    rel = float((x - y).pow(2).mean().sqrt() / y.pow(2).mean().sqrt().clamp_min(1e-30))
    probe_x = torch.randn(4, layers[0].in_features, generator=g).to(device, a.compute_dtype) if layers else None
    matmul = fp8_matmul_path(layers[0], probe_x)[0] if layers else "none"
    ok = bool(layers) and bool(torch.isfinite(x).all()) and rel <= FP8_RMS_BOUND
    why = (f"{len(layers)} fp8 layers, matmul {matmul}, video relative RMS error {rel:.3g} "
           f"(bound {FP8_RMS_BOUND:.3g})")
    return {"pass": ok, "why": why if ok else f"over the bound: {why}", "relative_rms": rel, "layers": len(layers),
            "matmul": matmul}
