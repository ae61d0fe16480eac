"""Prompt switching in the settings the official LongLive and Krea Realtime code accept: each one either matches
the official behaviour or is refused before any work, with a message that names the official behaviour and the
setting that avoids it (issue 31).

* LongLive (``--preset longlive``) with a sink larger than one chunk: refused (the official attention attends
  unwritten sink slots and its recompute never writes inside them).
* Krea (``recache krea``) with a context K that is not whole blocks: reproduced (the official recompute pads the
  context to a multiple of 128 tokens and its block mask lets the last, partial block attend the zero padding
  keys), checked against the official recompute written here: one pass over the whole context with that padded
  mask, on both sampler paths, in one run, in live play and on the command line.
* Krea, a new prompt while an interpolation is still running: reproduced by ``(blend N, krea)`` entries, checked
  against a reference of Krea's session semantics written here (the embedding in effect, a list of interpolated
  embeddings popped one per block, a new request replacing the list from the embedding in effect), on both sampler
  paths, chunk by chunk in live play, and through the schedule file the session saves.
* Krea, a prompt typed live with no step count: Krea's server interpolates it over 4 blocks (``KREA_INTERP_STEPS``),
  running blend or not; under recache krea a live prompt without a blend does the same, ``(blend 0)`` is a hard
  switch asked for, and a pack blend (``(blend N)``, slerp) typed during a running blend is refused with the ways
  out. The other cache modes take every prompt as typed.
"""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from krea_variants import UnpaddedRecompute
from wan_accel.app.play.registry import PlayError
from wan_accel.app.play.t2v import PromptPlaySession, context_digest
from wan_accel.cli import main as cli_main
from wan_accel.model.config import WanConfig
from wan_accel.model.loader import load_wan_checkpoint
from wan_accel.model.tiny import tiny_causal_model, tiny_text_embedding
from wan_accel.sampling.krea import (KREA_INTERP_STEPS, KreaRecompute, cache_setup, krea_schedule, krea_schedule_line,
                                     official_problem, padding_keys)
from wan_accel.sampling.prompts import PromptSchedule
from run_helpers import run_causal

FIX = Path(__file__).parent / "fixtures" / "krea_realtime"
TOL = 1e-4
H = W = 4
FPB = 3
LONGLIVE_MSG = r"(--)?sink 6 with (--)?preset longlive: LongLive's official attention always takes the first 6 frames"


# ------------------------------------------------------------------------------------------------ refusals
def test_the_one_check_names_the_official_behaviour_and_the_way_out():
    msg = official_problem(3, sink=6, preset="longlive")
    assert "written or not" in msg and "never writes inside the sink slots" in msg
    assert "Use sink at most 3" in msg and "leave out preset longlive" in msg
    # what the official code runs as the pack does is accepted
    for mode, fpb, window, sink, preset in [("switch", 3, 12, 3, "longlive"), ("none", 3, 9, 2, "longlive"),
                                            ("switch", 3, 15, 6, "self_forcing"), ("switch", 3, 15, 6, None),
                                            ("krea", 3, 6, 0, None), ("krea", 3, 9, 0, None),
                                            ("krea", 3, 12, 0, "krea"), ("krea", 3, -1, 0, None),
                                            ("krea", 1, 6, 0, None), ("switch", 2, 8, 5, "self_forcing"),
                                            ("krea", 3, 8, 0, "krea"), ("krea", 3, 7, 0, None),
                                            ("krea", 2, -1, 0, None)]:
        assert official_problem(fpb, sink, preset) is None, (mode, fpb, window, sink, preset)
        cache_setup(mode, fpb, window, sink=sink, preset=preset)
    with pytest.raises(ValueError, match=LONGLIVE_MSG):
        cache_setup("none", 3, 15, sink=6, preset="longlive")


@pytest.mark.parametrize("argv, want", [
    (["--preset", "longlive", "--sink", "6", "--kv-window", "15"], "error: " + LONGLIVE_MSG),
    (["--preset", "longlive", "--sink", "4", "--kv-window", "12", "--recache", "none"],
     r"error: --sink 4 with --preset longlive: .* frames 3\.\.3 keep the keys"),
])
def test_the_command_line_refuses_before_any_work(tmp_path, capsys, argv, want):
    out = tmp_path / "out"
    rc = cli_main(["generate", "--out", str(out), "--no-preview", "--device", "cpu", "--frames", "45", "--height",
                   "32", "--width", "32", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    import re
    assert re.match(want, err), err
    assert not (out / "latents.safetensors").exists()


def test_the_command_line_runs_the_settings_that_match(tmp_path, capsys):
    rc = cli_main(["generate", "--out", str(tmp_path), "--no-preview", "--json", "--device", "cpu", "--frames", "45",
                   "--height", "32", "--width", "32", "--preset", "self_forcing", "--sink", "6", "--kv-window",
                   "15"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["settings"]["sink"] == 6


@pytest.fixture(scope="module")
def handle():
    from wan_accel.app.jobs.handle import load_model_handle
    return load_model_handle(None, "fp32", "float32", "sdpa", device="cpu")


NODE_ARGS = dict(width=32, height=32, num_frames=4 * 11 + 1, seed=4, frames_per_block=3, sampler="reference")


@pytest.mark.parametrize("settings, want", [
    (dict(preset="longlive", kv_window=15, sink=6), LONGLIVE_MSG),
])
def test_the_sampler_node_refuses_before_any_work(handle, monkeypatch, settings, want):
    from wan_accel.app import prepare
    from wan_accel.nodes.model_nodes import CausalWanSampler

    def never(*_a, **_k):
        raise AssertionError("sampled a refused setting")
    monkeypatch.setattr(prepare, "prepare", never)
    with pytest.raises(ValueError, match="^" + want):
        CausalWanSampler().sample(handle, **{**NODE_ARGS, **settings})


def encode_with(model):
    cfg = model.config
    return lambda text: tiny_text_embedding(text, cfg.text_len, cfg.text_dim)


@pytest.fixture(scope="module")
def model():
    return tiny_causal_model(seed=5)


def test_the_play_session_refuses_before_any_work(model):
    with pytest.raises(PlayError, match="^" + LONGLIVE_MSG):
        PromptPlaySession(model, encode_with(model), H, W, schedule="longlive", kv_window=15, sink=6, prompt="a cat")


# ------------------------------------------------------------------------------------------------ Krea prompts
def krea_reference(first, requests: dict, blocks: int, embed) -> list:
    """Per-block prompt embeddings of Krea Realtime's session, as its server keeps them: the embedding in effect;
    a request before block b (text, N) replaces the pending list with torch.lerp(in effect, new,
    linspace(0, 1, N)) split per block; each block pops the next pending one (if any) and uses it."""
    current, pending, out = embed(first), [], []
    for b in range(blocks):
        if b in requests:
            text, n = requests[b]
            weights = torch.linspace(0, 1, steps=n).unsqueeze(1).unsqueeze(2).to(current)
            pending = list(torch.lerp(current, embed(text), weights).chunk(n, dim=0))
        if pending:
            current = pending.pop(0)
        out.append(current)
    return out


REQUESTS = {2: ("a dog runs", 4), 4: ("snow falls", 3), 5: ("a red fox", 2), 8: ("night", 4), 9: ("day", 3)}
BLOCKS = 11
# for the sampled runs (short): the change at 2 (over Krea's default 4 blocks) interrupts the one at 1 at its first
# block (which repeats the embedding in effect), the change at 4 interrupts the one at 2 half way
RUN_REQUESTS = {1: ("a dog runs", 3), 2: ("snow falls", 4), 4: ("a red fox", 2)}
RUN_BLOCKS = 6
TYPED_DURING_A_BLEND = (2, 4)


def schedule_text(first, requests) -> str:
    return "\n".join([f"0: {first}"] + [krea_schedule_line(b, t, n) for b, (t, n) in sorted(requests.items())])


def test_krea_entries_equal_kreas_interrupted_interpolation(model):
    embed = encode_with(model)
    want = krea_reference("a cat", REQUESTS, BLOCKS, embed)
    sched = PromptSchedule.parse(schedule_text("a cat", REQUESTS))
    got = sched.contexts({t: embed(t) for t in sched.texts()}, BLOCKS)
    for b, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), b
    assert PromptSchedule.parse(sched.to_text()) == sched            # the text form round-trips
    # the block of an interrupting change repeats the embedding in effect (no switch there)
    assert sched.switch_chunks(BLOCKS) == [3, 6, 10]
    # the linear mapping of an uninterrupted change lets the old blend advance one more block when interrupted
    lin = PromptSchedule.parse("0: a cat\n3: a dog runs (blend 3)\n5: snow falls (blend 2)")
    lctx = lin.contexts({t: embed(t) for t in lin.texts()}, 6)
    assert (lctx[4] - want[4]).abs().max() > 1e-3
    with pytest.raises(ValueError, match=r"\(blend 1, krea\) never reaches the new prompt"):
        PromptSchedule.parse("0: a\n2: b (blend 1, krea)")


def test_krea_entries_match_the_official_fixture():
    cfg = json.loads((FIX / "krea_config.json").read_text())
    io = load_file(str(FIX / cfg["io_file"]))
    lines = ["0: p0"] + [krea_schedule_line(ch["block"], f"p{ch['prompt']}", ch["interp_steps"])
                         for ch in cfg["prompt_changes"]]
    ctx = PromptSchedule.parse("\n".join(lines)).contexts({f"p{i}": io[f"prompt{i}"] for i in range(3)},
                                                          cfg["session"]["num_blocks"])
    for b, c in enumerate(ctx):
        assert (c - io[f"block{b}.prompt_embeds"]).abs().max() <= TOL, b


def krea_run(model, path, **prompts):
    gen = torch.Generator().manual_seed(3)
    noise = torch.randn(1, RUN_BLOCKS * FPB, model.config.out_dim, H, W, generator=gen)
    return run_causal(model, None, noise, krea_schedule(4), FPB, generator=torch.Generator().manual_seed(4),
                         kv_window=2 * FPB, recache="none", cache_policy=KreaRecompute(FPB, FPB), path=path,
                         fast_options={"cuda_graphs": "off"} if path == "optimized" else None, **prompts)


@pytest.mark.parametrize("path", ["reference", "optimized"])
def test_interrupted_interpolation_samples_as_krea(model, path):
    """The schedule's run equals a run given Krea's per-block embeddings directly (the cache policy itself is
    checked against the official session in test_krea_parity)."""
    embed = encode_with(model)
    want = krea_run(model, path, chunk_contexts=krea_reference("a cat", RUN_REQUESTS, RUN_BLOCKS, embed))
    sched = PromptSchedule.parse(schedule_text("a cat", RUN_REQUESTS))
    assert sched.switch_chunks(RUN_BLOCKS) == [3, 5]
    got = krea_run(model, path, prompt_schedule=sched, prompt_embeddings={t: embed(t) for t in sched.texts()})
    assert (got - want).abs().max() <= TOL


def test_live_play_under_krea_follows_krea_and_saves_it_bit_for_bit(model):
    """The requests typed live as a client of Krea's server sends them: the one over Krea's default 4 blocks as the
    plain prompt (it interrupts a running interpolation), the others with their (blend N, krea); a (blend N) typed
    during a running blend is refused first, naming the ways out."""
    embed = encode_with(model)
    play = PromptPlaySession(model, embed, H, W, seed=7, frames_per_block=FPB, kv_window=2 * FPB, recache="krea",
                             prompt="a cat")
    assert RUN_REQUESTS[TYPED_DURING_A_BLEND[0]][1] == KREA_INTERP_STEPS
    for b in range(RUN_BLOCKS):
        if b not in RUN_REQUESTS:
            play.step("")
            continue
        text, n = RUN_REQUESTS[b]
        if n == KREA_INTERP_STEPS:
            play.step(text)
            continue
        if b in TYPED_DURING_A_BLEND:
            with pytest.raises(PlayError, match=rf"^prompt '{text} \(blend {n}\)' at chunk {b}: the blend .* is still "
                                                rf"running .* Type '{text}' \(Krea's default: 4 blocks\), "
                                                rf"'{text} \(blend {n}, krea\)', or '{text} \(blend 0\)'"):
                play.step(f"{text} (blend {n})")
        play.step(f"{text} (blend {n}, krea)")
    video = play.latent_video()
    # the saved schedule file reproduces the session bit for bit (one run, both paths' reference for play)
    saved = PromptSchedule.parse(play.script_file())
    assert saved == PromptSchedule.parse(schedule_text("a cat", RUN_REQUESTS))
    from run_helpers import generate_latents
    setup = cache_setup("krea", FPB, 2 * FPB)
    again = generate_latents(model, None, RUN_BLOCKS * FPB, H, W, seed=7, schedule="self_forcing", frames_per_block=FPB,
                             kv_window=setup.kv_window, prompt_schedule=saved,
                             prompt_embeddings={t: embed(t) for t in saved.texts()}, path="reference",
                             **setup.sampler_kwargs())
    assert torch.equal(video, again.transpose(1, 2))
    # ... and Krea's per-block embeddings given directly make the same frames
    direct = generate_latents(model, None, RUN_BLOCKS * FPB, H, W, seed=7, schedule="self_forcing",
                              frames_per_block=FPB, kv_window=2 * FPB, path="reference",
                              chunk_contexts=krea_reference("a cat", RUN_REQUESTS, RUN_BLOCKS, embed),
                              **cache_setup("krea", FPB, 2 * FPB).sampler_kwargs())
    assert (video - direct.transpose(1, 2)).abs().max() <= TOL


def test_live_prompts_under_krea_ease_in_as_kreas_server_and_switch_hard_when_asked(model):
    embed = encode_with(model)
    krea, switch = cache_setup("krea", FPB, 2 * FPB), cache_setup("switch", FPB, 12)
    assert krea.live_line(2, "a dog") == "2: a dog (blend 4, krea)"
    assert krea.live_line(2, "a dog (blend 0)") == "2: a dog (blend 0)" == switch.live_line(2, "a dog (blend 0)")
    assert krea.live_line(2, "a :0.7 | b :0.3 (blend 3, krea)") == "2: a :0.7 | b :0.3 (blend 3, krea)"
    assert krea.live_line(0, "a dog") == "0: a dog" and switch.live_line(2, "a dog") == "2: a dog"
    play = PromptPlaySession(model, embed, H, W, seed=1, frames_per_block=FPB, kv_window=2 * FPB, recache="krea",
                             prompt="a cat")
    for p in ("", "a dog", "a dog", "a fox (blend 0)", "snow (blend 2)"):
        play.step(p)
    with pytest.raises(PlayError, match=r"^prompt 'rain \(blend 3, slerp\)' at chunk 5: the blend to chunk 4's prompt "
                                        r"is still running \(it ends at chunk 5\).* or wait until chunk 6$"):
        play.step("rain (blend 3, slerp)")
    play.step("rain")
    # a typed prompt without a blend is Krea's 4-block change, also the same text typed again changes nothing (as
    # Krea's server ignores a prompt equal to the one in effect); '(blend 0)' is a hard switch even mid-blend
    assert play.schedule_text == ("0: a cat\n1: a dog (blend 4, krea)\n3: a fox\n4: snow (blend 2)\n"
                                  "5: rain (blend 4, krea)\n")
    assert [e["switched"] for e in play.log] == [False, False, True, True, True, False]
    step = torch.linspace(0, 1, steps=KREA_INTERP_STEPS)
    cat, dog = embed("a cat"), embed("a dog")
    assert play.log[1]["context_sha256"] == play.log[0]["context_sha256"] == context_digest(cat)
    assert play.log[2]["context_sha256"] == context_digest(torch.lerp(cat, dog, step[1]))
    assert play.log[5]["context_sha256"] == play.log[4]["context_sha256"]
    # the first chunk's prompt is that chunk's prompt (Krea: a prompt sent before the first block is its prompt)
    first = PromptPlaySession(model, embed, H, W, seed=1, frames_per_block=FPB, kv_window=2 * FPB, recache="krea",
                              prompt="a cat")
    first.step("a dog")
    assert first.schedule_text == "0: a dog\n" and first.log[0]["context_sha256"] == context_digest(dog)
    # recache switch / none take every prompt as typed: a plain prompt is a hard switch, no refusal
    plain = PromptPlaySession(model, embed, H, W, seed=1, frames_per_block=FPB, recache="none", prompt="a cat")
    for p in ("", "a dog (blend 3)", "a fox"):
        plain.step(p)
    assert plain.schedule_text == "0: a cat\n1: a dog (blend 3)\n2: a fox\n"


# ------------------------------------------------------------------------------------------------ Krea padded context
class OfficialRecompute(KreaRecompute):
    """Krea's context recompute as the official model runs it: the whole context in one pass at t = 0, queries,
    keys and values right-padded with zeros to a multiple of 128 tokens, under the block mask "key before the end
    of the query's block (block_start + frames_per_block frames, not capped), or the query itself"; the padded
    rows dropped. Only the frame selection is the pack's (checked against the official session elsewhere)."""

    def _context_pass(self, ex, req, ctx):
        from wan_accel.model import attention as att     # self-attention over the KV cache calls att.attention
        n, fs, fpb = ctx.shape[1], req.frame_tokens, self.fpb
        total = n * fs
        full = -(-total // 128) * 128
        ends = torch.zeros(full, dtype=torch.long)
        for s0 in range(0, total, fs * fpb):
            ends[s0:s0 + fs * fpb] = s0 + fs * fpb
        idx = torch.arange(full)
        mask = (idx[None, :] < ends[:, None]) | (idx[:, None] == idx[None, :])
        plain = att.attention

        def official(q, k, v, key_padding_mask=None, backend="auto"):
            if q.shape[1] != total or k.shape[1] != total:       # cross-attention: as it is
                return plain(q, k, v, key_padding_mask, backend=backend)
            pad = [t.new_zeros(t.shape[0], full - total, *t.shape[2:]) for t in (q, k, v)]
            qp, kp, vp = (torch.cat([t, z], 1).transpose(1, 2).float() for t, z in zip((q, k, v), pad))
            out = torch.nn.functional.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask.to(q.device))
            return out.transpose(1, 2)[:, :total].to(q.dtype)

        step = ex.begin_chunk(0, n)
        att.attention = official
        try:
            ex.forward("refresh", ctx, float(req.refresh_t), 0, step, want_output=False)
        finally:
            att.attention = plain


def test_padding_keys_follow_the_official_mask():
    assert padding_keys(5, 1560, 3) == 8               # 7800 tokens padded to 7808: all 8 in the last block's reach
    assert padding_keys(5, 4, 3) == 4                  # 20 -> 128, but the block ends one frame (4 tokens) later
    assert padding_keys(4, 80, 3) == 64                # 320 -> 384: 64 of the 160 the block could reach
    assert padding_keys(6, 1560, 3) == padding_keys(3, 6, 3) == padding_keys(5, 7, 1) == 0    # whole blocks


@pytest.mark.parametrize("k, h, w", [(5, 4, 4), (4, 16, 20)])
def test_a_context_of_partial_blocks_samples_as_krea(model, k, h, w):
    """K = 5 with 4 tokens a frame (the block's end limits the padding keys) and K = 4 with 80 (the 128-token
    padding does), the stand-in first frame re-encoded from block 2 on: the policy on both sampler paths equals the
    official recompute, which differs from a recompute without the padding keys."""
    fpb, blocks_ = 3, 4
    reencode = lambda x: 0.75 * x + 0.1                   # noqa: E731
    gen = torch.Generator().manual_seed(11)
    noise = torch.randn(1, blocks_ * fpb, model.config.out_dim, h, w, generator=gen)
    sched = PromptSchedule.parse("0: a cat\n2: a dog (blend 2, krea)")
    embeds = {t: encode_with(model)(t) for t in sched.texts()}

    def run(policy, path):
        return run_causal(model, None, noise, krea_schedule(4), fpb, generator=torch.Generator().manual_seed(2),
                             kv_window=k + fpb, recache="none", cache_policy=policy, path=path,
                             prompt_schedule=sched, prompt_embeddings=embeds,
                             fast_options={"cuda_graphs": "off"} if path == "optimized" else None)
    want = run(OfficialRecompute(k, fpb, reencode=reencode), "reference")
    for path in ("reference", "optimized"):
        got = run(KreaRecompute(k, fpb, reencode=reencode), path)
        assert (got - want).abs().max() <= TOL, path
    assert (run(UnpaddedRecompute(k, fpb, reencode=reencode), "reference") - want).abs().max() > 10 * TOL


def test_a_context_of_partial_blocks_in_play_and_on_the_command_line(model, tmp_path, capsys):
    embed = encode_with(model)
    play = PromptPlaySession(model, embed, H, W, seed=5, frames_per_block=FPB, kv_window=8, recache="krea",
                             prompt="a cat")
    for p in ("", "", "a dog (blend 2, krea)", ""):
        play.step(p)
    assert play.cache.cache_policy.k == 5 and play.cache.cache_policy.positions[-1] == (9, 5)
    from run_helpers import generate_latents
    sched = PromptSchedule.parse(play.script_file())
    setup = cache_setup("krea", FPB, 8)
    one = generate_latents(model, None, 4 * FPB, H, W, seed=5, schedule="self_forcing", frames_per_block=FPB,
                           kv_window=setup.kv_window, prompt_schedule=sched, path="reference",
                           prompt_embeddings={t: embed(t) for t in sched.texts()}, **setup.sampler_kwargs())
    assert torch.equal(play.latent_video(), one.transpose(1, 2))
    rc = cli_main(["generate", "--out", str(tmp_path), "--no-preview", "--json", "--device", "cpu", "--frames", "45",
                   "--height", "32", "--width", "32", "--preset", "krea", "--kv-window", "8"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["settings"]["recache"] == "krea"
