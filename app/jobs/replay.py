"""Replay of the official fixtures (``tests/fixtures``, formats in their READMEs): one loader for every format
``check-reference`` knows (``Fixture``: config, recorded tensors, model, step list) and the official run through
one call into the sampling loop (``replay``). ``check-reference`` (reference.py) and ``bench fidelity`` use it."""
from __future__ import annotations

import dataclasses

import math
from functools import cached_property
from pathlib import Path

import torch

from ...cache.finite_flags import non_finite

INF = float("inf")
TOLERANCE = 1e-4                 # the largest max abs difference a recorded tensor may have
MG2_FIXTURE = "matrix_game2_causal_action_sampling"
KREA_FIXTURES = ("krea_realtime_recompute", "krea_realtime_partial_block", "krea_realtime_interrupted")
LONGLIVE_FILES = {"io_file": "longlive_io.safetensors", "lora_file": "lora_peft.safetensors",   # produce.py's
                  "merged_file": "merged_weights.safetensors"}


def _is_longlive(cfg: dict) -> bool:
    variants = cfg.get("variants")
    return (isinstance(variants, dict) and bool(variants) and "base_weights" in cfg and "global_sink" in cfg
            and all(isinstance(v, dict) and "switch_frame_indices" in v and "calls" in v for v in variants.values()))


KINDS = {  # format name -> detect(config), tried in this order
    "wan_t2v_full": lambda cfg: cfg.get("fixture") == "wan_t2v_full_sequence_forward",
    "causal_wan": lambda cfg: cfg.get("fixture") == "causal_wan_kv_cached_sampling",
    "matrix_game2": lambda cfg: cfg.get("fixture") == MG2_FIXTURE or (
        isinstance(cfg.get("config"), dict) and "action_config" in cfg["config"] and "calls" in cfg),
    "longlive": _is_longlive,
    "krea_realtime": lambda cfg: cfg.get("fixture") in KREA_FIXTURES,
}


def kind_of(cfg) -> str | None:
    """The format of a fixture config (a ``KINDS`` name), or None."""
    return next((name for name, detect in KINDS.items() if isinstance(cfg, dict) and detect(cfg)), None)


class FixtureError(ValueError):
    """A fixture the check cannot use (a file that is missing or damaged, a config key or recorded tensor that is
    not there); the message names the file and the fix."""


class FixtureConfig(dict):
    """A fixture's config JSON: a key that is not there names the config file and the key (never a bare
    KeyError)."""

    def __init__(self, data: dict, path: Path, where: str = ""):
        super().__init__({k: _config_value(v, path, f"{where}{k}.") for k, v in data.items()})
        self.path, self.where = Path(path), where

    def __missing__(self, key):
        section = f" in '{self.where[:-1]}'" if self.where else ""
        raise FixtureError(f"{self.path.name}: no '{key}'{section}; this fixture config is incomplete: copy it again "
                           f"from the fixture's source (or produce it again)")


def _config_value(value, path: Path, where: str):
    if isinstance(value, dict):
        return FixtureConfig(value, path, where)
    if isinstance(value, list):
        return [_config_value(v, path, where) for v in value]
    return value


class Row(tuple):
    """One compared tensor: ``(name, max_abs_diff)`` (a 2-tuple, so ``dict(rows)`` and ``for n, d in rows``
    work), with ``note`` saying why a row failed without a number (a tensor missing from the fixture, a fixture
    that could not run)."""

    def __new__(cls, name: str, diff, note: str | None = None):
        row = tuple.__new__(cls, (str(name), float(diff)))
        row.note = note
        return row


def row_ok(diff: float, tol: float = TOLERANCE) -> bool:
    """Whether one row passes: a number within the tolerance (NaN and inf fail)."""
    return isinstance(diff, (int, float)) and math.isfinite(diff) and diff <= tol


def max_abs_diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours = ours.detach().to("cpu", torch.float64)
    ref = ref.detach().to("cpu", torch.float64)
    if ours.shape != ref.shape:
        if ours.numel() != ref.numel():
            return float("inf")
        ours = ours.reshape(ref.shape)
    if ref.numel() == 0:
        return 0.0
    return float((ours - ref).abs().max())


class Recorded(dict):
    """The tensors of a fixture's io file: an input the run needs (``io[key]``) that is not there, or that holds
    NaN or inf, names the file and the key (``FixtureError``); ``compare(key, ours)`` is the row of one expected
    recorded tensor (inf, with a note, when the file lacks it or the run made nothing to compare; a recorded tensor
    of NaN or inf fails its row, with a note naming it); ``reference(key)`` is a recorded tensor as it is."""

    def __init__(self, tensors: dict, path: Path):
        super().__init__(tensors)
        self.path = Path(path)
        self.nonfinite = set(non_finite(tensors))          # one host sync for the whole file

    def __missing__(self, key):
        raise FixtureError(f"{self.path.name}: no tensor '{key}', which the run needs; the fixture is incomplete: "
                           f"copy or produce it again")

    def __getitem__(self, key):
        tensor = super().__getitem__(key)
        if key in self.nonfinite:
            raise FixtureError(f"{self.path.name}: tensor '{key}', which the run needs, holds NaN or inf; the "
                               f"fixture is damaged: copy or produce it again")
        return tensor

    def reference(self, key: str) -> torch.Tensor:
        """A recorded tensor to compare with (kept when it holds NaN or inf: its row fails)."""
        return dict.__getitem__(self, key) if key in self else self.__missing__(key)

    def compare(self, key: str, ours, diff=None, name: str | None = None) -> Row:
        name = key if name is None else name
        if key not in self:
            return Row(name, INF, f"expected, but missing from {self.path.name}")
        if ours is None:
            return Row(name, INF, "recorded, but the run made nothing to compare it with")
        value = (diff or max_abs_diff)(ours, self.reference(key))
        note = f"the recorded tensor holds NaN or inf in {self.path.name}" if key in self.nonfinite else None
        return Row(name, value if note is None or not row_ok(value) else INF, note)

    def noise(self, name):
        """A noise provider of the recorded draws: ``name(chunk, step)`` is the key of each."""
        return lambda ci, k, shape, dtype, dev: self[name(ci, k)].reshape(shape).to(dev, dtype)


def load_recorded(path) -> Recorded:
    """The tensors of a fixture's io file: one that is missing, damaged or truncated (the checkpoints' header check,
    ``read_header``, before anything is loaded) is a ``FixtureError`` naming it; a recorded tensor of NaN or inf is
    kept (its rows fail, naming it; as an input it is refused naming the file and key)."""
    from safetensors.torch import load_file

    from ...model.checkpoint import read_header
    path = Path(path)
    if not path.is_file():
        raise FixtureError(f"{path.name}: {'not a regular file' if path.exists() else 'not found'} (the recorded "
                           f"tensors of the fixture, in {path.parent}); copy or produce the fixture again")
    try:
        read_header(path)          # the checkpoints' header check: every tensor's bytes in the file, before loading
        return Recorded(load_file(str(path)), path)
    except Exception as exc:  # noqa: BLE001 - safetensors' own error types: a damaged file, said as one
        reason = " ".join(str(exc).split("; pickle checkpoints")[0].split())[:200] or type(exc).__name__
        raise FixtureError(f"{path.name}: not a readable safetensors file ({reason}): it is damaged or truncated; "
                           f"copy or produce the fixture again") from None


class Fixture:
    """One fixture: its folder, config (a dict; a ``FixtureConfig`` names what is missing), format (``kind``, from
    the config), recorded tensors (``io``, read when first used), model and step list."""

    def __init__(self, directory, cfg: dict):
        self.directory, self.cfg, self.kind = Path(directory), cfg, kind_of(cfg)

    def file(self, key: str) -> Path:
        """The file the config names under ``key`` (LongLive: the producer's names when the config has none)."""
        default = LONGLIVE_FILES.get(key) if self.kind == "longlive" else None
        return self.directory / (self.cfg[key] if default is None else self.cfg.get(key, default))

    @cached_property
    def io(self) -> Recorded:
        return load_recorded(self.file("io_file"))

    def model(self, device, weights: Path | None = None, lora: Path | None = None):
        """The fixture's model in float32 with SDPA, from ``weights`` (default: the weights the config names)."""
        from ...model.config import WanConfig
        from ...model.loader import load_wan_checkpoint
        if self.kind == "longlive":                                  # window and sink: per variant
            config = dict(self.cfg["model"], local_attn_size=-1, sink_size=0)
            weights = weights or (self.directory / self.cfg["base_weights"]).resolve()
        else:                                 # Matrix-Game-2 stores clip_dim at the top level of the JSON
            config = dict(self.cfg["config"], **({"clip_dim": self.cfg["clip_dim"]} if "clip_dim" in self.cfg else {}))
        return load_wan_checkpoint(weights or self.file("weights_file"), device=device, dtype=torch.float32,
                                   precision="float32", config=WanConfig.from_dict(config), attention="sdpa",
                                   lora=lora)

    def schedule(self):
        """The official step list as a ``Schedule``: every number from the config."""
        from ...sampling.krea import krea_schedule
        from ...sampling.scheduler import resolve_schedule
        if self.kind == "krea_realtime":
            s = self.cfg["session"]
            return krea_schedule(int(s["num_denoising_steps"]), float(s["strength"]), float(s["timestep_shift"]))
        if self.kind == "longlive":
            s = self.cfg["schedule"]
            return resolve_schedule("custom", steps=s["steps"], shift=s["shift"], warp=s.get("warp", True),
                                    num_train_timesteps=1000)
        s = self.cfg["sampler"]
        return resolve_schedule("custom", steps=s["denoising_step_list_config"], shift=s["timestep_shift"],
                                warp=s.get("warp_denoising_step", True),
                                num_train_timesteps=s.get("scheduler", {}).get("num_train_timesteps", 1000))

    def kv_cache(self, model):
        """Causal Wan and Matrix-Game-2: a KV cache of the run's size (its window and sink from the config, none for
        Matrix-Game-2; ``frame_seq_length`` tokens per frame, else the latent size's), as the run makes it."""
        from ...model.kv_cache import KVCache
        mg2, c, noise, p = self.kind == "matrix_game2", self.cfg["config"], self.io["initial_noise"], model.config
        b, f, (h, w) = noise.shape[0], noise.shape[2 if mg2 else 1], noise.shape[-2:]
        frame_tokens = self.cfg.get("frame_seq_length") or (h // p.patch_size[1]) * (w // p.patch_size[2])
        window, sink = ((int(c["local_attn_size"]), 0) if mg2 else
                        (c.get("local_attn_size", -1), c.get("sink_size", 0)))
        return KVCache.for_model(model, b, frame_tokens, f, window, sink)

    def actions(self, model):
        """Matrix-Game-2: the action call of the recorded mouse and keyboard sequences (its caches to inspect)."""
        io, window = self.io, int(self.cfg["config"]["local_attn_size"])
        return model.new_action_call(io["mouse_cond"].to(model.device) if "mouse_cond" in io else None,
                                     io["keyboard_cond"].to(model.device) if "keyboard_cond" in io else None, window)

    def prompts(self) -> dict:
        """{prompt name: recorded embedding} of LongLive (its prompt texts) and Krea (p0, p1, ...)."""
        if self.kind == "longlive":
            return {p: self.io[f"prompt{i}"] for i, p in enumerate(self.cfg["prompts"])}
        count = 1 + max([int(ch["prompt"]) for ch in self.cfg["prompt_changes"]], default=0)
        return {f"p{i}": self.io[f"prompt{i}"] for i in range(count)}      # a missing one names the io file

    def prompt_schedule(self, variant: str | None = None) -> str:
        """The prompt changes as a prompt schedule. LongLive: a switch applies from the first chunk at or after
        each of the variant's ``switch_frame_indices``; Krea: each change (requested before block b, interpolated
        over N blocks) as ``krea_schedule_line``, exact also for a change that interrupts a running one."""
        from ...sampling.krea import krea_schedule_line
        if self.kind == "longlive":
            fpb = int(self.cfg["frames_per_block"])
            chunks = [0] + [-(-int(f) // fpb) for f in self.cfg["variants"][variant]["switch_frame_indices"]]
            return "\n".join(f"{c}: {p}" for c, p in zip(chunks, self.cfg["prompts"]))
        return "\n".join(["0: p0"] + [krea_schedule_line(int(ch["block"]), f"p{int(ch['prompt'])}",
                                                         int(ch["interp_steps"])) for ch in self.cfg["prompt_changes"]])


def _causal_run(fx: Fixture, model, _variant, _hooks) -> tuple:
    s, io, c = fx.cfg["sampler"], fx.io, fx.cfg["config"]
    return io["context"].to(model.device), io["initial_noise"].to(model.device), s["num_frame_per_block"], dict(
        noise_provider=io.noise(lambda ci, k: f"extra_noise.block{ci}.step{k}"),
        refresh_t=float(s.get("context_noise", 0)), independent_first_frame=bool(s.get("independent_first_frame", False)),
        kv_window=int(c.get("local_attn_size", -1)), sink=int(c.get("sink_size", 0)))


def _mg2_run(fx: Fixture, model, _variant, hooks) -> tuple:
    from ...sampling.mg2 import FRAMES_PER_BLOCK
    io, window, device = fx.io, int(fx.cfg["config"]["local_attn_size"]), model.device
    noise = io["initial_noise"].to(device)
    actions, kv = hooks.pop("actions", None), hooks.pop("kv_cache", None)      # as sample_mg2 makes them
    actions = actions if actions is not None else fx.actions(model)
    kv = kv if kv is not None else fx.kv_cache(model)
    return io["visual_context"].to(device), noise.transpose(1, 2), FRAMES_PER_BLOCK, dict(
        noise_provider=io.noise(lambda ci, k: f"extra_noise.chunk{ci}.step{k}"), kv_window=window, sink=0,
        y=io["cond_concat"].transpose(1, 2).to(device), kv_cache=kv, model_kwargs={"actions": actions})


def _longlive_run(fx: Fixture, _model, variant: str, _hooks) -> tuple:
    from ...sampling.prompts import PromptSchedule
    v, io, embeddings = fx.cfg["variants"][variant], fx.io, fx.prompts()
    per_chunk = len(fx.cfg["schedule"]["steps"]) - 1
    return embeddings[fx.cfg["prompts"][0]], io["initial_noise"], int(fx.cfg["frames_per_block"]), dict(
        noise_provider=io.noise(lambda ci, k: f"renoise.{ci * per_chunk + k:03d}"),
        kv_window=int(v["local_attn_size"]), sink=int(v["sink_size"]), refresh_t=float(fx.cfg.get("context_noise", 0)),
        prompt_schedule=PromptSchedule.parse(fx.prompt_schedule(variant)), prompt_embeddings=embeddings,
        recache="switch")


def _krea_run(fx: Fixture, _model, _variant, hooks) -> tuple:
    from ...sampling.krea import KreaRecompute
    s, r, handed = fx.cfg["session"], fx.cfg["reencode"], hooks.pop("handed", [])
    fpb, k = int(s["num_frame_per_block"]), int(s["kv_cache_num_frames"])

    def reencode(x):
        handed.append(x.detach().to("cpu", torch.float32).clone())
        return float(r["a"]) * x.half().float() + float(r["b"])   # the session hands the frame over in float16

    policy = KreaRecompute(k, fpb, reencode=reencode, keep_first_frame=bool(s.get("keep_first_frame", False)))
    return None, fx.io["initial_noise"], fpb, dict(
        noise_provider=fx.io.noise(lambda ci, step: f"extra_noise.block{ci}.step{step}"), kv_window=k + fpb,
        prompt_schedule=fx.prompt_schedule(), prompt_embeddings=fx.prompts(), recache="none", cache_policy=policy)


RUNS = {"causal_wan": _causal_run, "matrix_game2": _mg2_run, "longlive": _longlive_run, "krea_realtime": _krea_run}


def replay(fx: Fixture, model, variant: str | None = None, *, path: str = "auto", options=None,
           **keywords) -> torch.Tensor:
    """The official run of ``fx`` on ``model`` (LongLive: of ``variant``), through the one prepare call with the
    doctor off and the model kept as it is (``path`` and the optimized path's ``options`` as given: a replay checks
    the paths themselves);
    the latents in the fixture's layout. ``keywords``: the run's hooks (tracer, callback), ``kv_cache`` (a cache to
    inspect), ``actions`` (Matrix-Game-2: the action call whose caches to inspect) or ``handed`` (Krea: a list that
    receives every frame handed to the stand-in re-encoder)."""
    from ..prepare import RunSpec, Setup, prepare
    from ...sampling.request import RunInputs, SamplingHooks
    from ...sampling.runner import FastOptions
    if fx.kind not in RUNS:
        raise ValueError(f"a {fx.kind} fixture has no sampling run to replay (runs: {', '.join(RUNS)})")
    context, noise, fpb, given = RUNS[fx.kind](fx, model, variant, keywords)
    given.update(keywords)
    fields = {kind: {f.name for f in dataclasses.fields(kind)} for kind in (RunSpec, RunInputs, SamplingHooks)}
    parts = {kind: {k: v for k, v in given.items() if k in names} for kind, names in fields.items()}
    unknown = sorted(set(given) - set().union(*fields.values()))
    if unknown:
        raise TypeError(f"replay takes no {unknown}")
    spec = RunSpec(schedule=fx.schedule(), frames_per_block=fpb, doctor=False, oom_retry="off", **parts[RunSpec])
    run = prepare(model, spec, RunInputs(context=context, noise=noise, **parts[RunInputs]),
                  SamplingHooks(**parts[SamplingHooks]),
                  setup=Setup(path, None if options is None else FastOptions.coerce(options), [], {}))
    out = run.latents()
    return out.transpose(1, 2) if fx.kind == "matrix_game2" else out
