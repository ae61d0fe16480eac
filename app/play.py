"""Matrix-Game-2 play session: the actions held during a chunk drive the next chunk, one chunk at a time.

Each ``step(keys, mouse)`` continues the video by one 3-latent-frame chunk (``sampling.mg2_continuation``) with the
given keys and camera motion held for the whole chunk, and records them. ``script`` is the Game Actions script of
the session: ``generate_mg2`` with it and the same seed reproduces the session's frames exactly. ``close`` drops the
caches (an abandoned session frees its memory).

This is the engine of play mode; the panel's keyboard/mouse front end and its server routes are not built yet.
"""
from __future__ import annotations

import torch

from ..sampling.actions_script import MODES, parse_action_script
from ..sampling.mg2 import FRAMES_PER_BLOCK, resolve_preset
from ..sampling.mg2_continuation import sample_mg2_continuable

FIRST_CHUNK_FRAMES = 4 * (FRAMES_PER_BLOCK - 1)     # scripted video frames of the first chunk (after the start frame)
CHUNK_FRAMES = 4 * FRAMES_PER_BLOCK                 # video frames of every later chunk


class PlaySession:
    def __init__(self, model, image_latent: torch.Tensor, visual_context: torch.Tensor, seed: int = 0,
                 preset: str = "universal", window: int | None = None, state_device=None):
        if not hasattr(model, "action_config"):
            raise ValueError("play mode needs a Matrix-Game-2 model (a checkpoint with action modules)")
        if image_latent.dim() != 5 or image_latent.shape[0] != 1:
            raise ValueError(f"play mode takes one start latent [1, 16, 1, h, w], got {tuple(image_latent.shape)}")
        self.model, self.image, self.context = model, image_latent, visual_context
        self.settings = resolve_preset(preset, window=window)
        self.mode, self.seed, self.state_device = self.settings.mode, int(seed), state_device
        self.state = None
        self.items: list[str] = []          # one script item per chunk
        self.chunks = 0

    @property
    def frames(self) -> int:
        return self.chunks * FRAMES_PER_BLOCK

    def action_term(self, keys=(), mouse=(0.0, 0.0)) -> str:
        """The script action of keys held (names of this mode's keys) and a camera motion (pitch, yaw)."""
        spec = MODES[self.mode]
        names = sorted({str(k).lower() for k in keys}, key=lambda k: spec["keys"].index(k) if k in spec["keys"] else 99)
        for k in names:
            if k not in spec["keys"]:
                raise ValueError(f"key {k!r} is not an action of mode {self.mode!r} ({', '.join(spec['keys'])})")
        terms = list(names)
        pitch, yaw = (float(mouse[0]), float(mouse[1])) if mouse is not None else (0.0, 0.0)
        if pitch or yaw:
            if not spec["mouse"]:
                raise ValueError(f"mode {self.mode!r} has no camera (mouse) actions")
            terms.append(f"mouse({pitch!r},{yaw!r})")
        return "+".join(terms) or "idle"

    def step(self, keys=(), mouse=(0.0, 0.0), callback=None) -> torch.Tensor:
        """Generate the next chunk with ``keys`` and ``mouse`` held; returns its latents [1, 16, 3, h, w]."""
        term = self.action_term(keys, mouse)
        count = FIRST_CHUNK_FRAMES if self.chunks == 0 else CHUNK_FRAMES
        acts = parse_action_script(f"{term}*{count}", self.mode)
        mouse_t, keyboard_t = acts.tensors(batch=1)
        if self.chunks:                      # the parser repeats the first action as a start frame: not here
            mouse_t = None if mouse_t is None else mouse_t[:, 1:]
            keyboard_t = keyboard_t[:, 1:]
        out, self.state = sample_mg2_continuable(
            self.model, self.image, self.context, mouse_t, keyboard_t, self.frames + FRAMES_PER_BLOCK,
            seed=self.seed, preset=self.settings, state=self.state, state_device=self.state_device,
            callback=callback)
        self.items.append(f"{term}*{count}")
        self.chunks += 1
        return out

    @property
    def script(self) -> str:
        """The Game Actions script (mode ``self.mode``) that reproduces the session with its seed."""
        return ", ".join(self.items)

    def close(self) -> None:
        self.state = None
