"""The optimized forward of causal chunks: static buffers, precomputed inputs, CUDA graphs, compile.

``get_runner(model)`` returns the model's runner (kept on the model, outside its state dict). ``runner.start``
prepares one sampling run and returns a ``Run``:

* static, preallocated KV cache (host-int bookkeeping, ``KVCache.plan``; slots written with a device index
  tensor cached per write plan), kept between runs of the same geometry so CUDA graphs stay valid;
* cross-attention K/V computed once per prompt into static buffers;
* time embeddings (sinusoid, e, e0) once per distinct timestep; RoPE cos/sin built on the device per chunk start
  from per-axis tables (uploaded once) and cached;
* one q/k/v GEMM (``fast_block.ensure_fused_qkv``), the fused kernels, regional torch.compile
  (``compile.compile_model``, scope 'blocks') and the attention backend resolved once;
* refresh passes that skip the last block's unused work and the head.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from ..model import fast_block
from ..model.attention import explain_backend
from .cuda_graphs import CudaGraphBackend, GraphManager, recorded_failure
from ..model.kv_cache import KVCache
from ..model.rope import MAX_POSITIONS, _axis_angles, axis_pairs

log = logging.getLogger("wan_accel")
RUNNER_ATTR = "_wan_accel_fast"
CUDA_GRAPH_MODES = ("auto", "off")
LATENT_DTYPES = ("float32", "stream")


@dataclass(frozen=True)
class FastOptions:
    """Switches of the optimized path (all on by default; each keeps the results within rounding).

    attention:         None: the model's own setting (the loader's); else auto | sdpa | flash_attn | fa3 | fa2.
    fused_qkv:         one q/k/v GEMM over a concatenated weight.
    fused_kernels:     the fused Triton kernels (LayerNorm+modulate, RMSNorm+RoPE, gated residual) where Triton
                       runs (CUDA; the CPU under TRITON_INTERPRET=1); plain torch ops elsewhere.
    cuda_graphs:       'auto' (on CUDA, unless block swap, compile-mode graphs or action modules rule it out) | 'off'.
    lean_refresh:      in refresh passes compute only what the cache needs (last block: k/v only; no head).
    skip_last_refresh: skip the final chunk's refresh (its result is never used).
    compile:           CompileSettings (or dict) for regional torch.compile of the blocks; None: no compile.
    keep_buffers:      keep the static KV cache and graphs after a run (fast repeats; holds their memory).
    oom_retry:         'auto' (CUDA) | 'on' | 'off': on out-of-memory in a chunk, swap more blocks and redo it.
    max_graphs:        most graphs kept per session (beyond it, calls run eagerly).
    latent_dtype:      'float32': the sampler's latent state (xt, x0, flow->x0, re-noising) is kept in at least
                       float32 whatever the model dtype (elementwise work on latents only) | 'stream': in the
                       model's stream dtype, as the reference path and the original pipelines (bf16 under the
                       'self_forcing' policy).
    """
    attention: str | None = None
    fused_qkv: bool = True
    fused_kernels: bool = True
    cuda_graphs: str = "auto"
    lean_refresh: bool = True
    skip_last_refresh: bool = True
    compile: object = None
    keep_buffers: bool = True
    oom_retry: str = "auto"
    max_graphs: int = 64
    latent_dtype: str = "float32"

    def __post_init__(self):
        if self.cuda_graphs not in CUDA_GRAPH_MODES:
            raise ValueError(f"cuda_graphs must be one of {CUDA_GRAPH_MODES}, got {self.cuda_graphs!r}")
        if self.oom_retry not in ("auto", "on", "off"):
            raise ValueError(f"oom_retry must be 'auto', 'on' or 'off', got {self.oom_retry!r}")
        if self.latent_dtype not in LATENT_DTYPES:
            raise ValueError(f"latent_dtype must be one of {LATENT_DTYPES}, got {self.latent_dtype!r}")

    def latent_dtype_for(self, model) -> torch.dtype:
        """dtype of the sampler's latent state for ``model`` (float64 models keep float64)."""
        if self.latent_dtype == "stream":
            return model.stream_dtype
        return torch.promote_types(model.stream_dtype, torch.float32)

    def replace(self, **changes) -> "FastOptions":
        return dataclasses.replace(self, **changes)

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
    from ..kernels import use_triton
    return use_triton(torch.empty(0, device=device))


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


def swapped_blocks(model) -> set:
    from ..memory.block_swap import active_swap
    swap = active_swap(model)
    return {k for k in swap.units if isinstance(k, int)} if swap is not None else set()


def _rope_axes(head_dim: int, h: int, w: int, device, dtype):
    """Per-axis (cos, sin) tables: frames [MAX_POSITIONS, nf], height [h, nh], width [w, nw] (float64 angles)."""
    nf, nh, nw = axis_pairs(head_dim)
    out = []
    for n, count in ((nf, MAX_POSITIONS), (nh, h), (nw, w)):
        ang = _axis_angles(torch.arange(count, dtype=torch.float64), n)
        out.append((torch.cos(ang).to(device=device, dtype=dtype), torch.sin(ang).to(device=device, dtype=dtype)))
    return out


class _Session:
    """Static buffers of one geometry (batch, cache layout, grid, dtype): reused by later runs."""

    def __init__(self, key, model, kv: KVCache, grid_hw, device, tdtype, external: bool):
        self.key, self.kv, self.external = key, kv, external
        self.device, self.tdtype = device, tdtype
        self.axes = _rope_axes(model.config.head_dim, grid_hw[0], grid_hw[1], device, tdtype)
        self.grid_hw = grid_hw
        self.rope: dict = {}
        self.idx: dict = {}
        self.args: dict = {}
        self.cross: list | None = None
        self.graphs: GraphManager | None = None

    def rope_for(self, start_frame: int, frames: int):
        key = (start_frame, frames)
        hit = self.rope.get(key)
        if hit is None:
            if start_frame + frames > MAX_POSITIONS:
                raise ValueError(f"RoPE position out of range: frames [{start_frame}, {start_frame + frames}); the "
                                 f"model's rotary table has {MAX_POSITIONS} positions")
            h, w = self.grid_hw
            tabs = []
            for i in range(2):
                f_tab = self.axes[0][i][start_frame:start_frame + frames]
                parts = [f_tab[:, None, None, :].expand(frames, h, w, f_tab.shape[-1]),
                         self.axes[1][i][None, :, None, :].expand(frames, h, w, self.axes[1][i].shape[-1]),
                         self.axes[2][i][None, None, :, :].expand(frames, h, w, self.axes[2][i].shape[-1])]
                tabs.append(torch.cat(parts, dim=-1).reshape(frames * h * w, -1))
            if len(self.rope) >= 32:
                self.rope.clear()
            hit = self.rope[key] = (tabs[0], tabs[1])
        return hit

    def write_index(self, step) -> torch.Tensor:
        idx = self.idx.get(step.writes)
        if idx is None:
            parts = [torch.arange(d0, d1, device=self.device) for d0, d1, _s0, _s1 in
                     sorted(step.writes, key=lambda w: w[2])]
            idx = self.idx[step.writes] = torch.cat(parts) if len(parts) > 1 else parts[0]
        return idx


class FastRunner:
    def __init__(self, model):
        self.model = model
        self.session: _Session | None = None
        self.notes: list = []
        self.runs = 0

    # ------------------------------------------------------------------ preparation
    def _compile(self, options: FastOptions) -> str | None:
        from ..compile.apply import compile_handle, compile_model
        from ..compile.settings import coerce_settings
        if options.compile is None:
            return None
        s = coerce_settings(options.compile)
        if s.scope != "blocks":
            self.notes.append("compile scope set to 'blocks' (the optimized path calls the blocks directly)")
            s = s.replace(scope="blocks")
        handle = compile_handle(self.model)
        if handle is None or handle.settings != s:
            compile_model(self.model, s)
        return s.mode if s.backend == "inductor" else s.backend

    def _fuse(self, options: FastOptions, swapped: set) -> int:
        fused = 0
        for i, block in enumerate(self.model.blocks):
            sa = block.self_attn
            if options.fused_qkv and i not in swapped:
                fused += bool(fast_block.ensure_fused_qkv(sa))
            elif i in swapped:
                fast_block.drop_fused_qkv(sa)
        return fused

    def _graphs_reason(self, options, device, swapped, compile_mode, actions, cache) -> str | None:
        """Why CUDA graphs are not used for this run (None: they are)."""
        if options.cuda_graphs == "off":
            return "switched off"
        if not graphs_device(device):
            return "not a CUDA device"
        if swapped:
            return "block swap moves weights between calls"
        if compile_mode in ("reduce-overhead", "max-autotune", "cudagraphs"):
            return f"the compile settings ({compile_mode}) already use CUDA graphs"
        if actions is not None:
            return "action modules allocate their caches per run"
        from ..compile.warm_start import model_signature
        failed = recorded_failure(cache, model_signature(self.model))
        if failed:
            return f"capture failed earlier on this machine ({failed}); clear the 'sampler' namespace to retry"
        return None

    def _session(self, key, kv_factory, grid_hw, device, tdtype, external_kv) -> _Session:
        if external_kv is not None:         # the caller's cache: a session for this run only
            return _Session(("external",) + key, self.model, external_kv, grid_hw, device, tdtype, True)
        s = self.session
        if s is None or s.key != key:
            self.release()                  # free the old buffers before allocating new ones
            s = self.session = _Session(key, self.model, kv_factory(), grid_hw, device, tdtype, False)
        s.kv.reset()
        return s

    def _attach_graphs(self, sess: _Session, options: FastOptions, device, cache, compile_mode) -> None:
        """Keep the session's graphs while the weights (addresses) and compiled code are those they captured."""
        from ..compile.warm_start import model_signature
        identity = (self._weights_id(), compile_mode)
        g = sess.graphs
        if g is not None and g.enabled and getattr(g, "identity", None) == identity:
            return
        if g is not None:
            g.release()
        sess.graphs = GraphManager(CudaGraphBackend(device), cache=cache, signature=model_signature(self.model),
                                   max_graphs=options.max_graphs)
        sess.graphs.identity = identity

    def start(self, options: FastOptions, *, batch: int, num_frames: int, grid_hw, kv_window: int, sink: int,
              kv_cache=None, actions=None, cache=None) -> "Run":
        """Prepare a run over ``num_frames`` latent frames of a ``grid_hw`` token grid (after patching)."""
        model = self.model
        self.notes = []
        device = model.device
        compile_mode = self._compile(options)
        swapped = swapped_blocks(model)
        fused = self._fuse(options, swapped)
        requested = options.attention or getattr(model, "attn_backend", "auto")
        backend, backend_reason = explain_backend(requested, device, model.compute_dtype, model.config.head_dim)
        frame_tokens = grid_hw[0] * grid_hw[1]
        tdtype = torch.float64 if model.stream_dtype == torch.float64 else torch.float32
        rolling = 0 < kv_window < num_frames
        layout = (kv_window, sink) if rolling else (num_frames, 0)
        key = (batch, rolling) + layout + (tuple(grid_hw), str(device), model.compute_dtype, tdtype)
        sess = self._session(key, lambda: KVCache.for_model(model, batch, frame_tokens, num_frames, kv_window, sink),
                             grid_hw, device, tdtype, kv_cache)
        graph_reason = "the caller passed its own KV cache" if sess.external else \
            self._graphs_reason(options, device, swapped, compile_mode, actions, cache)
        if graph_reason is None:
            self._attach_graphs(sess, options, device, cache, compile_mode)
        elif sess.graphs is not None:
            sess.graphs.release()
            sess.graphs = None
        kernels = bool(options.fused_kernels) and kernels_run_on(device)
        flags = fast_block.FastFlags(backend, kernels, bool(options.fused_qkv))
        self.runs += 1
        return Run(self, options, sess, flags, actions, info={
            "path": "optimized", "attention": backend, "attention_reason": backend_reason,
            "fused_qkv_blocks": fused, "fused_kernels": kernels,
            "compile": compile_mode, "cuda_graphs": graph_reason is None,
            "cuda_graphs_reason": graph_reason or "on", "swapped_blocks": len(swapped), "notes": self.notes})

    def _weights_id(self) -> tuple:
        return tuple(p.data_ptr() for p in self.model.parameters())

    def release(self) -> bool:
        had = self.session is not None
        if had and self.session.graphs is not None:
            self.session.graphs.release()
        self.session = None
        return had


class Run:
    """One sampling run of the optimized path: precomputed inputs and the per-call forward."""

    def __init__(self, runner: FastRunner, options: FastOptions, sess: _Session, flags, actions, info: dict):
        self.runner, self.model, self.options, self.sess = runner, runner.model, options, sess
        self.flags, self.actions, self.info = flags, actions, info
        self.emb: dict = {}
        self.cross: list = []

    @property
    def kv(self) -> KVCache:
        return self.sess.kv

    @property
    def graphs(self) -> GraphManager | None:
        g = self.sess.graphs
        return g if g is not None and g.enabled else None

    # ------------------------------------------------------------------ per-run inputs
    def set_prompt(self, text, image=None) -> None:
        """Cross-attention K/V of every block for this prompt, into the session's static buffers."""
        fresh = [fast_block.cross_kv(block, text, image) for block in self.model.blocks]
        old = self.sess.cross
        if old is not None and len(old) == len(fresh) and all(
                len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(a, b))
                for a, b in zip(old, fresh)):
            for a, b in zip(old, fresh):
                for x, y in zip(a, b):
                    x.copy_(y)
        else:
            self.sess.cross = fresh
            self.sess.args.clear()
            if self.sess.graphs is not None:
                self.sess.graphs.release()      # captured graphs read the previous buffers
        self.cross = self.sess.cross

    def embed_timesteps(self, timesteps, batch: int) -> None:
        """(e, e0) of every distinct timestep of the run: [B, 1, dim] and [B, 1, 6, dim]."""
        dev = self.model.device
        for t in timesteps:
            if t not in self.emb:
                tt = torch.full((batch, 1), float(t), dtype=torch.float32, device=dev)
                self.emb[t] = self.model.time_embed(tt)

    # ------------------------------------------------------------------ forward
    def _layer_args(self, step) -> list:
        key = (step, self.flags)
        args = self.sess.args.get(key)
        if args is None:
            idx = self.sess.write_index(step)
            args = [fast_block.FastArgs(layer.k, layer.v, idx, step.read_len, cross, self.flags)
                    for layer, cross in zip(self.kv.layers, self.cross)]
            if len(self.sess.args) >= 256:
                self.sess.args.clear()
            self.sess.args[key] = args
        return args

    def _lean_last(self) -> bool:
        if not self.options.lean_refresh:
            return False
        last = len(self.model.blocks) - 1
        return getattr(self.model.blocks[last], "action_model", None) is None and \
            last not in swapped_blocks(self.model)

    def _forward(self, inp: dict, start_frame: int, step, want_output: bool, lean: bool):
        model = self.model
        x = inp["xt"] if inp.get("y") is None else torch.cat([inp["xt"], inp["y"]], dim=2)
        patches = model._patchify(x.transpose(1, 2))
        b, _, f, h, w = patches.shape
        tokens = patches.flatten(2).transpose(1, 2).to(model.stream_dtype).contiguous()
        if self.actions is not None:
            self.actions.begin(start_frame, f, b, h * w, tokens.device, model.compute_dtype)
        args, e0, rope = self._layer_args(step), inp["e0"], (inp["cos"], inp["sin"])
        blocks = model.blocks
        n_full = len(blocks) - 1 if (lean and not want_output) else len(blocks)
        for i in range(n_full):
            tokens = blocks[i](tokens, e0, None, rope, fast=args[i], actions=self.actions)
        if not want_output:
            if n_full < len(blocks):
                fast_block.kv_only(blocks[-1], tokens, e0, rope, args[-1])
            return None
        return model._unpatchify_chunk(model.head(tokens, inp["e"]), (f, h, w))

    def forward(self, kind: str, xt, t: float, start_frame: int, step, y=None, want_output: bool = True):
        """Flow [B, F, C, H, W] for latent chunk xt at timestep t (None when want_output is False)."""
        e, e0 = self.emb[t]
        cos, sin = self.sess.rope_for(start_frame, xt.shape[1])
        inp = {"xt": xt, "y": y, "e": e, "e0": e0, "cos": cos, "sin": sin}
        lean = self._lean_last()
        graphs = self.graphs
        if graphs is not None and swapped_blocks(self.model):
            # a swap installed after start (learned limit / OOM fallback): a graph would bake in the addresses
            # of per-call weight copies (and capture the swap's side-stream copies)
            graphs.disable("block swap moves weights between calls")
            self.sess.graphs = graphs = None
            self.info.update(cuda_graphs=False, cuda_graphs_reason="block swap moves weights between calls")
        if graphs is None:
            return self._forward(inp, start_frame, step, want_output, lean)
        key = (kind, want_output, lean, tuple(xt.shape), xt.dtype, step, self.flags)
        return graphs.run(key, inp, lambda static: self._forward(static, start_frame, step, want_output, lean))

    # ------------------------------------------------------------------ end
    def on_oom(self) -> None:
        """After an out-of-memory error: drop graphs (weights may move now) and cached per-call objects."""
        g = self.sess.graphs
        if g is not None:
            g.disable("out of memory: running eagerly with block swap")
            self.sess.graphs = None
        self.sess.args.clear()

    def finish(self, completed: bool = True) -> dict:
        """End of the run (also after an error or interrupt): ends compile warm-up after a completed run, frees
        the buffers unless they are kept; returns the run's report."""
        from ..compile.apply import end_warmup
        if completed:
            end_warmup(self.model)
        g = self.sess.graphs
        report = dict(self.info, graphs=g.report() if g is not None else None)
        if not self.options.keep_buffers and not self.sess.external:
            self.runner.release()
        return report
