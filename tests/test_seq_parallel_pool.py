"""The worker ranks kept beside a model (the ComfyUI face's pool), on gloo CPU processes: the same latents as one
process, workers reused between runs, and torn down by an interrupt or error on rank 0, by a dying worker, and with
the model."""
from __future__ import annotations

import gc

import pytest
import torch

from wan_accel.app.jobs.handle import load_model_handle
from wan_accel.app.prepare import RunInputs, RunSpec, sample_video
from wan_accel.app.ranks.pool import POOL_KEY
from wan_accel.model.attachments import seq_parallel_of
from wan_accel.model.seq_parallel import ParallelError
from wan_accel.nodes.model_nodes import CausalWanSampler
from wan_accel.nodes.parallel_nodes import CausalWanSequenceParallel
from wan_accel.sampling.request import SamplingHooks

SPEC = RunSpec(path="reference", seed=3)                      # tiny model, 9 frames 64x64
ARGS = (SPEC, RunInputs(context=torch.zeros(1, 0, 64)), 64, 64, 9)
NODE_ARGS = (64, 64, 9, 3, "self_forcing", 3, -1, 0)       # the sampler node's widgets for the same run


class Interrupted(Exception):
    pass


def _interrupt_at(step: int):
    def callback(ci, k, nc, ns, x0):
        if k == step:
            raise Interrupted("processing interrupted")
    return callback


def test_pool_matches_one_process_and_leaves_no_worker_behind():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        handle = load_model_handle(None, "fp32", "float32", "sdpa", "cpu")
        with torch.no_grad():
            one = sample_video(handle.model, *ARGS)
            node_one = CausalWanSampler().sample(handle, *NODE_ARGS, sampler="reference")[0]["samples"]
        with pytest.raises(ValueError, match="use one of 1, 2, 4 ranks"):
            CausalWanSequenceParallel().apply(handle, 3, 20)
        (same,) = CausalWanSequenceParallel().apply(handle, 2, 20)     # the node: the same handle, with a pool
        pool = handle.extra[POOL_KEY]
        assert same is handle and not pool.running
        node_two = CausalWanSampler().sample(handle, *NODE_ARGS, sampler="reference")[0]["samples"]
        assert pool.running and float((node_two - node_one).abs().max()) <= 1e-5
        two = pool.sample(handle.model, *ARGS)
        assert float((two - one).abs().max()) <= 1e-5
        workers = list(pool.procs)
        assert float((pool.sample(handle.model, *ARGS) - one).abs().max()) <= 1e-5
        assert pool.procs == workers and all(p.poll() is None for p in workers)       # reused, not restarted

        with pytest.raises(Interrupted):                  # an interrupt on rank 0: the workers go
            pool.sample(handle.model, *ARGS, hooks=SamplingHooks(callback=_interrupt_at(1)))
        assert not pool.running and all(p.poll() is not None for p in workers)
        assert seq_parallel_of(handle.model) is None
        assert not torch.distributed.is_initialized()

        assert float((pool.sample(handle.model, *ARGS) - one).abs().max()) <= 1e-5  # restarted
        pool.procs[0].kill()                              # a worker dies: one clear error, no hang
        with pytest.raises(ParallelError, match="another rank stopped|died"):
            pool.sample(handle.model, *ARGS)
        assert not pool.running and not torch.distributed.is_initialized()

        pool.sample(handle.model, *ARGS)
        workers = list(pool.procs)
        del handle, same, pool                            # dropping the model stops its workers
        gc.collect()
        for p in workers:
            p.wait(10)                                    # raises if a worker is still running
        assert not torch.distributed.is_initialized()
    finally:
        torch.set_num_threads(threads)
