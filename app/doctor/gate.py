"""The doctor's verdicts applied to a run: features that failed or were slower here are switched off.

``gate_options`` checks (probing once per machine) each feature the optimized path is about to use for this model
(its device, dtype and head size) and returns FastOptions whose ``switched_off`` names the ones that are not
trusted, with one line per feature for the console and the node's text. ``gate_compile`` and ``gate_swap`` do the
same for the compile and the block swap; the one prepare step of every run (``app/prepare.prepare_model``) calls the
three, in its fixed order. Each takes an optional ``record`` (``new_record()``) that
receives ``switched_off`` {feature: why} and ``failed_fallbacks`` {feature: why}; ``features_summary`` turns it
and the sampler's report into what a run's report says about its features.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from ...kernels.fa3_packages import NAMES as FA3_PACKAGES
from ...kernels.registry import parse_ops
from ...model.attention import AUTO_CANDIDATES, explain_backend
from ...model.blocks import KERNEL_NAMES, epilogue_gelu_runs_on
from ...sampling.runner import FastOptions, graphs_device, kernels_part
from .core import FEATURES, Doctor, doctor_for

log = logging.getLogger("wan_accel")


def new_record() -> dict:
    """Where the gate functions write what they switched off and which fallback failed, each with its reason."""
    return {"switched_off": {}, "failed_fallbacks": {}}


def _say(lines: list, name: str, why: str, log_fn=None, record: dict | None = None, fallback: bool = False) -> None:
    """One line per feature per run: to ``log_fn`` where the caller shows lines itself, else to the log (never both,
    so a console that shows both does not print it twice); a feature the run's ``record`` already holds is not said
    again."""
    kind = "failed_fallbacks" if fallback else "switched_off"
    if record is not None and name in record.get(kind, {}):
        return
    line = (f"wan_accel: the fallback {name} failed its check on this machine: {why}; it stays in use (nothing to "
            f"fall back to), so results may be wrong" if fallback else
            f"wan_accel: {name} is switched off on this machine: {why}") + " (details: python -m wan_accel doctor)"
    if line in lines:
        return
    lines.append(line)
    if log_fn is not None:
        log_fn(line)
    else:
        log.warning(line)
    if record is not None:
        record.setdefault(kind, {})[name] = why


def model_doctor(model, doctor: Doctor | None = None) -> Doctor:
    """A Doctor probing the shape of ``model``'s calls (its device, compute dtype and head size)."""
    if doctor is not None:
        return doctor
    return doctor_for(model.device, model.compute_dtype, model.config.head_dim)


def gate_options(model, options: FastOptions, doctor: Doctor | None = None, log_fn=None,
                 record: dict | None = None) -> tuple[FastOptions, list]:
    """(options with ``switched_off`` set, lines saying what was switched off and why); a failed SDPA (the last
    fallback of attention) is said too, and stays in use."""
    options = FastOptions.coerce(options)
    doc = model_doctor(model, doctor)
    device, off, lines = torch.device(model.device), set(options.switched_off), []

    def judge(name: str) -> None:
        why = doc.why_off(name)
        if why:
            off.add(name)
            _say(lines, name, why, log_fn, record)

    requested = options.attention or getattr(model, "attn_backend", "auto")
    backend = explain_backend(requested, device, model.compute_dtype, model.config.head_dim)[0]
    while backend != "sdpa":
        judge(f"attention.{backend}")
        if f"attention.{backend}" not in off:
            break
        nxt = "fa2" if backend == "fa3" and requested in ("auto", "flash_attn") else "sdpa"
        backend = explain_backend(nxt, device, model.compute_dtype, model.config.head_dim)[0]
    for name in ("triton", *FA3_PACKAGES) if requested == "auto" else ():    # more exact candidates of 'auto'
        if AUTO_CANDIDATES[name].rejected(device, model.compute_dtype, model.config.head_dim) is None:
            judge(f"attention.{name}")
    if kernels_part(options, device):
        for name in KERNEL_NAMES:
            judge(f"kernel.{name}")
    mode = parse_ops(options.ops)[0]
    if mode == "kitchen" or (mode == "auto" and kernels_part(options, device)):
        for name in FEATURES:                # comfy-kitchen's candidates (op.<op>.kitchen.<backend>)
            if name.startswith("op.") and doc.unavailable(name)[0] is None:
                judge(name)
    if options.linear == "fp8":
        judge("linear.fp8")
    if options.fused_qkv:
        judge("fused_qkv")
    if options.cuda_graphs == "auto" and graphs_device(device):
        judge("cuda_graphs")
    if backend == "sdpa":
        why = doc.why_off("attention.sdpa")
        if why:
            _say(lines, "attention.sdpa", why, log_fn, record, fallback=True)
    return options.replace(switched_off=frozenset(off)), lines


def gate_compile(model, settings, doctor: Doctor | None = None, log_fn=None, lines: list | None = None,
                 record: dict | None = None):
    """``settings`` when compiled blocks are trusted here (or no compile is asked for), else None."""
    if settings is None:
        return None
    why = model_doctor(model, doctor).why_off("compile")
    if why:
        _say(lines if lines is not None else [], "compile", why, log_fn, record)
        return None
    return settings


def gate_swap(model, settings, doctor: Doctor | None = None, log_fn=None, lines: list | None = None,
              record: dict | None = None):
    """Swap settings to apply: without the prefetch stream when block swap failed its check here."""
    if settings is None or not getattr(settings, "blocks_to_swap", 0) or not getattr(settings, "prefetch", 0):
        return settings
    why = model_doctor(model, doctor).why_off("block_swap")
    if why:
        _say(lines if lines is not None else [], "block_swap (prefetch stream)", why, log_fn, record)
        return dataclasses.replace(settings, prefetch=0)
    return settings


def features_summary(model, options: FastOptions | None, sampler_report: dict, record: dict | None) -> dict:
    """What a run's report says about its features: ``ran`` (names, as the doctor calls them), ``switched_off``
    {name: why}, ``failed_fallbacks`` {name: why} and one boolean per accelerated feature (true only when it ran)."""
    record = record or new_record()
    info, ran = sampler_report or {}, []
    device = torch.device(model.device)
    if info.get("path") == "optimized":
        ran.append(f"attention.{info.get('attention', 'sdpa')}")
        part = kernels_part(options, device) if options is not None else False
        epilogue = epilogue_gelu_runs_on(device, model.compute_dtype)     # ffn_gelu runs on CUDA in bf16/fp16 only
        ran += [f"kernel.{k}" for k in (KERNEL_NAMES if part is True else part or ()) if k != "ffn_gelu" or epilogue]
        if info.get("fused_qkv_blocks"):
            ran.append("fused_qkv")
        if info.get("linear") == "fp8":
            ran.append("linear.fp8")
        if info.get("cuda_graphs"):
            ran.append("cuda_graphs")
        if info.get("compile"):
            ran.append("compile")
    else:
        requested = getattr(model, "attn_backend", "auto")
        ran.append(f"attention.{explain_backend(requested, device, model.compute_dtype, model.config.head_dim)[0]}")
    if info.get("swapped_blocks"):
        ran.append("block_swap")
    names = [f"kernel.{k}" for k in KERNEL_NAMES] + ["fused_qkv", "cuda_graphs", "compile", "block_swap"]
    return {"path": info.get("path"), "ran": ran, "switched_off": dict(record.get("switched_off", {})),
            "failed_fallbacks": dict(record.get("failed_fallbacks", {})),
            "enabled": {name: name in ran for name in names}}


def fused_kernels_ran(features: dict, device, dtype) -> bool:
    """A report's ``fused_kernels``: every fused kernel that applies on ``device`` in ``dtype`` ran (``features``
    from ``features_summary``; the FFN's GELU epilogue applies on CUDA in bf16/fp16 only)."""
    epilogue = epilogue_gelu_runs_on(device, dtype)
    return all(features["enabled"][f"kernel.{k}"] for k in KERNEL_NAMES if k != "ffn_gelu" or epilogue)
