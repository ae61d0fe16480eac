"""Krea's stand-in first frame re-encoded through the stream decoder's state (``sampling.krea.StreamReencode``).

Krea's server decodes each block as it is made with one streaming decoder (its temporal cache carried from block to
block), keeps the last 1 + (K - 1) * 4 pixel frames (``frame_context_cache``) and encodes the oldest of them, the
last pixel frame of latent frame f0 - K, as the new first frame. Here a stand-in causal decoder with a temporal
memory (a pixel frame depends on the latent frame before it) tells that frame apart from the same latent frame
decoded on its own; ``krea_session_pixels`` is that procedure as the official session runs it."""
import collections
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tolerances import step as dtype_step, within
from wan_accel.app.play.t2v import PromptPlaySession
from wan_accel.model.config import WanConfig
from wan_accel.model.loader import load_wan_checkpoint
from wan_accel.sampling.krea import KreaRecompute, StreamReencode, cache_setup, krea_schedule, vae_reencode
from run_helpers import generate_latents, run_causal

FIX = Path(__file__).parent / "fixtures" / "krea_realtime"
CFG = json.loads((FIX / "krea_config.json").read_text())
IO = load_file(str(FIX / CFG["io_file"]))
TOL = 1e-4


def step(x, memory):
    """One latent frame [B, 1, C, H, W] through the stand-in causal decoder: 1 pixel frame for the first frame,
    4 for the others, each depending on the frame before (the temporal cache)."""
    if memory is None:
        return torch.tanh(x)
    return torch.cat([torch.tanh(x * (k + 1) / 4 + 0.5 * memory) for k in range(4)], dim=1)


class PairStream:
    """The stand-in decoder as ComfyUI's walk runs it: the first frame alone, then pairs; a frame whose pair has
    not arrived is held back and returned with the next push."""

    def __init__(self):
        self.memory, self.held, self.first, self.pushes = None, None, True, 0

    def __call__(self, z):
        self.pushes += 1
        if self.held is not None:
            z, self.held = torch.cat([self.held, z], 1), None
        frames = list(z.split(1, dim=1))
        todo = [frames.pop(0)] if self.first else []
        self.first = False
        while len(frames) >= 2:
            todo += [frames.pop(0), frames.pop(0)]
        if frames:
            self.held = frames[0]
        out = []
        for x in todo:
            out.append(step(x, self.memory))
            self.memory = x
        return torch.cat(out, dim=1) if out else None


def krea_session_pixels(latents, k, fpb):
    """Per block b (from 1 on): the oldest pixel frame Krea's session keeps, decoding block after block with one
    decoder state (release_server.generate_block_internal: ``frame_context_cache`` of 1 + (K - 1) * 4 frames)."""
    cache, memory, out = collections.deque(maxlen=1 + (k - 1) * 4), None, {}
    blocks = latents.shape[1] // fpb
    for b in range(blocks):
        if b > 0:
            out[b] = cache[0]
        for i in range(b * fpb, (b + 1) * fpb):
            x = latents[:, i:i + 1]
            for p in step(x, memory).split(1, dim=1):
                cache.append(p)
            memory = x
    return out


def encode(px):
    return 0.75 * px.half().float() + 0.1


class Recorder:
    def __init__(self):
        self.seen = []

    def __call__(self, px):
        self.seen.append(px.clone())
        return encode(px)


@pytest.fixture(scope="module")
def model():
    return load_wan_checkpoint(FIX / CFG["weights_file"], device="cpu", dtype=torch.float32, precision="float32",
                               config=WanConfig.from_dict(CFG["config"]), attention="sdpa")


def _run(model, policy, path="reference", blocks=6, k=3, fpb=3, seed=3):
    noise = torch.randn(1, blocks * fpb, 16, 4, 6, generator=torch.Generator().manual_seed(seed))
    return run_causal(model, IO["prompt0"], noise, krea_schedule(4), fpb, generator=torch.Generator().manual_seed(1),
                         kv_window=k + fpb, recache="none", cache_policy=policy, path=path,
                         fast_options={"cuda_graphs": "off"} if path == "optimized" else None)


@pytest.mark.parametrize("path", ["reference", "optimized"])
def test_the_re_encoded_frame_is_the_one_the_session_keeps(model, path):
    k, fpb, blocks = 3, 3, 6
    rec = Recorder()
    stream = PairStream()
    out = _run(model, KreaRecompute(k, fpb, reencode=StreamReencode(stream, rec)), path, blocks, k, fpb)
    want = krea_session_pixels(out, k, fpb)
    # re-encoded from block 2 on (f0 - fpb >= K): the oldest kept pixel frame of each block, as the stream decoded it
    assert len(rec.seen) == blocks - 2
    for b, got in zip(range(2, blocks), rec.seen):
        assert (got - want[b]).abs().max() <= TOL, b
    assert stream.pushes == blocks - 1                  # one push a block, the frames before it
    # the same latent frame decoded on its own (vae_reencode: a first frame, no temporal cache) is another frame
    alone = Recorder()
    other = _run(model, KreaRecompute(k, fpb, reencode=vae_reencode(lambda z: PairStream()(z), alone)), path,
                 blocks, k, fpb)
    assert (alone.seen[0] - want[2]).abs().max() > 0.1
    assert (other - out).abs().max() > 10 * TOL


def test_with_the_fixtures_memoryless_decoder_it_matches_the_official_session(model):
    """The official fixture's stand-in decoder (each latent frame repeated as pixel frames) as a stream: the
    official session's output."""
    s = CFG["session"]
    k, fpb = s["kv_cache_num_frames"], s["num_frame_per_block"]
    state = {"first": True}

    def push(z):                                        # Wan's layout: 1 pixel frame for frame 0, then 4 each
        px = z.repeat_interleave(4, dim=1)
        if state["first"]:
            px, state["first"] = px[:, 3:], False
        return px
    rec = Recorder()
    noise = IO["initial_noise"]
    sched = "\n".join(["0: p0", "3: p1 (blend 2)", "6: p2 (blend 1)"])
    out = run_causal(model, None, noise, krea_schedule(4), fpb, kv_window=k + fpb, recache="none",
                        noise_provider=lambda ci, st, shape, dt, dev: IO[f"extra_noise.block{ci}.step{st}"],
                        prompt_schedule=sched, prompt_embeddings={f"p{i}": IO[f"prompt{i}"] for i in range(3)},
                        cache_policy=KreaRecompute(k, fpb, reencode=StreamReencode(push, rec)), path="reference")
    assert (out - IO["output"]).abs().max() <= TOL
    official = [IO[f"reencode_input.{i}"] for i in range(len(rec.seen))]
    assert len(official) == len(rec.seen) == 4
    for got, want in zip(rec.seen, official):
        assert within(got[0, 0].half(), want, TOL + dtype_step(torch.float16, want))   # the official's float16 copy


def test_play_goes_on_through_the_stream_as_one_run(model):
    """Chunk by chunk (each a continuation, the earlier frames from the state's history), the stream decodes every
    frame once and in order: the frames of one run, and the frames the session keeps re-encoded."""
    k, fpb, blocks = 3, 3, 6
    embed = lambda text: IO["prompt0"] if text == "a" else IO["prompt1"]          # noqa: E731
    rec, stream = Recorder(), PairStream()
    play = PromptPlaySession(model, embed, 4, 6, seed=5, schedule="krea", frames_per_block=fpb, kv_window=k + fpb,
                             recache="krea", prompt="a", reencode=StreamReencode(stream, rec))
    for p in ("", "", "b (blend 2, krea)", "", "", ""):
        play.step(p)
    video = play.latent_video().transpose(1, 2)
    want = krea_session_pixels(video, k, fpb)
    assert len(rec.seen) == blocks - 2
    for b, got in zip(range(2, blocks), rec.seen):
        assert (got - want[b]).abs().max() <= TOL, b
    setup = cache_setup("krea", fpb, k + fpb, StreamReencode(PairStream(), encode))
    one = generate_latents(model, None, blocks * fpb, 4, 6, seed=5, schedule="krea", frames_per_block=fpb,
                           kv_window=setup.kv_window, prompt_schedule=play.script_file(), path="reference",
                           prompt_embeddings={"a": IO["prompt0"], "b": IO["prompt1"]}, **setup.sampler_kwargs())
    assert torch.equal(video, one)


def test_a_stream_that_missed_frames_is_refused():
    s = StreamReencode(PairStream(), encode)
    s.push_frames(0, torch.zeros(1, 2, 16, 4, 6))
    with pytest.raises(ValueError, match="cannot follow"):
        s.push_frames(3, torch.zeros(1, 3, 16, 4, 6))
    with pytest.raises(ValueError, match="has not given the last pixel frame of latent frame 1"):
        s.reencode(1)                               # frame 1 is held back until its pair arrives
    s.push_frames(2, torch.zeros(1, 1, 16, 4, 6))
    assert s.reencode(1).shape == (1, 1, 16, 4, 6) and s.pixels_out == 1 + 4 * 2
    with pytest.raises(TypeError, match="by its index"):
        s(torch.zeros(1, 1, 16, 4, 6))


def test_the_nodes_re_encode_through_the_vaes_stream_decoder(monkeypatch):
    """A node's recache krea with a Wan VAE: the policy's own stream decoder gets every clean frame once, in order
    (VAE space), and the VAE encodes pixel frame 4 (f0 - K) of that stream; a VAE the streaming decoder cannot
    walk falls back to decoding the latent frame on its own."""
    from wan_accel.vae.latents import to_vae_latents
    from wan_accel.model.tiny import tiny_causal_model
    from wan_accel.nodes.comfy import streaming_decode
    from wan_accel.nodes.model_nodes import comfy_krea_reencode, krea_cache
    from tests.test_krea_wire import FakeVAE

    class FakeStream:                   # pixel frame p of the stream: latent frame (p + 3) // 4's mean, plus p
        def __init__(self, vae):
            self.pushed, self.out = [], 0

        def push(self, z):
            self.pushed.append(z.clone())
            n = z.shape[2]
            frames = (1 + 4 * (n - 1)) if self.out == 0 else 4 * n
            idx = torch.arange(self.out, self.out + frames)
            lat = torch.cat(self.pushed, 2)[:, :, (idx + 3) // 4].mean(1)            # [B, frames, h, w]
            px = (lat + idx.view(1, -1, 1, 1)).repeat_interleave(8, -2).repeat_interleave(8, -1)
            self.out += frames
            return px.unsqueeze(-1).expand(-1, -1, -1, -1, 3).clone()

    streams = []
    monkeypatch.setattr(streaming_decode, "KreaStreamDecoder",
                        lambda vae: streams.append(FakeStream(vae)) or streams[-1])
    vae = FakeVAE()
    encoded = []
    real_encode = vae.encode
    vae.encode = lambda px: encoded.append(px.clone()) or real_encode(px)
    setup = krea_cache("krea", 3, 6, vae)
    assert isinstance(setup.cache_policy.reencode, StreamReencode)
    model = tiny_causal_model(seed=5)
    noise = torch.randn(1, 12, 16, 4, 4, generator=torch.Generator().manual_seed(0))
    out = run_causal(model, torch.randn(1, model.config.text_len, model.config.text_dim), noise, krea_schedule(4),
                        3, kv_window=setup.kv_window, path="reference", **setup.sampler_kwargs())
    (stream,) = streams
    assert [z.shape[2] for z in stream.pushed] == [3, 3, 3]          # frames 0..8, one push a block
    assert (torch.cat(stream.pushed, 2) - to_vae_latents(out[:, :9])).abs().max() <= TOL
    assert len(encoded) == 2                                         # blocks 2 and 3: frames 3 and 6
    vae_z = to_vae_latents(out)
    for got, frame in zip(encoded, (3, 6)):
        want = vae_z[0, :, frame].mean(0) + 4 * frame
        assert got.shape == (1, 32, 32, 3)
        assert (got[0, ::8, ::8, 0] - want).abs().max() <= TOL, frame

    def not_wan(vae):
        raise ValueError("not a Wan 2.1 VAE")
    monkeypatch.setattr(streaming_decode, "KreaStreamDecoder", not_wan)
    assert not isinstance(comfy_krea_reencode(vae), StreamReencode)


VAE_CFG = json.loads((FIX / "krea_stream_vae.json").read_text())
VAE_IO = load_file(str(FIX / VAE_CFG["io_file"]))


class Replay:
    """A streaming decoder that replays the official stream's pixel frames (tests/fixtures/krea_realtime
    produce_stream_vae.py: Krea's VAEDecoderWrapper on a tiny random Wan VAE), checking it is given the official
    latents in order. ``pairs``: return them as ComfyUI's walk does (first frame alone, then pairs; a frame whose pair
    has not come is held back), else as Krea's decoder does (every frame of the push)."""

    def __init__(self, pairs=False):
        self.pixels = torch.cat([VAE_IO[f"stream.block{b}"] for b in range(VAE_CFG["num_blocks"])], 1)
        self.frames_in = self.pixels_out = 0
        self.pairs = pairs

    def __call__(self, z):
        n = z.shape[1]
        assert torch.equal(z, VAE_IO["latents"][:, self.frames_in:self.frames_in + n])
        self.frames_in += n
        done = self.frames_in if not self.pairs else 1 + 2 * ((self.frames_in - 1) // 2)
        upto = 1 + 4 * (done - 1)
        out, self.pixels_out = self.pixels[:, self.pixels_out:upto], upto
        return out if out.shape[1] else None


@pytest.mark.parametrize("pairs", [False, True])
def test_the_official_stream_of_a_real_vae_re_encodes_the_official_frame(pairs):
    """On a (tiny, random) Wan VAE the pixel frames of a latent frame differ and its stream decode differs from its
    decode alone by ~1 (the fixture's alone_vs_stream_max_abs): the frame the policy hands to the encoder is the one
    Krea's session hands over, from Krea's own decoder's stream, given all at once or held back a frame at a time as a
    pair walk returns it (the official whole decode equals the stream, stream_vs_whole_decode_max_abs 0). The
    layers that decode it through ComfyUI's VAE, ``KreaStreamDecoder``, are checked against this stream in
    tests/e2e/test_krea_reencode_vae.py."""
    k, fpb = VAE_CFG["kv_cache_num_frames"], VAE_CFG["num_frame_per_block"]
    assert VAE_CFG["stream_vs_whole_decode_max_abs"] == 0.0
    assert min(VAE_CFG["alone_vs_stream_max_abs"].values()) > 0.5
    seen = []

    def encode_pixels(px):                              # stand-in encoder: [B, 1, 3, 16, 16] -> [B, 1, 16, 2, 2]
        seen.append(px.clone())
        lat = torch.nn.functional.avg_pool2d(px[:, 0], 8)
        return lat.repeat(1, 6, 1, 1)[:, None, :16]
    policy = KreaRecompute(k, fpb, reencode=StreamReencode(Replay(pairs), encode_pixels))
    latents = VAE_IO["latents"]

    class State:                                        # what the chunk loop gives before_chunk (no model here)
        def __init__(self, f0):
            self.first_frame, self.base, self.out = f0, 0, latents

        def clean(self, start, end):
            return latents[:, start:end]
    for b in range(VAE_CFG["num_blocks"]):
        policy._remember(State(b * fpb))
        policy._feed_stream(State(b * fpb))
        policy.context(b * fpb)
    assert len(seen) == len(VAE_CFG["reencoded_blocks"])
    for b, got in zip(VAE_CFG["reencoded_blocks"], seen):
        assert got.shape == (1, 1, 3, 16, 16)
        assert torch.equal(got, VAE_IO[f"reencode_input.block{b}"][None]), b
