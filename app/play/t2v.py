"""Live prompt steering of a causal text-to-video model: sessions whose next chunk follows the prompt typed now.

``PromptPlaySession.step(prompt)`` continues the video by one chunk with ``prompt`` in effect from that chunk on: the
session is one run, prepared once at its first chunk (``app.prepare.prepare``, keeping its state) and extended by one
chunk per step (``Run.extend``); an empty prompt keeps the one in effect. A prompt is one line of the prompt
schedule's grammar (``sampling.prompts``): a text, a weighted mix ``a :0.7 | b :0.3``, an optional ``(blend N)``.
Every change becomes one schedule entry ``<chunk>: <prompt>``, and each chunk's context is taken from that schedule
exactly as a one-shot run takes it, so ``schedule_text`` given to ``generate --prompt-schedule`` (or the sampler
nodes) with the same seed and settings reproduces the session's frames exactly. A prompt switch re-caches the window
under the new prompt (``recache='switch'``, LongLive) unless the session was started with ``recache='none'``, or with
``recache='krea'`` rebuilds the cache from a short clean context before every chunk (Krea Realtime; the one policy
object goes on from chunk to chunk, reading the earlier clean frames from the state's history). The mode goes through
``sampling.krea.cache_setup``; with 'krea' the session's ``reencode`` (the VAE round trip of the frame that stands in
for the first frame) is used, or the frame as it is, said once in the log, and a prompt typed without a blend eases in
as Krea's server does it, ``(blend 4, krea)`` (``CacheSetup.live_line``; ``(blend 0)`` switches at once). A prompt
equal to the one in effect (as typed) changes nothing.

``log`` records per chunk the prompt in effect and the context rows the model was given (their SHA-256 and first
values), as Matrix-Game-2 play records the action rows. The session has the interface of ``registry.PlaySession``
that the registry, the routes and the Save node use (``describe``, ``log``, ``latent_video``, ``script``,
``script_file``, ``free``).
"""
from __future__ import annotations

import hashlib
import logging

import torch

from ...model.dit import check_text_tokens
from ...model.finite import NonFiniteError, check_conditioning
from ...sampling.krea import cache_setup
from ...sampling.prompts import PromptSchedule
from ...sampling.request import RunInputs
from .registry import PlayError, SessionBase

HEAD_VALUES = 8                 # first values of the context's first row kept in the log


def context_digest(context: torch.Tensor) -> str:
    """SHA-256 of a context's float32 values (row-major): what the log records of the rows the model was given."""
    data = context.detach().to("cpu", torch.float32).contiguous()
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


class PromptPlaySession(SessionBase):
    HEAVY = ("model", "encode", "run")

    kind = "t2v"

    def __init__(self, model, encode, height: int, width: int, seed: int = 0, schedule="self_forcing",
                 frames_per_block: int = 3, kv_window: int = -1, sink: int = 0, recache: str = "switch",
                 prompt: str = "", state_device=None, settings: dict | None = None, reencode=None):
        """model: a causal text-to-video WanModel; encode(text) -> [1, L, text_dim] embedding of one text (the
        graph's text encoder, or the tiny model's stand-in); height/width: latent size; prompt: the first chunk's
        prompt when its step gives none (checked now); settings: what the saved
        schedule's header says to reproduce it (pixel size, preset names...)."""
        if hasattr(model, "action_config"):
            raise PlayError("prompt play needs a text-to-video causal model; a Matrix-Game-2 model plays with the "
                            "Matrix-Game-2 Play Session node")
        try:
            self.cache = cache_setup(recache, frames_per_block, kv_window, reencode, sink=sink, preset=schedule)
        except ValueError as exc:
            raise PlayError(str(exc)) from None
        if self.cache.note:
            logging.getLogger("wan_accel").warning(self.cache.note)
        if not callable(encode):
            raise PlayError("prompt play needs a text encoder (connect the graph's CLIP)")
        self.model, self.encode = model, encode
        self.height, self.width, self.seed = int(height), int(width), int(seed)
        self.schedule, self.frames_per_block = schedule, int(frames_per_block)
        self.kv_window, self.sink, self.recache = self.cache.kv_window, int(sink), recache
        self.state_device, self.settings = state_device, dict(settings or {})
        self.lines: list[str] = []          # schedule entries "<chunk>: <prompt>", one per change
        self.prompt: str | None = None      # the prompt in effect (as typed)
        self.embeddings: dict = {}          # text -> [1, L, D] embedding (CPU), each text encoded once
        super().__init__()
        self.first_prompt = str(prompt or "")
        if self.first_prompt.strip():
            self._schedule_with(self.first_prompt)      # a bad first prompt is refused before anything is made

    # ------------------------------------------------------------------------------------------------ prompts
    def _schedule_with(self, prompt: str) -> tuple:
        """The session's schedule with ``prompt`` from the next chunk on (no new entry when it is unchanged)."""
        text = "\n".join(str(prompt).splitlines()).strip() if prompt is not None else ""
        if "\n" in text:
            raise PlayError("a live prompt is one line: join it, or use ' | ' to mix several prompts")
        if not text and not self.lines:
            text = "\n".join(self.first_prompt.splitlines()).strip()
        lines = list(self.lines)
        if text and text != self.prompt:
            lines.append(self.cache.live_line(self.chunks, text))     # krea: Krea's default interpolation
        elif not lines:
            raise PlayError("type a prompt for the first chunk")
        try:
            schedule = PromptSchedule.parse("\n".join(lines))
            schedule.validate(self.chunks + 1)
        except ValueError as exc:
            raise PlayError(f"prompt {text[:80]!r} is not a schedule prompt: {exc}") from None
        problem = self.cache.live_prompt_problem(schedule, self.chunks)     # recache krea: Krea's interruptions
        if problem:
            raise PlayError(problem)
        return schedule, lines, text or self.prompt

    def _embed(self, schedule: PromptSchedule) -> dict:
        for text in schedule.texts():
            if text in self.embeddings:
                continue
            emb = self.encode(text)
            if not isinstance(emb, torch.Tensor) or emb.dim() != 3 or emb.shape[0] != 1:
                raise PlayError(f"the text encoder gave {getattr(emb, 'shape', type(emb).__name__)} for {text[:60]!r}; "
                                f"expected one embedding [1, tokens, {self.model.config.text_dim}]")
            if emb.shape[-1] != self.model.config.text_dim:
                raise PlayError(f"the text encoder's embedding is {emb.shape[-1]} wide but the model takes "
                                f"{self.model.config.text_dim}: connect the model's own text encoder (umt5-xxl for Wan)")
            try:
                check_text_tokens(emb.shape[1], self.model.config.text_len,
                                  f"the text encoder's answer for {text[:60]!r}")
            except ValueError as exc:
                raise PlayError(str(exc)) from None
            check_conditioning(emb, f"the text encoder's answer for {text[:60]!r}",
                               "the text encoder is broken or in the wrong precision; type another prompt")
            self.embeddings[text] = emb.detach().cpu()
        return {t: self.embeddings[t] for t in schedule.texts()}

    def _prepare(self, prompt) -> tuple:
        """(schedule, its lines, the prompt in effect, the chunk's context, whether it switches) for ``prompt``,
        changing nothing of the session: whatever is wrong with the prompt (its text, its mix, what the encoder
        answers) is a PlayError saying why, and the session goes on from where it was."""
        try:
            schedule, lines, text = self._schedule_with(prompt)
            embeddings = self._embed(schedule)
            context = schedule.contexts(embeddings, self.chunks + 1)[self.chunks]
            switched = bool(self.chunks) and self.chunks in schedule.switch_chunks(self.chunks + 1)
        except PlayError:
            raise
        except Exception as exc:  # noqa: BLE001 - one bad prompt must not end the session
            shown = "\n".join(str(prompt).splitlines()).strip()[:80] if isinstance(prompt, str) else type(prompt).__name__
            reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            if not isinstance(exc, ValueError):
                reason = f"{type(exc).__name__}: {reason}"
            raise PlayError(f"prompt {shown!r} was refused ({reason}); the session goes on from chunk "
                            f"{self.chunks} with the prompt in effect") from None
        return schedule, lines, text, context, switched

    # ------------------------------------------------------------------------------------------------ chunks
    def step(self, prompt: str = "", callback=None) -> torch.Tensor:
        """Make the next chunk with ``prompt`` in effect (empty: the prompt in effect now); returns its latents
        [1, C, frames_per_block, h, w] (model space)."""
        with self.lock:
            self._check_going_on()
            schedule, lines, text, context, switched = self._prepare(prompt)
            policy = self.cache.cache_policy
            mark = policy.mark() if hasattr(policy, "mark") else None
            before = self.state
            try:
                frames, ctx = (self.chunks + 1) * self.frames_per_block, context.to(self.model.device)
                out = self._chunk(
                    dict(seed=self.seed, schedule=self.schedule, frames_per_block=self.frames_per_block,
                         kv_window=self.kv_window, sink=self.sink, recache=self.cache.recache),
                    RunInputs(context=ctx, noise=(1, frames, self.model.config.out_dim, self.height, self.width),
                              cache_policy=policy), callback, lambda run: run.extend(frames, context=ctx),
                    keep_state=True, state_device=self.state_device)
            except BaseException as exc:
                if before is None:              # a first chunk that failed: the next step prepares the run again
                    self.run = None
                else:                           # the chunk is dropped: the run goes on from the state before it
                    self.run.state = before
                if mark is not None:            # an interrupted chunk: the policy goes on from the last chunk made
                    policy.rewind(mark)
                if isinstance(exc, NonFiniteError):
                    raise PlayError(f"prompt {text[:80]!r} gave a chunk of NaN values, which was dropped: "
                                    f"{exc}; the session goes on from chunk {self.chunks}") from None
                raise
            self.state = self.run.state
            self.lines, self.prompt = lines, text
            self.log.append({"chunk": self.chunks, "prompt": text, "switched": switched,
                             "context_sha256": context_digest(context),
                             "context_head": context[0, 0, :HEAD_VALUES].float().tolist()})
            self.latents.append(out.detach().float().cpu().transpose(1, 2))
            self.chunks += 1
            return self.latents[-1]

    @property
    def schedule_text(self) -> str:
        """The prompt schedule (canonical text) that reproduces the session with its seed."""
        return PromptSchedule.parse("\n".join(self.lines)).to_text() if self.lines else ""

    script = schedule_text

    def script_file(self) -> str:
        """The schedule with a header saying how to reproduce the session (``#`` lines are comments)."""
        video = 4 * (self.frames - 1) + 1 if self.frames else 0
        s = dict(self.settings)
        args = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in s.items())
        return (f"# prompt play session: {self.chunks} chunks, {self.frames} latent frames ({video} video frames)\n"
                f"# reproduce: generate --prompt-schedule THIS_FILE --seed {self.seed} --frames {video} "
                f"--frames-per-block {self.frames_per_block} --kv-window {self.kv_window} --sink {self.sink} "
                f"--recache {self.recache}{' ' + args if args else ''}\n"
                f"# (or the causal sampler node with this text as prompt_schedule and the same settings)\n"
                f"{self.schedule_text}")

    def describe(self) -> dict:
        return {"type": self.kind, "mode": "t2v", "keys": [], "mouse": False, "seed": self.seed,
                "prompt": self.prompt, "recache": self.recache, "kv_window": self.kv_window, "sink": self.sink,
                "frames_per_block": self.frames_per_block, "chunks": self.chunks, "latent_frames": self.frames,
                "ended": self.ended, "script": self.schedule_text}
