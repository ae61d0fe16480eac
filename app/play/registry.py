"""Matrix-Game-2 play mode: sessions whose next chunk is driven by the actions held while it is made.

``PlaySession.step(keys, mouse)`` continues the video by one 3-latent-frame chunk (``sampling.mg2_continuation``: the
session is one run, prepared once at its first chunk, its next chunks sampled by ``Run.again``) with the given keys
and camera motion held for the whole chunk, and records them: ``script`` is the Game Actions script of the session,
and ``generate_mg2`` with it and the same seed reproduces the session's frames exactly. ``free`` drops everything
heavy (the model, the caches, attached decoders) and keeps what saving needs (the latents made so far, the script).

``PlayRegistry`` holds the live sessions of a server: one per starting node (starting again replaces it), at most
``max_sessions``, each ended once nobody has made a chunk or looked at it (``get``: the touch route) for its idle
timeout (an abandoned browser tab frees its memory), and ended sessions forgotten after the same time. Each chunk is
one ComfyUI prompt (the nodes' part), so a session never holds the prompt queue longer than one chunk.
"""
from __future__ import annotations

import secrets
import threading
import time

import torch

from ...sampling.actions_script import MODES, parse_action_script
from ...sampling.mg2 import FRAMES_PER_BLOCK, mg2_run, resolve_preset
from ...sampling.continuation import weight_fingerprint
from ...sampling.mg2_continuation import mg2_continuation
from ...sampling.request import SamplingHooks

FIRST_CHUNK_FRAMES = 4 * (FRAMES_PER_BLOCK - 1)     # scripted video frames of the first chunk (after the start frame)
CHUNK_FRAMES = 4 * FRAMES_PER_BLOCK                 # video frames of every later chunk
DEFAULT_IDLE_TIMEOUT_S = 300.0
MAX_SESSIONS = 4


class PlayError(ValueError):
    """A play request that cannot be done; the message says what to do instead."""


class SessionBase:
    """What every play session shares: its chunks' latents, and ``free`` (drops the heavy attributes named in
    ``HEAVY``, the state and attached decoders; keeps the latents and the script). ``run_spec``: the run spec
    (``app/prepare.RunSpec``) the session is prepared with (the start's choices, e.g. fp8 linear layers); None: the
    defaults. ``setup`` / ``run``: what preparing it did (``_chunk``)."""
    HEAVY: tuple = ("model",)
    frames_per_block = FRAMES_PER_BLOCK      # latent frames per chunk
    run_spec = None
    setup = None

    def __init__(self):
        self.state = self.run = None        # the state after the last chunk; the session's one run (``_chunk``)
        self.log: list[dict] = []           # per chunk: what it was given (the action or prompt, the rows)
        self.latents: list[torch.Tensor] = []   # model-space latents of each chunk, on the CPU (for saving)
        self.chunks = 0
        self.ended: str | None = None       # why the session ended (None while it can go on)
        self.attached: dict = {}            # front-end objects (a decoder...) released with the session
        self.kept: dict = {}                # what saving needs after the end (the VAE), dropped when forgotten
        self.frames_shown = 0               # decoded video frames sent to the page so far
        self.lock = threading.RLock()

    @property
    def frames(self) -> int:
        """Latent frames made so far."""
        return self.chunks * self.frames_per_block

    def _chunk(self, fields: dict, inputs, callback, more, **kwargs) -> torch.Tensor:
        """The next chunk's latents on the session's one run: at the first chunk the model (``setup``: the doctor's
        verdicts, the start's choices; its notes say what was switched off) and the run (``run_spec`` with
        ``fields``, ``inputs``, ``prepare``'s ``kwargs``) are prepared; every next chunk is ``more(run)``."""
        from ..prepare import RunSpec, prepare, prepare_model
        if self.run is not None:
            self.run.hooks = self.run.hooks.replace(callback=callback)
            return more(self.run)
        spec = self.run_spec or RunSpec()
        self.setup = self.setup or prepare_model(self.model, spec)
        self.run = prepare(self.model, spec.replace(**fields), inputs, SamplingHooks(callback=callback),
                           setup=self.setup, **kwargs)
        return self.run.latents()

    def _check_going_on(self) -> None:
        """An ended session is refused. The session's caches were made with the weights of its last chunk: other
        values (another checkpoint of the same structure, a patch applied in place) are refused before anything is
        made; the session goes on once they are restored (``sampling.continuation.weight_fingerprint``, as every
        continued state)."""
        if self.ended:
            raise PlayError(f"this play session has ended ({self.ended}): start a new one")
        if self.state is not None and weight_fingerprint(self.model) != self.state.settings.get("weights"):
            raise PlayError("the model's weights changed since this session's last chunk (another checkpoint of the "
                            "same structure, or a patch applied in place); its caches hold the earlier weights: "
                            "restore them, or start a new play session")

    def latent_video(self) -> torch.Tensor:
        """Every chunk's latents so far, [1, C, frames, h, w] (model space, CPU)."""
        if not self.latents:
            raise PlayError("the session has no frames yet: play at least one chunk first")
        return torch.cat(self.latents, 2)

    def free(self, reason: str = "ended") -> None:
        """End the session: drop the model, its caches and attached objects; keep the latents and the script."""
        with self.lock:
            self.ended = self.ended or reason
            self.state = None
            for name in self.HEAVY:
                setattr(self, name, None)
            for obj in self.attached.values():
                release = getattr(obj, "release", None)
                if callable(release):
                    try:
                        release()
                    except Exception:  # noqa: BLE001 - freeing must not fail halfway
                        pass
            self.attached.clear()


class PlaySession(SessionBase):
    HEAVY = ("model", "context", "run")

    def __init__(self, model, image_latent: torch.Tensor, visual_context: torch.Tensor, seed: int = 0,
                 preset: str = "universal", window: int | None = None, state_device=None, in_place: bool = True):
        if not hasattr(model, "action_config"):
            raise PlayError("play mode needs a Matrix-Game-2 model (a checkpoint with action modules)")
        if image_latent.dim() != 5 or image_latent.shape[0] != 1:
            raise PlayError(f"play mode takes one start latent [1, 16, 1, h, w], got {tuple(image_latent.shape)}")
        self.model, self.image, self.context = model, image_latent, visual_context
        self.settings = resolve_preset(preset, window=window)
        self.preset, self.window = preset, window
        self.mode, self.seed, self.state_device = self.settings.mode, int(seed), state_device
        self.in_place = bool(in_place)      # the session owns its state: caches written in place (False: copies)
        self.items: list[str] = []          # one script item per chunk
        super().__init__()

    @property
    def keys(self) -> tuple:
        return MODES[self.mode]["keys"]

    @property
    def has_mouse(self) -> bool:
        return bool(MODES[self.mode]["mouse"])

    def action_term(self, keys=(), mouse=(0.0, 0.0)) -> str:
        """The script action of keys held (names of this mode's keys) and a camera motion (pitch, yaw)."""
        spec = MODES[self.mode]
        names = sorted({str(k).strip().lower() for k in keys if str(k).strip()},
                       key=lambda k: spec["keys"].index(k) if k in spec["keys"] else 99)
        for k in names:
            if k not in spec["keys"]:
                raise PlayError(f"key {k!r} is not an action of mode {self.mode!r} ({', '.join(spec['keys'])})")
        terms = list(names)
        pitch, yaw = (float(mouse[0]), float(mouse[1])) if mouse is not None else (0.0, 0.0)
        if not all(map(lambda v: abs(v) < 1e3, (pitch, yaw))):      # also refuses nan
            raise PlayError(f"mouse motion ({pitch}, {yaw}) is not a camera action: give pitch and yaw near 0.1")
        if pitch or yaw:
            if not spec["mouse"]:
                raise PlayError(f"mode {self.mode!r} has no camera (mouse) actions")
            terms.append(f"mouse({pitch!r},{yaw!r})")
        return "+".join(terms) or "idle"

    def step(self, keys=(), mouse=(0.0, 0.0), callback=None) -> torch.Tensor:
        """Generate the next chunk with ``keys`` and ``mouse`` held; returns its latents [1, 16, 3, h, w]."""
        with self.lock:
            self._check_going_on()
            term = self.action_term(keys, mouse)
            count = FIRST_CHUNK_FRAMES if self.chunks == 0 else CHUNK_FRAMES
            acts = parse_action_script(f"{term}*{count}", self.mode)
            mouse_t, keyboard_t = acts.tensors(batch=1)
            if self.chunks:                      # the parser repeats the first action as a start frame: not here
                mouse_t = None if mouse_t is None else mouse_t[:, 1:]
                keyboard_t = keyboard_t[:, 1:]
            args, state_after = mg2_continuation(
                self.model, self.image, self.context, mouse_t, keyboard_t, self.frames + FRAMES_PER_BLOCK, self.seed,
                self.settings, self.state, self.state_device, self.in_place)
            fields, inputs = mg2_run(self.model, **args)
            out = self._chunk(fields, inputs, callback, lambda run: run.again(inputs)).transpose(1, 2)
            self.state = state_after()
            first = 0 if self.chunks == 0 else 1 + FIRST_CHUNK_FRAMES + CHUNK_FRAMES * (self.chunks - 1)
            given = self.state.actions             # exactly the tensors the model's action modules were given
            rows = lambda t: None if t is None else t[0, first:first + keyboard_t.shape[1]]
            self.log.append({"chunk": self.chunks, "action": term,
                             "keyboard": rows(given["keyboard"]).tolist(),
                             "mouse": None if given["mouse"] is None else rows(given["mouse"]).tolist()})
            self.items.append(f"{term}*{count}")
            self.latents.append(out.detach().float().cpu())
            self.chunks += 1
            return out

    @property
    def script(self) -> str:
        """The Game Actions script (mode ``self.mode``) that reproduces the session with its seed."""
        return ", ".join(self.items)

    def script_file(self) -> str:
        """The script with a header saying how to reproduce the session (``#`` lines are comments to the parser)."""
        return (f"# Matrix-Game-2 play session: {self.chunks} chunks, {self.frames} latent frames\n"
                f"# reproduce: Game Actions (mode {self.mode}) -> Matrix-Game-2 Sampler with seed {self.seed}, "
                f"preset {self.preset}, kv_window {self.window or 0}, num_frames {self.frames}, and the session's "
                f"start image (its first latent frame) and CLIP vision output\n{self.script}\n")


    def describe(self) -> dict:
        return {"mode": self.mode, "keys": list(self.keys), "mouse": self.has_mouse, "seed": self.seed,
                "preset": self.preset, "kv_window": self.window or 0, "chunks": self.chunks,
                "latent_frames": self.frames, "ended": self.ended, "script": self.script}


class PlayRegistry:
    """The server's play sessions, by id; ends abandoned ones (see the module's text)."""

    def __init__(self, max_sessions: int = MAX_SESSIONS, clock=time.monotonic, reaper: bool = True):
        self.max_sessions, self.clock, self.reaper = int(max_sessions), clock, reaper
        self._sessions: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def open(self, session: PlaySession, owner=None, idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S) -> str:
        """Register a session and return its id; ends the owner's earlier session and, over the limit, the
        least recently used one."""
        if not idle_timeout_s > 0:
            raise PlayError(f"idle timeout must be above 0 seconds, got {idle_timeout_s}")
        sid = secrets.token_hex(6)
        ended = []
        with self._lock:
            for other, entry in list(self._sessions.items()):
                if owner is not None and entry["owner"] == owner:
                    ended.append((entry["session"], "replaced by a new session"))
                    del self._sessions[other]
            live = sorted((e["seen"], k) for k, e in self._sessions.items() if not e["session"].ended)
            while len(live) >= self.max_sessions:
                _, oldest = live.pop(0)
                ended.append((self._sessions[oldest]["session"], "too many play sessions: the oldest was ended"))
            self._sessions[sid] = {"session": session, "owner": owner, "timeout": float(idle_timeout_s),
                                   "seen": self.clock(), "created": time.time()}
        for s, why in ended:
            s.free(why)
        self._start_reaper()
        return sid

    def get(self, sid: str) -> PlaySession:
        with self._lock:
            entry = self._sessions.get(str(sid))
            if entry is None:
                raise PlayError(f"there is no play session {str(sid)[:40]!r} (it ended, or the server restarted): "
                                f"start a new one with its Play Session node")
            entry["seen"] = self.clock()
            return entry["session"]

    def end(self, sid: str, reason: str = "ended by the user") -> PlaySession:
        session = self.get(sid)
        session.free(reason)
        return session

    def reap(self) -> list:
        """End sessions idle for longer than their timeout; forget ended ones idle that long. Returns the ids."""
        now, done = self.clock(), []
        with self._lock:
            for sid, entry in list(self._sessions.items()):
                if now - entry["seen"] <= entry["timeout"]:
                    continue
                done.append((sid, entry["session"]))
                if entry["session"].ended:
                    del self._sessions[sid]
                    entry["session"].kept.clear()
                else:
                    entry["seen"] = now             # kept (ended) for saving for one more timeout
        for sid, s in done:
            s.free("abandoned: no chunk and no panel watching it for the idle timeout")
        return [sid for sid, _ in done]

    def listing(self) -> list:
        now = self.clock()
        with self._lock:
            items = list(self._sessions.items())
        return [dict(e["session"].describe(), session=sid, owner=e["owner"], idle_s=round(now - e["seen"], 1),
                     idle_timeout_s=e["timeout"]) for sid, e in items]

    def __len__(self) -> int:
        return len(self._sessions)

    def clear(self) -> None:
        with self._lock:
            entries = list(self._sessions.values())
            self._sessions.clear()
        for e in entries:
            e["session"].free("the server let go of every session")
            e["session"].kept.clear()
        self._wake.set()

    # -------------------------------------------------------------------------------------- abandoned sessions
    def _start_reaper(self) -> None:
        if not self.reaper or (self._thread is not None and self._thread.is_alive()):
            return
        self._wake.clear()
        self._thread = threading.Thread(target=self._reap_loop, name="wan_accel_play_reaper", daemon=True)
        self._thread.start()

    def _reap_loop(self) -> None:
        while True:
            with self._lock:
                if not self._sessions:
                    self._thread = None
                    return
                interval = max(0.05, min(5.0, min(e["timeout"] for e in self._sessions.values()) / 4))
            if self._wake.wait(interval):
                self._wake.clear()
            try:
                self.reap()
            except Exception:  # noqa: BLE001 - the reaper must keep running
                pass


REGISTRY = PlayRegistry()
