"""Prompt switches in the one chunk loop: frames before a switch are untouched (bit for bit), the re-cache rewrites
the window (LongLive v1.0: the sink too until the window rolls, then not), the optimized path follows the reference,
'none' only swaps the cross-attention, runs replay, chunk-by-chunk continuation equals one scheduled run, and the
command line takes a schedule."""
import json

import pytest
import torch

from cli_run import run_cli_in
from wan_accel.model.config import WanConfig
from wan_accel.model.dit import WanModel
from wan_accel.model.kv_cache import KVCache
from wan_accel.model.tiny import init_tiny_weights
from run_helpers import sample_continuable
from wan_accel.sampling.prompts import PromptSchedule
from wan_accel.sampling.recache import recache_range
from run_helpers import run_causal

CFG = WanConfig(dim=32, ffn_dim=64, num_heads=2, num_layers=2, text_dim=16, text_len=6, freq_dim=8)
SCHEDULE = {"preset": "custom", "steps": [1000, 600, 300], "shift": 5.0}
FPB, H, W = 2, 4, 4
FRAME_TOKENS = (H // 2) * (W // 2)
EPS = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def model():
    return init_tiny_weights(WanModel(CFG), 2).eval()


@pytest.fixture(scope="module")
def emb():
    g = torch.Generator().manual_seed(4)
    return {t: torch.randn(1, 5, CFG.text_dim, generator=g) for t in ("a cat", "a dog", "a fox")}


def _run(model, emb, schedule, frames=12, window=6, sink=2, path="reference", **kw):
    return run_causal(model, None, (1, frames, CFG.out_dim, H, W), SCHEDULE, FPB,
                         generator=torch.Generator().manual_seed(9), kv_window=window, sink=sink,
                         prompt_schedule=schedule, prompt_embeddings=emb, path=path, **kw)


SWITCHING = "0: a cat\n2: a dog\n4: a fox :1 | a cat :1 (blend 2, slerp)"


@pytest.mark.parametrize("path", ["reference", "optimized"])
def test_switch_changes_frames_from_its_chunk_on_only(model, emb, path):
    one = _run(model, emb, "0: a cat", path=path)
    switched = _run(model, emb, SWITCHING, path=path)
    assert torch.equal(switched[:, :2 * FPB], one[:, :2 * FPB])           # chunks 0, 1: bit for bit
    for c in range(2, 6):
        assert not torch.equal(switched[:, c * FPB:(c + 1) * FPB], one[:, c * FPB:(c + 1) * FPB]), c


def test_optimized_path_follows_the_reference_with_switches(model, emb):
    ref = _run(model, emb, SWITCHING, frames=16)
    fast = _run(model, emb, SWITCHING, frames=16, path="optimized")
    scale = ref.abs().max().item()
    torch.testing.assert_close(fast, ref, rtol=0, atol=256 * EPS * scale)


def test_recache_none_differs_and_keeps_the_earlier_frames(model, emb):
    switch = _run(model, emb, SWITCHING)
    none = _run(model, emb, SWITCHING, recache="none")
    assert torch.equal(none[:, :2 * FPB], switch[:, :2 * FPB])
    assert not torch.equal(none[:, 2 * FPB:3 * FPB], switch[:, 2 * FPB:3 * FPB])
    with pytest.raises(ValueError, match="recache must be one of"):
        _run(model, emb, SWITCHING, recache="sometimes")


def test_a_schedule_replays_bit_for_bit(model, emb):
    assert torch.equal(_run(model, emb, SWITCHING), _run(model, emb, SWITCHING))
    assert torch.equal(_run(model, emb, SWITCHING, path="optimized"), _run(model, emb, SWITCHING, path="optimized"))


def test_recache_range_follows_longlive():
    from wan_accel.sampling.request import SamplingRequest
    req = SamplingRequest((1, 30, 16, 4, 4), None, (), (2, 2), kv_window=12, sink=3)
    assert recache_range(req, 0) == (0, 0)
    assert recache_range(req, 9) == (0, 9)             # not rolled: every frame, the sink included
    assert recache_range(req, 12) == (0, 12)
    assert recache_range(req, 15) == (6, 15)           # rolled: the 9 non-sink frames of the window
    assert recache_range(req.replace(kv_window=-1, sink=0), 15) == (0, 15)    # global: every frame


class _Snapshots:
    """A cache policy that records the self-attention cache before every chunk (after a switch's re-cache)."""

    def __init__(self):
        self.seen = []

    def before_chunk(self, state):
        kv = state.executor.kv
        self.seen.append((state.chunk_index, state.switched, kv.end,
                          [(l.k.clone(), l.v.clone()) for l in kv.layers]))


@pytest.mark.parametrize("switch_chunk, sink_rewritten", [(2, True), (5, False)])
def test_recache_rewrites_the_window_and_keeps_a_rolled_sink(model, emb, switch_chunk, sink_rewritten):
    window, sink = 6, 2
    before, after = _Snapshots(), _Snapshots()
    kv = KVCache.for_model(model, 1, FRAME_TOKENS, 16, window, sink)
    _run(model, emb, "0: a cat", frames=16, window=window, sink=sink, cache_policy=before)
    _run(model, emb, f"0: a cat\n{switch_chunk}: a dog", frames=16, window=window, sink=sink, cache_policy=after,
         kv_cache=kv)
    ci, switched, end, new = after.seen[switch_chunk]
    assert switched and [s[1] for s in after.seen].count(True) == 1
    old = before.seen[switch_chunk][3]
    assert end == switch_chunk * FPB * FRAME_TOKENS
    sink_slots, used = slice(0, sink * FRAME_TOKENS), slice(sink * FRAME_TOKENS, min(end, kv.capacity))
    # the first block's keys come before any cross-attention: the prompt does not reach them, so its re-cache
    # rewrites them with what they held (equal up to the order its matmuls summed in, which varies between CPUs)
    (k_first, _), (k_first_old, _) = new[0], old[0]
    torch.testing.assert_close(k_first[:, :min(end, kv.capacity)], k_first_old[:, :min(end, kv.capacity)], rtol=0,
                               atol=64 * EPS * k_first_old.abs().max().item())
    for (k_new, v_new), (k_old, _) in zip(new[1:], old[1:]):
        assert torch.equal(k_new[:, sink_slots], k_old[:, sink_slots]) != sink_rewritten
        assert not torch.equal(k_new[:, used], k_old[:, used])               # the window's frames re-cached
    # chunks before the switch saw the same cache as the run without it
    for c in range(switch_chunk):
        assert all(torch.equal(a[0], b[0]) for a, b in zip(after.seen[c][3], before.seen[c][3]))


def test_recache_before_the_window_rolls_is_one_full_pass_under_the_new_prompt(model, emb):
    """Not rolled yet: the cache after the re-cache equals one pass over all frames so far, at timestep 0, with the
    new prompt, into a fresh cache (full attention among them, as LongLive's KV-cached attention has no mask)."""
    frames, switch = 12, 3
    after = _Snapshots()
    out = _run(model, emb, f"0: a cat\n{switch}: a dog", frames=frames, window=-1, sink=0, cache_policy=after)
    n = switch * FPB
    fresh = KVCache.for_model(model, 1, FRAME_TOKENS, frames)
    t = torch.zeros(1, n)
    model.forward_chunk(out[:, :n], t, emb["a dog"], fresh, None, 0, return_output=False)
    got = after.seen[switch][3]
    for (k, v), layer in zip(got, fresh.layers):
        scale = layer.k[:, :n * FRAME_TOKENS].abs().max().item()
        torch.testing.assert_close(k[:, :n * FRAME_TOKENS], layer.k[:, :n * FRAME_TOKENS], rtol=0,
                                   atol=64 * EPS * scale)
        torch.testing.assert_close(v[:, :n * FRAME_TOKENS], layer.v[:, :n * FRAME_TOKENS], rtol=0,
                                   atol=64 * EPS * layer.v.abs().max().item())


def test_cache_policy_runs_before_every_chunk(model, emb):
    seen = _Snapshots()
    _run(model, emb, SWITCHING, cache_policy=seen)
    assert [(c, s) for c, s, *_ in seen.seen] == [(0, False), (1, False), (2, True), (3, False), (4, True),
                                                   (5, True)]


@pytest.mark.parametrize("window, sink", [(6, 2), (-1, 0)])
def test_chunk_by_chunk_with_prompt_changes_equals_one_scheduled_run(model, emb, window, sink):
    plan = ["a cat", "a cat", "a dog", "a dog", "a fox", "a cat", "a cat"]
    frames = len(plan) * FPB
    one = run_causal(model, None, (1, frames, CFG.out_dim, H, W), SCHEDULE, FPB,
                        generator=torch.Generator().manual_seed(11), kv_window=window, sink=sink,
                        prompt_schedule="0: a cat\n2: a dog\n4: a fox\n5: a cat", prompt_embeddings=emb,
                        path="reference")
    state, outs = None, []
    for c, text in enumerate(plan):
        out, state = sample_continuable(model, emb[text], (c + 1) * FPB, H, W, seed=11, schedule=SCHEDULE,
                                        frames_per_block=FPB, kv_window=window, sink=sink, state=state,
                                        path="reference")
        outs.append(out)
    assert torch.equal(torch.cat(outs, dim=1), one)
    assert torch.equal(state.last_context, emb["a cat"])


def test_continuation_takes_the_schedule_of_the_whole_video(model, emb):
    text = "0: a cat\n2: a dog\n4: a fox"
    one = _run(model, emb, text, frames=12)
    first, state = sample_continuable(model, None, 6, H, W, seed=9, schedule=SCHEDULE, frames_per_block=FPB,
                                      kv_window=6, sink=2, prompt_schedule=text, prompt_embeddings=emb,
                                      path="reference")
    rest, _ = sample_continuable(model, None, 12, H, W, schedule=SCHEDULE, frames_per_block=FPB, kv_window=6,
                                 sink=2, state=state, prompt_schedule=text, prompt_embeddings=emb, path="reference")
    assert torch.equal(torch.cat([first, rest], dim=1), one)


def test_schedule_errors_before_sampling(model, emb):
    with pytest.raises(ValueError, match="switches at chunk 9"):
        _run(model, emb, "0: a cat\n9: a dog")
    with pytest.raises(ValueError, match="no text embedding"):
        _run(model, emb, "0: a cat\n1: a bird")
    with pytest.raises(ValueError, match="prompt_embeddings"):
        _run(model, None, "0: a cat")


def _cli(args, tmp_path):
    return run_cli_in(tmp_path, "generate", "--device", "cpu", "--height", "32", "--width", "32", "--no-preview",
                      "--out", tmp_path / "out", *args)


def test_cli_generate_with_a_schedule_file(tmp_path):
    sched = tmp_path / "walk.txt"
    sched.write_text("# the walk\n0: a cat walks\n1: a dog runs (blend 2)\n")
    code, out, err = _cli(["--frames", "21", "--preset", "longlive", "--prompt-schedule", str(sched), "--json"],
                          tmp_path)
    assert code == 0, err[-2000:]
    report = json.loads(out)
    assert report["latent_shape"][1] == 6
    assert report["settings"]["kv_window"] == 12 and report["settings"]["sink"] == 3
    assert [s["chunk"] for s in report["sampler"]["prompt_switches"]] == [1]
    assert report["settings"]["prompt_schedule"] == sched.read_text()


@pytest.mark.parametrize("schedule, words", [
    ("0: a cat\n5: a dog", "switches at chunk 5"),
    ("0: a cat\n1: a dog :nan", "line 2"),
    ("1: a dog", "chunk 0"),
    ("walk.txt", "no such file"),
])
def test_cli_bad_schedules_exit_2_with_one_line(tmp_path, schedule, words):
    code, _out, err = _cli(["--frames", "21", "--prompt-schedule", schedule], tmp_path)
    assert code == 2, err[-2000:]
    assert err.startswith("error: --prompt-schedule") and words in err, err
    assert "Traceback" not in err
