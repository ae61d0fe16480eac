"""The probes of the doctor (``app/doctor/core.py``): each accelerated feature against its plain fallback.

Per feature family: the attention backends (SDPA against plain softmax math; FlashAttention 3 / 2 against SDPA),
the fused Triton kernels against their torch references (compiled on CUDA, interpreted on a CPU under
TRITON_INTERPRET=1), the FFN's bias + GELU in the GEMM's epilogue against Linear -> GELU(tanh) in float32 (CUDA
only), fused q/k/v against three GEMMs, CUDA-graph replay of one chunk against eager, a compiled block against eager,
block swap against resident, and the native ``MODEL`` path (its probe needs ComfyUI, so the nodes package registers
it: ``vocabulary.register_probe``). Each feature names the code it exercises (``sources``). Inputs are seeded and
shaped like the real call (head size, dtype, layout) with a few hundred tokens.
"""
from __future__ import annotations

import importlib
from typing import Callable

import torch
import torch.nn.functional as F

from ...kernels import _common, norm_modulate, qk_norm_rope, residual, residual_layernorm, rms_norm
from ...kernels import candidates as op_candidates, registry
from ...kernels import kitchen
from ...kernels import fp8_linear as fp8
from ...kernels import fa3_fp8, fa3_packages, flash_attention, fp8_attention, int8_attention
from ...model import attention as attn
from ...model.attention_approx import fp8_error_bound
from ...model import fused_qkv as fq
from ...model.blocks import WanSelfAttention, _project, epilogue_gelu_runs_on, ffn_epilogue, linear_gelu
from . import vocabulary
from .vocabulary import Feature, NotAvailable, OutsideProbe, Probe, ProbeContext, register_feature


def _rand(ctx: ProbeContext, *shape, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(ctx.device, ctx.dtype)


def _dim(ctx: ProbeContext) -> int:
    return ctx.heads * ctx.head_dim


# ----------------------------------------------------------------------------------------------- attention
def _qkv(ctx: ProbeContext):
    shape = (1, ctx.tokens, ctx.heads, ctx.head_dim)
    return tuple(_rand(ctx, *shape, seed=s) for s in (1, 2, 3))


ATTENTION_ULPS = 16     # two reductions (over the head size, then over a few hundred keys) in another order


def _check_sdpa(ctx: ProbeContext) -> Probe:
    q, k, v = _qkv(ctx)
    return Probe(lambda: attn.attention(q, k, v, backend="sdpa"), lambda: attn.attention_reference(q, k, v), ctx.dtype,
                 judge_speed=False, ulps=ATTENTION_ULPS,
                 note="SDPA is the fallback of every attention backend; checked against math")


FA_HINTS = {"fa3": "pip install fa3-fwd (PyPI: FlashAttention 3's forward, bf16, CUDA 13, torch >= 2.10) or the "
                   "'hopper' build of flash-attn (module flash_attn_interface); SM 9.x GPUs",
            "fa2": "pip install flash-attn (2.x) built for this GPU's architecture; needs SM 8.0+"}


def _fa_checker(name: str):
    def check(ctx: ProbeContext) -> Probe:
        why = attn.flash_problem(name, ctx.device, ctx.dtype, ctx.head_dim)   # the op registry's 'attention.<name>'
        if why:
            raise NotAvailable(why, FA_HINTS[name])
        fn, (q, k, v) = attn.flash_function(name), _qkv(ctx)

        def feature():
            out = fn(q, k, v)
            return out[0] if isinstance(out, (tuple, list)) else out
        return Probe(feature, lambda: attn._sdpa(q, k, v), ctx.dtype, ulps=ATTENTION_ULPS)
    return check


def _candidate_probe(family: str, name: str, hint, inputs, reference, **probe) -> tuple:
    """(requires, check) of the doctor's probe of the op registry's candidate ``name`` of ``family`` against
    ``reference`` on ``inputs(ctx)``: NotAvailable with the candidate's reason (and ``hint()``) where it cannot run."""
    def requires(ctx: ProbeContext) -> None:
        why = registry.candidate(family, name).rejected(ctx.device, ctx.dtype, ctx.head_dim)
        if why:
            raise NotAvailable(why, hint())

    def check(ctx: ProbeContext) -> Probe:
        requires(ctx)
        args = inputs(ctx)
        return Probe(lambda: registry.candidate(family, name).fn(*args), lambda: reference(*args), ctx.dtype,
                     judge_speed=False, **probe)
    return requires, check


_EXACT = dict(ulps=ATTENTION_ULPS, note="checked against math; speed: the operator store times it at the call's shapes")
_TRITON_HINT = "run on a CUDA GPU (SM 8.0+) with triton installed, bf16/fp16 weights"
_TRITON_ATTENTION = _candidate_probe("attention", "triton", lambda: _TRITON_HINT, _qkv, attn.attention_reference,
                                     **_EXACT)
_FA3_PACKAGES = {name: _candidate_probe("attention", name, lambda n=name: fa3_packages.HINTS[n], _qkv,
                                        attn.attention_reference, **_EXACT) for name in fa3_packages.NAMES}


def _approximate_checker(mode: str, bound):
    """A probe of the opt-in attention ``mode`` against exact attention (float32 math), judged by ``bound(q, k, v,
    kernel)``, its module's ``error_bound`` (per element, derived from its quantization: see that docstring) for
    the implementation the op registry takes here, rather than the dtype's resolution."""
    def check(ctx: ProbeContext) -> Probe:
        if ctx.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise NotAvailable(f"needs fp32/fp16/bf16 (probe dtype {ctx.dtype})")
        q, k, v = _qkv(ctx)
        kernel = registry.choice(f"attention.{mode}", ctx.device, ctx.dtype, ctx.head_dim)[0]
        return Probe(lambda: attn.attention(q, k, v, backend=mode), lambda: attn.attention_reference(q, k, v),
                     ctx.dtype, bound=lambda: bound(q, k, v, kernel),
                     note=f"{mode} ({kernel}) within its stated error bound of exact attention (difference in "
                          f"units of the bound)")
    return check


_check_int8 = _approximate_checker("int8", lambda q, k, v, kernel: int8_attention.error_bound(q, k, v, kernel=kernel))
_check_fp8_attention = _approximate_checker("fp8", lambda q, k, v, kernel: fp8_error_bound(q, k, v, kind=kernel))


# ----------------------------------------------------------------------------------------------- fp8 linear
def _fp8_inputs(ctx: ProbeContext):
    """A linear layer [2 * dim, dim] with bias and its input: random tokens, some with outliers (per-token scales),
    and rows where the bound is tight, so a wrong result shows: non-negative rows of x and W (no cancellation:
    the bound is an eighth of the output) and rows half a step between two e4m3 codes (each product off by the
    most rounding allows: the error reaches 85 % of the bound)."""
    d = _dim(ctx)
    x = _rand(ctx, ctx.tokens, d, seed=20)
    w = _rand(ctx, 2 * d, d, scale=d ** -0.5, seed=21)
    x[:: max(1, ctx.tokens // 8), : max(1, d // 64)] *= 40
    x[:8], w[:8] = x[:8].abs(), w[:8].abs()
    for t in (x, w):
        t[8:16] = 1.0625 * d ** -0.5
        t[8:16, 0] = 1.75 * d ** -0.5
    return x, w, _rand(ctx, 2 * d, scale=0.1, seed=22)


def _check_fp8(ctx: ProbeContext) -> Probe:
    """fp8 linear (weight per output row, input per token) against the exact product (float64), judged by
    ``fp8_linear.error_bound`` (derived from e4m3's rounding) plus the exact product's own rounding to the probe
    dtype, rather than the dtype's resolution."""
    if ctx.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise NotAvailable(f"needs fp32/fp16/bf16 (probe dtype {ctx.dtype})")
    x, w, b = _fp8_inputs(ctx)
    path = fp8.path_for(ctx.device, w.shape[1], w.shape[0])[0]
    copy = fp8.quantize_weight(w)

    def exact():
        return x.double() @ w.double().t() + b.double()

    return Probe(lambda: fp8.fp8_linear(x, *copy, b), exact, ctx.dtype, judge_speed=False,
                 bound=lambda: fp8.error_bound(x, w, b, path) + fp8.unit_roundoff(ctx.dtype) * exact().abs(),
                 note=f"fp8 ({path}) within its stated error bound of the exact product (difference in units of "
                      f"the bound); speed is judged at the run's shapes")


# ----------------------------------------------------------------------------------------------- kernels
def _kernel_ready(ctx: ProbeContext) -> None:
    why = _common.triton_problem(ctx.device)        # the op registry's probe of the pack's kernels
    if why:
        hint = "pip install triton (on Windows: the triton-windows build matching your torch)"
        raise NotAvailable(why, hint if _common.triton_module() is None else "run on a CUDA GPU")


def _tuned(mod, x, launch, key, *out) -> tuple:
    """``out``, what ``mod._launcher`` returned beside ``launch`` and ``key``, once ``launch`` ran tuned."""
    # the row kernels' candidates depend on the width (one-pass tiles up to a bound); the others' are fixed
    cands = mod.candidates(x.shape[-1]) if hasattr(mod, "candidates") else mod.CANDIDATES
    if not _common.launched(mod._KERNEL_NAME, key, cands, launch, None, x, smem=mod._smem):
        raise RuntimeError(f"every Triton config of {mod.NAME} failed on this machine (see the operator store)")
    return out


def _check_lnmod(ctx: ProbeContext) -> Probe:
    _kernel_ready(ctx)
    d, frames = _dim(ctx), 2
    x = _rand(ctx, 1, ctx.tokens - ctx.tokens % frames, d, seed=4)
    shift, scale = _rand(ctx, 1, frames, d, scale=0.1, seed=5), _rand(ctx, 1, frames, d, scale=0.1, seed=6)

    def feature():
        sh, sc = norm_modulate._check(x, shift, scale)
        return _tuned(norm_modulate, x, *norm_modulate._launcher(x, sh, sc, 1e-6))[0]
    return Probe(feature, lambda: norm_modulate.layernorm_modulate_reference(x, shift, scale, 1e-6), ctx.dtype)


def _check_rmsrope(ctx: ProbeContext) -> Probe:
    _kernel_ready(ctx)
    d, hd = _dim(ctx), ctx.head_dim
    x, w = _rand(ctx, 1, ctx.tokens, d, seed=7), 1 + _rand(ctx, d, scale=0.1, seed=8)
    angles = torch.arange(ctx.tokens)[:, None] * torch.rand(hd // 2, generator=torch.Generator().manual_seed(9))
    cos, sin = angles.cos().to(ctx.device), angles.sin().to(ctx.device)

    def feature():
        qk_norm_rope._check(x, w, cos, sin, ctx.heads)
        return _tuned(qk_norm_rope, x, *qk_norm_rope._launcher(x, w, cos, sin, ctx.heads, 1e-6))[0]
    return Probe(feature, lambda: qk_norm_rope.rmsnorm_rope_reference(x, w, cos, sin, ctx.heads, 1e-6), ctx.dtype)


def _check_rmsnorm(ctx: ProbeContext) -> Probe:
    _kernel_ready(ctx)
    d = _dim(ctx)
    x, w = _rand(ctx, 1, ctx.tokens, d, seed=13), 1 + _rand(ctx, d, scale=0.1, seed=14)

    def feature():
        rms_norm._check(x, w)
        return _tuned(rms_norm, x, *rms_norm._launcher(x, w, 1e-6))[0]
    return Probe(feature, lambda: rms_norm.rmsnorm_reference(x, w, 1e-6), ctx.dtype)


def _check_gres(ctx: ProbeContext) -> Probe:
    _kernel_ready(ctx)
    d, frames = _dim(ctx), 2
    n = ctx.tokens - ctx.tokens % frames
    x, y, gate = _rand(ctx, 1, n, d, seed=10), _rand(ctx, 1, n, d, seed=11), _rand(ctx, 1, frames, d, seed=12)

    def feature():
        g = residual._check(x, y, gate)
        return _tuned(residual, x, *residual._launcher(x, y, g))[0]
    return Probe(feature, lambda: residual.gated_residual_reference(x, y, gate), ctx.dtype)


def _check_resnorm(ctx: ProbeContext) -> Probe:
    _kernel_ready(ctx)
    d, frames = _dim(ctx), 2
    n = ctx.tokens - ctx.tokens % frames
    x, y = _rand(ctx, 1, n, d, seed=15), _rand(ctx, 1, n, d, seed=16)
    gate, shift, scale = (_rand(ctx, 1, frames, d, scale=0.1, seed=s) for s in (17, 18, 19))
    w, b = 1 + _rand(ctx, d, scale=0.1, seed=20), _rand(ctx, d, scale=0.1, seed=21)
    uses = ({"gate": gate, "weight": w, "bias": b}, {"shift": shift, "scale": scale})   # after self-/cross-attention

    def feature():
        outs = []
        for kw in uses:
            w, b = kw.get("weight"), kw.get("bias")
            g, sh, sc = residual_layernorm._check(x, y, kw.get("gate"), w, b, kw.get("shift"), kw.get("scale"))
            outs += _tuned(residual_layernorm, x, *residual_layernorm._launcher(x, y, g, w, b, sh, sc, 1e-6))
        return torch.cat(outs, dim=1)
    return Probe(feature, lambda: torch.cat([t for kw in uses for t in residual_layernorm.residual_norm_reference(
        x, y, **kw, eps=1e-6)], dim=1), ctx.dtype)


# ----------------------------------------------------------------------------------------------- FFN epilogue
def _ffn_gelu_requires(ctx: ProbeContext) -> None:
    if not epilogue_gelu_runs_on(ctx.device, ctx.dtype):
        raise NotAvailable(f"runs on a CUDA GPU in bf16/fp16 only (here {ctx.device.type}, "
                           f"{str(ctx.dtype).replace('torch.', '')}; on a CPU torch's _addmm_activation computes "
                           f"the erf GELU, not the model's tanh GELU)", "run on a CUDA GPU with bf16/fp16 weights")


def _ffn_gelu_inputs(ctx: ProbeContext):
    """The FFN's first layer [2 * dim, dim] with its bias, and its input: pre-activations spread over about +-5,
    through the GELU's bend (where the tanh and erf GELUs differ most, about 2.7), the bias as large as the
    product (a dropped bias shows)."""
    d = _dim(ctx)
    x = _rand(ctx, ctx.tokens, d, seed=23)
    return x, _rand(ctx, 2 * d, d, scale=1.5 * d ** -0.5, seed=24), _rand(ctx, 2 * d, seed=25)


def ffn_gelu_probe(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> Probe:
    """The first linear's bias + GELU in the GEMM's epilogue (``model.blocks.linear_gelu``, the call ``_ffn``
    makes) against Linear -> GELU(tanh) computed in float32 from the same inputs, compared in x's dtype."""
    return Probe(lambda: linear_gelu(x, w, b),
                 lambda: F.gelu(F.linear(x.float(), w.float(), b.float()), approximate="tanh"), x.dtype,
                 note="against Linear -> GELU(tanh) in float32 from the same inputs; speed: the epilogue saves "
                      "a pass over the FFN's hidden tensor, not judged at the probe's shape")


def _check_ffn_gelu(ctx: ProbeContext) -> Probe:
    _ffn_gelu_requires(ctx)
    return ffn_gelu_probe(*_ffn_gelu_inputs(ctx))


# ----------------------------------------------------------------------------------------------- fused q/k/v
def _check_fused_qkv(ctx: ProbeContext) -> Probe:
    d = _dim(ctx)
    torch.manual_seed(13)
    sa = WanSelfAttention(d, ctx.heads, True, 1e-6).to(ctx.device, ctx.dtype).requires_grad_(False)
    h = _rand(ctx, 1, ctx.tokens, d, seed=14)

    def feature():
        if not fq.ensure_fused_qkv(sa):
            raise RuntimeError("the q/k/v weights could not be fused")
        return torch.cat(_project(sa, h, True, 3), dim=-1)
    return Probe(feature, lambda: torch.cat(_project(sa, h, False, 3), dim=-1), ctx.dtype)


# ----------------------------------------------------------------------------------------------- whole chunks
def _probe_model(ctx: ProbeContext):
    from ...model.config import WanConfig
    from ...model.tiny import TINY_CONFIG, tiny_causal_model
    cfg = WanConfig.from_dict(dict(TINY_CONFIG.to_dict(), dim=_dim(ctx), ffn_dim=2 * _dim(ctx),
                                   num_heads=ctx.heads, text_dim=64))
    return tiny_causal_model(0, ctx.device, ctx.dtype, config=cfg)


CHUNK_SCHEDULE = {"preset": "custom", "steps": [1000, 500], "shift": 5.0}   # two denoising calls and a refresh
CHUNK_ULPS = 64     # a whole chunk (every block, two steps) accumulates more rounding than one op


def _chunk(model, ctx: ProbeContext, **options):
    """One chunk (3 latent frames, 16x16 latents: 192 tokens) of the optimized path."""
    from ..run import FastOptions, Run, RunInputs, RunSpec, Setup
    cfg = model.config
    context = torch.randn(1, cfg.text_len, cfg.text_dim, generator=torch.Generator().manual_seed(15)).to(ctx.device)
    opts = FastOptions(fused_kernels=False, keep_buffers=True, **{"cuda_graphs": "off", **options})
    spec = RunSpec(schedule=CHUNK_SCHEDULE, doctor=False, oom_retry="off")      # the model as the probe made it
    return Run(model, spec, Setup("optimized", opts, [], {}),
               RunInputs(context=context, noise=(1, 3, cfg.out_dim, 16, 16))).latents().to(ctx.dtype)


def _needs_graphs(ctx: ProbeContext) -> None:
    if ctx.device.type != "cuda":
        raise NotAvailable("CUDA graphs need a CUDA GPU", "run on a CUDA GPU")


def _chunk_probe(ctx: ProbeContext, change=lambda model: None, options=None, **probe) -> Probe:
    """One chunk on a probe model that ``change(model)`` gave the feature (and with ``options``) against the same
    chunk on an unchanged one."""
    feature, fallback = _probe_model(ctx), _probe_model(ctx)
    change(feature)
    return Probe(lambda: _chunk(feature, ctx, **(options or {})), lambda: _chunk(fallback, ctx), ctx.dtype,
                 ulps=CHUNK_ULPS, **probe)


def _check_graphs(ctx: ProbeContext) -> Probe:
    _needs_graphs(ctx)
    return _chunk_probe(ctx, options={"cuda_graphs": "auto"})


def _needs_compile(ctx: ProbeContext) -> None:
    if ctx.device.type != "cuda" and not ctx.with_compile:
        raise NotAvailable("not probed on a CPU by default (an Inductor compile takes tens of seconds here)",
                           "python -m wan_accel doctor --with-compile")


def _check_compile(ctx: ProbeContext) -> Probe:
    _needs_compile(ctx)
    from ...compile.apply import compile_model
    from ...compile.settings import CompileSettings
    settings = CompileSettings(backend=ctx.compile_backend or "inductor", scope="blocks", warm_start=False)
    return _chunk_probe(ctx, lambda model: compile_model(model, settings), judge_speed=False,
                        note="speed not judged: a probe this small does not show what compiling gains")


def _check_swap(ctx: ProbeContext) -> Probe:
    from ...memory.block_swap import apply_block_swap, SwapSettings
    return _chunk_probe(ctx, lambda model: apply_block_swap(model, SwapSettings(blocks_to_swap=1, prefetch=1),
                                                            device=ctx.device), judge_speed=False,
                        note="feature time minus fallback time is the transfer time of one swapped block per call")


NATIVE_HINT = ("run the Wan Doctor node inside ComfyUI (or `python -m wan_accel doctor` with ComfyUI's Python, "
               "ComfyUI's folder importable)")


def _native_probe() -> OutsideProbe:
    """The native MODEL path's probe: registered by the nodes package (``nodes/comfy/native_probe.py``), which may import
    ComfyUI; until it is, the feature needs ComfyUI."""
    probe = vocabulary.PROBES.get("native_model")
    if probe is None:
        raise NotAvailable("needs ComfyUI (the native MODEL path runs on ComfyUI's own Wan model; its probe is "
                           "registered when the pack's nodes load)", NATIVE_HINT)
    return probe


def _check_native(ctx: ProbeContext) -> Probe:
    return _native_probe().check(ctx)


def _needs_native(ctx: ProbeContext) -> None:
    probe = _native_probe()
    (probe.requires or probe.check)(ctx)


def _native_sources() -> tuple:
    probe = vocabulary.PROBES.get("native_model")
    if probe is None:
        return ()
    return (probe.check, probe.requires or "") + tuple(probe.sources() if probe.sources else ())


_CHUNK_CODE = (_probe_model, _chunk, _chunk_probe)


def _chunk_sources(*modules) -> Callable[[], tuple]:
    """The code a whole-chunk probe runs: the tiny model, the optimized sampler, and the feature's own modules."""
    def sources() -> tuple:
        from ...model import blocks, tiny
        from ...sampling import runner, sampler
        return _CHUNK_CODE + (blocks, tiny, runner, sampler) + tuple(importlib.import_module(m, __package__)
                                                                      for m in modules)
    return sources


def _kernel_sources(mod) -> Callable[[], tuple]:
    """A kernel's operator-store name (``name@sourcehash`` of its Triton source), its module and _common."""
    return lambda: (str(getattr(mod, "_KERNEL_NAME", mod.NAME)), mod, _common)


_ATTENTION = lambda: (attn, _qkv, attn.attention_reference)   # noqa: E731
for _feature in (
    Feature("attention.sdpa", "torch scaled_dot_product_attention", _check_sdpa, switches_off="nothing (fallback)",
            sources=_ATTENTION),
    Feature("attention.fa3", "FlashAttention 3", _fa_checker("fa3"), ("flash_attn_3", "flash-attn-3", "fa3-fwd"),
            "fa3 (fa2 or SDPA is used)", sources=_ATTENTION),
    Feature("attention.fa2", "FlashAttention 2", _fa_checker("fa2"), ("flash-attn", "flash_attn"),
            "fa2 (SDPA is used)", sources=_ATTENTION),
    Feature("attention.triton", "the pack's Triton flash-attention kernel (an 'auto' candidate)",
            _TRITON_ATTENTION[1], ("triton",), "this kernel (the other exact candidates)",
            requires=_TRITON_ATTENTION[0],
            sources=lambda: (str(flash_attention._KERNEL_NAME), flash_attention, attn, _qkv, attn.attention_reference)),
    Feature("attention.fa3_hub", "FlashAttention 3 from the Hugging Face kernel hub (opt-in; an 'auto' candidate)",
            _FA3_PACKAGES["fa3_hub"][1], ("kernels",), "this package (the other exact candidates)",
            requires=_FA3_PACKAGES["fa3_hub"][0], sources=lambda: (fa3_packages, attn, _qkv, attn.attention_reference)),
    Feature("attention.fa3_xformers", "FlashAttention 3 through xformers (an 'auto' candidate)",
            _FA3_PACKAGES["fa3_xformers"][1], ("xformers",), "this operator (the other exact candidates)",
            requires=_FA3_PACKAGES["fa3_xformers"][0],
            sources=lambda: (fa3_packages, attn, _qkv, attn.attention_reference)),
    Feature("attention.int8", "int8 attention (opt-in)", _check_int8, ("comfy-kitchen",), "int8 (SDPA is used)",
            sources=lambda: (attn, int8_attention, _qkv, attn.attention_reference)),
    Feature("attention.fp8", "fp8 attention (opt-in)", _check_fp8_attention,
            ("triton", "flash_attn_3", "flash-attn-3", "fa3-fwd"), "fp8 (SDPA is used)",
            sources=lambda: (attn, fp8_attention, fa3_fp8, _qkv, attn.attention_reference)),
    Feature("linear.fp8", "fp8 linear layers (opt-in)", _check_fp8, switches_off="fp8 linear (exact linear layers)",
            sources=lambda: (fp8, _fp8_inputs)),
    Feature("kernel.layernorm_modulate", "fused LayerNorm + modulate (Triton)", _check_lnmod, ("triton",),
            "this kernel (torch ops)", sources=_kernel_sources(norm_modulate)),
    Feature("kernel.rmsnorm_rope", "fused RMSNorm + RoPE (Triton)", _check_rmsrope, ("triton",),
            "this kernel (torch ops)", sources=_kernel_sources(qk_norm_rope)),
    Feature("kernel.gated_residual", "fused gated residual (Triton)", _check_gres, ("triton",),
            "this kernel (torch ops)", sources=_kernel_sources(residual)),
    Feature("kernel.rms_norm", "fused RMSNorm (Triton; the cross-attention's query)", _check_rmsnorm, ("triton",),
            "this kernel (torch ops)", sources=_kernel_sources(rms_norm)),
    Feature("kernel.residual_norm", "fused residual + LayerNorm (Triton; around the cross-attention)", _check_resnorm,
            ("triton",), "this kernel (the gated residual, LayerNorm, LayerNorm+modulate apart)",
            sources=_kernel_sources(residual_layernorm)),
    Feature("kernel.ffn_gelu", "bias + GELU in the GEMM epilogue (the FFN's first linear; CUDA, bf16/fp16)",
            _check_ffn_gelu, switches_off="the epilogue (the FFN's Linear -> GELU -> Linear as torch modules)",
            requires=_ffn_gelu_requires,
            sources=lambda: (linear_gelu, ffn_epilogue, epilogue_gelu_runs_on, ffn_gelu_probe, _ffn_gelu_inputs)),
    Feature("fused_qkv", "one q/k/v GEMM", _check_fused_qkv, switches_off="fused q/k/v (three GEMMs)",
            sources=lambda: (fq, _project, WanSelfAttention)),
    Feature("cuda_graphs", "CUDA-graph replay of a chunk", _check_graphs, switches_off="CUDA graphs (eager)",
            requires=_needs_graphs, sources=_chunk_sources("...sampling.cuda_graphs")),
    Feature("compile", "compiled blocks (torch.compile)", _check_compile, switches_off="the compile (eager)",
            requires=_needs_compile, sources=_chunk_sources("...compile.apply", "...compile.settings")),
    Feature("block_swap", "block swap with a prefetch stream", _check_swap,
            switches_off="the prefetch stream (synchronous copies)", requires=lambda ctx: None,
            sources=_chunk_sources("...memory.block_swap")),
    Feature("native_model", "native ComfyUI MODEL path", _check_native, switches_off="the native MODEL path",
            requires=_needs_native, sources=_native_sources),
):
    register_feature(_feature)


# ----------------------------------------------------------------------------------------------- op candidates
def _op_args(op: str, ctx: ProbeContext) -> tuple:
    """Inputs of ``op`` shaped like the model's call (2 frames of per-frame modulation; Wan's RoPE tables)."""
    from ...model.rope import RopeCache
    d, frames = _dim(ctx), 2
    n = ctx.tokens - ctx.tokens % frames
    x = _rand(ctx, 1, n, d, seed=16)
    if op == "layernorm_modulate":
        return x, _rand(ctx, 1, frames, d, scale=0.1, seed=17), _rand(ctx, 1, frames, d, scale=0.1, seed=18), 1e-6
    cos, sin = RopeCache().get(ctx.head_dim, (frames, 1, n // frames), 0, ctx.device)
    return x, 1 + _rand(ctx, d, scale=0.1, seed=19), cos, sin, ctx.heads, 1e-6


def _candidate_sources(op: str) -> Callable[[], tuple]:
    mods = {"layernorm_modulate": norm_modulate, "rmsnorm_rope": qk_norm_rope}
    return lambda: (op_candidates, kitchen, mods[op], _op_args)


def candidate_feature(op: str, name: str) -> str:
    """The doctor's name of a candidate implementation (its failed verdict switches off that one alone)."""
    return f"op.{op}.{name}"


for _op, _cands in op_candidates.CANDIDATES.items():
    for _name, _cand in _cands.items():
        if _cand.group != "kitchen":      # the pack's kernels are 'kernel.<name>'; torch is the reference
            continue
        _requires, _check = _candidate_probe(
            _op, _name, lambda: kitchen.INSTALL_HINT if not kitchen.available() else "run on a CUDA GPU",
            lambda ctx, op=_op: _op_args(op, ctx), op_candidates.REFERENCES[_op],
            note="speed: the operator store times every verified implementation")
        register_feature(Feature(candidate_feature(_op, _name), f"{_op}: {_cand.summary}", _check,
                                 (kitchen.DISTRIBUTION,), f"{_name} for {_op} (another verified implementation)",
                                 requires=_requires, sources=_candidate_sources(_op)))
