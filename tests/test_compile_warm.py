"""Inductor on CPU, two fresh processes sharing one cache folder: the second compile hits the caches, and
with lock_global_ops no process-global Dynamo/Inductor config changes. (Needs a C++ compiler; tiny model.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PKG_PARENT = Path(__file__).resolve().parent.parent.parent
MARK = "WARM_RESULT "

_CHILD = r"""
import json, sys
import torch
import torch._dynamo.config as dc
import torch._inductor.config as ic
from wan_accel.cache import LimitCache
from wan_accel.compile import CompileSettings, compile_model, end_warmup
from wan_accel.compile import compat
from wan_accel.compile.apply import compile_handle


class Block(torch.nn.Module):  # the smallest transformer-ish block: one matmul, one fused pointwise kernel
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.tanh(self.lin(x)) * 0.5


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


torch.manual_seed(0)
cache = LimitCache(sys.argv[1])
model, x = Tiny(), torch.randn(2, 8, 16)
run = lambda m: m(x)
torch.set_grad_enabled(False)
expected = run(model)
dyn, ind = dc.get_config_copy(), ic.save_config_portable()
compile_model(model, CompileSettings(lock_global_ops=True), cache)
out = run(model)
end_warmup(model)
run(model)
h = compile_handle(model)
print("WARM_RESULT " + json.dumps({
    "close": bool(torch.allclose(out, expected, atol=1e-5)),
    "dynamo_unchanged": dc.get_config_copy() == dyn,
    "inductor_unchanged": ic.save_config_portable() == ind,
    "counters": compat.cache_counters(), "report": {"inductor_options": h.inductor_options, "loaded_artifacts": h.loaded_artifacts,
               "artifact_saves": h.warm_start.saves if h.warm_start else 0},
    "artifacts": [e["key"] for e in cache.entries("compile")],
}), flush=True)
"""


def _child(cache_file: Path) -> dict:
    env = dict(os.environ)
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_INTERPRET"):
        env.pop(var, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PKG_PARENT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(cache_file)], env=env, capture_output=True,
                          text=True, timeout=300)
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    pytest.fail(f"compile child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def test_warm_second_compile_hits_caches_and_globals_stay_unchanged(tmp_path):
    cache_file = tmp_path / "cache" / "limits.json"
    cold = _child(cache_file)
    warm = _child(cache_file)
    for r in (cold, warm):
        assert r["close"] and r["dynamo_unchanged"] and r["inductor_unchanged"]
        assert r["report"]["inductor_options"]["max_fusion_size"] == 64  # locked: conservative
    assert (tmp_path / "cache" / "inductor").is_dir()  # Inductor's cache beside the limit cache
    assert cold["report"]["artifact_saves"] >= 1 and len(cold["artifacts"]) == 1
    assert cold["counters"].get("inductor.fxgraph_cache_hit", 0) == 0
    assert warm["counters"].get("inductor.fxgraph_cache_hit", 0) >= 1
    assert warm["report"]["loaded_artifacts"]  # the saved Mega-Cache artifacts were loaded first
