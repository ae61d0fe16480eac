"""Settings -> (Inductor options, kernel tile caps): the single source of truth for what each preset sets.

``preset_options`` is pure: the same settings (and mode table) always give the same dicts, and it never touches
torch state. ``render_presets_table`` documents every combination from it (docs/compile.md embeds the output).
``resolve_inductor_options`` is the run-time step: it drops keys this torch does not know, with one warning.

Run ``python -m wan_accel.compile.presets`` to print the table.
"""
from __future__ import annotations

import logging
import warnings

from ..cache.safety import warn_once
from .settings import MODES, TILING_PRESETS, CompileSettings, coerce_settings

log = logging.getLogger("wan_accel.compile")

# torch._inductor.list_mode_options() as of torch 2.6+ (the run-time value is used when torch is present).
STATIC_MODE_OPTIONS: dict[str, dict] = {
    "default": {},
    "reduce-overhead": {"triton.cudagraphs": True},
    "max-autotune-no-cudagraphs": {"max_autotune": True, "coordinate_descent_tuning": True},
    "max-autotune": {"max_autotune": True, "coordinate_descent_tuning": True, "triton.cudagraphs": True},
}

# Tile caps for the pack's own Triton kernels (kernels/): largest XBLOCK / RBLOCK / YBLOCK and num_warps; ROW 0
# keeps the row kernels to their looped tiles (no whole-row one-pass tiles; the other presets leave them allowed).
CONSERVATIVE_CAPS = {"XBLOCK": 64, "RBLOCK": 64, "YBLOCK": 8, "num_warps": 8, "ROW": 0,
                     "autotune_policy": "default"}
DEFAULT_CAPS = {"XBLOCK": 128, "RBLOCK": 128, "YBLOCK": 8, "num_warps": 8, "autotune_policy": "default"}
EXTREME_CAPS = {"XBLOCK": 128, "RBLOCK": 128, "YBLOCK": 16, "num_warps": 16, "autotune_policy": "extreme"}

CONSERVATIVE_FUSION = 64
EXTREME_FUSION = 128

# EXTREME-PLUS: autotune GEMMs and pointwise kernels, coordinate descent on block sizes, 3-D (YBLOCK) tiles.
EXTREME_OPTIONS = {
    "max_autotune": True,
    "max_autotune_gemm": True,
    "max_autotune_pointwise": True,
    "coordinate_descent_tuning": True,
    "triton.max_tiles": 3,
    "triton.prefer_nd_tiling": True,
    "max_fusion_size": EXTREME_FUSION,
}


def mode_options(mode: str, dynamic=None) -> dict:
    """The Inductor options a torch.compile ``mode`` stands for (asked from torch; static table otherwise)."""
    try:
        from torch._inductor import list_mode_options

        return dict(list_mode_options(mode, dynamic))
    except Exception:  # noqa: BLE001 - torch absent or signature drift
        return dict(STATIC_MODE_OPTIONS.get(mode, {}))


def preset_options(settings: CompileSettings | dict | None = None,
                   mode_table: dict[str, dict] | None = None) -> tuple[dict, dict]:
    """(inductor_options, kernel_caps) for these settings.

    inductor_options is what goes to ``torch.compile(options=...)`` (the mode is already folded in, since
    torch.compile takes ``mode`` or ``options`` but not both); empty for non-Inductor backends.
    kernel_caps bounds the tiles of the pack's own kernels: XBLOCK, RBLOCK, YBLOCK, num_warps and the
    operator store's autotune_policy ("extreme": entries only replaced by faster measurements).
    mode_table: mode -> options; None asks torch (``torch._inductor.list_mode_options``).
    """
    s = coerce_settings(settings)
    extreme = s.tiling_preset == "EXTREME-PLUS"
    options: dict = {}
    if s.backend == "inductor":
        if mode_table is not None:
            options.update(mode_table.get(s.mode, {}))
        else:
            options.update(mode_options(s.mode, s.dynamic_arg))
        if extreme:
            options.update(EXTREME_OPTIONS)
        if s.lock_global_ops:
            options["max_fusion_size"] = CONSERVATIVE_FUSION
    if s.lock_global_ops:
        caps = dict(CONSERVATIVE_CAPS)
        if extreme:
            caps["autotune_policy"] = "extreme"
    else:
        caps = dict(EXTREME_CAPS if extreme else DEFAULT_CAPS)
    return options, caps


# ----------------------------------------------------------------------------- run-time validation
def resolve_inductor_options(options: dict) -> dict:
    """Keep only the keys this torch's Inductor knows (``torch._inductor.list_options()``).

    Unknown keys are dropped with one warning naming them all (once per process per key set).
    """
    if not options:
        return {}
    try:
        from torch._inductor import list_options

        known = set(list_options())
    except Exception:  # noqa: BLE001 - cannot check: pass nothing rather than fail inside torch.compile
        warnings.warn("wan_accel: torch._inductor.list_options() is unavailable; compiling without the preset's "
                      "Inductor options", RuntimeWarning, stacklevel=2)
        return {}
    kept = {k: v for k, v in options.items() if k in known}
    dropped = sorted(set(options) - set(kept))
    if dropped:
        warn_once("inductor options", ",".join(dropped), f"wan_accel: this torch's Inductor does not know "
                  f"option(s) {dropped}; they were dropped from the compile preset", stacklevel=2)
    return kept


# ----------------------------------------------------------------------------- CUDA graphs: the pack's own stay in charge
# Inductor's cudagraph trees skip a graph whose inputs are mutated in place; the optimized sampler's blocks write
# their KV buffers in place (index_copy_ under compile), so 'reduce-overhead', 'max-autotune' and the 'cudagraphs' backend would end
# with no graph at all (slower than 'default'). The sampler compiles their graph-free equivalent instead and
# replays whole chunks with its own CUDA graphs (sampling/cuda_graphs.py).
GRAPH_SAFE_MODES = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


def graph_safe_settings(settings) -> tuple[CompileSettings | None, str]:
    """(settings to compile with, note) so that the pack's own CUDA graphs stay in charge of graph capture.

    'reduce-overhead' -> 'default' and 'max-autotune' -> 'max-autotune-no-cudagraphs' (the same Inductor options
    without ``triton.cudagraphs``); backend 'cudagraphs' -> None (no torch.compile: the pack's graphs replay the
    eager blocks); anything else is returned as is with an empty note."""
    s = coerce_settings(settings)
    if s.backend == "cudagraphs":
        return None, ("backend 'cudagraphs': no torch.compile; the sampler's own CUDA graphs replay each chunk "
                      "(torch's cudagraph backend would skip blocks that update the KV cache in place)")
    if s.backend == "inductor" and s.mode in GRAPH_SAFE_MODES:
        safe = GRAPH_SAFE_MODES[s.mode]
        return s.replace(mode=safe), (f"mode '{s.mode}' compiled as '{safe}' with the sampler's own CUDA graphs "
                                      "(Inductor's cudagraph trees would skip blocks that update the KV cache in "
                                      "place)")
    return s, ""


def graphs_summary(settings) -> str:
    """Who captures CUDA graphs in the optimized sampler for these settings (the presets table's last column)."""
    safe, note = graph_safe_settings(settings)
    if safe is None:
        return "the sampler's own, of the eager blocks (no torch.compile)"
    if note:
        return f"the sampler's own; compiled as `{safe.mode}`"
    return "the sampler's own"


# ----------------------------------------------------------------------------- documentation
def _fmt(options: dict) -> str:
    if not options:
        return "(none)"
    return "<br>".join(f"`{k}={v}`" for k, v in sorted(options.items()))


def _fmt_caps(caps: dict) -> str:
    return (f"X/R {caps['XBLOCK']}/{caps['RBLOCK']}, Y {caps['YBLOCK']}, warps {caps['num_warps']}, "
            f"{caps['autotune_policy']}")


def render_presets_table(mode_table: dict[str, dict] | None = None) -> str:
    """Markdown table of every tiling preset x lock state x mode (Inductor backend), from preset_options.

    mode_table defaults to STATIC_MODE_OPTIONS so the documentation does not depend on the installed torch.
    """
    table = STATIC_MODE_OPTIONS if mode_table is None else mode_table
    lines = ["| tiling_preset | lock_global_ops | mode | Inductor options | kernel caps | CUDA graphs (optimized "
             "sampler) |",
             "|---|---|---|---|---|---|"]
    for preset in TILING_PRESETS:
        for lock in (True, False):
            for mode in MODES:
                s = CompileSettings(tiling_preset=preset, lock_global_ops=lock, mode=mode)
                options, caps = preset_options(s, mode_table=table)
                lines.append(f"| {preset} | {'on' if lock else 'off'} | {mode} | {_fmt(options)} | "
                             f"{_fmt_caps(caps)} | {graphs_summary(s)} |")
    for backend in ("cudagraphs", "eager"):
        for lock in (True, False):
            s = CompileSettings(backend=backend, lock_global_ops=lock)
            _, caps = preset_options(s, mode_table=table)
            lines.append(f"| any | {'on' if lock else 'off'} | backend={backend} | (none: not Inductor) | "
                         f"{_fmt_caps(caps)} | {graphs_summary(s)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render_presets_table())
