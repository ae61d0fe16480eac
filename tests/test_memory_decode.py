"""Chunked VAE decode: overlap blending on synthetic causal decoders, OOM learning, the ComfyUI node."""
from __future__ import annotations

import logging
import math

import pytest
import torch

from wan_accel.cache import LimitCache
from wan_accel.memory.chunked_decode import decode_chunked
from wan_accel.memory.limits import NAMESPACE, vae_limit_key


def invariant_decode(z, ratio=4):
    """A causal decoder whose video frame j depends only on latent frame ceil(j / ratio): [B, T', H, W, 3]."""
    t = z.shape[2]
    idx = [0] + [1 + (j - 1) // ratio for j in range(1, 1 + ratio * (t - 1))]
    frames = z[:, :3, idx]                      # [B, 3, T', h, w]
    return frames.permute(0, 2, 3, 4, 1).contiguous() * 0.5 + 0.25


COLD = 0.8


def cold_start_decode(z):
    """Like invariant_decode, but each call's first frames are off (no temporal context): error COLD*exp(-j/2)."""
    out = invariant_decode(z)
    err = COLD * torch.exp(-torch.arange(out.shape[1], dtype=out.dtype) / 2)
    return out + err.view(1, -1, 1, 1, 1)


@pytest.fixture
def latent():
    torch.manual_seed(0)
    return torch.randn(2, 16, 11, 3, 5)


@pytest.mark.parametrize("chunk,overlap", [(2, 1), (3, 1), (4, 2), (5, 3), (11, 2), (50, 1)])
def test_chunk_invariant_decoder_equals_full_decode(latent, chunk, overlap):
    full = invariant_decode(latent)
    out, used = decode_chunked(latent, invariant_decode, chunk_frames=chunk, overlap=overlap)
    assert out.shape == full.shape == (2, 1 + 4 * 10, 3, 5, 3)
    torch.testing.assert_close(out, full, rtol=0, atol=1e-6)
    assert used == min(chunk, 11)


def test_seam_error_is_bounded_by_the_blend(latent):
    full = invariant_decode(latent)   # what a decode with full temporal context gives
    overlap = 2
    out, _ = decode_chunked(latent, cold_start_decode, chunk_frames=5, overlap=overlap)
    err = (out - full).abs().amax(dim=(0, 2, 3, 4))
    m = 4 * (overlap - 1) + 1          # blended video frames per seam
    # a blended frame k mixes the earlier chunk (weight 1 - w_k) and the later chunk's cold frame k (weight w_k)
    bound = 0.0
    for k in range(m):
        w = (k + 1) / (m + 1)
        bound = max(bound, w * COLD * math.exp(-k / 2) + (1 - w) * COLD * math.exp(-(4 * 3 + k) / 2 + 0))
    seams = [4 * s for s in (3, 6)]      # chunks of 5 latent frames overlapping by 2: [0, 5), [3, 8), [6, 11)
    for g in seams:
        assert err[g:g + m].max() <= bound + 1e-5
        assert err[g] < 0.5 * COLD          # a hard cut would show the full cold-start error here
    # frames after the seam carry only the later chunk's decaying error
    assert err[0] <= COLD + 1e-6
    assert err.max() <= COLD + 1e-6


def test_time_ratio_is_inferred_and_checked(latent):
    two = lambda z: invariant_decode(z, ratio=2)  # noqa: E731
    out, _ = decode_chunked(latent, two, chunk_frames=4, overlap=1)
    torch.testing.assert_close(out, two(latent), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="expected"):
        decode_chunked(latent, invariant_decode, chunk_frames=4, overlap=1, time_ratio=2)
    with pytest.raises(ValueError, match="uncovered"):
        decode_chunked(latent, invariant_decode, chunk_frames=4, overlap=0)
    with pytest.raises(ValueError, match="video latent"):
        decode_chunked(latent[:, :, 0], invariant_decode, chunk_frames=4)


def test_oom_halves_the_chunk_learns_it_and_output_is_unchanged(latent, tmp_path):
    cache = LimitCache(tmp_path / "limits.json")
    sizes = []

    def tight(z):
        sizes.append(z.shape[2])
        if z.shape[2] > 5:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return invariant_decode(z)

    key = vae_limit_key("wan2.1", 2, 3, 5)
    out, used = decode_chunked(latent, tight, chunk_frames=11, overlap=1, key=key, cache=cache)
    torch.testing.assert_close(out, invariant_decode(latent), rtol=0, atol=1e-6)
    assert used == 5 and sizes[:3] == [11, 5, 5] and cache.get(NAMESPACE, key)["size"] == 5
    sizes.clear()
    decode_chunked(latent, tight, chunk_frames=11, overlap=1, key=key, cache=LimitCache(tmp_path / "limits.json"))
    assert max(sizes) == 5                     # the next run starts at the learned size


# ---------------------------------------------------------------------- the ComfyUI node with a stand-in VAE
class FakeVAE:
    """Mimics comfy.sd.VAE for Wan: decode([B, 16, t, h, w]) -> [B, T', H, W, 3]; logs ComfyUI's tiled-fallback
    warning (and still returns frames) when a call has more than ``tile_above`` latent frames."""

    def __init__(self, tile_above=None):
        self.calls, self.tile_above = [], tile_above
        self.vae_dtype = torch.float32

    def temporal_compression_decode(self):
        return 4

    def decode(self, z):
        self.calls.append(z.shape[2] if z.dim() == 5 else 0)
        if z.dim() == 4:
            return z[:, :3].permute(0, 2, 3, 1)
        if self.tile_above is not None and z.shape[2] > self.tile_above:
            logging.warning("Warning: Ran out of memory when regular VAE decoding, retrying with tiled VAE decoding.")
        return invariant_decode(z)


def test_node_returns_comfy_images_and_learns_from_tiling_fallback(tmp_path, monkeypatch):
    from wan_accel.nodes.memory_nodes import WanChunkedVAEDecode

    torch.manual_seed(1)
    latent = torch.randn(1, 16, 9, 4, 6)
    node = WanChunkedVAEDecode()
    vae = FakeVAE()
    (images,) = node.decode({"samples": latent}, vae, chunk_frames=3, overlap=1)
    full = invariant_decode(latent)
    assert images.shape == (1 * 33, 4, 6, 3)
    torch.testing.assert_close(images, full.reshape(-1, 4, 6, 3), rtol=0, atol=1e-6)
    assert max(vae.calls) == 3

    tiling = FakeVAE(tile_above=4)
    (images,) = node.decode({"samples": latent}, tiling, chunk_frames=0, overlap=1)
    torch.testing.assert_close(images, full.reshape(-1, 4, 6, 3), rtol=0, atol=1e-6)
    learned = LimitCache().get(NAMESPACE, vae_limit_key("wan2.1", 1, 4, 6))
    assert learned["size"] <= 4 and tiling.calls[0] == 9
    again = FakeVAE(tile_above=4)
    node.decode({"samples": latent}, again, chunk_frames=0, overlap=1)
    assert max(again.calls) <= 4               # starts at the learned size
    (img,) = node.decode({"samples": torch.randn(2, 16, 4, 6)}, FakeVAE(), chunk_frames=0, overlap=1)
    assert img.shape == (2, 4, 6, 3)


def test_image_latent_on_a_video_vae_is_one_frame():
    """An image latent [B, C, H, W] given to a video VAE (ComfyUI's latent_dim 3) decodes as one latent frame
    instead of failing inside the VAE."""
    from wan_accel.nodes.memory_nodes import WanChunkedVAEDecode

    vae = FakeVAE()
    vae.latent_dim = 3
    latent = torch.randn(2, 16, 4, 6)
    (img,) = WanChunkedVAEDecode().decode({"samples": latent}, vae, chunk_frames=0, overlap=1)
    assert img.shape == (2, 4, 6, 3)
    torch.testing.assert_close(img, invariant_decode(latent.unsqueeze(2)).reshape(-1, 4, 6, 3), rtol=0, atol=1e-6)
