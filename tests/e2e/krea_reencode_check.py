"""Run with ComfyUI's python inside its work tree (tests/e2e/test_krea_reencode_vae.py does):

    python krea_reencode_check.py   -> JSON: Krea's re-encoded first frame through ComfyUI's Wan VAE, against the
                                       official stream fixture and Krea's procedure written out below

ComfyUI's own Wan 2.1 VAE class (comfy.ldm.wan.vae.WanVAE, loaded through ``comfy.sd.VAE``) is built with the weights
of tests/fixtures/krea_realtime/krea_stream_vae.* (width 8; the official module's constructor draws its default
initial weights from the seed-0 generator, then every parameter is drawn N(0, 0.2) in order), float32 on the CPU.
That fixture holds what the official session code did with those weights: the pixel frames of its streaming decode,
block by block, and the frame it handed to its encoder at each block that re-encodes the first frame.

Krea's procedure, as the fixture README describes it (release_server.py of the Krea commit named there): each block's
clean latents are decoded as the block is made, with the decoder's feature cache carried from block to block; the
pixel frames go into a queue of the last 1 + (K - 1) * 4; at a block that re-encodes (block b, (b - 1) * 3 >= K) the
oldest of them, the last pixel frame of latent frame f0 - K, is encoded alone as a video's first frame (a fresh
encoder cache, the mean of the encoder's output, normalised with the Wan 2.1 latent mean and std) and stands in for
the first frame of the context.
"""
from __future__ import annotations

import collections
import importlib
import json
import sys
from pathlib import Path

import torch

from streaming_decode_check import adapter, load_pack

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "krea_realtime"


def fixture_vae(cfg: dict):
    """ComfyUI's WanVAE with the fixture's weights, as a ``comfy.sd.VAE``, and the module itself."""
    import comfy.sd
    from comfy.ldm.wan.vae import WanVAE
    spec = cfg["vae"]
    torch.manual_seed(spec["seed"])
    model = WanVAE(dim=spec["dim"], z_dim=spec["z_dim"], dim_mult=spec["dim_mult"],
                   num_res_blocks=spec["num_res_blocks"], attn_scales=[], temperal_downsample=[False, True, True])
    # ComfyUI's layers skip torch's default initialisation; the official constructor runs it, which moves the
    # seeded generator before the N(0, 0.2) draws: run it here in the same order
    for m in model.modules():
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d)):
            torch.nn.modules.conv._ConvNd.reset_parameters(m)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    vae = comfy.sd.VAE(sd=model.state_dict(), dtype=torch.float32)
    return vae, vae.first_stage_model


def official_first_frame_latent(model, frame: torch.Tensor) -> torch.Tensor:
    """Krea's encode of one pixel frame [1, 3, H, W] in [-1, 1] as a video's first frame: the encoder with a fresh
    cache, the mean half of its output, normalised -> model space [1, 1, 16, h, w]."""
    from comfy.latent_formats import Wan21
    from comfy.ldm.wan.vae import count_cache_layers
    fmt = Wan21()
    with torch.no_grad():
        out = model.encoder(frame[:, :, None], feat_cache=[None] * count_cache_layers(model.encoder), feat_idx=[0])
        mu = model.conv1(out)[:, :model.z_dim]
    return ((mu - fmt.latents_mean) / fmt.latents_std).permute(0, 2, 1, 3, 4)


def queue_oldest(pixels_per_block: list, k: int) -> torch.Tensor:
    """The oldest pixel frame of the session's queue (the last 1 + (K - 1) * 4 frames) after these blocks."""
    queue = collections.deque(maxlen=1 + (k - 1) * 4)
    for px in pixels_per_block:
        queue.extend(px.split(1, dim=1))
    return queue[0][:, 0]


def as_images(frames: torch.Tensor) -> torch.Tensor:
    """Pixel frames [B, T, 3, H, W] in [-1, 1] (Krea's) -> ComfyUI's images [B, T, H, W, 3] in [0, 1]."""
    return ((frames.float() + 1) / 2).clamp(0, 1).permute(0, 1, 3, 4, 2)


class Recorder:
    """Wraps a VAE's encode: keeps every pixel batch it is given."""

    def __init__(self, encode):
        self.encode, self.seen = encode, []

    def __call__(self, pixels):
        self.seen.append(pixels.detach().clone())
        return self.encode(pixels)


def drive(policy, latents: torch.Tensor, blocks: int, fpb: int) -> dict:
    """The policy's work before each block, as the chunk loop asks it (``_remember``, ``_feed_stream``, the
    context), over given clean latents; returns {block: context} for the blocks with a context."""
    class State:
        def __init__(self, f0):
            self.first_frame, self.base, self.out = f0, 0, latents

        def clean(self, start, end):
            return latents[:, start:end]

    contexts = {}
    for b in range(blocks):
        state = State(b * fpb)
        policy._remember(state)
        policy._feed_stream(state)
        ctx = policy.context(b * fpb)
        if ctx is not None:
            contexts[b] = ctx
    return contexts


def max_abs(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def check() -> dict:
    load_pack()
    krea = importlib.import_module("wan_accel.sampling.krea")
    model_nodes = importlib.import_module("wan_accel.nodes.model_nodes")
    vae_latents = importlib.import_module("wan_accel.vae.latents")
    from safetensors.torch import load_file
    cfg = json.loads((FIX / "krea_stream_vae.json").read_text())
    io = load_file(str(FIX / cfg["io_file"]))
    k, fpb, blocks = cfg["kv_cache_num_frames"], cfg["num_frame_per_block"], cfg["num_blocks"]
    vae, model = fixture_vae(cfg)
    assert vae.vae_dtype == torch.float32, vae.vae_dtype
    latents = io["latents"]                                     # model space [1, 15, 16, 2, 2]
    official = [io[f"stream.block{b}"] for b in range(blocks)]  # [1, 9 or 12, 3, 16, 16] in [-1, 1]
    result = {"blocks": blocks}

    # 1. the streaming decode: Krea's walk over ComfyUI's layers against the official stream, and ComfyUI's own walk
    mod = adapter()
    ours, comfy = mod.KreaStreamDecoder(vae), mod.WanStreamDecoder(vae)
    got = [ours.push(vae_latents.to_vae_latents(latents[:, b * fpb:(b + 1) * fpb])) for b in range(blocks)]
    want = as_images(torch.cat(official, 1))
    result["krea_stream_vs_official"] = max_abs(torch.cat(got, 1), want)
    result["krea_stream_frames_per_block"] = [int(g.shape[1]) for g in got]
    theirs = [comfy.push(vae_latents.to_vae_latents(latents[:, b * fpb:(b + 1) * fpb])) for b in range(blocks)]
    theirs = torch.cat([t for t in theirs + [comfy.finish()] if t is not None], 1)
    result["comfy_stream_vs_official_latent_frames_0_2"] = max_abs(theirs[:, :9], want[:, :9])
    result["comfy_stream_vs_official_from_latent_frame_3"] = max_abs(theirs[:, 9:], want[:, 9:])

    # 2. Krea's procedure written out on the official stream: the frame handed to the encoder, and its encode
    official_frames = {b: queue_oldest(official[:b], k) for b in cfg["reencoded_blocks"]}
    result["queue_oldest_vs_official_input"] = max(max_abs(official_frames[b], io[f"reencode_input.block{b}"])
                                                   for b in official_frames)
    official_latents = {b: official_first_frame_latent(model, f) for b, f in official_frames.items()}

    # 3. the pack's path: recache krea's re-encode for a ComfyUI VAE (what the nodes build), in the policy
    vae.encode = Recorder(vae.encode)
    reencode = model_nodes.comfy_krea_reencode(vae)
    result["stream_reencode"] = type(reencode).__name__
    policy = krea.KreaRecompute(k, fpb, reencode=reencode)
    contexts = drive(policy, latents, blocks, fpb)
    seen = vae.encode.seen
    result["encoded"] = len(seen)
    result["encoder_input_vs_official"] = max(max_abs(px, as_images(official_frames[b][:, None])[0])
                                              for b, px in zip(cfg["reencoded_blocks"], seen))
    result["reencoded_vs_official"] = max(max_abs(contexts[b][:, :1], official_latents[b])
                                          for b in cfg["reencoded_blocks"])
    result["reencoded_scale"] = max(float(official_latents[b].abs().max()) for b in official_latents)
    # the same latent frame decoded on its own (the fallback for a VAE the stream cannot walk) is another frame
    first = cfg["reencoded_blocks"][0]
    vae.encode.seen = []
    model_nodes.comfy_vae_reencode(vae)(latents[:, first * fpb - k:first * fpb - k + 1])
    result["alone_vs_official"] = max_abs(vae.encode.seen[0], as_images(official_frames[first][:, None])[0])

    # 4. a sampled run (the pack's tiny model, the node's krea cache setup with this VAE): every frame the policy
    # re-encoded is Krea's procedure on the run's own clean latents (decoded block by block with Krea's walk)
    prepare = importlib.import_module("wan_accel.app.prepare")
    request = importlib.import_module("wan_accel.sampling.request")
    tiny = importlib.import_module("wan_accel.model.tiny")
    net = tiny.tiny_causal_model(seed=3)
    vae.encode.seen = []
    setup = model_nodes.krea_cache("krea", fpb, k + fpb, vae)
    stream = setup.cache_policy.reencode
    made, real = [], stream.reencode

    def recorded(frame):
        made.append((frame, real(frame)))
        return made[-1][1]
    stream.reencode = recorded
    run_blocks = 5
    noise = torch.randn(1, run_blocks * fpb, 16, 2, 2, generator=torch.Generator().manual_seed(4))
    text = tiny.tiny_text_embedding("a cat", net.config.text_len, net.config.text_dim)
    spec = prepare.RunSpec(schedule=krea.krea_schedule(4), frames_per_block=fpb, kv_window=setup.kv_window,
                           path="reference", recache=setup.recache, doctor=False)
    out = prepare.prepare(net, spec, request.RunInputs(context=text, noise=noise, cache_policy=setup.cache_policy,
                                                       generator=torch.Generator().manual_seed(5))).latents()
    walk = mod.KreaStreamDecoder(vae)
    pixels = [walk.push(vae_latents.to_vae_latents(out[:, b * fpb:(b + 1) * fpb])) for b in range(run_blocks)]
    result["run_reencoded_frames"] = [int(f) for f, _ in made]
    errs = []
    for frame, latent in made:
        b = (frame + k) // fpb                                  # the block whose context it stands in for
        oldest = queue_oldest([(2 * p - 1).permute(0, 1, 4, 2, 3) for p in pixels[:b]], k)
        errs.append(max_abs(latent, official_first_frame_latent(model, oldest)))
    result["run_reencoded_vs_procedure"] = max(errs)
    result["torch"] = torch.__version__
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(Path.cwd()))         # the ComfyUI work tree
    from comfy.cli_args import args
    args.cpu = True                             # as main.py --cpu
    torch.set_num_threads(2)
    with torch.no_grad():                       # as ComfyUI runs a prompt
        print(json.dumps(check()))
