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

Which files: every test file that imports from ``wan_accel.kernels``, or names ``TRITON_INTERPRET``, the
interpreter children or triton, is either in ``PASS_FILES`` or in ``LEFT_OUT`` with the reason
(``test_every_kernel_test_file_is_placed``): a new kernel test file has to be placed. Left out are the files whose
tests run whole samplers, the doctor or compile through the kernels (under the interpreter each takes minutes,
measured on a 2-core CPU, below; their kernels' numbers are the kernel files' to check) and those with nothing to
run again.
``DESELECT``: single tests of the chosen files left out for the same reason. The pass took 20 to 45 s on a
2-core CPU shared with other jobs (2026-11-28).
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
# a kernel or Triton test file: it imports from wan_accel.kernels, or names TRITON_INTERPRET, the interpreter
# children or triton itself
KERNEL_TEST = re.compile(r"^\s*(from wan_accel\.kernels\b|import wan_accel\.kernels\b"
                         r"|from wan_accel import .*\bkernels\b|import triton\b)"
                         r"|TRITON_INTERPRET|interpret_child|importorskip\(\"triton", re.M)
SELF = Path(__file__).name

# the kernel test files run again under the interpreter: each checks kernels/ or the choice between the kernels and
# their fallbacks on a CPU, in seconds under the interpreter
PASS_FILES = (
    "test_vae_norm_kernel.py",
    "test_kernels_dispatch.py",
    "test_kernels_numerics.py",
    "test_residual_norm.py",
    "test_flash_attention.py",
    "test_kv_quant.py",
    "test_kitchen_dtypes.py",
    "test_kitchen_candidates.py",
    "test_kitchen_newer.py",
    "test_int8_attention.py",
    "test_attention_store.py",
    "test_compile_presets.py",
    "test_cuda_paths.py",
    "test_fa3_packages.py",
    "test_fa3_fwd.py",
    "test_fa3_fp8.py",
    "test_fa3_kvcache.py",
    "test_gpu_paths_cpu.py",
    "test_autotune_store.py",
    "test_graph_timer.py",
    "test_dispatch_counts.py",
    "test_op_registry.py",
    SELF,                            # its sentinel below proves the interpreter is on in the pass
)

# file -> why it is not in the pass; the seconds are the file alone under TRITON_INTERPRET=1 on a 2-core CPU shared
# with other jobs (AMD EPYC, 2026-11-28). The tests of these files that took "no Triton on a CPU" for granted were
# made to say so themselves (they force the CPU without the interpreter: run them with TRITON_INTERPRET=1 to check)
LEFT_OUT = {
    "test_fast_sampler_bench.py": "whole tiny sampler benches, the kernels interpreted: about 200 s (its op counts "
                                  "are of the kernels' torch versions in either run)",
    "test_hard_edges_round5_b.py": "names the FA3 discovery only to stand in a build that exits while imported; no "
                                   "kernel runs",
    "test_fp8_attention.py": "its CPU tests run the fp8 attention kernel at Wan shapes in the interpreter: over 500 s",
    "test_fp8_linear.py": "whole tiny sampler runs with every fp8 quantize interpreted: over 840 s",
    "test_compile_apply.py": "Inductor compiles of the tiny model around the kernels: 68 s",
    "test_compile_opaque_ops.py": "Inductor compiles around the kernels' custom ops: 132 s",
    "test_doctor_trust.py": "the doctor's probes of every feature, the kernels interpreted: 302 s",
    "test_hard_edges_round4.py": "whole Krea reference checks and decoder runs: about 390 s",
    "test_row_kernels_one_pass.py": "every test is an interpreter child or marked cuda: all skip in the pass",
    "test_doctor_interpret.py": "every test is an interpreter child (it ran in the plain run): all skip in the pass",
    "test_fast_sampler_interpret.py": "its test is an interpreter child (it ran in the plain run): skips in the pass",
    "test_gpu_truth.py": "self-test stages and tiny sampler runs with the kernels interpreted: 253 s",
    "test_kernels_ptx.py": "compiles the kernels to PTX: skips itself under TRITON_INTERPRET=1 (compiled mode only)",
    "test_kernels_ptx_fp8_vae.py": "compiles the kernels to PTX: skips itself under TRITON_INTERPRET=1 (compiled mode "
                                   "only)",
    "test_lora_ops_wire.py": "LoRA and the ops modes through whole tiny sampler runs, the kernels interpreted: 150 s",
    "test_doctor.py": "the doctor's probes of every feature, the kernels interpreted: 72 s",
    "test_compile_warm.py": "Inductor warm-start compiles in processes of its own (it clears TRITON_INTERPRET there)",
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
    "test_fa3_fp8.py::test_bench_fidelity_states_fa3s_whole_video_effect":
        "four fixture runs of bench fidelity with the pack's fp8 kernel interpreted: 65 s",
    "test_fa3_kvcache.py::test_a_video_through_the_fused_way_equals_the_separate_ways":
        "four tiny sampler runs with the fused kernels interpreted: 47 s",
}
TIMEOUT = 900


def _kernel_test_files() -> set[str]:
    return {p.name for p in TESTS.glob("test_*.py") if KERNEL_TEST.search(p.read_text(encoding="utf-8"))} - {SELF}


def test_every_kernel_test_file_is_placed():
    found = _kernel_test_files()
    unplaced = sorted(found - set(PASS_FILES) - set(LEFT_OUT))
    assert not unplaced, (f"kernel or Triton test files that are neither in PASS_FILES nor in LEFT_OUT (with the "
                          f"reason): {unplaced}")
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
    collected = {n.split("::")[0].rsplit(".", 1)[-1] + ".py" for n in results}
    assert set(PASS_FILES) <= collected, sorted(set(PASS_FILES) - collected)        # no file dropped silently
    ran = {n.split("::")[0].rsplit(".", 1)[-1] for n, s in results.items() if s == "passed"}
    assert {"test_vae_norm_kernel", "test_kernels_dispatch", "test_flash_attention"} <= ran, sorted(ran)
