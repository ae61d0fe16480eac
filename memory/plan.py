"""The VRAM plan: dtype, blocks resident vs swapped, prefetch, KV window, VAE chunk and attention backend, each
with its reason in words. Estimates come from ``estimate``; limits learned on this machine (limit cache,
namespace ``memory``) override them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..cache.json_out import to_json
from .estimate import (Workload, activation_bytes, attended_tokens, block_compute_ms, kv_cache_bytes,
                       query_tokens, transfer_ms, vae_decode_bytes, video_frames_for)
from .limits import dit_limit_key, learned_size, vae_kind as vae_kind_of, vae_limit_key
from .pinned import MiB, plan_pinned
from .system import HOST_RAM_HEADROOM, GiB, PlainFields, SystemInfo, detect_system, gib
from .weights import ModelWeights, TensorInfo, keeps_fp8, weights_from_tensors

VAE_OVERLAP = 2                 # latent frames shared by two VAE decode chunks
CLIP_TOKENS = 257


@dataclass
class MemoryPlan(PlainFields):
    fits: bool
    device: str
    dtype: str                      # weights and compute: 'bfloat16' | 'float16' | 'float32'
    attention_backend: str          # 'flash' | 'efficient' | 'math' | 'cpu'
    blocks_total: int
    blocks_to_swap: int             # the last N blocks live on the host
    prefetch: int                   # swapped blocks copied ahead of use
    pinned_blocks: int              # swapped blocks in pinned memory (the rest pageable)
    offload_embeddings: bool
    kv_window: int                  # latent frames in the self-attention KV cache; -1 = global (whole video)
    vae_chunk_frames: int           # latent frames per VAE decode chunk
    vae_overlap: int
    budget_bytes: int
    estimated_peak_bytes: int
    pinned_bytes: int = 0           # page-locked host RAM the swap takes, as the pinned allocator counts it
    breakdown: dict = field(default_factory=dict)
    reasons: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    learned: dict = field(default_factory=dict)
    system: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)
    workload: dict = field(default_factory=dict)
    alternatives: list = field(default_factory=list)   # settings that make it fit, each with its estimate (GPU plans)

    @property
    def blocks_resident(self) -> int:
        return self.blocks_total - self.blocks_to_swap

    def to_json(self, **kw) -> str:
        return to_json(self.to_dict(), **{"sort_keys": True, "indent": None, **kw})

    def swap_settings(self):
        """The block-swap settings of this plan (memory.block_swap.SwapSettings)."""
        from .block_swap import SwapSettings

        return SwapSettings(blocks_to_swap=self.blocks_to_swap, prefetch=self.prefetch,
                            offload_embeddings=self.offload_embeddings)

    def summary(self) -> str:
        w, m = self.workload, self.model
        kv = "global (whole video)" if self.kv_window < 0 else f"{self.kv_window} latent frames"
        lines = [
            f"VRAM plan: {m.get('source', '?')} [{m.get('signature', '?')}] at {w.get('width')}x{w.get('height')}, "
            f"{w.get('frames')} frames, batch {w.get('batch')}, {w.get('mode')} sampling",
            f"system: {SystemInfo.from_dict(self.system).describe()}" if self.system else "system: ?",
            ("fits: yes" if self.fits else "fits: NO") +
            f" (estimated peak {gib(self.estimated_peak_bytes)}, budget {gib(self.budget_bytes)})",
            f"dtype: {self.dtype} - {self.reasons.get('dtype', '')}",
            f"attention: {self.attention_backend} - {self.reasons.get('attention_backend', '')}",
            f"blocks: {self.blocks_to_swap} of {self.blocks_total} swapped ({self.blocks_resident} resident), "
            f"prefetch {self.prefetch} - {self.reasons.get('blocks_to_swap', '')}",
        ]
        if self.blocks_to_swap:
            lines.append(f"pinned host RAM: {gib(self.pinned_bytes)} ({self.pinned_blocks} of {self.blocks_to_swap} "
                         "swapped blocks)")
        for k in ("prefetch", "pinned_blocks", "offload_embeddings"):
            if self.reasons.get(k):
                lines.append(f"{k.replace('_', ' ')}: {self.reasons[k]}")
        lines.append(f"KV window: {kv} - {self.reasons.get('kv_window', '')}")
        lines.append(f"VAE decode: chunks of {self.vae_chunk_frames} latent frames, overlap {self.vae_overlap} - "
                     f"{self.reasons.get('vae_chunk_frames', '')}")
        lines.append("breakdown: " + ", ".join(f"{k} {gib(v)}" for k, v in self.breakdown.items()))
        if not self.fits and self.reasons.get("fits"):
            lines.append(f"what to change: {self.reasons['fits']}")
        lines += [f"note: {n}" for n in self.notes]
        if self.alternatives:
            lines.append("settings that fit (estimated; * recommended):")
            for a in self.alternatives:
                est = (f"peak {gib(a['estimated_peak_bytes'])}, {a['blocks_to_swap']} of {self.blocks_total} blocks "
                       f"swapped, KV window {a['kv_window']}" if a["fits"] else "does not fit")
                lines.append(f"  {'*' if a['recommended'] else '-'} {a['option']}: {est} - {a['why']}")
        return "\n".join(lines)


# ---------------------------------------------------------------------- alternatives
FP8_STORAGE = "F8_E4M3"
# the order of preference on equal speed (blocks swapped): what changes the output least first
ALTERNATIVE_ORDER = ("block swap", "fp8 weights", "shorter KV window")


def fp8_weights(weights: ModelWeights) -> ModelWeights:
    """The same model with every block linear weight stored as fp8 (the loader keeps those at 1 byte per element;
    norms, biases, embeddings and the head stay at the run's dtype)."""
    tensors = {n: (TensorInfo(n, FP8_STORAGE, t.shape, t.numel) if t.is_float and keeps_fp8(n, FP8_STORAGE, t.shape)
                   else t) for n, t in weights.tensors.items()}
    return weights_from_tensors(tensors, source=f"{weights.source} as fp8", config=weights.config or None)


def _option(kind: str, name: str, plan: "MemoryPlan", how: str) -> dict:
    return {"kind": kind, "option": name, "fits": plan.fits, "estimated_peak_bytes": plan.estimated_peak_bytes,
            "blocks_to_swap": plan.blocks_to_swap, "kv_window": plan.kv_window, "dtype": plan.dtype,
            "weights_bytes": plan.breakdown.get("weights_resident", 0) + plan.breakdown.get("swap_buffers", 0),
            "how": how, "recommended": False, "why": ""}


def plan_alternatives(base: "MemoryPlan", weights: ModelWeights, workload: Workload, system: SystemInfo,
                      **kw) -> list:
    """The settings that make a GPU plan fit, each with its own estimate: the weights as planned with block swap,
    fp8 block weights (when they are not fp8 already), and a shorter KV window (causal sampling with block swap: the
    largest that fits without it, else the smallest, down to two context frames beyond the chunk, when it swaps
    fewer blocks). The recommended one swaps the fewest blocks (streaming costs time every forward); on a
    tie, the one that changes the output least (block swap: none; fp8: weight rounding; a shorter window: what the
    model attends to). Any model config: nothing here is model-specific."""
    swap = f"{base.dtype} weights" + (" + block swap" if base.blocks_to_swap else ", all resident")
    options = [_option("block swap", swap, base, "the weights as planned" + (
        "; the last blocks stream from host RAM (output unchanged, slower per swapped block)"
        if base.blocks_to_swap else " (output unchanged)"))]
    if not any(t.dtype == FP8_STORAGE and keeps_fp8(n, t.dtype, t.shape) for n, t in weights.tensors.items()):
        fp8 = make_plan(fp8_weights(weights), workload, system, alternatives=False, **kw)
        options.append(_option("fp8 weights", "fp8 weights" + (" + block swap" if fp8.blocks_to_swap else ""), fp8,
                               "load an fp8 (float8_e4m3fn) checkpoint: block linear weights "
                                                   "at 1 byte; output within fp8 rounding of the weights"))
    if workload.mode == "causal" and base.blocks_to_swap:
        fpb, full = workload.frames_per_block, workload.cache_frames()
        start = full if base.kv_window < 0 else base.kv_window
        smallest = max(fpb + 2, weights.sink_size + fpb + 1)     # two frames of context beyond the chunk
        shorter = None
        for w in range(min(start, full) - 1, smallest - 1, -1):
            shorter = make_plan(weights, workload, system, alternatives=False, **{**kw, "kv_window": w})
            if shorter.fits and shorter.blocks_to_swap == 0:
                break
        if shorter is not None and shorter.blocks_to_swap < base.blocks_to_swap:
            w = shorter.kv_window
            options.append(_option("shorter KV window", f"KV window {w}" + (
                " + block swap" if shorter.blocks_to_swap else ""), shorter, f"--kv-window {w}: fewer frames "
                "attended (outputs differ unless the model was made for it)"))
    fitting = [o for o in options if o["fits"]]
    if fitting:
        best = min(fitting, key=lambda o: (o["blocks_to_swap"], ALTERNATIVE_ORDER.index(o["kind"])))
        best["recommended"] = True
    for o in options:
        o["why"] = ("recommended: " if o["recommended"] else "") + o["how"]
    return options


# ---------------------------------------------------------------------- decisions
def _choose_dtype(weights: ModelWeights, system: SystemInfo) -> tuple[str, int, str]:
    stored = weights.storage_dtype
    if not system.has_gpu:
        return "float32", 4, "no CUDA device: the CPU computes in float32"
    if stored == "F16":
        return "float16", 2, "the checkpoint stores float16; kept as is"
    if system.bf16:
        why = {"BF16": "the checkpoint stores bfloat16; kept as is",
               "F32": f"the checkpoint stores float32; bfloat16 halves the weights (SM {system.capability_str} "
                      "has bf16)"}.get(stored, f"the checkpoint stores {stored}; weights are held in bfloat16")
        return "bfloat16", 2, why
    return "float16", 2, (f"SM {system.capability_str} has no bf16: float16 (the checkpoint stores {stored}); "
                          "bf16-trained weights may lose a little precision")


def _choose_backend(system: SystemInfo) -> tuple[str, str]:
    if not system.has_gpu:
        return "cpu", "no CUDA device: torch SDPA on the CPU"
    if system.capability is not None and tuple(system.capability) >= (8, 0):
        return "flash", f"SM {system.capability_str}: flash attention through SDPA (memory linear in tokens)"
    return "efficient", (f"SM {system.capability_str} has no flash attention: memory-efficient SDPA "
                         "(memory linear in tokens)")


def make_plan(weights: ModelWeights, workload: Workload, system: SystemInfo | None = None, *,
              reserve_bytes: int = 0, kv_window: int | None = None, cache=None, vae_kind: str | None = None,
              alternatives: bool = True, reserve_name: str = "reserve") -> MemoryPlan:
    """Plan a generation. ``kv_window``: None = the model's own (its local_attn_size, else global), -1 = global,
    N = N latent frames. ``cache``: a LimitCache whose learned limits override the estimates (None: the estimates
    alone). ``vae_kind``: the VAE whose learned decode limit applies ('wan2.1', 'wan2.2'; None: from the model's
    latent channels). ``alternatives``: on a GPU, also list the settings that make it fit (``plan_alternatives``).
    ValueError naming the input ``reserve_name`` when ``reserve_bytes`` is negative or leaves nothing to plan with
    (a zero or negative budget)."""
    system = system or detect_system()
    reasons, notes, learned = {}, list(workload.notes()), {}
    dtype, elem, reasons["dtype"] = _choose_dtype(weights, system)
    backend, reasons["attention_backend"] = _choose_backend(system)
    gpu = system.has_gpu
    blocks = weights.block_bytes_at(elem)
    L, max_block = len(blocks), max(blocks)
    other, emb = weights.other_bytes_at(elem), weights.embedding_bytes_at(elem)
    patch, causal, B = weights.patch_size, workload.mode == "causal", workload.batch
    tpf, lq = workload.tokens_per_frame(patch), query_tokens(workload, patch)
    text_tokens = weights.text_len + (CLIP_TOKENS if weights.model_type == "i2v" else 0)
    fpb, full_frames = workload.frames_per_block, workload.cache_frames()

    # the memory a plan counts: the GPU's free VRAM, or the host's available RAM without a GPU; the headroom kept of it
    have, margin = ((system.free_vram, max(512 * MiB, int(0.04 * system.total_vram))) if gpu else
                    (system.host_ram_available, HOST_RAM_HEADROOM))
    name = reserve_name
    if reserve_bytes < 0:
        raise ValueError(f"{name} must be 0 or more, got {reserve_bytes / GiB:g} GiB")
    if reserve_bytes and reserve_bytes + margin >= have:    # nothing reserved: a short machine is the plan's to say
        what = "free VRAM" if gpu else "available RAM"
        most = max(0.0, (have - margin) / GiB)
        raise ValueError(f"{name} {reserve_bytes / GiB:g} GiB leaves nothing to plan with: the {what} is {gib(have)}, "
                         f"of which {gib(margin)} is kept as headroom; use {name} below {most:.2f}" + (
                             " (0 for none)" if most else f" (0: there is no {what} beyond the headroom)"))
    budget = have - reserve_bytes - margin

    def frames_of(window: int) -> int:
        return full_frames if window < 0 else min(window, full_frames)

    def needs(n_swap: int, window: int, off_emb: bool) -> dict:
        return {
            "weights_resident": sum(blocks[:L - n_swap]) + other - (emb if off_emb else 0),
            "swap_buffers": (min(n_swap, 2) * max_block if n_swap else 0) + (emb if off_emb else 0),
            "kv_cache": kv_cache_bytes(L, frames_of(window) * tpf, weights.dim, elem, B) if causal else 0,
            "cross_attn_cache": kv_cache_bytes(L, text_tokens, weights.dim, elem, B) if causal else 0,
            "activations": activation_bytes(lq, weights.dim, weights.ffn_dim, weights.num_heads, elem, B),
        }

    def min_swap(window: int, off_emb: bool) -> int | None:
        for n in (range(L + 1) if gpu else (0,)):
            if sum(needs(n, window, off_emb).values()) <= budget:
                return n
        return None

    requested = kv_window if kv_window is not None else (weights.local_attn_size if weights.local_attn_size > 0 else -1)
    if not causal:
        requested = -1
    window, off_emb = requested, False
    n = min_swap(window, off_emb)
    if n is None and gpu and emb:
        off_emb = True
        n = min_swap(window, off_emb)
    min_window = max(2 * fpb, weights.sink_size + fpb)      # the smallest window: two chunks, or the sink and one
    if n is None and causal:
        w = frames_of(requested) - fpb
        while w >= min_window:
            n = min_swap(w, off_emb)
            if n is not None:
                window = w
                break
            w -= fpb
    fits = n is not None
    if not fits:
        window = min(min_window, full_frames) if causal else -1
        n = L if gpu else 0
    if window >= full_frames:
        window = -1     # the window holds the whole video: that is a global cache

    # limits learned on this machine
    key = dit_limit_key(weights.config or weights, dtype, workload.width, workload.height, workload.frames,
                        workload.mode, B)
    resident_ok = learned_size(cache, key) if gpu else None
    if resident_ok is not None and L - resident_ok > n:
        learned["dit"] = {"key": key, "resident_blocks": resident_ok}
        reasons["blocks_to_swap"] = (f"learned on this machine: only {resident_ok} resident blocks ran without "
                                     f"running out of memory at this size (the estimate allowed {L - n})")
        n = L - resident_ok

    need = needs(n, window, off_emb)
    peak = sum(need.values())
    kv_now = need["kv_cache"]
    if "blocks_to_swap" not in reasons:
        if not gpu:
            reasons["blocks_to_swap"] = "no CUDA device: every block runs from host memory, nothing to swap"
        elif not fits:
            reasons["blocks_to_swap"] = "every block swapped (the least VRAM block swap can reach); still too large"
        elif n == 0:
            reasons["blocks_to_swap"] = f"all {L} blocks ({gib(sum(blocks))}) fit beside the caches and activations"
        else:
            reasons["blocks_to_swap"] = (f"the weights need {gib(sum(blocks) + other)}; keeping {L - n} blocks resident "
                                         f"and streaming {n} ({gib(sum(blocks[L - n:]))}) keeps the peak at {gib(peak)} "
                                         f"within {gib(budget)}")
    if not fits:
        reasons["fits"] = (f"even with every block swapped{', embeddings offloaded' if off_emb else ''} and the "
                           f"smallest KV window the estimate is {gib(peak)} for a budget of {gib(budget)}: lower the "
                           f"resolution or frame count, lower 'reserve', or free {'VRAM' if gpu else 'RAM'} used by "
                           "other programs" + ("; fp8 weights (SM 8.9+) would also help" if gpu and system.fp8 else ""))

    # prefetch and pinning
    prefetch = 1 if gpu and n > 0 else 0
    pinned_blocks = 0
    swapped = sum(blocks[L - n:]) + (emb if off_emb else 0)
    pinned_total = 0
    if gpu and n > 0:
        # the swap packs its tensors into power-of-two pinned slabs (memory.pinned) within the pinned budget,
        # counted as the allocator counts them
        pinned_blocks, pinned_total = plan_pinned(
            [weights.block_tensor_bytes_at(i, elem) or [blocks[i]] for i in range(L - n, L)], system.pinned_budget)
        lk = attended_tokens(workload, frames_of(window), patch)
        copy = transfer_ms(max_block, pinned_blocks == n)
        comp = block_compute_ms(max(weights.block_float_numel), lq, lk, weights.dim, system.capability, B)
        extra = n * max(0.0, copy - comp)
        reasons["prefetch"] = (f"1 block ahead: the copy of the next swapped block (~{copy:.1f} ms) overlaps the "
                               f"current block's compute (~{comp:.1f} ms); expect ~{extra:.0f} ms more per forward "
                               "than fully resident" if extra >= 1 else
                               f"1 block ahead: the copy (~{copy:.1f} ms) hides behind compute (~{comp:.1f} ms)")
        reasons["pinned_blocks"] = ((f"all {n} swapped blocks pinned ({gib(swapped)} of weights take "
                                     f"{gib(pinned_total)} of page-locked RAM)") if pinned_blocks == n else
                                    f"{pinned_blocks} of {n} swapped blocks pinned ({gib(pinned_total)} page-locked of "
                                    f"the pinned budget {gib(system.pinned_budget)}); the rest copy from pageable "
                                    "memory, slower")
        if swapped > system.host_ram_available:
            fits = False
            reasons["fits"] = (f"the swapped weights need {gib(swapped)} of host RAM but only "
                               f"{gib(system.host_ram_available)} is available; add RAM or use a smaller model")
    if off_emb:
        reasons["offload_embeddings"] = (f"text/image embeddings ({gib(emb)}) live on the host and are copied in "
                                         "when used, to make room")

    # KV window
    if not causal:
        reasons["kv_window"] = "full-sequence sampling keeps no KV cache"
    elif window < 0:
        reasons["kv_window"] = f"global cache over {full_frames} latent frames ({gib(kv_now)}) fits"
        if full_frames > 21:
            notes.append(f"{workload.latent_frames} latent frames exceed the 21 that Self-Forcing / CausVid "
                         "checkpoints were trained on; a rolling KV window (local_attn_size) may be needed")
    elif requested > 0 and window == frames_of(requested):
        whose = "the requested" if kv_window is not None else "the model's"
        reasons["kv_window"] = f"{whose} rolling window of {window} latent frames ({gib(kv_now)})"
    else:
        full_kv = kv_cache_bytes(L, full_frames * tpf, weights.dim, elem, B)
        reasons["kv_window"] = (f"a global cache needs {gib(full_kv)}, which does not fit even with every block "
                                f"swapped; a rolling window of {window} latent frames ({gib(kv_now)}) does. Outputs "
                                "differ from global attention unless the model was trained with such a window")

    # VAE decode chunk
    t_lat, lat_h, lat_w = workload.latent_frames, workload.latent_h, workload.latent_w
    v_elem = 2 if gpu else 4
    floor = max(1, min(t_lat, VAE_OVERLAP + 1)) if t_lat > 1 else 1

    def best_chunk(vbudget: int) -> int | None:
        for c in range(t_lat, floor - 1, -1):
            if vae_decode_bytes(c, lat_h, lat_w, v_elem, B) <= vbudget:
                return c
        return None

    vbudget = budget - (need["weights_resident"] if gpu else 0)
    chunk = best_chunk(vbudget)
    where = "beside the resident DiT weights"
    if chunk is None and gpu:
        vbudget = budget
        chunk, where = best_chunk(vbudget), "once the DiT weights are unloaded (ComfyUI does this when memory is short)"
    if chunk is None:
        chunk = floor
        reason = (f"even {floor} latent frames per chunk is estimated at {gib(vae_decode_bytes(floor, lat_h, lat_w, v_elem, B))} "
                  f"(budget {gib(vbudget)}); decoding starts there and learns from any out-of-memory error")
    elif chunk >= t_lat:
        reason = (f"the whole video ({t_lat} latent frames -> {video_frames_for(t_lat)} frames) decodes in one go "
                  f"{where} (estimated {gib(vae_decode_bytes(chunk, lat_h, lat_w, v_elem, B))})")
    else:
        reason = (f"{chunk} latent frames per chunk (estimated {gib(vae_decode_bytes(chunk, lat_h, lat_w, v_elem, B))}) "
                  f"fit {where}; {t_lat} would need {gib(vae_decode_bytes(t_lat, lat_h, lat_w, v_elem, B))}")
    vkey = vae_limit_key(vae_kind or vae_kind_of(weights.out_dim), B, lat_h, lat_w)
    vlearned = learned_size(cache, vkey)
    if vlearned is not None and vlearned < chunk:
        learned["vae"] = {"key": vkey, "chunk": vlearned}
        reason = f"learned on this machine: {vlearned} latent frames per chunk decoded without running out of memory"
        chunk = max(floor, vlearned)
    reasons["vae_chunk_frames"] = reason
    overlap = 0 if chunk >= t_lat else min(VAE_OVERLAP, chunk - 1)

    plan = MemoryPlan(
        fits=fits, device=system.device, dtype=dtype, attention_backend=backend, blocks_total=L, blocks_to_swap=n,
        prefetch=prefetch, pinned_blocks=pinned_blocks, pinned_bytes=int(pinned_total), offload_embeddings=off_emb, kv_window=window,
        vae_chunk_frames=chunk, vae_overlap=overlap, budget_bytes=int(budget), estimated_peak_bytes=int(peak),
        breakdown={k: int(v) for k, v in need.items()}, reasons=reasons, notes=notes, learned=learned,
        system=system.to_dict(), model={k: v for k, v in weights.summary().items() if k != "block_bytes"},
        workload=workload.to_dict())
    if alternatives and gpu:
        plan.alternatives = plan_alternatives(plan, weights, workload, system, reserve_bytes=reserve_bytes,
                                              kv_window=kv_window, cache=cache, vae_kind=vae_kind)
    return plan
