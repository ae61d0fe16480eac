"""Matrix-Game-2 fixture format for ``check-reference``: every recorded tensor of the official run.

Compared: the scheduler tables, the call sequence (kinds, starts, timesteps and every cache's
[global_end, local_end] after each call), ``xt``/``flow``/``x0`` of every call, the intermediates of the
recorded calls (patch embedding, img_emb, each block's output, the action modules' input/output and branch
contributions), ``output``, and the final self-attention, mouse and keyboard caches (oldest entry first).
Every number comes from the fixture's config JSON.
"""
from __future__ import annotations

from pathlib import Path

import torch

FIXTURE_NAME = "matrix_game2_causal_action_sampling"


def detect(cfg: dict) -> bool:
    return cfg.get("fixture") == FIXTURE_NAME or (
        isinstance(cfg.get("config"), dict) and "action_config" in cfg["config"] and "calls" in cfg)


def fixture_config(cfg: dict):
    """WanConfig of the fixture (``clip_dim`` is stored at the top level of the JSON)."""
    from ...model.config import WanConfig
    c = dict(cfg["config"])
    if "clip_dim" in cfg:
        c["clip_dim"] = cfg["clip_dim"]
    return WanConfig.from_dict(c)


def load_fixture_model(directory: Path, cfg: dict, device="cpu"):
    from ...model.loader import load_wan_checkpoint
    return load_wan_checkpoint(Path(directory) / cfg["weights_file"], device=device, dtype=torch.float32,
                               precision="float32", config=fixture_config(cfg), attention="sdpa")


class _Recorder:
    """Forward hooks that keep the intermediates of the calls named in the fixture."""

    def __init__(self, model, wanted: dict):
        self.wanted = {int(v): k for k, v in wanted.items()}        # call index -> 'callN'
        self.current, self.saved, self.once, self.calls = {}, {}, {}, 0
        self.handles = []
        hook = lambda name, store: (lambda _m, _i, out: store.__setitem__(name, out.detach().clone()))
        self.handles.append(model.patch_embedding.register_forward_hook(hook("patch_embedding", self.current)))
        self.handles.append(model.img_emb.register_forward_hook(hook("img_emb", self.once)))
        for i, block in enumerate(model.blocks):
            self.handles.append(block.register_forward_hook(hook(f"block{i}", self.current)))
        for b in model.action_config.blocks:
            act = model.blocks[b].action_model
            self.handles.append(act.register_forward_hook(
                lambda _m, inp, out, b=b: self.current.update({f"block{b}.action_in": inp[0].detach().clone(),
                                                                f"block{b}.action_out": out.detach().clone()})))
            for name in ("proj_mouse", "proj_keyboard"):
                if hasattr(act, name):
                    self.handles.append(getattr(act, name).register_forward_hook(
                        hook(f"block{b}.{name}", self.current)))

    def after_call(self) -> None:
        tag = self.wanted.get(self.calls)
        if tag is not None:
            self.saved[tag] = dict(self.current, **self.once)
        self.current.clear()
        self.calls += 1

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _call_key(rec: dict) -> str:
    return f"chunk{rec['chunk']}." + ("context" if rec["kind"] == "context" else f"step{rec['step']}")


def run(directory, cfg: dict, device="cpu") -> list:
    from .mg2 import sample_mg2
    from ...model.kv_cache import KVCache
    from .reference import _calls_row, _load_io, _schedule_from, _schedule_rows, call_tensors
    directory = Path(directory)
    model = load_fixture_model(directory, cfg, device)
    io = _load_io(directory, cfg)
    sched = _schedule_from(cfg)
    window = int(cfg["config"]["local_attn_size"])
    noise = io["initial_noise"]
    b, _, f, h, w = noise.shape
    c = model.config
    frame_tokens = cfg.get("frame_seq_length") or (h // c.patch_size[1]) * (w // c.patch_size[2])
    kv = KVCache.for_model(model, b, frame_tokens, f, window, 0)
    actions = model.new_action_call(io["mouse_cond"].to(device) if "mouse_cond" in io else None,
                                    io["keyboard_cond"].to(device) if "keyboard_cond" in io else None, window)
    recorder = _Recorder(model, cfg.get("intermediates", {}).get("calls", {}))
    records, ends = [], []

    def trace(rec):
        recorder.after_call()
        records.append(rec)
        ends.append(_cache_ends(kv, actions))

    def provide(ci, k, shape, dtype, dev):
        return io[f"extra_noise.chunk{ci}.step{k}"].reshape(shape).to(dev, dtype)

    try:
        out = sample_mg2(model, noise.to(device), io["cond_concat"].to(device), io["visual_context"].to(device),
                         actions.mouse, actions.keyboard, sched, window, noise_provider=provide, tracer=trace,
                         kv_cache=kv, actions=actions)
    finally:
        recorder.close()
    rows = _schedule_rows(sched, io, cfg) + [_calls_row(records, cfg, ends)]
    for key, ours in call_tensors(records, cfg, _call_key, io, transpose=True):
        rows.append(io.compare(key, ours))
    for key in expected_intermediates(cfg, io):
        tag, _, name = key[len("inter."):].partition(".")
        rows.append(io.compare(key, recorder.saved.get(tag, {}).get(name)))
    rows.append(io.compare("output", out))
    return rows + _cache_rows(model, kv, actions, io, cfg)


def expected_intermediates(cfg: dict, io=()) -> list:
    """The intermediates the config implies (for each call ``intermediates.calls`` names: the patch embedding,
    img_emb, every block's output, and for each action block its input, output and the branch contribution of
    each enabled branch), then every other one ``io`` records."""
    c, a = cfg["config"], cfg["config"].get("action_config", {})
    names = ["patch_embedding", "img_emb"] + [f"block{i}" for i in range(int(c["num_layers"]))]
    for b in a.get("blocks", ()):
        names += [f"block{b}.action_in", f"block{b}.action_out"]
        names += [f"block{b}.proj_mouse"] if a.get("enable_mouse", True) else []
        names += [f"block{b}.proj_keyboard"] if a.get("enable_keyboard", True) else []
    keys = [f"inter.{tag}.{n}" for tag in cfg.get("intermediates", {}).get("calls", {}) for n in names]
    return list(dict.fromkeys(keys + sorted(k for k in io if k.startswith("inter."))))


def _cache_ends(kv, actions) -> dict:
    def pair(cache):
        return [cache.end, min(cache.end, cache.capacity)]
    out = {"self_attn": pair(kv)}
    if actions.mouse_cache is not None:
        out["mouse"] = pair(actions.mouse_cache)
    if actions.keyboard_cache is not None:
        out["keyboard"] = pair(actions.keyboard_cache)
    return out


def _cache_rows(model, kv, actions, io, cfg: dict) -> list:
    """The final self-attention, mouse and keyboard caches: every one expected when the config describes them
    (``final_caches``), else the ones recorded."""
    expected = "final_caches" in cfg
    pairs = [(f"kv_final.layer{i}", kv, i) for i in range(len(kv.layers))]
    for slot, b in enumerate(model.action_config.blocks):
        if actions.mouse_cache is not None:
            pairs.append((f"mouse_kv_final.layer{b}", actions.mouse_cache, slot))
        if actions.keyboard_cache is not None:
            pairs.append((f"keyboard_kv_final.layer{b}", actions.keyboard_cache, slot))
    rows = []
    for prefix, cache, layer in pairs:
        k, v = cache.ordered(layer)
        for name, ours in (("k", k), ("v", v)):
            key = f"{prefix}.{name}"
            if expected or key in io:
                rows.append(io.compare(key, ours))
    return rows
