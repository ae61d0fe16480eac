"""LongLive v1.0 interactive inference (prompt switches with KV re-cache, rolling window with sink frames, the
generator LoRA) against tensors recorded from the official code (tests/fixtures/longlive/README.md)."""
import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from wan_accel.model.config import WanConfig
from wan_accel.model.lora import LoraError, merge_lora, read_lora, to_comfy
from wan_accel.model.loader import load_wan_checkpoint
from wan_accel.sampling.prompts import PromptSchedule
from run_helpers import run_causal
from wan_accel.sampling.scheduler import resolve_schedule

FIX = Path(__file__).parent / "fixtures" / "longlive"
CFG = json.loads((FIX / "longlive_config.json").read_text())
IO = load_file(str(FIX / "longlive_io.safetensors"))
BASE = (FIX / CFG["base_weights"]).resolve()
LORA = FIX / "lora_peft.safetensors"
MERGED = FIX / "merged_weights.safetensors"
FPB = CFG["frames_per_block"]
BOUND = 1e-4                     # the project's acceptance bound; float32 runs land near 1e-6
EMBEDDINGS = {p: IO[f"prompt{i}"] for i, p in enumerate(CFG["prompts"])}


def _schedule_text(variant: str) -> str:
    """The official switch_frame_indices as a prompt schedule: a switch applies from the first chunk whose first
    frame is at or after the index."""
    switches = CFG["variants"][variant]["switch_frame_indices"]
    chunks = [0] + [-(-f // FPB) for f in switches]
    return "\n".join(f"{c}: {p}" for c, p in zip(chunks, CFG["prompts"]))


def _model(path=BASE, **kw):
    return load_wan_checkpoint(path, config=WanConfig.from_dict(dict(CFG["model"], local_attn_size=-1,
                                                                      sink_size=0)),
                               attention="sdpa", **kw)


def _sched():
    s = CFG["schedule"]
    return resolve_schedule("custom", s["steps"], s["shift"], s["warp"])


def _provide(ci, k, shape, dtype, dev):
    """The official run's re-noise draws, in the order it drew them (steps - 1 per chunk)."""
    per_chunk = len(CFG["schedule"]["steps"]) - 1
    return IO[f"renoise.{ci * per_chunk + k:03d}"].reshape(shape).to(dev, dtype)


def _run(model, variant, path, **kw):
    v = CFG["variants"][variant]
    args = dict(prompt_schedule=PromptSchedule.parse(_schedule_text(variant)), prompt_embeddings=EMBEDDINGS,
                recache="switch")
    args.update(kw)
    return run_causal(model, EMBEDDINGS[CFG["prompts"][0]], IO["initial_noise"], _sched(), FPB,
                         noise_provider=_provide, kv_window=v["local_attn_size"], sink=v["sink_size"], path=path,
                         **args)


def _first_bad_chunk(out, ref):
    diff = (out.float() - ref).abs().amax(dim=(0, 2, 3, 4))
    bad = [i // FPB for i, d in enumerate(diff.tolist()) if d > BOUND]
    return (bad[0], float(diff.max())) if bad else None


@pytest.fixture(scope="module")
def base_model():
    return _model()


def test_fixture_files_are_what_the_readme_says():
    assert hashlib.sha256(BASE.read_bytes()).hexdigest() == CFG["base_weights_sha256"]
    assert tuple(IO["initial_noise"].shape) == tuple(CFG["latent_shape"])
    assert sum(1 for k in IO if k.startswith("renoise.")) == CFG["renoise_draws"]
    total = sum(p.stat().st_size for p in FIX.iterdir() if p.is_file())
    assert total < 2 * 1024 * 1024
    # every switch re-caches: the official call list has one timestep-0 pass over several chunks per switch
    for name, v in CFG["variants"].items():
        recache = [c for c in v["calls"] if c["t"] == 0 and c["frames"] > FPB]
        assert len(recache) == len(v["switch_frame_indices"]), name


@pytest.mark.parametrize("path", ["reference", "optimized"])
@pytest.mark.parametrize("variant", ["w9s3", "w12s3"])
def test_prompt_switches_with_recache_match_longlive(base_model, variant, path):
    out = _run(base_model, variant, path)
    ref = IO[f"{variant}.latents"]
    assert out.shape == ref.shape
    assert _first_bad_chunk(out, ref) is None, f"first chunk over {BOUND}, max diff: {_first_bad_chunk(out, ref)}"


def test_without_recache_the_run_leaves_longlive(base_model):
    """The switch's re-cache is what the fixture checks: skipping it moves the chunks after the first switch (and
    only those) well past the bound."""
    out = _run(base_model, "w12s3", "reference", recache="none")
    ref = IO["w12s3.latents"]
    first_switch = -(-CFG["variants"]["w12s3"]["switch_frame_indices"][0] // FPB) * FPB
    assert (out[:, :first_switch] - ref[:, :first_switch]).abs().max() <= BOUND
    assert (out[:, first_switch:] - ref[:, first_switch:]).abs().max() > 100 * BOUND


@pytest.mark.parametrize("variant", ["w9s3", "w12s3"])
def test_every_step_x0_matches(base_model, variant):
    """The x0 of every denoising step of every chunk (locates a mismatch; the last step's x0 is the output)."""
    ref = IO[f"{variant}.x0_steps"]
    seen = torch.full_like(ref, float("nan"))

    def record(ci, k, num_chunks, num_steps, x0):
        seen[k, :, ci * FPB:(ci + 1) * FPB] = x0.float()
    _run(base_model, variant, "reference", callback=record)
    assert torch.equal(ref[-1], IO[f"{variant}.latents"])
    diff = (seen - ref).abs().amax(dim=(1, 3, 4, 5))          # [step, frame]
    assert bool(torch.isfinite(diff).all()) and float(diff.max()) <= BOUND, diff


@pytest.mark.parametrize("path", ["reference", "optimized"])
def test_lora_merged_at_load_matches_longlive(path):
    model = _model(lora=LORA)
    out = _run(model, "w12s3_lora", path)
    ref = IO["w12s3_lora.latents"]
    assert _first_bad_chunk(out, ref) is None, _first_bad_chunk(out, ref)
    assert (ref - IO["w12s3.latents"]).abs().max() > 100 * BOUND      # the LoRA does change the video


def test_merged_file_matches_longlive_and_the_load_time_merge():
    merged = _model(MERGED)
    out = _run(merged, "w12s3_lora", "reference")
    assert _first_bad_chunk(out, IO["w12s3_lora.latents"]) is None
    at_load = dict(_model(lora=LORA).named_parameters())
    for name, p in merged.named_parameters():
        assert (p - at_load[name]).abs().max() <= 8 * torch.finfo(torch.float32).eps * max(1.0, float(p.abs().max()))


def test_lora_merge_by_hand(tmp_path):
    """W + strength * alpha / rank * B @ A on exactly the named layers, with the file's alpha or the rank."""
    lora = read_lora(LORA)
    layer = "blocks.1.cross_attn.k"
    a, b = lora[layer]["down"], lora[layer]["up"]
    rank = a.shape[0]
    base = dict(_model().named_parameters())
    for strength in (1.0, 0.5):
        model = _model()
        n = merge_lora(model, LORA, strength=strength)
        assert n == len(lora) == CFG["lora"]["keys"] // 2
        got = dict(model.named_parameters())
        scale = strength
        want = base[f"{layer}.weight"] + scale * (b @ a)
        assert (got[f"{layer}.weight"] - want).abs().max() <= 4 * torch.finfo(torch.float32).eps * \
            float(want.abs().max())
        assert torch.equal(got["blocks.1.cross_attn.k.bias"], base["blocks.1.cross_attn.k.bias"])
        assert torch.equal(got["head.head.weight"], base["head.head.weight"])
    # a file-side alpha beats the rank (ComfyUI layout, written by to_comfy)
    comfy = tmp_path / "comfy.safetensors"
    to_comfy(LORA, comfy, alpha=3.0 * rank)
    sd = load_file(str(comfy))
    assert all(k.startswith("diffusion_model.") for k in sd)
    model = _model()
    merge_lora(model, comfy)
    want = base[f"{layer}.weight"] + 3.0 * (b @ a)
    assert (dict(model.named_parameters())[f"{layer}.weight"] - want).abs().max() <= \
        4 * torch.finfo(torch.float32).eps * float(want.abs().max())


def _bad_lora(tmp_path, edit):
    sd = load_file(str(LORA))
    edit(sd)
    p = tmp_path / "bad.safetensors"
    save_file(sd, str(p))
    return p


@pytest.mark.parametrize("edit, message", [
    (lambda sd: sd.update({"base_model.model.blocks.7.ffn.0.lora_A.weight": torch.zeros(4, 64),
                           "base_model.model.blocks.7.ffn.0.lora_B.weight": torch.zeros(128, 4)}),
     r"'base_model\.model\.blocks\.7\.ffn\.0\.lora_A\.weight' targets 'blocks\.7\.ffn\.0\.weight', which the model"),
    (lambda sd: sd.update({"base_model.model.blocks.0.ffn.0.lora_B.weight": torch.zeros(64, 4)}),
     r"makes a \[64, 64\] update but 'blocks\.0\.ffn\.0\.weight' is \[128, 64\]"),
    (lambda sd: sd.pop("base_model.model.blocks.0.self_attn.q.lora_B.weight"),
     r"layer 'blocks\.0\.self_attn\.q' .* has no lora_B"),
    (lambda sd: sd.update({"base_model.model.blocks.0.self_attn.q.weight": torch.zeros(64, 64)}),
     r"key 'base_model\.model\.blocks\.0\.self_attn\.q\.weight' is not a LoRA weight"),
    (lambda sd: sd["base_model.model.blocks.0.self_attn.o.lora_A.weight"].view(-1)[0].fill_(float("nan")),
     r"'base_model\.model\.blocks\.0\.self_attn\.o\.lora_A\.weight' is not a finite"),
])
def test_bad_lora_files_are_refused_by_key_and_change_nothing(tmp_path, edit, message):
    path = _bad_lora(tmp_path, edit)
    with pytest.raises(LoraError, match=message):
        _model(lora=path)
    model = _model()
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(LoraError):
        merge_lora(model, path)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_pickle_and_missing_lora_files_are_refused(tmp_path):
    with pytest.raises(LoraError.__mro__[1], match="pickle checkpoint"):
        merge_lora(_model(), tmp_path / "lora.pt")
    with pytest.raises(LoraError.__mro__[1], match="not found"):
        merge_lora(_model(), tmp_path / "absent.safetensors")
    with pytest.raises(LoraError, match="strength must be a finite"):
        merge_lora(_model(), LORA, strength=float("inf"))


def test_blend_transition_is_the_hand_computed_mix(base_model):
    """LongLive has no blend: a blended switch is checked against contexts computed by hand instead. Chunk c of a
    (blend 3) switch at chunk s uses (1 - a) * old + a * new with a = (c - s + 1) / 3, then the new prompt."""
    p0, p1 = CFG["prompts"][:2]
    schedule = PromptSchedule.parse(f"0: {p0}\n3: {p1} (blend 3)")
    n_chunks = IO["initial_noise"].shape[1] // FPB
    e0, e1 = EMBEDDINGS[p0], EMBEDDINGS[p1]
    hand = [e0] * 3 + [(1 - a) * e0 + a * e1 for a in (1 / 3, 2 / 3)] + [e1] * (n_chunks - 5)
    got = schedule.contexts(EMBEDDINGS, n_chunks)
    for c, (g, h) in enumerate(zip(got, hand)):
        assert (g - h).abs().max() <= 2 * torch.finfo(torch.float32).eps * float(h.abs().max()), c
    assert schedule.switch_chunks(n_chunks) == [3, 4, 5]
    v = CFG["variants"]["w12s3"]
    kw = dict(noise_provider=_provide, kv_window=v["local_attn_size"], sink=v["sink_size"], path="reference")
    by_schedule = run_causal(base_model, e0, IO["initial_noise"], _sched(), FPB, prompt_schedule=schedule,
                                prompt_embeddings=EMBEDDINGS, **kw)
    by_hand = run_causal(base_model, e0, IO["initial_noise"], _sched(), FPB, chunk_contexts=hand, **kw)
    assert (by_schedule - by_hand).abs().max() <= BOUND
    hard = run_causal(base_model, e0, IO["initial_noise"], _sched(), FPB,
                         prompt_schedule=PromptSchedule.parse(f"0: {p0}\n3: {p1}"), prompt_embeddings=EMBEDDINGS,
                         **kw)
    assert torch.equal(by_schedule[:, :3 * FPB], hard[:, :3 * FPB])
    assert (by_schedule[:, 3 * FPB:] - hard[:, 3 * FPB:]).abs().max() > 100 * BOUND


def test_cli_convert_lora_for_comfyui(tmp_path, capsys):
    """ComfyUI maps diffusion_model.<layer> keys on a WAN model (LongLive's peft names load nothing there): the
    converted file holds the same matrices under those names, with the alpha, and merges to the same weights."""
    from wan_accel.cli import main as cli_main
    out = tmp_path / "longlive_comfy.safetensors"
    assert cli_main(["convert-lora", str(LORA), str(out)]) == 0
    sd, src = load_file(str(out)), load_file(str(LORA))
    assert len(sd) == len(src) * 3 // 2
    for k, v in src.items():
        assert torch.equal(sd["diffusion_model." + k[len("base_model.model."):]], v)
    a = dict(_model(lora=LORA).named_parameters())
    assert all(torch.equal(p, a[n]) for n, p in _model(lora=out).named_parameters())
    assert cli_main(["convert-lora", str(MERGED), str(tmp_path / "x.safetensors")]) == 2
    assert "is not a LoRA weight" in capsys.readouterr().err


def test_cli_convert_lora_reads_the_released_pt(tmp_path, capsys):
    """LongLive releases its LoRA as lora.pt (the peft state dict under 'generator_lora'): convert-lora reads it
    with weights_only=True and writes the same file as from the safetensors copy; a .pt without LoRA tensors is
    refused with the reason."""
    from wan_accel.cli import main as cli_main
    src = load_file(str(LORA))
    torch.save({"generator_lora": src}, str(tmp_path / "lora.pt"))
    assert cli_main(["convert-lora", str(tmp_path / "lora.pt"), str(tmp_path / "from_pt.safetensors")]) == 0
    assert cli_main(["convert-lora", str(LORA), str(tmp_path / "from_st.safetensors")]) == 0
    a, b = load_file(str(tmp_path / "from_pt.safetensors")), load_file(str(tmp_path / "from_st.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    torch.save({"generator": src}, str(tmp_path / "base.pt"))
    assert cli_main(["convert-lora", str(tmp_path / "base.pt"), str(tmp_path / "x.safetensors")]) == 2
    assert "no LoRA tensors found" in capsys.readouterr().err
    assert not (tmp_path / "x.safetensors").exists()
