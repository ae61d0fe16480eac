"""Settings -> options: every preset x lock state x mode, validation, and the documented table."""
from __future__ import annotations

import dataclasses
import itertools
import warnings
from pathlib import Path

import pytest

from wan_accel.compile import CompileSettings, preset_options, render_presets_table, resolve_inductor_options
from wan_accel.compile.presets import STATIC_MODE_OPTIONS, mode_options
from wan_accel.compile.settings import MODES, TILING_PRESETS

DOC = Path(__file__).resolve().parent.parent / "docs" / "compile.md"
COMBOS = list(itertools.product(TILING_PRESETS, (True, False), MODES))


@pytest.mark.parametrize("preset,lock,mode", COMBOS)
def test_preset_table(preset, lock, mode):
    s = CompileSettings(tiling_preset=preset, lock_global_ops=lock, mode=mode)
    options, caps = preset_options(s, mode_table=STATIC_MODE_OPTIONS)
    # the mode is folded into the options (torch.compile takes mode or options, not both)
    for k, v in STATIC_MODE_OPTIONS[mode].items():
        assert options[k] == v
    extreme = preset == "EXTREME-PLUS"
    if extreme:
        assert options["max_autotune"] and options["max_autotune_gemm"] and options["max_autotune_pointwise"]
        assert options["coordinate_descent_tuning"] is True
        assert options["triton.max_tiles"] == 3 and options["triton.prefer_nd_tiling"] is True
        assert caps["autotune_policy"] == "extreme"
    else:
        assert "triton.max_tiles" not in options and caps["autotune_policy"] == "default"
    if lock:
        assert options["max_fusion_size"] == 64
        assert (caps["XBLOCK"], caps["RBLOCK"], caps["num_warps"]) == (64, 64, 8) and caps["YBLOCK"] <= 8
    elif extreme:
        assert 128 <= options["max_fusion_size"] <= 256
        assert (caps["XBLOCK"], caps["RBLOCK"], caps["YBLOCK"], caps["num_warps"]) == (128, 128, 16, 16)
    else:
        assert "max_fusion_size" not in options and caps["num_warps"] <= 8
    from wan_accel.kernels import current_caps, use_kernel_caps

    with use_kernel_caps(caps):      # one-pass row tiles: off under the conservative (locked) caps only
        assert current_caps()["ROW"] == (0 if lock else 1)


@pytest.mark.parametrize("backend", ["cudagraphs", "eager"])
def test_non_inductor_backends_get_no_inductor_options(backend):
    options, caps = preset_options(CompileSettings(backend=backend, tiling_preset="EXTREME-PLUS",
                                                   mode="max-autotune"))
    assert options == {} and caps["XBLOCK"] == 64


def test_preset_options_is_pure():
    s = CompileSettings(tiling_preset="EXTREME-PLUS", lock_global_ops=False)
    a, b = preset_options(s), preset_options(s)
    assert a == b and a[0] is not b[0]
    a[0]["max_fusion_size"] = 1
    assert preset_options(s)[0]["max_fusion_size"] == 128


def test_runtime_mode_table_agrees_with_static_table():
    for mode in MODES:
        runtime = mode_options(mode)
        assert STATIC_MODE_OPTIONS[mode].items() <= runtime.items()


def test_every_preset_option_is_known_to_this_torch():
    import torch._inductor

    known = set(torch._inductor.list_options())
    for preset, lock, mode in COMBOS:
        options, _ = preset_options(CompileSettings(tiling_preset=preset, lock_global_ops=lock, mode=mode))
        assert set(options) <= known, set(options) - known


def test_unknown_options_dropped_with_one_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = resolve_inductor_options({"max_fusion_size": 64, "no_such_knob_a": 1, "no_such_knob_b": 2})
        resolve_inductor_options({"max_fusion_size": 64, "no_such_knob_a": 1, "no_such_knob_b": 2})
    assert kept == {"max_fusion_size": 64}
    msgs = [str(w.message) for w in caught if "no_such_knob" in str(w.message)]
    assert len(msgs) == 1 and "no_such_knob_a" in msgs[0] and "no_such_knob_b" in msgs[0]


@pytest.mark.parametrize("field,value", [("backend", "tensorrt"), ("mode", "fast"), ("dynamic", "maybe"),
                                         ("scope", "layers"), ("recompile_limit", 0),
                                         ("stance_after_warmup", "force_eager"), ("fullgraph", "yes")])
def test_invalid_settings_raise_clear_errors(field, value):
    with pytest.raises(ValueError, match=field):
        CompileSettings(**{field: value})


def test_settings_round_trip_and_hash():
    s = CompileSettings(mode="max-autotune", dynamic=True, recompile_limit=16)
    assert s.dynamic == "true" and s.dynamic_arg is True
    assert CompileSettings.from_dict(dataclasses.asdict(s)) == s
    assert s.codegen_hash() == CompileSettings.from_dict(dataclasses.asdict(s)).codegen_hash()
    assert s.codegen_hash() != s.replace(tiling_preset="EXTREME-PLUS").codegen_hash()
    assert s.codegen_hash() == s.replace(stance_after_warmup="default").codegen_hash()  # runtime-only field
    with pytest.raises(ValueError, match="unknown compile setting"):
        CompileSettings.from_dict({"bakend": "inductor"})


def test_docs_table_is_generated_from_preset_options():
    text = DOC.read_text(encoding="utf-8")
    assert render_presets_table() in text


def test_kernel_default_caps_are_the_conservative_preset():
    from wan_accel.compile.presets import CONSERVATIVE_CAPS
    from wan_accel.kernels import DEFAULT_CAPS

    # the same tile bounds; one-pass row tiles allowed outside a preset, off under the conservative caps
    assert {k: v for k, v in DEFAULT_CAPS.items() if k != "ROW"} == \
        {k: v for k, v in CONSERVATIVE_CAPS.items() if k != "ROW"}
    assert DEFAULT_CAPS["ROW"] == 1 and CONSERVATIVE_CAPS["ROW"] == 0


def test_graph_safe_settings_keep_the_pack_graphs_in_charge():
    from wan_accel.compile import graph_safe_settings
    from wan_accel.compile.presets import GRAPH_SAFE_MODES, STATIC_MODE_OPTIONS

    for mode in ("reduce-overhead", "max-autotune"):
        s = CompileSettings(mode=mode, tiling_preset="EXTREME-PLUS")
        assert mode in GRAPH_SAFE_MODES
        safe, note = graph_safe_settings(s)
        assert safe.mode not in GRAPH_SAFE_MODES and note and mode in note
        assert safe.tiling_preset == "EXTREME-PLUS" and safe.backend == "inductor"
        opts, _ = preset_options(safe, mode_table=STATIC_MODE_OPTIONS)
        assert not opts.get("triton.cudagraphs")
    assert graph_safe_settings(CompileSettings(mode="max-autotune"))[0].mode == "max-autotune-no-cudagraphs"
    none, note = graph_safe_settings(CompileSettings(backend="cudagraphs"))
    assert none is None and "cudagraphs" in note
    plain = CompileSettings(mode="max-autotune-no-cudagraphs")
    assert graph_safe_settings(plain) == (plain, "") and graph_safe_settings({"mode": "default"})[1] == ""
    assert "compiled as `default`" in render_presets_table()
