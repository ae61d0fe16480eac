"""The optimized executor of causal chunks: static buffers, precomputed inputs, CUDA graphs.

``get_runner(model)`` returns the model's runner (kept on the model, outside its state dict). ``runner.start``
prepares one sampling run and returns a ``Run``, the executor the chunk loop (``sampling/loop.py``) drives:

* static, preallocated KV cache (host-int bookkeeping and device write indices, ``KVCache.plan``), kept between runs
  of the same geometry so CUDA graphs stay valid;
* cross-attention K/V computed once per prompt into static buffers;
* time embeddings (sinusoid, e, e0) once per distinct timestep; RoPE tables from the model's one provider;
* the block parts: one q/k/v GEMM (``model/fused_qkv.py``), the fused kernels where Triton runs, the attention
  backend resolved once;
* refresh passes that skip the last block's unused work and the head;
* under ``linear='fp8'`` (opt-in, approximate): an fp8 copy of every block linear layer's weight
  (``model/fp8_linear.py``), kept while the weights do not change, made only after the speed verdict (read from
  the operator store, or measured once) says fp8 is not slower at the run's largest call;
* under ``attention='fp8'`` (opt-in, approximate): the KV cache's fp8 copy, likewise made only after fp8
  attention's speed verdict at the run's largest self-attention call says it is not slower.

The block forward is the model's own (``model/blocks.py``); only the parts differ from the reference executor. What
the policy floors did to the model (block swap, compile) is read through ``model/attachments.py``: the model is
compiled, swapped or offloaded by its owner before sampling, never from here.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import time

import torch

from ..kernels import use_triton
from ..kernels.candidates import mode_problem as ops_mode_problem
from ..kernels.registry import SWITCHED_OFF, parse_ops, parse_ops as check_ops_mode, use as use_ops
from ..model.attachments import (RUNNER_ATTR, compiled_mode, end_compile_warmup, model_signature, seq_parallel_of,
                                 swapped_blocks)
from ..model.attention import (APPROXIMATE, auto_request, explain_backend, fp8_implementation, plan_shapes,
                               warm_plans)
from ..model.attention_approx import attention_speed, fp8_scheme
from ..model import cached_attention
from ..model.blocks import KERNEL_NAMES, BlockParts, LayerCall, cross_kv
from ..model.fp8_linear import check_mode as check_linear_mode
from ..model.fp8_linear import check_block as check_fp8_block
from ..model.fp8_linear import GROUPS as FP8_GROUPS
from ..model.fp8_linear import drop_fp8, ensure_fp8, fp8_speed, fp8_tensors, linear_path
from ..model.fused_qkv import drop_fused_qkv, ensure_fused_qkv
from ..model.kv_cache import KVCache
from ..cache.warmup import spent
from .cuda_graphs import CudaGraphBackend, GraphManager, recorded_failure
from .request import Replaceable

log = logging.getLogger("wan_accel")
_SAID: set = set()      # speed verdict lines already shown in this process
CUDA_GRAPH_MODES = ("auto", "off")
LATENT_DTYPES = ("float32", "stream")


@dataclass(frozen=True)
class FastOptions(Replaceable):
    """Switches of the optimized path (all on by default; each keeps the results within rounding).

    attention:         None: the model's own setting (the loader's); else auto | sdpa | flash_attn | fa3 | fa2.
    fused_qkv:         one q/k/v GEMM over a concatenated weight.
    fused_kernels:     the fused kernels where they run: the Triton ones (LayerNorm+modulate, RMSNorm+RoPE, gated
                       residual, RMSNorm; CUDA, or the CPU under TRITON_INTERPRET=1) and the FFN's GELU in its GEMM
                       epilogue (CUDA, bf16/fp16); plain torch ops elsewhere.
    cuda_graphs:       'auto' (on CUDA, unless block swap, compile-mode graphs or action modules rule it out) | 'off'.
                       (Compile the model with ``compile.compile_model`` before sampling; the runner keeps its graphs
                       in charge of compiled blocks unless the compile itself uses CUDA graphs.)
    lean_refresh:      in refresh passes compute only what the cache needs (last block: k/v only; no head).
    skip_last_refresh: skip the final chunk's refresh (its result is never used).
    keep_buffers:      keep the static KV cache and graphs after a run (fast repeats; holds their memory).
    max_graphs:        most graphs kept per session (beyond it, calls run eagerly).
    latent_dtype:      'float32': the sampler's latent state (xt, x0, flow->x0, re-noising) is kept in at least
                       float32 whatever the model dtype (elementwise work on latents only) | 'stream': in the
                       model's stream dtype, as the reference path and the original pipelines (bf16 under the
                       'self_forcing' policy).
    switched_off:      features that failed their self-check on this machine (``app/doctor/core.py``): names such as
                       'attention.fa3', 'attention.fa2', 'kernel.<name>', 'fused_qkv', 'cuda_graphs'; each is
                       replaced by its plain fallback and everything else stays on.
    ops:               which implementation runs LayerNorm+modulate and RMSNorm+RoPE (kernels/candidates.py):
                       'auto' (where the fused kernels run: the operator store's fastest verified one among the
                       pack's kernel, comfy-kitchen's backends and torch; elsewhere plain torch ops as before) |
                       'pack' | 'kitchen' (comfy-kitchen, an optional extra) | 'torch'; and/or 'family=candidate'
                       pairs of the op registry (kernels/registry.py; ``doctor --ops`` lists them), comma-separated.
    keep_slower:       keep an opt-in approximate mode (int8 attention, fp8 linear) even where it was measured slower
                       than the exact one at the run's own shape on this GPU (otherwise the run says so and stays
                       exact).
    linear:            'exact' | 'fp8' (opt-in, approximate): every linear layer inside the blocks runs an fp8 copy of
                       its weight (per-row scales) on inputs quantized per token (``kernels/fp8_linear.py``; within
                       its ``error_bound``); ``torch._scaled_mm`` on CUDA SM 8.9+, emulated in float32 elsewhere.
    """
    attention: str | None = None
    fused_qkv: bool = True
    fused_kernels: bool = True
    cuda_graphs: str = "auto"
    lean_refresh: bool = True
    skip_last_refresh: bool = True
    keep_buffers: bool = True
    max_graphs: int = 64
    latent_dtype: str = "float32"
    switched_off: frozenset = frozenset()
    ops: str = "auto"
    keep_slower: bool = False
    linear: str = "exact"

    def __post_init__(self):
        check_ops_mode(self.ops)
        check_linear_mode(self.linear)
        object.__setattr__(self, "switched_off", frozenset(self.switched_off or ()))
        if self.cuda_graphs not in CUDA_GRAPH_MODES:
            raise ValueError(f"cuda_graphs must be one of {CUDA_GRAPH_MODES}, got {self.cuda_graphs!r}")
        if self.latent_dtype not in LATENT_DTYPES:
            raise ValueError(f"latent_dtype must be one of {LATENT_DTYPES}, got {self.latent_dtype!r}")

    def latent_dtype_for(self, model) -> torch.dtype:
        """dtype of the sampler's latent state for ``model`` (float64 models keep float64)."""
        if self.latent_dtype == "stream":
            return model.stream_dtype
        return torch.promote_types(model.stream_dtype, torch.float32)

    @classmethod
    def coerce(cls, value) -> "FastOptions":
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return cls(**value)
        raise TypeError(f"fast options must be FastOptions or a dict, got {type(value).__name__}")


def graphs_device(device) -> bool:
    """Whether CUDA graphs exist for this device (CUDA only)."""
    return torch.device(device).type == "cuda"


def kernels_run_on(device) -> bool:
    """Whether the fused Triton kernels run on this device (CUDA, or the CPU under TRITON_INTERPRET=1). Elsewhere
    their torch fallbacks would only add work, so the plain block math is used."""
    return use_triton(torch.empty(0, device=device))


def kernels_part(options: FastOptions, device):
    """BlockParts.fused_kernels for a run: True (all), False (none) or the tuple of kernels still trusted."""
    if not (options.fused_kernels and kernels_run_on(device)):
        return False
    torch_ops = [f for f, cand in parse_ops(options.ops)[1].items() if cand == "torch"]      # the ops overrides
    kept = tuple(k for k in KERNEL_NAMES if f"kernel.{k}" not in options.switched_off and k not in torch_ops)
    return True if len(kept) == len(KERNEL_NAMES) else (kept or False)


def ops_part(options: FastOptions, device, kernels) -> tuple:
    """BlockParts.ops for a run: () where 'auto' leaves it to ``kernels`` (the fused kernels do not run here or
    are turned off), else (mode, *switched off 'op:candidate'): the pack's kernels the doctor switched off and
    the candidates named 'op.<op>.<candidate>' in ``switched_off``. An explicit mode (or a family=candidate
    override) that cannot run here is a ValueError naming the fix."""
    problem = ops_mode_problem(options.ops, device)
    if problem:
        raise ValueError(problem)
    mode = parse_ops(options.ops)[0]
    if mode == "auto" and not kernels:
        return ()
    off = [f"{k}:pack" for k in ("layernorm_modulate", "rmsnorm_rope") if f"kernel.{k}" in options.switched_off]
    off += sorted(n[len("op."):].replace(".", ":", 1) for n in options.switched_off if n.startswith("op."))
    return (mode, *off)


def get_runner(model) -> "FastRunner":
    runner = model.__dict__.get(RUNNER_ATTR)
    if runner is None:
        runner = FastRunner(model)
        model.__dict__[RUNNER_ATTR] = runner
    return runner


def release_buffers(model) -> bool:
    """Free the optimized path's static buffers and graphs kept on ``model``; True when something was freed."""
    runner = model.__dict__.get(RUNNER_ATTR)
    return runner.release() if runner is not None else False


SPEED_FIELDS = {"int8": "int8_speed", "fp8": "fp8_attention_speed"}   # the report field of each attention verdict
GRAPHING_COMPILE_MODES = ("reduce-overhead", "max-autotune", "cudagraphs")


class _Session:
    """Static buffers of one geometry (batch, cache layout, grid, dtype): reused by later runs."""

    def __init__(self, key, kv: KVCache, external: bool):
        self.key, self.kv, self.external = key, kv, external
        self.calls: dict = {}
        self.cross: list | None = None
        self.graphs: GraphManager | None = None


class FastRunner:
    def __init__(self, model):
        self.model = model
        self.session: _Session | None = None
        self.notes: list = []

    # ------------------------------------------------------------------ preparation
    def _fuse(self, options: FastOptions, swapped: set) -> int:
        fused = 0
        for i, block in enumerate(self.model.blocks):
            sa = block.self_attn
            if options.fused_qkv and i not in swapped:
                fused += bool(ensure_fused_qkv(sa))
            elif i in swapped:
                drop_fused_qkv(sa)
        return fused

    def _linear(self, options: FastOptions, swapped: set, tokens: int) -> tuple[str, dict, tuple | None]:
        """The run's linear mode, with the model's fp8 copies made (fp8) or freed (exact; also where fp8 is judged
        slower at ``tokens`` before any copy is made, and not kept: no copy is made); (mode, report fields, the
        speed verdict or None). The verdict, (slower, why, faster groups) of fp8 against exact linear layers at the
        run's largest call (``fp8_speed``: the operator store's verdicts per layer group, measured once per GPU and
        shape; stored ones make no tensor), is read before any fp8 copy is made."""
        blocks = self.model.blocks
        verdict = None
        if options.linear == "fp8" and "linear.fp8" in options.switched_off:
            line = f"fp8 linear is {SWITCHED_OFF}: this run uses exact linear layers"
            log.warning("wan_accel: %s", line)
            self.notes.append(line)
        elif options.linear == "fp8":
            for i, block in enumerate(blocks):     # every block checked before any copy is made
                if i not in swapped:
                    check_fp8_block(block, prefix=f"blocks.{i}.")
            cfg = self.model.config
            verdict = fp8_speed(tokens, cfg.dim, cfg.ffn_dim, self.model.compute_dtype, self.model.device)
        if verdict is not None and (options.keep_slower or not verdict[0]):     # else exact: no copy is made
            done = kept = 0
            groups = None if options.keep_slower else verdict[2]   # fp8 only where faster
            for i, block in enumerate(blocks):
                if i in swapped:            # its weights stream per call: a second copy would stream too
                    drop_fp8(block)
                    continue
                d, k = ensure_fp8(block, prefix=f"blocks.{i}.", groups=groups)
                done, kept = done + d, kept + k
            path, why = linear_path(self.model)
            return ("fp8" if done else "exact"), {
                "linear_path": path, "linear_reason": why, "fp8_layers": done, "fp8_layers_kept_as_stored": kept,
                "fp8_blocks_exact_swapped": len(swapped),
                "fp8_groups": list(FP8_GROUPS) if groups is None else [g for g in FP8_GROUPS if g in groups]}, verdict
        for block in blocks:
            drop_fp8(block)
        return "exact", {}, verdict

    def _graphs_reason(self, options, device, swapped, compile_mode, actions, cache) -> str | None:
        """Why CUDA graphs are not used for this run (None: they are)."""
        if options.cuda_graphs == "off":
            return "switched off"
        if "cuda_graphs" in options.switched_off:
            return SWITCHED_OFF
        if not graphs_device(device):
            return "not a CUDA device"
        if swapped:
            return "block swap moves weights between calls"
        if compile_mode in GRAPHING_COMPILE_MODES:
            return f"the compile settings ({compile_mode}) already use CUDA graphs"
        if actions is not None:
            return "action modules allocate their caches per run"
        if seq_parallel_of(self.model) is not None:
            return "sequence parallelism: its collectives wait with a timeout, outside graphs"
        failed = recorded_failure(cache, model_signature(self.model))
        if failed:
            return f"capture failed earlier on this machine ({failed}); clear the 'sampler' namespace to retry"
        return None

    def _session(self, key, kv_factory, external_kv) -> _Session:
        if external_kv is not None:         # the caller's cache: a session for this run only
            return _Session(("external",) + key, external_kv, True)
        s = self.session
        if s is None or s.key != key:
            self.release()                  # free the old buffers before allocating new ones
            s = self.session = _Session(key, kv_factory(), False)
        s.kv.reset()
        return s

    def _attach_graphs(self, sess: _Session, options: FastOptions, device, cache, compile_mode) -> None:
        """Keep the session's graphs while the weights (addresses) and compiled code are those they captured."""
        identity = (self._weights_id(), compile_mode)
        g = sess.graphs
        if g is not None and g.enabled and getattr(g, "identity", None) == identity:
            return
        if g is not None:
            g.release()
        sess.graphs = GraphManager(CudaGraphBackend(device), cache=cache, signature=model_signature(self.model),
                                   max_graphs=options.max_graphs)
        sess.graphs.identity = identity

    def start(self, req, inputs, cache) -> "Run":
        """Prepare the run of ``req`` (a ``SamplingRequest`` on the optimized path: its FastOptions, geometry and
        chunks, so the speed verdicts of fp8 linear layers and fp8 attention are read before any fp8 copy is made)
        over ``inputs``' KV cache (None: the session's) and action call; ``cache``: the LimitCache of recorded
        graph capture failures."""
        with use_ops(parse_ops(req.options.ops)[1]):      # the ops string's family=candidate overrides
            options, batch, num_frames, kv_window = req.options, req.batch, req.num_frames, req.kv_window
            kv_cache, actions = inputs.kv_cache, inputs.model_kwargs.get("actions")
            model = self.model
            self.notes = []
            device = model.device
            if "fused_qkv" in options.switched_off:
                options = options.replace(fused_qkv=False)
            compile_mode = compiled_mode(model)
            swapped = swapped_blocks(model)
            fused = self._fuse(options, swapped)
            frame_tokens = req.frame_tokens
            tokens = batch * max((n for _f0, n in req.chunks), default=0) * frame_tokens     # the largest block call
            linear, linear_info, verdict = self._linear(options, swapped, tokens)
            requested = options.attention or getattr(model, "attn_backend", "auto")
            backend, backend_reason = explain_backend(requested, device, model.compute_dtype, model.config.head_dim,
                                                      off=options.switched_off)
            attention_part = backend
            if requested == "auto" and graphs_device(device):     # the operator store's choice per call shape
                attention_part = auto_request(options.switched_off)
                backend, backend_reason = "auto", f"operator store per shape (by availability: {backend_reason})"
            rolling = 0 < kv_window < num_frames
            layout = (kv_window, req.sink) if rolling else (num_frames, 0)
            sp = seq_parallel_of(model)
            key = (batch, rolling) + layout + (tuple(req.grid_hw), str(device), model.compute_dtype, model.rope_dtype(),
                                               None if sp is None else (sp.rank, sp.world))
            sess = self._session(key, lambda: KVCache.for_model(model, batch, frame_tokens, num_frames, kv_window,
                                                                req.sink), kv_cache)
            graph_reason = "the caller passed its own KV cache" if sess.external else \
                self._graphs_reason(options, device, swapped, compile_mode, actions, cache)
            if graph_reason is None:
                self._attach_graphs(sess, options, device, cache, compile_mode)
            elif sess.graphs is not None:
                sess.graphs.release()
                sess.graphs = None
            kernels = kernels_part(options, device)
            parts = BlockParts(attention_part, kernels, bool(options.fused_qkv), ops_part(options, device, kernels),
                               linear)
            run = Run(self, options, sess, parts, actions, frame_tokens, info={
                "path": "optimized", "attention": backend, "attention_reason": backend_reason,
                "fused_qkv_blocks": fused, "fused_kernels": bool(kernels),
                "compile": compile_mode, "cuda_graphs": graph_reason is None,
                "cuda_graphs_reason": graph_reason or "on", "swapped_blocks": len(swapped), "linear": linear,
                **linear_info, "notes": self.notes})
            if attention_part == "fp8" and sp is None:
                # fp8 attention's speed verdict before the cache's fp8 copy exists: a run judged slower (and not
                # kept) never allocates it
                largest = max(plan_shapes(frame_tokens, req.chunks, kv_window, num_frames), key=lambda s: s[0] * s[1])
                _b, _cap, heads, head_dim = sess.kv.layers[0].k.shape
                run._judge_attention("fp8", largest, batch, int(heads), int(head_dim))
            fp8_cache = run.parts.attention == "fp8"
            scheme = "smoothed"
            if fp8_cache:                       # the copy in the form this machine's fp8 implementation reads
                kind = fp8_implementation(device, model.compute_dtype, model.config.head_dim)[0]
                scheme, run.info["fp8_attention_kind"] = fp8_scheme(kind), kind
            sess.kv.use_fp8(fp8_cache, scheme)      # fp8 attention: K/V quantized once, as they enter the cache
            if verdict is not None and (linear == "fp8" or verdict[0]):
                run._judge_fp8(verdict)
            return run

    def _weights_id(self) -> tuple:
        return tuple(p.data_ptr() for p in self.model.parameters()) + \
            tuple(t.data_ptr() for t in fp8_tensors(self.model))

    def release(self) -> bool:
        had = self.session is not None
        if had and self.session.graphs is not None:
            self.session.graphs.release()
        self.session = None
        return had


class Run:
    """One sampling run of the optimized path: the executor of the chunk loop (precomputed inputs, graphs)."""

    def __init__(self, runner: FastRunner, options: FastOptions, sess: _Session, parts: BlockParts, actions,
                 frame_tokens: int, info: dict):
        self.runner, self.model, self.options, self.sess = runner, runner.model, options, sess
        self.parts, self.actions, self.frame_tokens, self.info = parts, actions, frame_tokens, info
        self.emb: dict = {}
        self.cross: list = []
        self.image = None

    @property
    def kv(self) -> KVCache:
        return self.sess.kv

    @property
    def graphs(self) -> GraphManager | None:
        g = self.sess.graphs
        return g if g is not None and g.enabled else None

    # ------------------------------------------------------------------ per-run inputs
    def set_text(self, embedded) -> None:
        """Cross-attention K/V of every block for ``embedded`` (EmbeddedText), into the session's static buffers; at
        a prompt switch they replace the previous prompt's (in the same buffers when the shapes agree, so captured
        graphs stay valid)."""
        memo: dict = {}             # the prompt quantized once for every block's fp8 k/v
        fresh = [cross_kv(block, embedded.tensor, self.image, self.parts.linear, memo) for block in self.model.blocks]
        old = self.sess.cross
        if old is not None and len(old) == len(fresh) and all(
                len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(a, b))
                for a, b in zip(old, fresh)):
            for a, b in zip(old, fresh):
                for x, y in zip(a, b):
                    x.copy_(y)
        else:
            self.sess.cross = fresh
            self.sess.calls.clear()
            if self.sess.graphs is not None:
                self.sess.graphs.release()      # captured graphs read the previous buffers
        self.cross = self.sess.cross

    def prepare(self, text, clip_fea, timesteps, batch: int) -> None:
        """text: the embedded prompt (EmbeddedText); clip_fea: raw image features or None; (e, e0) of every distinct
        timestep of the run: [B, 1, dim] and [B, 1, 6, dim]."""
        self.image = self.model.embed_image(clip_fea)
        self.set_text(text)
        for t in timesteps:
            if t not in self.emb:
                tt = torch.full((batch, 1), float(t), dtype=torch.float32, device=self.model.device)
                self.emb[t] = self.model.time_embed(tt)

    def begin_chunk(self, start_frame: int, frames: int):
        """The chunk's KV write plan (host ints + device slot index), shared by every call of the chunk."""
        return self.kv.plan(start_frame * self.frame_tokens, frames * self.frame_tokens)

    def begin_recache(self, start_frame: int, frames: int):
        """The write plan of a re-cache: the cached frames [start_frame, start_frame + frames) rewritten in place."""
        return self.kv.rewrite(start_frame * self.frame_tokens, frames * self.frame_tokens)

    # ------------------------------------------------------------------ forward
    def _layer_calls(self, step, seq=None) -> list:
        key = (step, self.parts, seq)
        calls = self.sess.calls.get(key)
        if calls is None:
            calls = [LayerCall(cross, self.parts, layer.k, layer.v, step.index, step.read_len, seq=seq,
                               write_span=step.span, write_lens=step.seqlens)
                     for layer, cross in zip(self.kv.layers, self.cross)]
            if len(self.sess.calls) >= 256:
                self.sess.calls.clear()
            self.sess.calls[key] = calls
        return calls

    def _lean_last(self) -> bool:
        if not self.options.lean_refresh:
            return False
        last = len(self.model.blocks) - 1
        return getattr(self.model.blocks[last], "action_model", None) is None and \
            last not in swapped_blocks(self.model)

    def _forward(self, inp: dict, start_frame: int, step, want_output: bool, lean: bool):
        model = self.model
        tokens, grid = model.chunk_tokens(inp["xt"], inp.get("y"))
        tokens, rope, seq = model.shard_chunk(tokens, (inp["cos"], inp["sin"]), grid)
        if self.actions is not None:
            self.actions.begin(start_frame, grid[0], tokens.shape[0], tokens.shape[1] // grid[0], tokens.device,
                               model.compute_dtype)
        hidden = model.run_blocks(tokens, inp["e0"], rope, self._layer_calls(step, seq), self.actions,
                                  kv_only_last=lean and not want_output)
        if not want_output:
            return None
        return model.chunk_output(hidden, inp["e"], grid, seq)

    def forward(self, kind: str, xt, t: float, start_frame: int, step, y=None, want_output: bool = True):
        """Flow [B, F, C, H, W] for latent chunk xt at timestep t (None when want_output is False)."""
        with use_ops(parse_ops(self.options.ops)[1]):     # the ops string's family=candidate overrides
            model = self.model
            e, e0 = self.emb[t]
            h, w = xt.shape[-2] // model.config.patch_size[1], xt.shape[-1] // model.config.patch_size[2]
            cos, sin = model.rope.get(model.config.head_dim, (xt.shape[1], h, w), start_frame, model.device,
                                      model.rope_dtype())
            inp = {"xt": xt, "y": y, "e": e, "e0": e0, "cos": cos, "sin": sin}
            lean = self._lean_last()
            graphs = self.graphs
            if graphs is not None and swapped_blocks(model):
                # a swap installed after start (learned limit / OOM fallback): a graph would bake in the addresses
                # of per-call weight copies (and capture the swap's side-stream copies)
                graphs.disable("block swap moves weights between calls")
                self.sess.graphs = graphs = None
                self.info.update(cuda_graphs=False, cuda_graphs_reason="block swap moves weights between calls")
            if graphs is None or kind == "recache":     # a re-cache is rare and of its own shape: never graphed
                return self._forward(inp, start_frame, step, want_output, lean)
            key = (kind, want_output, lean, tuple(xt.shape), xt.dtype, step, self.parts)
            # the denoise and refresh calls of one chunk share a warm key: a refresh (once per chunk) is graphed at its
            # first call once its chunk's denoise calls warmed up the same shapes
            warm = (tuple(xt.shape), xt.dtype, step, self.parts)
            return graphs.run(key, inp, lambda static: self._forward(static, start_frame, step, want_output, lean),
                              warm_key=warm)

    # ------------------------------------------------------------------ end
    def on_oom(self) -> None:
        """After an out-of-memory error: drop graphs (weights may move now) and cached per-call objects."""
        g = self.sess.graphs
        if g is not None:
            g.disable("out of memory: running eagerly with block swap")
            self.sess.graphs = None
        self.sess.calls.clear()

    def warm(self, req) -> None:
        """Before the first chunk: the operator store's attention choice for every (query, key) length the run
        will meet, and where that is FlashAttention 3 whether the cache's write goes inside its kernel, so no timed
        chunk pays for measuring (the choices and the time go into the report); the speed
        verdict of int8 attention at the run's shapes (fp8 attention and fp8 linear are judged at start)."""
        with use_ops(parse_ops(self.options.ops)[1]):
            if seq_parallel_of(self.model) is not None or not self.cross:
                return
            t0 = time.perf_counter()
            _, text_len, heads, head_dim = self.cross[0][0].shape
            shapes = plan_shapes(self.frame_tokens, req.chunks, req.kv_window, req.num_frames, int(text_len))
            with spent("attention_plans"):
                chosen = warm_plans(shapes, req.batch, int(heads), int(head_dim), self.model.compute_dtype,
                                    self.model.device, self.parts.attention)
                appends = cached_attention.warm(plan_shapes(self.frame_tokens, req.chunks, req.kv_window,
                                                            req.num_frames), req.batch, int(heads), int(head_dim),
                                                self.model.compute_dtype, self.model.device, self.parts.attention)
            if appends:
                self.info["kv_append_in_kernel"] = appends
            if chosen:
                self.info["attention_kernels"] = {f"q{q}/k{k}": name for (q, k), name in chosen}
                self.info["attention_plans_s"] = round(time.perf_counter() - t0, 4)
            if self.parts.attention in APPROXIMATE and shapes and \
                    SPEED_FIELDS[self.parts.attention] not in self.info:          # not judged at start
                self._judge_attention(self.parts.attention, max(shapes, key=lambda s: s[0] * s[1]), req.batch,
                                      int(heads), int(head_dim))

    def _judge_attention(self, mode: str, shape, batch: int, heads: int, head_dim: int) -> None:
        """int8 / fp8 attention is opt-in for speed: where it is measured slower than exact attention at the run's
        largest call on this GPU, the run says so before its first chunk and stays exact (unless ``keep_slower``)."""
        slower, why = attention_speed(mode, shape[0], shape[1], batch, heads, head_dim, self.model.compute_dtype,
                                      self.model.device)
        self.info[SPEED_FIELDS[mode]] = {"slower": slower, "why": why}
        if slower:
            self._slower(f"{mode} attention", "exact attention", why, lambda: self._exact_attention(mode))

    def _exact_attention(self, mode: str) -> None:
        self.parts = self.parts._replace(attention=auto_request(self.options.switched_off)
                                         if graphs_device(self.model.device) else "sdpa")
        self.kv.use_fp8(False)
        self.info["attention"] = f"exact ({mode} measured slower)"

    def _judge_fp8(self, verdict: tuple) -> None:
        """fp8 linear is opt-in for speed: where a block's linear layers are measured slower in fp8 than exact at the
        run's largest call on this GPU, the run says so before its first chunk and stays exact (unless
        ``keep_slower``); where only some layer groups are slower, those run exact. ``verdict``: (slower, why,
        faster groups) judged at start, before any fp8 copy was made (``FastRunner._linear`` made the copies of the
        faster groups only, or none)."""
        slower, why, faster = verdict
        self.info["fp8_speed"] = {"slower": slower, "why": why,
                                  "faster_groups": None if faster is None else sorted(faster)}
        if slower:
            self._slower("fp8 linear", "exact linear layers", why,
                         lambda: self.info.update(linear="exact (fp8 measured slower)", linear_path=None))

    def _slower(self, mode: str, exact: str, why: str, use_exact) -> None:
        """One line for an opt-in mode measured slower than ``exact``: kept (``keep_slower``) or replaced by it."""
        if self.options.keep_slower:
            line = f"{mode} is slower than {exact} here ({why}); kept because keep_slower is set"
        else:
            use_exact()
            line = (f"{mode} is slower than {exact} on this GPU ({why}): this run uses {exact}; --keep-slower "
                    f"(CLI) keeps {mode.split()[0]} anyway")
        if line not in _SAID:       # once per process: every later run of the same shape reads the same verdict
            _SAID.add(line)
            log.warning("wan_accel: %s", line)
        self.info.setdefault("notes", []).append(line)

    def finish(self, completed: bool = True) -> dict:
        """End of the run (also after an error or interrupt): ends compile warm-up after a completed run, frees
        the buffers unless they are kept; returns the run's report."""
        if completed:
            end_compile_warmup(self.model)
        g = self.sess.graphs
        report = dict(self.info, graphs=g.report() if g is not None else None)
        if not self.options.keep_buffers and not self.sess.external:
            self.runner.release()
        return report
