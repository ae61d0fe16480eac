"""Stands in for nodes/streaming_decode.WanStreamDecoder (a ``vae.frames.FrameStream``) outside ComfyUI: a latent frame's 'images' are its mean
(2x2 RGB), one for the walk's first frame and four for every later one (as the real decoder gives), an unpaired last
frame held back until the next push or ``finish`` (the walk: the first frame alone, then pairs). Every push, load, finish and
release is recorded."""
import torch


class FakeDecoder:
    def __init__(self, vae=None):
        self.vae = vae
        self.pushed, self.held, self.finished, self.released, self.loads = [], None, 0, 0, 0
        self.walked = 0                  # latent frames decoded so far in this walk

    def load(self, shape):
        self.loads += 1

    def _images(self, frames):
        out = []
        for f in frames:
            out += [f] * (1 if self.walked == 0 else 4)
            self.walked += 1
        return None if not out else torch.stack(out, 1)[..., None, None, None].expand(-1, -1, 2, 2, 3)

    def push(self, latent):
        self.pushed.append(latent.clone())
        frames = [latent[:, :, i].mean(dim=(1, 2, 3)) for i in range(latent.shape[2])]
        if self.held is not None:
            frames.insert(0, self.held)
        # the walk: the first frame alone, then pairs; an unpaired last frame waits for the next push
        self.held = frames.pop() if (len(frames) - (self.walked == 0)) % 2 else None
        return self._images(frames)

    def finish(self):
        self.finished += 1
        held, self.held = self.held, None
        return None if held is None else self._images([held])

    def snapshot(self):
        return {"held": None if self.held is None else self.held.clone(), "walked": self.walked}

    def restore(self, snap):
        self.restored = snap
        self.held, self.walked = snap["held"], snap["walked"]

    def release(self):
        self.released += 1
