"""The doctor's verdicts applied to a run: features that failed or were slower here are switched off.

``gate_options`` checks (probing once per machine) each feature the optimized path is about to use for this model
(its device, dtype and head size) and returns FastOptions whose ``switched_off`` names the ones that are not
trusted, with one line per feature for the console and the node's text. ``gate_compile`` and ``gate_swap`` do the
same for the compile and the block swap that ``app/jobs/generate.sampler_setup`` applies; ``gated_sampling`` routes callers
that take no FastOptions (the Matrix-Game-2 loop).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch

from ...model.attention import explain_backend
from ...sampling.runner import FastOptions, graphs_device, kernels_part
from ...sampling.sampler import sampler_path
from .core import Doctor, doctor_for

log = logging.getLogger("wan_accel")


def _line(name: str, why: str) -> str:
    return f"wan_accel: {name} is switched off on this machine: {why} (details: python -m wan_accel doctor)"


def _say(lines: list, name: str, why: str, log_fn=None) -> None:
    line = _line(name, why)
    lines.append(line)
    log.warning(line)
    if log_fn is not None:
        log_fn(line)


def model_doctor(model, doctor: Doctor | None = None) -> Doctor:
    """A Doctor probing the shape of ``model``'s calls (its device, compute dtype and head size)."""
    if doctor is not None:
        return doctor
    return doctor_for(model.device, model.compute_dtype, model.config.head_dim)


def gate_options(model, options: FastOptions, doctor: Doctor | None = None, log_fn=None) -> tuple[FastOptions, list]:
    """(options with ``switched_off`` set, lines saying what was switched off and why)."""
    options = FastOptions.coerce(options)
    doc = model_doctor(model, doctor)
    device, off, lines = torch.device(model.device), set(options.switched_off), []

    def judge(name: str) -> None:
        why = doc.why_off(name)
        if why:
            off.add(name)
            _say(lines, name, why, log_fn)

    requested = options.attention or getattr(model, "attn_backend", "auto")
    backend = explain_backend(requested, device, model.compute_dtype, model.config.head_dim)[0]
    while backend != "sdpa":
        judge(f"attention.{backend}")
        if f"attention.{backend}" not in off:
            break
        nxt = "fa2" if backend == "fa3" and requested in ("auto", "flash_attn") else "sdpa"
        backend = explain_backend(nxt, device, model.compute_dtype, model.config.head_dim)[0]
    if kernels_part(options, device):
        for name in ("kernel.layernorm_modulate", "kernel.rmsnorm_rope", "kernel.gated_residual"):
            judge(name)
    if options.fused_qkv:
        judge("fused_qkv")
    if options.cuda_graphs == "auto" and graphs_device(device):
        judge("cuda_graphs")
    return options.replace(switched_off=frozenset(off)), lines


def gate_compile(model, settings, doctor: Doctor | None = None, log_fn=None, lines: list | None = None):
    """``settings`` when compiled blocks are trusted here (or no compile is asked for), else None."""
    if settings is None:
        return None
    doc = model_doctor(model, doctor)
    why = doc.why_off("compile")
    if why:
        _say(lines if lines is not None else [], "compile", why, log_fn)
        return None
    return settings


def gate_swap(model, settings, doctor: Doctor | None = None, log_fn=None, lines: list | None = None):
    """Swap settings to apply: without the prefetch stream when block swap failed its check here."""
    if settings is None or not getattr(settings, "blocks_to_swap", 0) or not getattr(settings, "prefetch", 0):
        return settings
    doc = model_doctor(model, doctor)
    why = doc.why_off("block_swap")
    if why:
        _say(lines if lines is not None else [], "block_swap (prefetch stream)", why, log_fn)
        return dataclasses.replace(settings, prefetch=0)
    return settings


def gated_sampling(model, notes: list | None = None, log_fn=None, only_cuda: bool = True):
    """A context in which ``sample_causal`` calls left on path 'auto' run the optimized path with the doctor's
    verdicts applied (on CUDA, where 'auto' means the optimized path; elsewhere nothing changes unless
    ``only_cuda`` is False)."""
    if only_cuda and torch.device(model.device).type != "cuda":
        return contextlib.nullcontext()
    options, lines = gate_options(model, FastOptions(), log_fn=log_fn)
    if notes is not None:
        notes.extend(lines)
    return sampler_path("optimized", options)
