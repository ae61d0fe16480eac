"""Stands in for nodes/streaming_decode.WanStreamDecoder outside ComfyUI: one 'image' per latent frame (its mean,
2x2 RGB), the last frame held back until the next push or ``finish`` (as the real walk holds back an unpaired
frame). Every push, load, finish and release is recorded."""
import torch


class FakeDecoder:
    def __init__(self, vae=None):
        self.vae = vae
        self.pushed, self.held, self.finished, self.released, self.loads = [], None, 0, 0, 0

    def load(self, shape):
        self.loads += 1

    def push(self, latent):
        self.pushed.append(latent.clone())
        frames = [latent[:, :, i].mean(dim=(1, 2, 3)) for i in range(latent.shape[2])]
        if self.held is not None:
            frames.insert(0, self.held)
        self.held = frames.pop()
        return None if not frames else torch.stack(frames, 1)[..., None, None, None].expand(-1, -1, 2, 2, 3)

    def finish(self):
        self.finished += 1
        held, self.held = self.held, None
        return None if held is None else held[:, None, None, None, None].expand(-1, 1, 2, 2, 3)

    def release(self):
        self.released += 1
