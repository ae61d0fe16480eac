"""Run with ComfyUI's python inside its work tree (tests/e2e/test_streaming_decode.py does):

    python streaming_decode_check.py parity   -> JSON: max |streaming - VAE.decode| per (frames, chunk size), and for a
                                                 walk continued by another decoder (snapshot / restore)
    python streaming_decode_check.py tiny     -> JSON: the same for ComfyUI's tiny video decoder (TAEHV, taew2_1's
                                                 layout, random weights, loaded through comfy.sd.VAE as a file is)
    python streaming_decode_check.py write-tiny-vae PATH -> a random-weight taew2_1-layout .safetensors at PATH
    python streaming_decode_check.py memory N [S] -> JSON: peak RSS growth of a streaming decode of N latent frames of SxS (4)
    python streaming_decode_check.py write-vae PATH -> a small random-weight Wan 2.1 VAE .safetensors at PATH
    python streaming_decode_check.py timing [FRAMES SIDE] -> JSON: first-frame time, chunk latency, decode share
    python streaming_decode_check.py memory-whole N [S] -> the same for ComfyUI's whole VAE.decode (for contrast)

A random-weight Wan 2.1 VAE is built from ComfyUI's own class (comfy.ldm.wan.vae.WanVAE) at a small width and loaded
through ``comfy.sd.VAE`` like a real file; float32 on the CPU. The adapters (nodes/comfy/streaming_decode.py) are imported
from this checkout as ``wan_accel`` (``load_pack``), so the pack need not be installed in ComfyUI's environment.
"""
from __future__ import annotations

import importlib.util
import json
import resource
import sys
import time
from pathlib import Path

import torch

ADAPTER = Path(__file__).resolve().parents[2] / "nodes" / "streaming_decode.py"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from vae_decoders_check import load_pack  # noqa: E402


def adapter():
    """nodes/comfy/streaming_decode.py of this checkout (it imports the pack's vae/ floor, so through the package)."""
    load_pack()
    return importlib.import_module("wan_accel.nodes.comfy.streaming_decode")


def small_vae(dim: int = 8, seed: int = 0):
    import comfy.sd
    from comfy.ldm.wan.vae import WanVAE
    torch.manual_seed(seed)
    model = WanVAE(dim=dim, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                   temperal_downsample=[False, True, True])
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():                       # ComfyUI's ops leave weights uninitialised: fill them
        for name, p in model.named_parameters():
            if name.endswith("gamma"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / (p[0].numel() ** 0.5))
    return comfy.sd.VAE(sd=model.state_dict(), dtype=torch.float32)


def tiny_state(seed: int = 1) -> dict:
    """A random-weight ComfyUI TAEHV for 16 latent channels (taew2_1's layout) as a float32 state dict (a float16 file
    is read by ComfyUI's loader as HunyuanVideo's taehv, whose latents it scales)."""
    from comfy.taesd.taehv import TAEHV
    from vae_decoders_check import fill
    model = fill(TAEHV(latent_channels=16), seed).float()
    return {k: v.contiguous() for k, v in model.state_dict().items()}


def tiny_vae(seed: int = 1):
    import comfy.sd
    vae = comfy.sd.VAE(sd=tiny_state(seed), dtype=torch.float32)
    model = vae.first_stage_model
    assert type(model).__name__ == "TAEHV" and vae.latent_channels == 16, (type(model), vae.latent_channels)
    if hasattr(model, "show_progress_bar"):
        model.show_progress_bar = False
    return vae


def write_tiny_vae(path: str) -> dict:
    """A random-weight taew2_1-layout file for a server's Load VAE (ComfyUI reads it as a tiny video decoder)."""
    from safetensors.torch import save_file
    sd = tiny_state()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, path)
    return {"path": path, "tensors": len(sd), "class": "TAEHV"}


def tiny_parity() -> dict:
    """ComfyUI's tiny video decoder streamed (``stream_decoder``: ComfyTinyStream) against its own ``VAE.decode``,
    clamped to 0..1 as an IMAGE; chunks of 1, 2, 3 latent frames; and what ComfyUI's VAE.decode gives (its range)."""
    mod, vae = adapter(), tiny_vae()
    result = {"adapter": type(mod.stream_decoder(vae)).__name__}
    for frames in (5, 6):
        z = torch.randn(1, 16, frames, 4, 6, generator=torch.Generator().manual_seed(frames)) * 2
        whole = vae.decode(z)
        result[f"whole_range_{frames}"] = [float(whole.min()), float(whole.max())]
        result[f"whole_shape_{frames}"] = list(whole.shape)
        for chunk in (1, 2, 3):
            got = stream(mod, vae, z, chunk, mod.stream_decoder)
            assert got.shape == whole.shape, (got.shape, whole.shape)
            result[f"{frames}x{chunk}"] = (got - whole.clamp(0, 1)).abs().max().item()
    return result


def write_vae(path: str, dim: int = 8) -> dict:
    """A random-weight Wan 2.1 VAE file (ComfyUI's class, small width) for a server to load like a real one."""
    from comfy.ldm.wan.vae import WanVAE
    from safetensors.torch import save_file
    vae = small_vae(dim)
    sd = {k: v.contiguous() for k, v in vae.first_stage_model.state_dict().items()}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, path)
    return {"path": path, "tensors": len(sd), "class": WanVAE.__name__}


def stream(mod, vae, z, chunk: int, make=None):
    dec, parts = (make or mod.WanStreamDecoder)(vae), []
    for f in range(0, z.shape[2], chunk):
        out = dec.push(z[:, :, f:f + chunk])
        if out is not None:
            parts.append(out)
    out = dec.finish()
    if out is not None:
        parts.append(out)
    return torch.cat(parts, 1)


def parity() -> dict:
    mod, vae = adapter(), small_vae()
    assert vae.vae_dtype == torch.float32, vae.vae_dtype
    result = {}
    for frames in (5, 6, 7):
        z = torch.randn(1, 16, frames, 2, 2, generator=torch.Generator().manual_seed(frames))
        whole = vae.decode(z)
        for chunk in (1, 2, 3):
            got = stream(mod, vae, z, chunk)
            assert got.shape == whole.shape, (got.shape, whole.shape)
            result[f"{frames}x{chunk}"] = (got - whole).abs().max().item()
    result["frames_of_7"] = int(vae.decode(torch.zeros(1, 16, 7, 4, 4)).shape[1])
    # a continued video: one decoder's walk up to frame k (its ``finish`` not called), snapshot, a new decoder
    # restores it and decodes the rest: together, the whole decode (k = 3: nothing held back; k = 4: one frame)
    z = torch.randn(1, 16, 9, 2, 2, generator=torch.Generator().manual_seed(9))
    whole = vae.decode(z)
    for k in (3, 4):
        first = mod.WanStreamDecoder(vae)
        parts = [p for p in (first.push(z[:, :, :2]), first.push(z[:, :, 2:k])) if p is not None]
        walk = first.snapshot()
        first.release()
        second = mod.WanStreamDecoder(vae)
        second.restore(walk)
        parts += [p for p in (second.push(z[:, :, k:k + 3]), second.push(z[:, :, k + 3:]), second.finish())
                  if p is not None]
        got = torch.cat(parts, 1)
        assert got.shape == whole.shape, (got.shape, whole.shape)
        result[f"continued_at_{k}"] = (got - whole).abs().max().item()
    other = mod.WanStreamDecoder(small_vae(seed=1))
    try:
        other.restore(walk)
        result["other_vae_refused"] = False
    except ValueError:
        result["other_vae_refused"] = True
    return result


def memory(frames: int, chunk: int = 3, whole: bool = False, side: int = 4) -> dict:
    """Peak RSS growth while decoding ``frames`` latent frames chunk by chunk; each chunk's images are dropped once
    made (a consumer that shows or saves them), so what remains is the decoder's own working memory."""
    mod, vae = adapter(), small_vae()
    z = torch.randn(1, 16, frames, side, side, generator=torch.Generator().manual_seed(1))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if whole:                                   # for contrast: ComfyUI's VAE.decode of the whole video
        t0 = time.perf_counter()
        made = vae.decode(z).shape[1]
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {"latent_frames": frames, "video_frames": made, "rss_growth_kb": peak - base, "peak_rss_kb": peak,
                "seconds": time.perf_counter() - t0, "first_frames_s": None}
    dec, made, t0, first = mod.WanStreamDecoder(vae), 0, time.perf_counter(), None
    for f in range(0, frames, chunk):
        out = dec.push(z[:, :, f:f + chunk])
        if out is not None:
            made += out.shape[1]
            first = first if first is not None else time.perf_counter() - t0
        del out
    out = dec.finish()
    made += 0 if out is None else out.shape[1]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"latent_frames": frames, "video_frames": made, "rss_growth_kb": peak - base, "peak_rss_kb": peak,
            "seconds": time.perf_counter() - t0, "first_frames_s": first}


def timing(num_frames: int = 33, side: int = 64) -> dict:
    """CausalWan Sampler + Decode on the built-in tiny model with the small VAE: time to the first decoded frames,
    per-chunk latency and the decode's share of it (the pack loaded from this checkout as ``wan_accel``)."""
    import importlib
    load_pack()
    nodes = importlib.import_module("wan_accel.nodes.model_nodes")
    stream_nodes = importlib.import_module("wan_accel.nodes.stream_nodes")
    (handle,) = nodes.CausalWanModelLoader().load("(built-in tiny model)", "fp32", "float32", "sdpa")
    node, vae = stream_nodes.CausalWanSamplerDecode(), small_vae()
    t0 = time.perf_counter()
    images, _, _ = node.sample(vae, handle, side, side, num_frames, 1, "self_forcing", 3, -1, 0, live_preview=False)
    total = time.perf_counter() - t0
    r = node.last_report
    return {"video_frames": int(images.shape[0]), "size": side, "total_s": total, "first_frames_s": r["first_frames_s"],
            "chunk_s": r["chunk_s"], "decode_s": r["decode_s"],
            "decode_share": sum(r["decode_s"]) / max(sum(r["chunk_s"]), 1e-9), "torch": torch.__version__}


if __name__ == "__main__":
    sys.path.insert(0, str(Path.cwd()))         # the ComfyUI work tree
    from comfy.cli_args import args
    args.cpu = True                             # as main.py --cpu
    torch.set_num_threads(2)
    what = sys.argv[1]
    if what == "timing":
        print(json.dumps(timing(*(int(v) for v in sys.argv[2:]))))
        sys.exit(0)
    if what == "write-vae":
        print(json.dumps(write_vae(sys.argv[2])))
        sys.exit(0)
    if what == "write-tiny-vae":
        print(json.dumps(write_tiny_vae(sys.argv[2])))
        sys.exit(0)
    if what == "tiny":
        print(json.dumps(tiny_parity()))
        sys.exit(0)
    print(json.dumps(parity() if what == "parity" else memory(int(sys.argv[2]), whole=what == "memory-whole",
                                                                     side=int(sys.argv[3]) if len(sys.argv) > 3 else 4)))
