"""Every ```python block of README.md and docs/*.md runs as it is written, each in a new interpreter with the
folder above the pack on PYTHONPATH (``import wan_accel`` as a user's script does), its own limit cache and an empty
working folder: an example that names a moved module or an undefined value fails here.

A block that truly cannot run on a CPU test machine (it needs a GPU, ComfyUI or a large download) is skipped only
when the line just before its fence is ``<!-- not-run: the reason -->``; a marker anywhere else is an error."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import wan_accel

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"^\s*<!--\s*not-run:\s*(.*?)\s*-->\s*$")
TIMEOUT = 300


def _blocks():
    """(file, line of the fence, code, reason it is not run or None) of every ```python block."""
    found = []
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```python":
                start = i
                j = i + 1
                while j < len(lines) and lines[j].strip() != "```":
                    j += 1
                before = next((ln for ln in reversed(lines[:start]) if ln.strip()), "")
                marker = NOT_RUN.match(before)
                found.append((path, start + 1, "\n".join(lines[start + 1:j]) + "\n",
                              marker.group(1) if marker else None))
                i = j
            i += 1
    return found


BLOCKS = _blocks()


def _id(block) -> str:
    return f"{block[0].relative_to(REPO_ROOT)}:{block[1]}"


def _run(block, tmp: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    parent = str(Path(wan_accel.__path__[0]).resolve().parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (parent, env.get("PYTHONPATH", "")) if p)
    env["WAN_ACCEL_CACHE"] = str(tmp / "cache" / "limits.json")
    env.pop("WAN_ACCEL_DEBUG", None)
    return subprocess.run([sys.executable, "-c", block[2]], capture_output=True, text=True, env=env, cwd=tmp,
                          timeout=TIMEOUT)


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """Every runnable block started at once, two at a time (most of a block is torch's import): {id: process}."""
    todo = [b for b in BLOCKS if b[3] is None]
    folders = {_id(b): tmp_path_factory.mktemp(re.sub(r"\W", "_", _id(b))) for b in todo}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {_id(b): pool.submit(_run, b, folders[_id(b)]) for b in todo}
        return {k: f.result() for k, f in futures.items()}


def test_the_blocks_are_found():
    names = {_id(b).split(":")[0] for b in BLOCKS}
    assert {"docs/model.md", "docs/memory.md", "docs/compile.md", "docs/sampler.md", "docs/matrix_game2.md"} <= names


@pytest.mark.parametrize("block", BLOCKS, ids=[_id(b) for b in BLOCKS])
def test_the_python_example_runs(ran, block):
    if block[3] is not None:
        pytest.skip(f"marked not-run: {block[3]}")
    proc = ran[_id(block)]
    assert proc.returncode == 0, f"{_id(block)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


def test_a_not_run_marker_says_why_and_stands_before_a_block():
    """The only way out of this test is a reason on the line before a block: a marker elsewhere (a block moved away
    from it) or one without a reason is refused."""
    placed = {(b[0], b[1]) for b in BLOCKS if b[3] is not None}
    for b in BLOCKS:
        if b[3] is not None:
            assert b[3], f"{_id(b)}: a not-run marker needs its reason"
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        for n, line in enumerate(lines, 1):
            if "not-run" in line and NOT_RUN.match(line):
                after = next((k for k in range(n, len(lines)) if lines[k].strip()), None)
                assert after is not None and lines[after].strip() == "```python" and (path, after + 1) in placed, \
                    f"{path.relative_to(REPO_ROOT)}:{n}: a not-run marker with no ```python block right after it"
