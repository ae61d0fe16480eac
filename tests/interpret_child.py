"""Run a test module's ``--child`` part in a fresh interpreter with ``TRITON_INTERPRET=1`` (the variable is read when
Triton is imported, so the kernels under the interpreter need their own process) and return the JSON it prints."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# set by tests/test_interpret_pass.py in the pytest run it starts under TRITON_INTERPRET=1: the interpreter children
# (which set the variable themselves) already ran in the plain run, so that run skips them
PASS_VAR = "WAN_ACCEL_INTERPRET_PASS"


def run_interpreted_child(script: Path, cache_dir: Path, mark: str, timeout: float = 300) -> dict:
    if os.environ.get(PASS_VAR):        # tests/test_interpret_pass.py's second run: this child ran in the first one
        pytest.skip("the TRITON_INTERPRET=1 pass: this interpreter child already ran in the plain pass")
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    env["WAN_ACCEL_CACHE"] = str(cache_dir / "limits.json")
    import wan_accel                     # the folder that makes `import wan_accel` work, for the child
    parent = str(Path(wan_accel.__path__[0]).parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (parent, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, str(script), "--child"], env=env, capture_output=True, text=True,
                          timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith(mark):
            return json.loads(line[len(mark):])
    pytest.fail(f"interpreter child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
