"""Prompt schedules: which prompt (or mix of prompts) conditions each chunk of a causal run, and how a switch blends.

Text form, one entry per line (blank lines and lines starting with ``#`` are ignored)::

    0: a cat walks in the garden
    6: the cat starts to run (blend 2)
    9: a red fox :0.7 | snow falls :0.3 (blend 3, slerp)

``<chunk>: <prompt>``: from that chunk on, the prompt conditions the video. A prompt is one text or a weighted mix
``text :w | text :w`` (each weight finite and > 0, written after a space and a colon; the weights are normalised to
sum 1, dividing by the largest first so that no sum overflows; a part without a weight counts 1; at most
``MAX_MIX_PARTS`` parts). A trailing ``(blend N)`` / ``(blend N, slerp)`` / ``(blend N, linear)``
moves from the previous chunk's context to the new one over N chunks: chunk c + j (j = 0 .. N-1) gets
``blend(previous, new, (j + 1) / N)``, so the N-th chunk is the new prompt exactly; N = 0 or no blend is a hard
switch. ``(blend N, krea)`` (N >= 2) is Krea Realtime's interpolation: chunk c + j (j = 0 .. N-1) gets
``torch.lerp(previous, new, linspace(0, 1, N)[j])`` in float32, so chunk c repeats the previous chunk's context and
chunk c + N - 1 is the new prompt; an entry that interrupts a running blend starts from the context of the chunk
before it, as Krea restarts from the embedding in effect. A Krea prompt change requested before block b is
``b: <prompt> (blend N, krea)``, interrupted or not. Chunk 0 must be present. In a schedule a line without a blend
is a hard switch under every cache mode; only a prompt typed live under Krea's cache mode gets Krea's default
interpolation (``sampling.krea.CacheSetup.live_line``: ``(blend 4, krea)``, ``(blend 0)`` a hard switch).

Bounds, checked while the text is read and before anything is encoded: a chunk is below ``MAX_CHUNKS`` (the
chunks of the longest video; ``validate`` then checks the run's own), so a schedule has at most that many entries;
a prompt text is at most ``MAX_PROMPT_CHARS`` characters (the text encoder reads ``TEXT_TOKENS`` tokens) and is
text: no lone surrogate (a string no encoder or file can take) and no control character.

Mixes and blends act on the raw text-encoder output [B or 1, L, text_dim] (before the model's text embedding), in
float32, cast back to the embeddings' dtype; embeddings of different lengths are zero-padded to the longest, as the
model pads every context to its text length with zeros anyway.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

BLEND_MODES = ("linear", "slerp", "krea")
SLERP_PARALLEL_COS = 0.9995      # rows closer to (anti-)parallel than this are blended linearly
_BLEND = re.compile(r"\(\s*blend\s+([^,()]*?)\s*(?:,\s*([^,()]*?)\s*)?\)\s*$", re.IGNORECASE)
_ENTRY = re.compile(r"^\s*([^:]*?)\s*:(.*)$")
_WEIGHT = re.compile(r"^(.*\S)\s+:\s*(\S+)\s*$|^\s*:\s*(\S+)\s*$")
EXAMPLE = "0: a cat walks in the garden\n6: the cat starts to run (blend 2)"
MAX_CHUNKS = 1024               # chunks of the longest video: 4093 video frames = 1024 latent frames, 1 per chunk
TEXT_TOKENS = 512               # what Wan's text encoder (umt5-xxl) reads of a prompt; the rest is cut off
MAX_PROMPT_CHARS = 16 * TEXT_TOKENS     # more characters than any TEXT_TOKENS tokens spell out
MAX_MIX_PARTS = 8               # prompts mixed in one entry (each is encoded on its own)
MAX_LINE_CHARS = MAX_MIX_PARTS * (MAX_PROMPT_CHARS + 32) + 64     # the longest line a valid entry can take
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


@dataclass(frozen=True)
class Entry:
    """From ``chunk`` on: the mix ``parts`` ((text, weight), ...; raw weights, normalised on use), reached from the
    previous chunk's context over ``blend`` chunks with ``mode`` ('linear' | 'slerp')."""
    chunk: int
    parts: tuple
    blend: int = 0
    mode: str = "linear"

    def weights(self) -> list:
        """The parts' weights normalised to sum 1: divided by the largest first (each then in (0, 1], their sum at
        most the number of parts), so weights near the float maximum never overflow the sum."""
        top = max(w for _, w in self.parts)
        scaled = [w / top for _, w in self.parts]
        total = math.fsum(scaled)
        return [w / total for w in scaled]

    def prompt_text(self) -> str:
        if len(self.parts) == 1 and self.parts[0][1] == 1.0:
            return self.parts[0][0]
        return " | ".join(f"{t} :{w!r}" for t, w in self.parts)

    def line(self) -> str:
        tail = "" if not self.blend else f" (blend {self.blend}" + (f", {self.mode})" if self.mode != "linear" else ")")
        return f"{self.chunk}: {self.prompt_text()}{tail}"


def check_prompt_text(text, where: str = "prompt") -> str:
    """A prompt text the text encoder can read whole: a str of at most MAX_PROMPT_CHARS characters, with no lone
    surrogate and no control character; ValueError naming ``where`` and the fix (never echoing a long text)."""
    if not isinstance(text, str):
        raise ValueError(f"{where}: a prompt is text, got {type(text).__name__}")
    if len(text) > MAX_PROMPT_CHARS:
        raise ValueError(f"{where}: a prompt of {len(text):,} characters is longer than the text encoder reads (the "
                         f"first {TEXT_TOKENS} tokens, at most about {MAX_PROMPT_CHARS:,} characters); shorten it")
    bad = _SURROGATE.search(text)
    if bad is not None:
        raise ValueError(f"{where}: the prompt holds U+{ord(bad.group()):04X} at character {bad.start() + 1}, a lone "
                         f"surrogate that is not a character (text pasted from a broken source); retype it")
    bad = _CONTROL.search(text)
    if bad is not None:
        raise ValueError(f"{where}: the prompt holds the control character U+{ord(bad.group()):04X} at character "
                         f"{bad.start() + 1}; remove it (a prompt is plain text on one line)")
    return text


def ends_in_blend(prompt: str) -> bool:
    """Whether a one-line prompt says how it is reached: a trailing ``(blend N)`` / ``(blend N, mode)``, ``(blend 0)``
    (a hard switch asked for) included. A live session under Krea's cache mode gives a prompt without one Krea's own
    interpolation (``sampling.krea.CacheSetup.live_line``)."""
    return isinstance(prompt, str) and _BLEND.search(prompt) is not None


def _check_text(text, where: str) -> str:
    if not isinstance(text, str) or not text.strip():
        first = EXAMPLE.splitlines()[0]
        raise ValueError(f"{where}: a prompt text is empty; write the text after the colon (e.g. '{first}')")
    text = check_prompt_text(text.strip(), where)
    if "\n" in text or "\r" in text or "|" in text:
        raise ValueError(f"{where}: a prompt text may not contain a line break or '|' (the mix separator); put each "
                         f"prompt on one line")
    return text


_INT_EXAMPLES = {"the chunk": "write the chunk as a whole number >= 0 before the colon, e.g. '6: the cat runs'",
                 "the blend length": "write the blend length as a whole number of chunks, e.g. '(blend 2)'"}
MAX_INT_DIGITS = 9               # no chunk number or blend length of a video (at most 1024 chunks) is longer


def _number(value: str, what: str, where: str, kind=float):
    text = str(value)
    seen = repr(text) if len(text) <= 40 else f"{text[:24]!r}... ({len(text)} characters)"
    fix = _INT_EXAMPLES.get(what, "write e.g. (blend 2)") if kind is int else "write e.g. 'a red fox :0.7 | snow :0.3'"
    digits = text.strip().lstrip("+-")
    if kind is int and digits.isdigit() and len(digits) > MAX_INT_DIGITS:
        raise ValueError(f"{where}: {what} {seen} is far larger than any video's chunks (at most 1024); {fix}")
    try:
        return kind(text)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {what} {seen} is not a{'n integer' if kind is int else ' number'}; "
                         f"{fix}") from None


def _check_weight(w: float, where: str) -> float:
    if not math.isfinite(w) or w <= 0:
        raise ValueError(f"{where}: the weight {w!r} must be a finite number > 0; give every mixed prompt a positive "
                         f"weight (they are normalised to sum 1)")
    return float(w)


_BLEND_WORD = re.compile(r"\(\s*blend\b", re.IGNORECASE)
_TRAILING_WEIGHT = re.compile(r"\s:\s*\S*\s*$")


def _unambiguous(text: str, where: str, weighted: bool = True) -> str:
    """Refuse prompt text that reads as a mistyped part of the grammar rather than as text: a ``(blend`` that is
    not the line's trailing ``(blend N)`` (no length, not at the end, a second one), or a part ending in ``' :'``
    after its weight was taken (a second weight, or a colon with no weight)."""
    shown = text.strip()[:60]
    if _BLEND_WORD.search(text):
        raise ValueError(f"{where}: {shown!r} holds a '(blend' that is not a blend this grammar reads (a blend is "
                         f"the end of the line, '(blend N)' with N a whole number of chunks, e.g. '... (blend 2)' or "
                         f"'... (blend 2, slerp)'); write it so, or leave it out of the prompt text")
    if _TRAILING_WEIGHT.search(text) and not weighted:
        raise ValueError(f"{where}: {shown!r} ends in ' :' with no weight after it; write the weight after the colon "
                         f"(e.g. 'a cat :0.7'), or remove the colon")
    if _TRAILING_WEIGHT.search(text):
        raise ValueError(f"{where}: {shown!r} ends in ' :' after its weight was read: a part has one weight, "
                         f"written once after a space and a colon (e.g. 'a cat :0.7 | a dog :0.3'); remove the "
                         f"extra ' :...', or separate the prompts with ' | '")
    return text


def _parse_prompt(body: str, where: str) -> tuple:
    parts = []
    if body.count("|") >= MAX_MIX_PARTS:
        raise ValueError(f"{where}: a mix of {body.count('|') + 1} prompts; mix at most {MAX_MIX_PARTS} (each is "
                         f"encoded on its own)")
    for piece in body.split("|"):
        m = _WEIGHT.match(piece)
        if m is None:
            parts.append((_check_text(_unambiguous(piece, where, weighted=False), where), 1.0))
            continue
        text, w = (m.group(1), m.group(2)) if m.group(1) is not None else ("", m.group(3))
        parts.append((_check_text(_unambiguous(text, where), where),
                      _check_weight(_number(w, "the weight", where), where)))
    return tuple(parts)


@dataclass(frozen=True)
class PromptSchedule:
    entries: tuple
    lines: tuple = field(default=(), compare=False, repr=False)    # each entry's line in the parsed text, if any

    def _where(self, i: int) -> str:
        """How an error names entry ``i``: its line of the parsed text, or its place among the entries."""
        if self.lines:
            return f"prompt schedule line {self.lines[i]}"
        return f"entry {i + 1} (chunk {self.entries[i].chunk})"

    def __post_init__(self):
        entries = tuple(self.entries)
        object.__setattr__(self, "entries", entries)
        if not entries:
            raise ValueError("a prompt schedule needs an entry for chunk 0 (e.g. '0: a cat walks in the garden')")
        if entries[0].chunk != 0:
            raise ValueError(f"{self._where(0)}: the first entry must be for chunk 0 (it is for chunk "
                             f"{entries[0].chunk}); start with '0: <prompt>'")
        for i, e in enumerate(entries):
            where = self._where(i)
            if not isinstance(e.chunk, int) or e.chunk < 0:
                raise ValueError(f"{where}: the chunk {e.chunk!r} must be >= 0, a whole number")
            if i and e.chunk <= entries[i - 1].chunk:
                raise ValueError(f"{where}: chunk {e.chunk} does not come after chunk {entries[i - 1].chunk} "
                                 f"({self._where(i - 1)}); chunks must strictly increase: order the lines by chunk, "
                                 f"one line per chunk")
            if e.chunk >= MAX_CHUNKS:
                raise ValueError(f"{where}: chunk {e.chunk} is past the longest video ({MAX_CHUNKS} chunks, "
                                 f"0..{MAX_CHUNKS - 1}); use a chunk of the video")
            if not e.parts:
                raise ValueError(f"{where}: no prompt text")
            if len(e.parts) > MAX_MIX_PARTS:
                raise ValueError(f"{where}: a mix of {len(e.parts)} prompts; mix at most {MAX_MIX_PARTS}")
            for t, w in e.parts:
                _check_text(t, where)
                _check_weight(w, where)
            shares = e.weights()
            if min(shares) <= 0.0:
                t, w = e.parts[shares.index(min(shares))]
                raise ValueError(f"{where}: the weight {w!r} of {t[:40]!r} is too small beside "
                                 f"{max(x for _, x in e.parts)!r} for its share to be a number (it rounds to 0); "
                                 f"give weights within a factor of 1e300 of each other")
            if e.mode not in BLEND_MODES:
                raise ValueError(f"{where}: blend mode {e.mode!r} is not one of {BLEND_MODES}; write "
                                 f"'(blend {e.blend}, slerp)' or '(blend {e.blend})'")
            if not isinstance(e.blend, int) or e.blend < 0:
                raise ValueError(f"{where}: the blend length {e.blend!r} must be >= 0 chunks, a whole number")
            if e.chunk == 0 and e.blend:
                raise ValueError(f"{where}: chunk 0 has no earlier prompt to blend from; remove its (blend ...)")
            if e.mode == "krea" and e.blend < 2:
                raise ValueError(f"{where}: (blend {e.blend}, krea) never reaches the new prompt (Krea's "
                                 f"interpolation over linspace(0, 1, {max(e.blend, 1)}) stays on the old one); write "
                                 f"(blend 2, krea) or more")

    # ------------------------------------------------------------------ text form
    @classmethod
    def parse(cls, text: str) -> "PromptSchedule":
        """The schedule of ``text`` (see the module doc); ValueError naming the line and the fix."""
        if not isinstance(text, str):
            raise ValueError(f"a prompt schedule is text, got {type(text).__name__}")
        entries = []
        for no, raw in enumerate(text.splitlines(), 1):
            where = f"prompt schedule line {no}"
            if len(raw) > MAX_LINE_CHARS:       # before any pattern runs over it
                raise ValueError(f"{where} has {len(raw):,} characters; an entry is at most {MAX_MIX_PARTS} prompts "
                                 f"of at most {MAX_PROMPT_CHARS:,} characters each (what the text encoder reads)")
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if len(entries) >= MAX_CHUNKS:
                raise ValueError(f"{where}: the prompt schedule has more than {MAX_CHUNKS} entries, but a video has "
                                 f"at most {MAX_CHUNKS} chunks (one entry each); nothing was encoded")
            m = _ENTRY.match(line)
            if m is None or not m.group(1):
                raise ValueError(f"{where}: {line[:60]!r} is not '<chunk>: <prompt>'; write e.g. "
                                 f"'0: a cat walks in the garden'")
            chunk = _number(m.group(1), "the chunk", where, int)
            body, blend, mode = m.group(2), 0, "linear"
            b = _BLEND.search(body)
            if b is not None:
                blend = _number(b.group(1), "the blend length", where, int)
                mode = (b.group(2) if b.group(2) is not None else "linear").lower()
                body = body[:b.start()]
            entries.append((no, Entry(chunk, _parse_prompt(body, where), blend, mode)))
        if not entries:
            raise ValueError(f"the prompt schedule has no entries; write one line per switch, e.g. {EXAMPLE!r}")
        return cls(tuple(e for _, e in entries), tuple(no for no, _ in entries))

    def to_text(self) -> str:
        return "\n".join(e.line() for e in self.entries) + "\n"

    @classmethod
    def coerce(cls, value) -> "PromptSchedule":
        """A schedule from a PromptSchedule or its text form."""
        return value if isinstance(value, cls) else cls.parse(value)

    # ------------------------------------------------------------------ against a run
    def validate(self, num_chunks: int) -> "PromptSchedule":
        """Clear error when the schedule does not fit a run of ``num_chunks`` chunks; returns self."""
        last = self.entries[-1].chunk
        if last >= num_chunks:
            raise ValueError(f"the prompt schedule switches at chunk {last} but the run has chunks 0..{num_chunks - 1}"
                             f"; use chunks below {num_chunks} (or make the video longer)")
        return self          # (entries strictly increase from chunk 0: at most one per chunk of the run)

    def until(self, num_chunks: int) -> "PromptSchedule":
        """The entries that start before chunk ``num_chunks`` (the part of a longer video's schedule a shorter run
        follows; its contexts are the longer schedule's first ``num_chunks``)."""
        return PromptSchedule(tuple(e for e in self.entries if e.chunk < num_chunks))

    def texts(self) -> list:
        """The distinct texts to encode, in first-use order."""
        return list(dict.fromkeys(t for e in self.entries for t, _ in e.parts))

    def _specs(self, num_chunks: int) -> list:
        """A hashable description of every chunk's context (equal descriptions: the same context)."""
        specs, by_chunk, prev = [], {e.chunk: e for e in self.entries}, None
        active = None                              # (start chunk, from spec, entry)
        for c in range(num_chunks):
            e = by_chunk.get(c)
            if e is not None:
                target = ("mix", tuple(zip((t for t, _ in e.parts), e.weights())))
                active = (c, prev, e, target) if e.blend and prev is not None else (c, None, e, target)
            start, src, e, target = active
            j = c - start
            if e.mode == "krea":                   # lerp over linspace(0, 1, N): step 0 repeats the previous context
                spec = (target if src is None or j >= e.blend - 1 or src == target else src if j == 0 else
                        ("blend", src, target, float(torch.linspace(0, 1, steps=e.blend)[j]), e.mode))
            elif src is None or j + 1 >= e.blend or src == target:
                spec = target
            else:
                spec = ("blend", src, target, (j + 1) / e.blend, e.mode)
            specs.append(spec)
            prev = spec
        return specs

    def switch_chunks(self, num_chunks: int) -> list:
        """The chunks > 0 whose context differs from the previous chunk's."""
        specs = self._specs(num_chunks)
        return [c for c in range(1, num_chunks) if specs[c] != specs[c - 1]]

    def contexts(self, embeddings: dict, num_chunks: int) -> list:
        """The raw context of every chunk, from ``embeddings`` {text: [B or 1, L, text_dim]} (mixes and blends in
        float32, cast back to the embeddings' dtype). Chunks with the same context share one tensor."""
        missing = [t for t in self.texts() if t not in embeddings]
        if missing:
            raise ValueError(f"no text embedding for prompt(s) {missing[:3]}; encode every text of schedule.texts()")
        raw = {t: embeddings[t] for t in self.texts()}
        dims = {(v.dim(), v.shape[-1]) for v in raw.values()}
        if len(dims) != 1 or next(iter(dims))[0] != 3:
            raise ValueError(f"the prompt embeddings must all be [B or 1, L, text_dim] with one text_dim, got "
                             f"{sorted({tuple(v.shape) for v in raw.values()})}")
        dtype = next(iter(raw.values())).dtype
        length = max(v.shape[1] for v in raw.values())
        padded = {t: _pad(v, length) for t, v in raw.items()}
        built: dict = {}

        def build(spec):
            if spec not in built:
                if spec[0] == "mix":
                    parts = spec[1]
                    if len(parts) == 1:
                        built[spec] = padded[parts[0][0]]
                    else:
                        built[spec] = sum(padded[t].float() * w for t, w in parts).to(dtype)
                else:
                    _, src, dst, alpha, mode = spec
                    built[spec] = blend(build(src), build(dst), alpha, mode).to(dtype)
            return built[spec]

        return [build(s) for s in self._specs(num_chunks)]


def _pad(t: torch.Tensor, length: int) -> torch.Tensor:
    if t.shape[1] == length:
        return t
    return torch.cat([t, t.new_zeros(t.shape[0], length - t.shape[1], t.shape[2])], dim=1)


def blend(a: torch.Tensor, b: torch.Tensor, alpha: float, mode: str = "linear") -> torch.Tensor:
    """(1 - alpha) a + alpha b ('linear'), or per token row the spherical interpolation
    sin((1 - alpha) w) / sin(w) a + sin(alpha w) / sin(w) b with cos(w) the rows' cosine ('slerp'; rows that are
    zero or within SLERP_PARALLEL_COS of (anti-)parallel are blended linearly); 'krea': ``torch.lerp(a, b, alpha)``
    (Krea Realtime's interpolation, alpha a float32 step of ``linspace(0, 1, N)``). float32 math, float32 result."""
    if mode not in BLEND_MODES:
        raise ValueError(f"blend mode must be one of {BLEND_MODES}, got {mode!r}")
    a32, b32 = a.float(), b.float()
    alpha = float(alpha)
    if mode == "krea":
        return torch.lerp(a32, b32, torch.tensor(alpha, dtype=torch.float32))
    lin = (1.0 - alpha) * a32 + alpha * b32
    if mode == "linear":
        return lin
    a32, b32 = torch.broadcast_tensors(a32, b32)
    na, nb = a32.norm(dim=-1, keepdim=True), b32.norm(dim=-1, keepdim=True)
    cos = ((a32 * b32).sum(-1, keepdim=True) / (na * nb).clamp_min(torch.finfo(torch.float32).tiny)).clamp(-1, 1)
    omega = torch.acos(cos)
    so = torch.sin(omega)
    safe = so.clamp_min(torch.finfo(torch.float32).eps)
    sl = torch.sin((1.0 - alpha) * omega) / safe * a32 + torch.sin(alpha * omega) / safe * b32
    linear_rows = (cos.abs() > SLERP_PARALLEL_COS) | (na == 0) | (nb == 0)
    return torch.where(linear_rows, lin.expand_as(sl), sl)


__all__ = ["PromptSchedule", "Entry", "blend", "check_prompt_text", "ends_in_blend", "BLEND_MODES", "SLERP_PARALLEL_COS",
           "MAX_CHUNKS", "MAX_PROMPT_CHARS", "MAX_MIX_PARTS", "TEXT_TOKENS"]
