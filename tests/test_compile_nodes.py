"""The compile nodes: cheap import, complete widgets, clear errors, a patched copy of a native model."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from wan_accel.compile import CompileSettings
from wan_accel.nodes import compile_nodes

NODE_FILE = Path(__file__).resolve().parent.parent / "nodes" / "compile_nodes.py"


def test_module_imports_nothing_heavy():
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('compile_nodes_alone', {str(NODE_FILE)!r})\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        "heavy = [m for m in ('torch', 'triton', 'comfy') if m in sys.modules]\n"
        "print(sorted(mod.NODE_CLASS_MAPPINGS), heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("[]"), out.stdout


def test_every_widget_has_a_tooltip_and_matches_the_settings():
    for cls in compile_nodes.NODE_CLASS_MAPPINGS.values():
        assert cls.DESCRIPTION and cls.RETURN_NAMES and cls.CATEGORY == "wan_accel/compile"
        spec = cls.INPUT_TYPES()
        for section in spec.values():
            for name, (_, opts) in section.items():
                assert opts.get("tooltip"), f"{cls.__name__}.{name} has no tooltip"
    widgets = compile_nodes.WanCompileSettings.INPUT_TYPES()["required"]
    assert set(widgets) == set(dataclasses.asdict(CompileSettings()))
    defaults = {k: opts["default"] for k, (_, opts) in widgets.items()}
    assert CompileSettings.from_dict(defaults) == CompileSettings()


def test_settings_node_builds_settings_and_reports_bad_values():
    node = compile_nodes.WanCompileSettings()
    values = dict(dataclasses.asdict(CompileSettings()), tiling_preset="EXTREME-PLUS", scope="whole")
    (settings,) = node.build(**values)
    assert isinstance(settings, CompileSettings) and settings.tiling_preset == "EXTREME-PLUS"
    with pytest.raises(Exception, match="Wan Compile Settings: compile setting mode"):
        node.build(**dict(values, mode="ludicrous"))


class _Patcher:
    """Minimal stand-in for ComfyUI's ModelPatcher."""

    def __init__(self, base):
        self.model, self.wrappers = base, {}

    def clone(self):
        return _Patcher(self.model)

    def get_model_object(self, name):
        return getattr(self.model, name)

    def add_wrapper_with_key(self, wtype, key, fn):
        self.wrappers.setdefault(wtype, {}).setdefault(key, []).append(fn)


def _patcher(diffusion_model):
    import torch

    base = torch.nn.Module()
    base.diffusion_model = diffusion_model
    return _Patcher(base)


def test_apply_node_returns_a_patched_copy():
    import torch

    from wan_accel.bench.compile import tiny_workload

    patcher = _patcher(tiny_workload(blocks=2)[0])
    node = compile_nodes.ApplyCompileNativeWan()
    (out,) = node.apply(patcher, CompileSettings(backend="eager", warm_start=False))
    assert out is not patcher and patcher.wrappers == {}
    assert set(out.wrappers) == {"apply_model", "outer_sample"}
    with pytest.raises(Exception, match="Apply Compile \\(native Wan\\): compile scope 'blocks'"):
        node.apply(_patcher(torch.nn.Linear(2, 2)), None)
