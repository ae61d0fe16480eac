"""``--help`` of every command, subcommand and bench answers at once: it imports no torch (nor triton, numpy,
safetensors, Pillow), checked with ``python -X importtime -m wan_accel ... --help`` in a new process as a user types
it, not by timing it. And every option of every command and bench says what it does.

The commands are read from the parser itself (cli/__init__.py's COMMAND_MODULES, nested actions) and from
cli/bench.py's BENCHES and ROUTES: a new command or bench is checked without a change here."""
from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import wan_accel
from wan_accel.bench import options
from wan_accel.cli import bench as cli_bench
from wan_accel.cli import build_parser

HEAVY = ("torch", "triton", "numpy", "safetensors", "PIL")
ROUTE_VALUES = {"--world-size": "2"}       # a route's option needs a value to be taken


def _subparsers(parser):
    return [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]


def _commands() -> list[list[str]]:
    """argv (before --help) of the program, every command and nested action, every bench and every bench route."""
    found = [[]]

    def walk(parser, prefix):
        for action in _subparsers(parser):
            for name, sub in action.choices.items():
                found.append(prefix + [name])
                walk(sub, prefix + [name])

    walk(build_parser(), [])
    found += [["bench", what] for what in cli_bench.BENCHES]
    found += [["bench", what, option, ROUTE_VALUES[option]] for what, option in cli_bench.ROUTES]
    return found


COMMANDS = _commands()


def _env() -> dict:
    env = dict(os.environ)
    parent = str(Path(wan_accel.__path__[0]).resolve().parent)       # `import wan_accel` in the new process
    env["PYTHONPATH"] = os.pathsep.join(p for p in (parent, env.get("PYTHONPATH", "")) if p)
    env.pop("WAN_ACCEL_DEBUG", None)
    return env


def _help(argv: list[str], tmp: Path) -> tuple[list[str], subprocess.CompletedProcess]:
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "wan_accel", *argv, "--help"],
                          capture_output=True, text=True, env=_env(), cwd=tmp, timeout=120)
    return argv, proc


def _imported(stderr: str) -> set[str]:
    """Top-level names of the modules ``-X importtime`` reports as imported."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            name = line.rsplit("|", 1)[1].strip()
            if name != "package":                       # the header line
                names.add(name.split(".")[0])
    return names


@pytest.fixture(scope="module")
def helps(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("help")
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict((" ".join(a), p) for a, p in pool.map(lambda a: _help(a, tmp), COMMANDS))


def test_the_commands_are_found():
    names = {" ".join(c) for c in COMMANDS}
    assert {"", "generate", "check-reference", "cache clear", "selftest", "bench sampler", "bench play",
            "bench fidelity", "bench attention", "bench sampler --world-size 2"} <= names, sorted(names)


@pytest.mark.parametrize("command", [" ".join(c) for c in COMMANDS], ids=lambda c: c or "(program)")
def test_help_prints_without_importing_torch(helps, command):
    proc = helps[command]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage: python -m wan_accel"), proc.stdout[:500]
    imported = _imported(proc.stderr)
    assert "wan_accel" in imported, proc.stderr[-2000:]           # the importtime report was read
    heavy = sorted(set(HEAVY) & imported)
    assert not heavy, f"`python -m wan_accel {command} --help` imports {heavy}"


def test_the_importtime_report_is_read():
    """The check above sees torch where a help imports it (a command line that imports torch, then asks for help)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", "import torch"], capture_output=True,
                          text=True, env=_env(), timeout=300)
    assert "torch" in _imported(proc.stderr)


def _bench_parsers():
    for what, (module, _) in cli_bench.BENCHES.items():
        yield f"bench {what}", module
    for (what, option), (module, _) in cli_bench.ROUTES.items():
        yield f"bench {what} {option}", module


def _options_missing_help(parser, name):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _options_missing_help(sub, f"{name} {sub_name}".strip())
        elif action.option_strings and not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            if not (action.help or "").strip():
                yield f"{name} {'/'.join(action.option_strings)}"


def test_every_option_of_every_command_has_help():
    missing = list(_options_missing_help(build_parser(), ""))
    for name, module in _bench_parsers():
        parser = argparse.ArgumentParser()
        cli_bench._options(module)(parser)
        missing += list(_options_missing_help(parser, name))
    assert not missing, f"options without help text: {missing}"


def test_the_named_options_say_what_they_do():
    text = {}
    for argv in (["generate"], ["check-reference"]):
        parser = build_parser()
        sub = next(a for a in _subparsers(parser)).choices[argv[0]]
        text.update({f"{argv[0]} {s}": a.help for a in sub._actions for s in a.option_strings})
    assert "float32" in text["generate --precision"] and "wan21" in text["generate --precision"]
    assert "noise" in text["generate --seed"]
    assert "preview" in text["generate --no-preview"]
    assert "exit 1" in text["check-reference --tol"]
    assert "cuda" in text["check-reference --device"] and "JSON" in text["check-reference --json"]


@pytest.mark.parametrize("name", sorted(options.ARGUMENTS))
def test_a_bench_module_takes_its_options_from_the_light_module(name):
    """The bench that runs is the bench whose options --help printed (one definition, in bench/options.py)."""
    module = importlib.import_module(f"wan_accel.bench.{name}")
    assert module.add_arguments is options.ARGUMENTS[name]

