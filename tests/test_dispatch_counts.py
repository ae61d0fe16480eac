"""The optimized loop's structure, verified on the CPU with ``profiling.dispatch_counts``: no host sync in a whole
video (text-to-video with global and rolling caches, Matrix-Game-2), fewer aten ops per steady-state step than the
reference path, and the KV bytes of a step equal to the cache's write plan."""
import pytest
import torch

from wan_accel.model.mg2_model import tiny_mg2_model
from wan_accel.model.tiny import TINY_CONFIG, tiny_causal_model
from wan_accel.profiling.dispatch_counts import Counts, DispatchCounts
from wan_accel.sampling import runner as runner_mod
from wan_accel.app.jobs.mg2 import generate_mg2
from wan_accel.sampling.mg2 import resolve_preset
from wan_accel.app.prepare import RunSpec
from wan_accel.sampling.request import SamplingHooks
from run_helpers import generate_latents
from wan_accel.sampling.scheduler import resolve_schedule

# The schedule is resolved before counting: resolve_schedule builds its tables from CPU tensors it creates itself
# (never on the model's device), so its float()/int() reads are no device syncs, but on a CPU run they would look
# like ones.
SCHEDULE = resolve_schedule("self_forcing")



@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch):
    """The counts are of the loop's own structure, as on any CPU: under TRITON_INTERPRET=1 the fused kernels would run
    in Triton's interpreter, whose own tensor copies count as dispatches, so their torch versions run here (the
    kernels' numbers are the kernel tests' to check, under the interpreter too)."""
    from wan_accel.kernels import _common

    monkeypatch.setattr(_common, "interpreter_usable", lambda: False)


END_OF_RUN = {"tolist": 1}     # model/finite.check_output: the one host read of a run, after its last chunk

def test_counter_sees_syncs_ops_and_kv_write_bytes():
    from wan_accel.model.kv_cache import write_kv
    x = torch.arange(6.0)
    cache = torch.zeros(2, 5, 3)
    with DispatchCounts() as c:
        y = x * 2 + 1                                    # 2 ops, no sync
        before = c.snapshot()
        x.sum().item()                                   # 1 conversion (its _local_scalar_dense is part of it)
        torch.nonzero(x > 2)                             # 1 sync op
        x[x > 3]                                         # boolean-mask index: 1
        bool(x[1])                                       # 1
        y.tolist()                                       # 1
        float(x[2])                                      # 1
        torch.unique(x)                                  # 1
        write_kv(cache, cache.clone(), torch.tensor([0, 3]), torch.ones(2, 2, 3), torch.ones(2, 2, 3))  # scattered
        write_kv(cache, cache.clone(), torch.tensor([1, 2]), torch.ones(2, 2, 3), torch.ones(2, 2, 3), slice(1, 3))
    assert before.ops == 2 and before.syncs == 0
    assert c.syncs == 7, dict(c.sync_names)
    assert dict(c.sync_names)["item"] == 1 and "_local_scalar_dense" not in c.sync_names
    assert c.kv_write_bytes == 2 * (2 * 2 * 2 * 3 * 4)          # two writes of k and v, 2 x 2 x 3 float32 each
    delta = c.snapshot() - before
    assert delta.syncs == 7 and delta.ops > 7 and isinstance(delta, Counts)
    with DispatchCounts() as d:                          # a fresh counter starts at zero; nothing leaks out
        pass
    assert d.ops == d.syncs == 0


def _wan(path, kv_window=-1, sink=0):
    model = tiny_causal_model()
    ctx = torch.randn(1, 5, TINY_CONFIG.text_dim, generator=torch.Generator().manual_seed(1))
    kw = dict(schedule=SCHEDULE, kv_window=kv_window, sink=sink, path=path)
    generate_latents(model, ctx, 12, 4, 4, **kw)            # warm: the optimized path's static session exists
    with DispatchCounts() as c:
        report = {}
        generate_latents(model, ctx, 12, 4, 4, callback=c.step_callback(), report=report, **kw)
    assert report["path"] == path
    return c


@pytest.mark.parametrize("kv_window,sink", [(-1, 0), (6, 3)])
def test_optimized_text_to_video_has_no_host_sync(kv_window, sink):
    opt = _wan("optimized", kv_window, sink)
    ref = _wan("reference", kv_window, sink)
    # one host read per video: the finite check of the output (and the conditioning) when the run ends
    assert dict(opt.sync_names) == END_OF_RUN, dict(opt.sync_names)
    assert isinstance(ref.syncs, int)          # reported whatever it is (0 today)
    step_opt, step_ref = opt.steady_step(), ref.steady_step()
    assert step_opt.syncs == 0 and 0 < step_opt.ops < step_ref.ops       # precomputed time embeddings, one qkv GEMM
    # one steady step writes the chunk's rows once: 3 frames x 4 tokens, x layers x (k, v) x heads x head_dim x 4 B
    c = TINY_CONFIG
    assert step_opt.kv_write_bytes == 3 * 4 * c.num_layers * 2 * c.num_heads * c.head_dim * 4
    assert step_ref.kv_write_bytes == step_opt.kv_write_bytes


def test_matrix_game2_optimized_has_no_host_sync():
    model = tiny_mg2_model()
    cfg, a = model.config, model.action_config
    g = torch.Generator().manual_seed(0)
    lf = 9                                            # more than the 6-frame window: the rolling cache wraps
    video = 1 + 4 * (lf - 1)
    image = torch.randn(1, 16, 1, 4, 4, generator=g)
    visual = torch.randn(1, cfg.clip_tokens, cfg.clip_dim, generator=g)
    mouse = 0.1 * torch.randn(1, video, a.mouse_dim_in, generator=g) if a.enable_mouse else None
    keyboard = (torch.rand(1, video, a.keyboard_dim_in, generator=g) > 0.5).float() if a.enable_keyboard else None
    settings = resolve_preset("universal")
    assert settings.window < lf
    counts = {}
    for path in ("optimized", "reference"):
        spec = RunSpec(path=path, doctor=False)
        generate_mg2(model, image, visual, (mouse, keyboard), num_frames=lf, preset=settings, spec=spec)
        with DispatchCounts() as c:
            generate_mg2(model, image, visual, (mouse, keyboard), num_frames=lf, preset=settings, spec=spec,
                         hooks=SamplingHooks(callback=c.step_callback()))
        counts[path] = c
    assert dict(counts["optimized"].sync_names) == END_OF_RUN, dict(counts["optimized"].sync_names)
    assert isinstance(counts["reference"].syncs, int)
    assert 0 < counts["optimized"].steady_step().ops < counts["reference"].steady_step().ops


def test_a_sync_in_the_optimized_forward_is_caught(monkeypatch):
    """The zero above is not the counter's blindness: one item() per forward call is counted as such."""
    original = runner_mod.Run.forward

    def forward(self, kind, xt, *args, **kwargs):
        float(xt.abs().max())
        return original(self, kind, xt, *args, **kwargs)

    monkeypatch.setattr(runner_mod.Run, "forward", forward)
    c = _wan("optimized")
    assert c.syncs == 4 * 4 + 3 + 1 and dict(c.sync_names) == {"__float__": 19, **END_OF_RUN}  # 4 x 4 steps + 3 refreshes
    assert c.steady_step().syncs == 1


def test_allocated_bytes_count_new_tensors_only():
    x = torch.ones(8, 4)
    with DispatchCounts() as c:
        y = x * 2                          # new: 128 bytes
        y.add_(1)                          # in place: nothing new
        z = y.view(32)[:16]                # views: nothing new
        w = torch.cat([z, z])              # new: 128 bytes
    assert (c.alloc_bytes, c.largest_alloc_bytes) == (256, 128) and w.numel() == 32
    assert c.snapshot().alloc_bytes == 256
