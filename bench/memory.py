"""``python -m wan_accel bench offload``: DiT forward time and peak VRAM with 0, half and all-but-one blocks
swapped, side by side, for a Wan-shaped block stack (random weights, realistic token count). This module imports
neither ComfyUI nor the command-line layer.

Without a GPU it says so and runs a tiny functional pass on the CPU (outputs identical with and without swap).
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from ..cache.json_out import print_json
from ..memory.block_swap import SwapSettings, apply_block_swap
from . import print_columns
from .options import OFFLOAD_SHAPES as SHAPES, offload as add_arguments  # noqa: F401  (defined without torch)


def _stack(n, dim, ffn, heads, device, dtype):
    """A stack of ``n`` Wan-shaped blocks built on ``device`` in ``dtype`` (seed 0)."""
    class BenchBlock(nn.Module):
        """Wan-shaped block: modulated self-attention, cross-attention over 512 text tokens, GELU FFN."""

        def __init__(self, dim, ffn, heads):
            super().__init__()
            self.heads = heads
            self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
            self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
            self.norm3 = nn.LayerNorm(dim)
            self.self_qkv = nn.ModuleList(nn.Linear(dim, dim) for _ in range(4))
            self.cross_qkv = nn.ModuleList(nn.Linear(dim, dim) for _ in range(4))
            self.ffn = nn.Sequential(nn.Linear(dim, ffn), nn.GELU(approximate="tanh"), nn.Linear(ffn, dim))
            self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim ** 0.5)

        def _attn(self, lin, x, kv_src, extra_kv=None):
            b, n, d = x.shape
            h = self.heads
            q = lin[0](x).view(b, n, h, -1).transpose(1, 2)
            k = lin[1](kv_src).view(b, kv_src.shape[1], h, -1).transpose(1, 2)
            v = lin[2](kv_src).view(b, kv_src.shape[1], h, -1).transpose(1, 2)
            if extra_kv is not None:
                k, v = torch.cat([extra_kv, k], 2), torch.cat([extra_kv, v], 2)
            o = F.scaled_dot_product_attention(q, k, v)
            return lin[3](o.transpose(1, 2).reshape(b, n, d))

        def forward(self, x, ctx, cached):
            m = self.modulation.chunk(6, dim=1)
            y = self.norm1(x) * (1 + m[1]) + m[0]
            x = x + self._attn(self.self_qkv, y, y, cached) * m[2]
            x = x + self._attn(self.cross_qkv, self.norm3(x), ctx)
            y = self.norm2(x) * (1 + m[4]) + m[3]
            return x + self.ffn(y) * m[5]

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            with torch.device(device):   # built block by block on the device: no full fp32 copy anywhere
                self.blocks = nn.ModuleList(BenchBlock(dim, ffn, heads).to(dtype) for _ in range(n))

        def forward(self, x, ctx, cached):
            for b in self.blocks:
                x = b(x, ctx, cached)
            return x

    torch.manual_seed(0)
    return Stack().eval()


def _cpu_pass(args) -> int:
    print("bench offload: a CUDA GPU is required for timings and peak VRAM; running a tiny functional pass on "
          "the CPU instead (same transfer code path, synchronous copies)", file=sys.stderr if args.json else sys.stdout)
    stack = _stack(4, 64, 128, 4, "cpu", torch.float32)
    x, ctx, cached = torch.randn(1, 24, 64), torch.randn(1, 16, 64), torch.randn(1, 4, 8, 16)
    with torch.no_grad():
        ref = stack(x, ctx, cached)
        rows = []
        for n in (0, 2, 3):
            swap = apply_block_swap(stack, SwapSettings(n, 1), device="cpu")
            out = stack(x, ctx, cached)
            rows.append({"blocks_swapped": n, "identical": bool(torch.equal(out, ref)), "copies": swap.stats.copies})
            swap.remove()
    ok = all(r["identical"] for r in rows)
    if args.json:
        print_json({"device": "cpu", "functional_pass": ok, "rows": rows}, sort_keys=True)
    else:
        cols = ["blocks_swapped", "identical", "copies"]
        print_columns(cols, [[r[c] for c in cols] for r in rows], rule=True)
    return 0 if ok else 1


def _time_forward(stack, inputs, repeats, warmup):
    with torch.no_grad():
        for _ in range(warmup):
            stack(*inputs)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(repeats):
            start.record()
            stack(*inputs)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2], torch.cuda.max_memory_allocated()


def run(args) -> int:
    if not torch.cuda.is_available():
        return _cpu_pass(args)
    dim, ffn, heads, layers = SHAPES[args.model]
    n = args.blocks or layers
    device, dtype = torch.device("cuda"), torch.bfloat16
    tokens = args.frames_per_block * (args.height // 16) * (args.width // 16)
    cached_tokens = max(0, (args.kv_frames - args.frames_per_block)) * (args.height // 16) * (args.width // 16)
    stack = _stack(n, dim, ffn, heads, device, dtype)
    x = torch.randn(1, tokens, dim, device=device, dtype=dtype)
    ctx = torch.randn(1, 512, dim, device=device, dtype=dtype)
    cached = torch.randn(1, heads, cached_tokens, dim // heads, device=device, dtype=dtype) if cached_tokens else None
    rows, base = [], None
    for swapped in sorted({0, n // 2, n - 1}):
        swap = apply_block_swap(stack, SwapSettings(swapped, 1), device=device) if swapped else None
        ms, peak = _time_forward(stack, (x, ctx, cached), args.repeats, args.warmup)
        base = ms if base is None else base
        rows.append({"blocks_swapped": swapped, "blocks_resident": n - swapped, "forward_ms": round(ms, 2),
                     "ratio_to_resident": round(ms / base, 3), "peak_vram_gib": round(peak / 1024 ** 3, 3),
                     "pinned_gib": round(swap.stats.pinned_bytes / 1024 ** 3, 3) if swap else 0.0})
        if swap is not None:
            swap.remove()
    if args.json:
        print_json({"device": torch.cuda.get_device_name(), "model": args.model, "tokens": tokens,
                    "keys": cached_tokens + tokens, "rows": rows}, sort_keys=True)
        return 0
    print(f"bench offload: {args.model} block shape (dim {dim}, ffn {ffn}, {n} blocks), {tokens} query tokens, "
          f"{cached_tokens + tokens} keys, bf16, {torch.cuda.get_device_name()}")
    cols = ["blocks_swapped", "blocks_resident", "forward_ms", "ratio_to_resident", "peak_vram_gib", "pinned_gib"]
    print_columns(cols, [[r[c] for c in cols] for r in rows], rule=True)
    return 0
