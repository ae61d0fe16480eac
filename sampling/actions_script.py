"""Action scripts for Matrix-Game-2: a short text -> per-video-frame keyboard and mouse sequences.

Grammar (case-insensitive; spaces ignored; items separated by commas or new lines; ``#`` starts a comment)::

    script := item { "," item }
    item   := action [ "*" COUNT ]           COUNT = video frames (a positive integer, default 1)
    action := "idle" | term { "+" term }
    term   := KEY | "mouse(" PITCH "," YAW ")" | "look_up" | "look_down" | "look_left" | "look_right"

Keys per mode (the checkpoint's keyboard channels, in order):

* ``universal``: ``W`` (forward), ``S`` (back), ``A`` (left), ``D`` (right); mouse (pitch, yaw)
* ``gta_drive``: ``W`` (forward), ``S`` (back); mouse (pitch, yaw), yaw steers
* ``templerun``: ``nomove``, ``jump``, ``slide``, ``turnleft``, ``turnright``, ``leftside``, ``rightside``;
  no mouse

``mouse(p, y)`` sets the two mouse channels (camera pitch and yaw per frame; the released demos use 0.1), each
within [-MAX_MOUSE, MAX_MOUSE] = [-1, 1]; ``look_*`` are shorthands for +-0.1. ``idle`` is no key and no mouse
movement. A script is at most MAX_SCRIPT_CHARS characters and covers at most MAX_SCRIPT_FRAMES video frames after
the start frame (the longest video the sampler makes). Example::

    W*20, W+A*8, mouse(0.1,0)*12, idle*4

The script describes the video frames that follow the start image; the start frame (video frame 0) repeats
the first item's action, as in the released pipeline. The counts must add up to a multiple of 4
(4 video frames per latent frame): ``N`` scripted frames give ``1 + N`` video frames and ``1 + N/4`` latent
frames.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

VIDEO_FRAMES_PER_LATENT = 4
LOOK_VALUE = 0.1
MAX_MOUSE = 1.0                 # camera pitch/yaw per frame: the released demos use 0.1
MAX_VIDEO_FRAMES = 4093         # the longest video of every sampler (as the sampler node's widget)
MAX_SCRIPT_FRAMES = MAX_VIDEO_FRAMES - 1    # scripted frames after the start frame
MAX_SCRIPT_CHARS = 65536

MODES = {
    "universal": {"keys": ("w", "s", "a", "d"), "mouse": True,
                  "aliases": {"forward": "w", "back": "s", "left": "a", "right": "d"}},
    "gta_drive": {"keys": ("w", "s"), "mouse": True, "aliases": {"forward": "w", "back": "s"}},
    "templerun": {"keys": ("nomove", "jump", "slide", "turnleft", "turnright", "leftside", "rightside"),
                  "mouse": False, "aliases": {}},
}
LOOKS = {"look_up": (LOOK_VALUE, 0.0), "look_down": (-LOOK_VALUE, 0.0),
         "look_left": (0.0, -LOOK_VALUE), "look_right": (0.0, LOOK_VALUE)}

_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?"
_MOUSE = re.compile(rf"^mouse\(({_NUM}),({_NUM})\)$")
_ITEM = re.compile(r"^(?P<action>.+?)(?:\*(?P<count>[^*]*))?$")


def video_frames(latent_frames: int) -> int:
    """The video frames of ``latent_frames`` latent frames: the start frame, then 4 for every later one."""
    return 1 + VIDEO_FRAMES_PER_LATENT * (int(latent_frames) - 1)


class ActionScriptError(ValueError):
    """A script that cannot be turned into an action sequence; the message says what to fix."""


@dataclass
class GameActions:
    """Per-video-frame actions; ``keyboard[j]`` / ``mouse[j]`` are the inputs of video frame j."""
    mode: str
    keyboard: list          # [Nv][keys of the mode] floats (0/1)
    mouse: list | None      # [Nv][2] floats, or None when the mode has no mouse input
    script: str = ""

    @property
    def video_frames(self) -> int:
        return len(self.keyboard)

    @property
    def latent_frames(self) -> int:
        return 1 + (self.video_frames - 1) // VIDEO_FRAMES_PER_LATENT

    def summary(self) -> str:
        chunks, rest = divmod(self.latent_frames, 3)
        extra = f" + {rest} latent frame(s) beyond the last full chunk" if rest else ""
        return (f"{self.mode}: {self.video_frames} video frames = {self.latent_frames} latent frames "
                f"({chunks} chunk(s) of 3{extra})")

    def tensors(self, batch: int = 1, frames: int | None = None, device=None, dtype=None):
        """(mouse [B, Nv, 2] or None, keyboard [B, Nv, K]) torch tensors, the first ``frames`` video frames."""
        import torch

        dtype = dtype or torch.float32
        n = self.video_frames if frames is None else frames
        if n > self.video_frames:
            raise ActionScriptError(f"{n} video frames of actions are needed but the script gives only "
                                    f"{self.video_frames}")
        kb = torch.tensor(self.keyboard[:n], dtype=dtype, device=device)[None].expand(batch, -1, -1)
        ms = None
        if self.mouse is not None:
            ms = torch.tensor(self.mouse[:n], dtype=dtype, device=device)[None].expand(batch, -1, -1)
        return ms, kb


def _parse_term(term: str, mode: str, keys: dict, where: str):
    """-> ('key', index) | ('mouse', (pitch, yaw))."""
    spec = MODES[mode]
    m = _MOUSE.match(term)
    if m or term in LOOKS or term.startswith("mouse"):
        if not spec["mouse"]:
            raise ActionScriptError(f"{where}: mode {mode!r} has no mouse input; remove {term!r}")
        if term in LOOKS:
            return "mouse", LOOKS[term]
        if not m:
            raise ActionScriptError(f"{where}: bad mouse term {term!r}; write mouse(PITCH,YAW), e.g. mouse(0.1,0)")
        vals = (float(m.group(1)), float(m.group(2)))
        if not all(math.isfinite(v) and abs(v) <= MAX_MOUSE for v in vals):
            raise ActionScriptError(f"{where}: mouse values must be finite numbers within [-{MAX_MOUSE:g}, "
                                    f"{MAX_MOUSE:g}] (the released demos use 0.1), got {term!r}")
        return "mouse", vals
    if term not in keys:
        names = ", ".join(k.upper() if len(k) == 1 else k for k in spec["keys"])
        alias = ", ".join(spec["aliases"])
        raise ActionScriptError(f"{where}: unknown key {term!r} for mode {mode!r}; valid keys: {names}"
                                + (f" (aliases: {alias})" if alias else "") + ", idle, "
                                + ("mouse(p,y), look_up/down/left/right" if spec["mouse"] else "no mouse terms"))
    return "key", keys[term]


def _split_items(text: str) -> list[str]:
    """Split at commas and new lines that are not inside parentheses."""
    items, depth, cur = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(0, depth - 1)
        if (ch == "\n" or ch == ",") and depth == 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    items.append("".join(cur))
    return items


def parse_action_script(script: str, mode: str = "universal") -> GameActions:
    """Parse ``script`` for ``mode``; raise :class:`ActionScriptError` with the item at fault."""
    if mode not in MODES:
        raise ActionScriptError(f"unknown action mode {mode!r}; choose one of {', '.join(MODES)}")
    if not isinstance(script, str):
        raise ActionScriptError(f"the action script must be text, got {type(script).__name__}")
    if len(script) > MAX_SCRIPT_CHARS:
        raise ActionScriptError(f"the action script is {len(script)} characters long; at most {MAX_SCRIPT_CHARS} "
                                f"are read: use counts (e.g. 'W*40') instead of repeating items")
    spec = MODES[mode]
    keys = {k: i for i, k in enumerate(spec["keys"])}
    keys.update({a: keys[k] for a, k in spec["aliases"].items()})
    text = "\n".join(line.split("#", 1)[0] for line in script.splitlines())
    items = [re.sub(r"\s+", "", it).lower() for it in _split_items(text)]
    items = [it for it in items if it]
    if not items:
        raise ActionScriptError("the action script is empty; write e.g. 'W*20, W+A*8, mouse(0.1,0)*12, idle*4'")
    kdim = len(spec["keys"])
    keyboard, mouse, total = [], [], 0
    for n, item in enumerate(items, 1):
        where = f"item {n} ({item[:40]!r})"
        m = _ITEM.match(item)
        action, count = m.group("action"), m.group("count")
        if count is None:
            reps = 1
        elif not (count.isascii() and count.isdigit()) or not count.strip("0"):
            raise ActionScriptError(f"{where}: the count after '*' must be a positive whole number of video "
                                    f"frames (digits 0-9), got {count!r}")
        else:
            # more digits than the bound has are over it: never turn a huge digit string into an int
            reps = int(count) if len(count.lstrip("0")) <= len(str(MAX_SCRIPT_FRAMES)) else MAX_SCRIPT_FRAMES + 1
        total += reps
        if total > MAX_SCRIPT_FRAMES:
            raise ActionScriptError(f"{where}: with this item the script covers more than {MAX_SCRIPT_FRAMES} video "
                                    f"frames after the start frame (at most {MAX_SCRIPT_FRAMES}: a "
                                    f"{MAX_VIDEO_FRAMES}-frame video, the longest the sampler makes); lower its "
                                    f"count")
        row, cam = [0.0] * kdim, None
        if action != "idle":
            for term in action.split("+"):
                if not term:
                    raise ActionScriptError(f"{where}: empty term; join keys with '+', e.g. W+A")
                kind, val = _parse_term(term, mode, keys, where)
                if kind == "key":
                    row[val] = 1.0
                elif cam is not None:
                    raise ActionScriptError(f"{where}: more than one mouse term in one action")
                else:
                    cam = val
        keyboard.extend(list(row) for _ in range(reps))
        mouse.extend(list(cam or (0.0, 0.0)) for _ in range(reps))
    total = len(keyboard)
    if total % VIDEO_FRAMES_PER_LATENT:
        short = VIDEO_FRAMES_PER_LATENT - total % VIDEO_FRAMES_PER_LATENT
        raise ActionScriptError(
            f"the script covers {total} video frames after the start frame; this must be a multiple of "
            f"{VIDEO_FRAMES_PER_LATENT} (each latent frame is {VIDEO_FRAMES_PER_LATENT} video frames): add "
            f"{short} frame(s) or remove {total % VIDEO_FRAMES_PER_LATENT}")
    keyboard.insert(0, list(keyboard[0]))
    mouse.insert(0, list(mouse[0]))
    return GameActions(mode=mode, keyboard=keyboard, mouse=mouse if spec["mouse"] else None, script=script)


def check_action_values(acts: GameActions) -> GameActions:
    """Every keyboard value finite in [0, 1] and every mouse value finite in [-MAX_MOUSE, MAX_MOUSE]."""
    for j, row in enumerate(acts.keyboard):
        for v in row:
            if not (isinstance(v, (int, float)) and math.isfinite(v) and 0.0 <= v <= 1.0):
                raise ActionScriptError(f"keyboard value {v!r} of video frame {j}: keys are 0 (up) or 1 (down)")
    for j, row in enumerate(acts.mouse or ()):
        if len(row) != 2:
            raise ActionScriptError(f"mouse row of video frame {j} has {len(row)} values; give (pitch, yaw)")
        for v in row:
            if not (isinstance(v, (int, float)) and math.isfinite(v) and abs(v) <= MAX_MOUSE):
                raise ActionScriptError(f"mouse value {v!r} of video frame {j} is outside [-{MAX_MOUSE:g}, "
                                        f"{MAX_MOUSE:g}] (camera pitch/yaw per frame; the released demos use 0.1)")
    return acts
