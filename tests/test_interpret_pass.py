"""The kernel tests run a second time with ``TRITON_INTERPRET=1``, in a pytest of their own.

``.venv/bin/python -m pytest`` (the README's and ``.ci/run``'s command) runs with the variable unset, so a test that
takes "no Triton on a CPU" for granted (``assert not kernel_runs(x)``) passes there and fails for whoever runs the
suite with the interpreter on, as the kernel tests' own children do. This file runs the test files of the kernels
(``PASS_FILES``) again in a new process with the variable set before triton's first import (it is read then).

Under that pass:

* the interpreter children (``tests/interpret_child.py``, ``test_kernels_numerics.py``'s) skip themselves: they set
  ``TRITON_INTERPRET=1`` on their own and ran in the plain run already (``PASS_VAR``);
* this file's own run test skips (no recursion), and ``test_inside_the_pass_the_interpreter_runs_the_kernels``
  proves the variable took effect (the parent checks it passed, not skipped).

Which files: every test file that imports from ``wan_accel.kernels`` is either in ``PASS_FILES`` or in ``LEFT_OUT``
with the reason (``test_every_kernel_test_file_is_placed``): a new kernel test file has to be placed. Left out are
the files whose tests run whole samplers, the doctor or compile through the kernels: under the interpreter each of
them takes minutes (measured on a 2-core CPU, below) and their kernels' numbers are the kernel files' to check.
``DESELECT``: single tests of the chosen files left out for the same reason. The pass takes about 2 minutes on a
2-core CPU.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from interpret_child import PASS_VAR

TESTS = Path(__file__).resolve().parent
REPO_ROOT = TESTS.parent
KERNEL_IMPORT = re.compile(r"^\s*(from wan_accel\.kernels\b|import wan_accel\.kernels\b|from wan_accel import .*\bkernels\b)",
                           re.M)
SELF = Path(__file__).name

# the kernel test files run again under the interpreter (each checks kernels/ itself: numerics, dispatch, fallback)
PASS_FILES = (
    "test_vae_norm_kernel.py",
    "test_kernels_dispatch.py",
    "test_kernels_numerics.py",
    "test_residual_norm.py",
    "test_row_kernels_one_pass.py",
    "test_flash_attention.py",
    "test_kv_quant.py",
    "test_kitchen_dtypes.py",
    "test_kitchen_candidates.py",
    "test_int8_attention.py",
    SELF,                            # its sentinel below proves the interpreter is on in the pass
)

# seconds: wall time of the file alone under TRITON_INTERPRET=1 on a 2-core CPU shared with other jobs (2026-11-28)
LEFT_OUT = {
    "test_fp8_attention.py": "its CPU tests run the fp8 attention kernel at Wan shapes in the interpreter: over 500 s",
    "test_fp8_linear.py": "the fp8 linear layers of whole tiny sampler runs through the interpreter: over 300 s",
    "test_attention_store.py": "the attention store's choice between every candidate (the Triton ones interpreted)",
    "test_compile_apply.py": "compile of the tiny model (Inductor), the kernels as opaque ops: minutes either way",
    "test_compile_opaque_ops.py": "compiles graphs around the kernels' custom ops: minutes either way",
    "test_compile_presets.py": "compile presets and tile caps: no kernel run on a CPU depends on the setting",
    "test_cuda_paths.py": "fake CUDA devices: the paths under test never take the CPU interpreter",
    "test_doctor_interpret.py": "runs the doctor under TRITON_INTERPRET=1 in its own processes already",
    "test_doctor_trust.py": "the doctor's verdict store (whole probes: minutes through the interpreter)",
    "test_fa3_packages.py": "fake FlashAttention 3 packages: no Triton kernel involved",
    "test_fast_sampler_interpret.py": "runs the optimized sampler under TRITON_INTERPRET=1 in its own process already",
    "test_gpu_paths_cpu.py": "fake GPU capabilities and devices: the paths under test never take the CPU interpreter",
    "test_gpu_truth.py": "the self-test and the doctor on a machine without a GPU (whole stages)",
    "test_kernels_ptx.py": "compiles the kernels to PTX for a GPU target: the interpreter is not involved",
    "test_kernels_ptx_fp8_vae.py": "compiles the kernels to PTX for a GPU target: the interpreter is not involved",
    "test_lora_ops_wire.py": "LoRA on the pack's ops through whole tiny sampler runs (minutes through the interpreter)",
}

# single tests of PASS_FILES left out: each runs whole tiny sampler or store runs through the interpreter
DESELECT = {
    "test_int8_attention.py::test_every_int8_call_of_the_fidelity_runs_is_within_the_bound":
        "every int8 call of two fixtures' sampler runs, interpreted: 178 s",
    "test_int8_attention.py::test_both_sampler_paths_run_int8_from_the_loader": "two tiny sampler runs: 35 s",
    "test_kitchen_candidates.py::test_store_records_the_choice_and_a_second_process_times_nothing":
        "times every candidate, the interpreted ones included, in two processes: 42 s",
    "test_kitchen_candidates.py::test_without_comfy_kitchen_everything_works_as_before":
        "a tiny sampler run with comfy-kitchen's import blocked: 15 s",
    "test_kitchen_candidates.py::test_a_wrong_candidate_is_failed_by_the_doctor_and_switched_off_alone":
        "the doctor's probes of every candidate: 11 s",
    "test_kitchen_candidates.py::test_comfy_kitchen_triton_under_the_interpreter":
        "starts its own TRITON_INTERPRET=1 process: it ran in the plain run",
}
TIMEOUT = 900


def _kernel_test_files() -> set[str]:
    return {p.name for p in TESTS.glob("test_*.py") if KERNEL_IMPORT.search(p.read_text(encoding="utf-8"))}


def test_every_kernel_test_file_is_placed():
    found = _kernel_test_files()
    unplaced = sorted(found - set(PASS_FILES) - set(LEFT_OUT))
    assert not unplaced, (f"test files importing wan_accel.kernels that are neither in PASS_FILES nor in LEFT_OUT "
                          f"(with the reason): {unplaced}")
    gone = sorted(n for n in (*PASS_FILES, *LEFT_OUT, *(d.split("::")[0] for d in DESELECT))
                  if not (TESTS / n).is_file())
    assert not gone, f"named here but not in tests/: {gone}"
    assert not set(PASS_FILES) & set(LEFT_OUT)


def test_inside_the_pass_the_interpreter_runs_the_kernels():
    """The sentinel of the pass (skipped in the plain run): TRITON_INTERPRET=1 took effect, CPU tensors go to Triton."""
    if not os.environ.get(PASS_VAR):
        pytest.skip("only inside the TRITON_INTERPRET=1 pass")
    import torch

    from wan_accel.kernels import _common
    assert _common.interpret_enabled() and _common.interpreter_usable()
    assert _common.use_triton(torch.zeros(1))


def _results(xml: Path) -> dict:
    """{test id: 'passed' | 'failed' | 'skipped'} from pytest's JUnit XML."""
    out = {}
    for case in ET.parse(xml).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        out[name] = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
    return out


def test_the_kernel_tests_pass_under_the_interpreter(tmp_path):
    if os.environ.get(PASS_VAR):
        pytest.skip("this is the TRITON_INTERPRET=1 pass itself")
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env[PASS_VAR] = "1"
    xml = tmp_path / "pass.xml"
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
            f"--basetemp={tmp_path / 'tmp'}", *(str(TESTS / n) for n in PASS_FILES)]
    for node in DESELECT:
        argv += ["--deselect", f"tests/{node}"]
    proc = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"under TRITON_INTERPRET=1:\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
    results = _results(xml)
    sentinel = [s for n, s in results.items() if n.endswith("::test_inside_the_pass_the_interpreter_runs_the_kernels")]
    assert sentinel == ["passed"], sentinel
    ran = {n.split("::")[0].rsplit(".", 1)[-1] for n, s in results.items() if s == "passed"}
    assert {"test_vae_norm_kernel", "test_kernels_dispatch"} <= ran, sorted(ran)
