"""Sequence parallelism on gloo: 2 and 3 local processes (spawned here, loopback only, bounded in time) give one
process's latents within float32 rounding, each rank keeps 1/N of the KV cache (its heads), and a rank that dies
makes the others stop with a clear error within the collective timeout."""
from __future__ import annotations

import time

import pytest
import torch

import seq_parallel_scenarios as scenarios
from wan_accel.app.ranks.parallel import run_ranks
from wan_accel.model.seq_parallel import ParallelError, SeqParallel, check_heads, enable, valid_rank_counts
from wan_accel.model.tiny import tiny_causal_model

PARITY = 1e-5          # float32 rounding: the ranks compute the same sums in other blockings
FIXTURE_TOL = 1e-4     # the public fixtures' acceptance bound (official implementations)

CLI = ["generate", "--device", "cpu", "--frames", "9", "--height", "64", "--width", "64", "--no-preview",
       "--kv-window", "2", "--frames-per-block", "1"]
JOBS = {
    2: [("t2v_global", "t2v_fixture", {}),
        ("t2v_rolling", "t2v_fixture", {"kv_window": 4}),
        ("tiny_rolling_optimized", "tiny6", {"kv_window": 6, "sink": 1, "path": "optimized"}),
        ("mg2_fixture", "mg2", {}),
        ("bench", "bench_rank", {}),
        ("cli", "cli_generate", {"argv": CLI, "out": None})],     # last: the command ends the group
    3: [("tiny_global", "tiny6", {}),
        ("tiny_rolling", "tiny6", {"kv_window": 6, "sink": 1}),
        ("mg2_6heads", "mg2", {"heads": 6})],
}
CASES = [(w, name) for w, jobs in JOBS.items() for name, _, _ in jobs if name not in ("cli", "bench")]
_RUNS: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _out_dir(tmp_path_factory):
    for jobs in JOBS.values():
        for _name, fn, kw in jobs:
            if fn == "cli_generate":
                kw["out"] = str(tmp_path_factory.mktemp("generate"))


def _runs(world: int):
    """(one process's results, the ranks' results) for the jobs of ``world`` (the ranks are started once)."""
    if world not in _RUNS:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)        # tiny tensors: threads only contend with the ranks for the cores
        try:
            one = scenarios.several(None, JOBS[world])
        finally:
            torch.set_num_threads(threads)
        ranks = run_ranks(scenarios.several, world, (JOBS[world],), timeout_s=120, collective_timeout_s=60)
        _RUNS[world] = (one, ranks)
    return _RUNS[world]


@pytest.mark.parametrize("world,name", CASES)
def test_ranks_match_one_process(world, name):
    one, ranks = _runs(world)
    ref = one[name]
    if ref.get("fixture") is not None and "rolling" not in name:
        assert float((ref["out"] - ref["fixture"]).abs().max()) <= FIXTURE_TOL
    heads = ref["k0"].shape[2]
    for rank, res in enumerate(ranks):
        got = res[name]
        assert float((got["out"] - ref["out"]).abs().max()) <= PARITY, (rank, name)
        # the rank's cache: 1/N of the bytes, holding exactly its heads of the one-process cache
        assert got["kv_bytes"] * world == ref["kv_bytes"]
        share = slice(rank * heads // world, (rank + 1) * heads // world)
        for key in ("k0", "v0"):
            assert got[key].shape[2] == heads // world
            assert float((got[key] - ref[key][:, :, share]).abs().max()) <= PARITY
        if "mg2" in name:           # the per-position action cache is split by position: 1/N as well (rounded)
            assert abs(got["mouse_bytes"] * world - ref["mouse_bytes"]) <= ref["mouse_bytes"] // 2


def test_communication_is_counted():
    """What a rank sends, from the shapes: per layer and model call the all-to-all of q, k, v (the other ranks'
    heads of this rank's tokens) and of the attention output (this rank's heads of the other ranks' tokens); per
    denoising call the all-gather of the head's output (the refresh pass has no output)."""
    _, ranks = _runs(2)
    n, layers, dim, out_dim, steps, chunks = 2, 2, 64, 16 * 4, 4, 2     # the public causal fixture
    tokens = 3 * 24 // n                                               # this rank's tokens of a 3-frame chunk
    fp32 = 4
    per_layer = (3 * tokens * dim + tokens * dim) * (n - 1) // n * fp32
    gather = tokens * out_dim * (n - 1) * fp32
    per_chunk = steps * (layers * per_layer + gather) + layers * per_layer
    for rank in ranks:
        stats = rank["t2v_global"]["stats"]
        assert stats["bytes_sent"] == chunks * per_chunk
        assert stats["collectives"] == chunks * (steps * (2 * layers + 1) + 2 * layers)


def test_bench_reports_kv_and_communication_per_rank():
    one, ranks = _runs(2)
    ref = one["bench"]
    assert ref["world_size"] == 1 and ref["comm_bytes_per_chunk"] == 0
    for res in ranks:
        got = res["bench"]
        assert got["world_size"] == 2 and got["kv_bytes_per_rank"] * 2 == ref["kv_bytes_per_rank"]
        assert got["comm_bytes_per_chunk"] > 0 and got["collectives_per_chunk"] > 0
    assert float((ranks[0]["bench"]["latents"] - ref["latents"]).abs().max()) <= PARITY


def test_head_counts_that_do_not_divide_name_the_valid_rank_counts():
    assert valid_rank_counts(12) == [1, 2, 3, 4, 6, 12]
    assert valid_rank_counts(40) == [1, 2, 4, 5, 8, 10, 20, 40]
    with pytest.raises(ValueError, match=r"12 is not divisible by 5: use one of 1, 2, 3, 4, 6, 12 ranks"):
        check_heads(12, 5)
    model = tiny_causal_model()                       # 4 heads
    with pytest.raises(ValueError, match=r"4 is not divisible by 3: use one of 1, 2, 4 ranks"):
        enable(model, SeqParallel(0, 3))
    assert getattr(model, "_wan_accel_seq_parallel", None) is None
    with pytest.raises(ValueError, match="outside a group of 2"):
        SeqParallel(2, 2)
    with pytest.raises(ValueError, match="cannot be split across 4 ranks"):
        SeqParallel(0, 4).layout(3, 2)


def test_a_rank_that_dies_stops_the_others_with_a_clear_error():
    timeout = 15.0
    t0 = time.monotonic()
    with pytest.raises(ParallelError, match="rank 1 died") as info:
        run_ranks(scenarios.dies_mid_run, 2, timeout_s=90, collective_timeout_s=timeout)
    elapsed = time.monotonic() - t0
    kind, message = info.value.outcomes[0]
    assert kind == "parallel", message                 # the survivor stopped on its own, with the clear error
    assert "sequence-parallel rank 0 of 2" in message and "another rank stopped" in message
    assert elapsed < timeout + 30                     # 30 s: starting two interpreters with torch on a slow CI
    assert not torch.distributed.is_initialized()



def test_generate_command_as_torchrun_ranks():
    """The generate command under torchrun's environment (the ranks' last job): rank 0 writes one process's latents,
    and its report says what each rank held and sent."""
    one, ranks = _runs(2)
    ref = one["cli"]
    assert ref["code"] == 0 and ref["parallel"] is None
    assert [r["cli"]["code"] for r in ranks] == [0, 0]
    got = ranks[0]["cli"]
    assert float((got["out"] - ref["out"]).abs().max()) <= PARITY
    par = got["parallel"]
    assert par["world_size"] == 2 and par["rank"] == 0 and par["backend"] == "gloo"
    assert par["kv_bytes_per_rank"] * 2 == par["kv_bytes_one_process"]
    assert par["comm_bytes_per_chunk"] > 0
