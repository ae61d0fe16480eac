"""The pack's own streaming decoders (vae/): the Wan 2.1 VAE and the TAEHV-class tiny decoder, their weights files,
and the decode columns of ``bench sampler --decode``.

ComfyUI's own decoders on the same weights: tests/e2e/test_vae_decoders_comfy.py (needs ComfyUI)."""
from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import save_file

from wan_accel.bench import sampler as bench
from wan_accel.bench.decode import ChunkDecoder
from wan_accel.cli import main
from wan_accel.vae import latents, taehv, wan21
from wan_accel.vae.build import build_decoder
from wan_accel.vae.weights import DecoderWeightsError

KINDS = ("wan", "tiny")
EPS32 = torch.finfo(torch.float32).eps
# streaming and a whole decode run the same layers on different frame counts, so the convolutions may sum in
# another order: up to 8 float32 ulps per layer (oneDNN picks its blocking by CPU and frame count) over the decoders'
# ~32 layers in sequence, of the output's scale
DEPTH_ULPS = 8 * 32


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    bound = DEPTH_ULPS * EPS32 * max(1.0, want.abs().max().item())
    err = (got - want).abs().max().item()
    assert err <= bound, (err, bound)


def _latents(frames: int, seed: int, h: int = 2, w: int = 3) -> torch.Tensor:
    """Model-space latents [1, frames, 16, h, w] as the sampler makes them."""
    return torch.randn(1, frames, 16, h, w, generator=torch.Generator().manual_seed(seed))


def _decode(decoder, x: torch.Tensor) -> torch.Tensor:
    """The whole video at once: model-space latents [B, F, 16, h, w] -> images [B, 3, 1 + 4 (F - 1), 8h, 8w]."""
    return decoder.to_images(decoder.stream().push(x))


def _push_all(decoder, x: torch.Tensor, sizes) -> tuple:
    stream, parts, f = decoder.stream(), [], 0
    for n in sizes:
        parts.append(stream.push(x[:, f:f + n]))
        f += n
    assert f == x.shape[1]
    return torch.cat(parts, 2), [p.shape[2] for p in parts]


@pytest.fixture(scope="module")
def decoders():
    return {k: build_decoder(k, reduced=True, seed=3) for k in KINDS}


# ----------------------------------------------------------------------------------------- the architecture
def test_key_names_and_shapes_are_those_of_the_real_files():
    """A few keys of wan_2.1_vae.safetensors and taew2_1.safetensors (their decoder halves) with their shapes."""
    with torch.device("meta"):
        wan, tiny = wan21.WanVAEDecoder(), taehv.TinyVideoDecoder()
    w = {k: tuple(v.shape) for k, v in wan.state_dict().items()}
    t = {k: tuple(v.shape) for k, v in tiny.state_dict().items()}
    assert len(w) == 108 and len(t) == 64
    assert w["conv2.weight"] == (16, 16, 1, 1, 1) and w["decoder.conv1.weight"] == (384, 16, 3, 3, 3)
    assert w["decoder.middle.1.to_qkv.weight"] == (1152, 384, 1, 1) and w["decoder.middle.1.norm.gamma"] == (384, 1, 1)
    assert w["decoder.upsamples.3.time_conv.weight"] == (768, 384, 3, 1, 1)        # temporal: stages 1 and 2
    assert w["decoder.upsamples.7.time_conv.weight"] == (768, 384, 3, 1, 1)
    assert "decoder.upsamples.11.time_conv.weight" not in w and w["decoder.upsamples.11.resample.1.weight"] == (
        96, 192, 3, 3)
    assert w["decoder.upsamples.4.shortcut.weight"] == (384, 192, 1, 1, 1)
    assert w["decoder.upsamples.14.residual.6.weight"] == (96, 96, 3, 3, 3)
    assert w["decoder.head.0.gamma"] == (96, 1, 1, 1) and w["decoder.head.2.weight"] == (3, 96, 3, 3, 3)
    assert t["decoder.1.weight"] == (256, 16, 3, 3) and t["decoder.3.conv.0.weight"] == (256, 512, 3, 3)
    assert t["decoder.7.conv.weight"] == (256, 256, 1, 1) and t["decoder.13.conv.weight"] == (256, 128, 1, 1)
    assert t["decoder.19.conv.weight"] == (128, 64, 1, 1) and "decoder.8.bias" not in t
    assert t["decoder.22.weight"] == (3, 64, 3, 3) and t["decoder.22.bias"] == (3,)


# ----------------------------------------------------------------------------------------- streaming
@pytest.mark.parametrize("kind", KINDS)
def test_streaming_equals_a_whole_decode(kind, decoders):
    dec = decoders[kind]
    x = _latents(5, 1)
    whole, _ = _push_all(dec, x, [5])
    for sizes in ([1] * 5, [3, 2], [1, 3, 1]):
        got, _ = _push_all(dec, x, sizes)
        _close(got, whole)
    # causal: the frames of the first chunk do not depend on what follows
    first, _ = _push_all(dec, x[:, :3], [3])
    _close(whole[:, :, :first.shape[2]], first)


def _unfused(decoder):
    """The Wan decoder with its layers run one by one as the modules define them (no RMS norm fused)."""
    for m in decoder.modules():
        if isinstance(m, wan21.RMSNorm):
            m.fused = False
    return decoder


def test_the_fused_norm_gives_the_frames_of_the_layers_one_by_one(decoders):
    """The Wan decoder's norm + SiLU written into each causal convolution's buffer after its history (the default;
    torch ops here, the Triton kernel where it runs: tests/test_vae_norm_kernel.py) against the layers one by one
    with torch.cat, streamed in chunks of 1, 2 and 3 latent frames."""
    fused = decoders["wan"]
    plain = _unfused(build_decoder("wan", reduced=True, seed=3))
    assert all(m.fused for m in fused.modules() if isinstance(m, wan21.RMSNorm))
    assert not any(m.fused for m in plain.modules() if isinstance(m, wan21.RMSNorm))
    x = _latents(5, 6)
    for sizes in ([5], [1] * 5, [3, 2], [1, 3, 1]):
        _close(_push_all(fused, x, sizes)[0], _push_all(plain, x, sizes)[0])


@pytest.mark.parametrize("kind", KINDS)
def test_frame_counts(kind, decoders):
    """T latent frames -> 1 + 4 (T - 1) pixel frames; the first chunk of n gives 4 n - 3, every later one 4 n."""
    dec = decoders[kind]
    for t in range(1, 5):
        out = _decode(dec, _latents(t, t))
        assert out.shape == (1, 3, 1 + 4 * (t - 1), 16, 24) and 0.0 <= out.min() and out.max() <= 1.0
    _, counts = _push_all(dec, _latents(6, 0), [1, 3, 2])
    assert counts == [1, 12, 8]


def test_latents_are_denormalised_by_the_published_statistics(decoders):
    x = _latents(2, 5)
    mean = torch.tensor(latents.WAN21_LATENT_MEAN).view(1, 16, 1, 1, 1)
    std = torch.tensor(latents.WAN21_LATENT_STD).view(1, 16, 1, 1, 1)
    raw = x.permute(0, 2, 1, 3, 4) * std + mean
    for dec in decoders.values():
        torch.testing.assert_close(dec.stream().push(x), dec.stream().push_raw(raw), rtol=0, atol=0)
    assert std.min() > 1 and mean.abs().max() > 1           # a decode of undenormalised latents would differ


# ----------------------------------------------------------------------------------------- weights files
def _save(path, decoder, extra=None, drop=()):
    sd = {k: v.contiguous() for k, v in decoder.state_dict().items() if k not in drop}
    save_file({**sd, **(extra or {})}, str(path))
    return path


@pytest.mark.parametrize("kind", KINDS)
def test_saved_weights_round_trip_by_key_name(kind, decoders, tmp_path):
    dec = decoders[kind]
    # a full VAE file also holds the encoder half, which the decoder does not use
    path = _save(tmp_path / f"{kind}.safetensors", dec, extra={"encoder.conv1.weight": torch.ones(2, 3)})
    loaded = build_decoder(kind, path)
    assert loaded.config == dec.config                      # the narrow widths read from the file
    for (k, a), (k2, b) in zip(dec.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    x = _latents(2, 4)
    assert torch.equal(_decode(loaded, x), _decode(dec, x))
    other = build_decoder(kind, reduced=True, seed=4)       # another seed: other weights, other frames
    assert not torch.equal(_decode(other, x), _decode(dec, x))


@pytest.mark.parametrize("kind", KINDS)
def test_a_wrong_file_gives_one_clear_error(kind, decoders, tmp_path):
    dec = decoders[kind]
    key = next(iter(k for k in dec.state_dict() if k.endswith("weight")))
    cases = {
        "missing": ({}, (key,), [f"1 missing: {key}"]),
        "unexpected": ({"decoder.99.weight": torch.zeros(1)}, (), ["1 unexpected: decoder.99.weight"]),
        "shape": ({key: torch.zeros(2, 2)}, (key,), [f"1 with another shape: {key} [2, 2] (expected"]),
        "dtype": ({key: torch.zeros(dec.state_dict()[key].shape, dtype=torch.int32)}, (key,),
                  [f"1 not floating point: {key} I32"]),
    }
    for name, (extra, drop, expect) in cases.items():
        path = _save(tmp_path / f"{name}.safetensors", dec, extra, drop)
        with pytest.raises(DecoderWeightsError) as info:
            build_decoder(kind, path)
        message = str(info.value)
        assert "\n" not in message and str(path) in message and ".safetensors" in message.split(": ", 1)[1]
        for text in expect:
            assert text in message, (name, message)
    other = "tiny" if kind == "wan" else "wan"
    path = _save(tmp_path / "other.safetensors", decoders[other])
    with pytest.raises(DecoderWeightsError, match=f"weights of the '{other}' decoder, not of '{kind}'"):
        build_decoder(kind, path)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    with pytest.raises(DecoderWeightsError, match="not a readable safetensors file"):
        build_decoder(kind, junk)


def test_a_wan22_vae_is_named(tmp_path):
    path = tmp_path / "wan22.safetensors"
    save_file({wan21.WAN22_MARK: torch.zeros(1), "decoder.middle.0.residual.0.gamma": torch.zeros(1)}, str(path))
    with pytest.raises(DecoderWeightsError, match="a Wan 2.2 VAE"):
        build_decoder("wan", path)


# ----------------------------------------------------------------------------------------- in the sampler
def test_each_chunk_is_decoded_from_the_sampler_s_final_latents(decoders):
    """The on_chunk_latents hook decodes every chunk once, before its refresh, and its frames are the decode of the
    finished video."""
    from wan_accel.model.tiny import tiny_causal_model
    from run_helpers import generate_latents
    dec = decoders["wan"]
    model = tiny_causal_model(0, "cpu", torch.float32, "float32")
    hook = ChunkDecoder(dec, torch.device("cpu"), 0.0)
    parts, push = [], hook.stream.push
    hook.stream.push = lambda x: parts.append(push(x)) or parts[-1]
    out = generate_latents(model, torch.zeros(1, 0, model.config.text_dim), 6, 2, 4, seed=0,
                           on_chunk_latents=hook)
    assert hook.chunk_frames == [3, 3] and len(hook.decode_s) == 2 and hook.frames == 21
    _close(torch.cat(parts, 2), dec.stream().push(out))


def _bench(capsys, *argv):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.run(parser.parse_args(list(argv) + ["--json", "--device", "cpu", "--repeat", "1"])) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("kind", KINDS)
def test_bench_sampler_reports_the_decode_columns(kind, capsys):
    out = _bench(capsys, "--variants", "optimized", "--frames", "21", "--height", "32", "--width", "32",
                 "--decode", kind)
    assert out["decode"] == kind and out["vae"] is None
    (row,) = out["rows"]
    assert row["decode"] == kind and row["decoded_frames"] == 21            # 6 latent frames: 1 + 4 * 5
    assert len(row["decode_ms"]) == len(row["chunk_ms"]) == 2 and all(d > 0 for d in row["decode_ms"])
    # one timed run: its wall time is its sampling (the DiT-only steady_s) plus its decode
    assert row["end_to_end_s"] == pytest.approx(row["steady_s"] + row["decode_s"], abs=2e-4)
    # both figures are rounded as reported (end_to_end_s to 1e-4 s, the FPS to 0.01): the FPS recomputed from the
    # rounded time may differ by what half a unit of that rounding moves it, plus half a unit of its own
    e = row["end_to_end_s"]
    assert row["video_fps_with_decode"] == pytest.approx(21 / e, abs=21 / e * 0.5e-4 / (e - 0.5e-4) + 0.005 + 1e-9)
    assert 0 < row["first_frame_s"] < row["end_to_end_s"] and 0 < row["decode_share"] < 1
    assert row["decoder_peak_mb"] is None                                    # a CUDA figure
    narrow = build_decoder(kind, reduced=True)                               # the tiny shape's decoder
    assert row["decoder_weights_mb"] == round(sum(p.numel() * 4 for p in narrow.parameters()) / 2 ** 20, 1)


def test_bench_decode_reads_vae_weights(capsys, decoders, tmp_path):
    path = _save(tmp_path / "tiny.safetensors", decoders["tiny"])
    out = _bench(capsys, "--variants", "optimized", "--frames", "9", "--height", "32", "--width", "32",
                 "--decode", "tiny", "--vae", str(path))
    assert out["vae"] == str(path) and out["rows"][0]["decoded_frames"] == 9


@pytest.mark.parametrize("argv,expect", [
    (["--decode", "vae"], "argument --decode: invalid choice: 'vae'"),
    (["--decode", "wan", "--vae", "{tmp}/absent.safetensors"], "--vae {tmp}/absent.safetensors: file not found"),
    (["--decode", "wan", "--vae", "{tmp}/text.safetensors"], "is not a readable safetensors file"),
    (["--vae", "{tmp}/tiny.safetensors"], "--vae gives weights for a decoder: add --decode wan"),
    (["--decode", "wan", "--vae", "{tmp}/tiny.safetensors"], "holds the weights of the 'tiny' decoder"),
    (["--decode", "tiny", "--world-size", "2"], "--decode is measured in one process"),
])
def test_bench_decode_bad_input(argv, expect, tmp_path, capsys, decoders):
    (tmp_path / "text.safetensors").write_text("not a safetensors file")
    _save(tmp_path / "tiny.safetensors", decoders["tiny"])
    argv = [a.format(tmp=tmp_path) for a in argv]
    try:
        code = main(["bench", "sampler", *argv])
    except SystemExit as exc:                                  # the parser's own refusal of a choice
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and expect.format(tmp=tmp_path) in err and "Traceback" not in err, err
