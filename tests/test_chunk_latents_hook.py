"""First frames sooner: ``on_chunk_latents`` hands each chunk's final latents over before the chunk's cache-refresh
pass is enqueued (a decode a consumer enqueues then runs before the refresh), once per chunk, on both sampler paths;
``on_chunk`` still fires after the refresh (progress). The latents are those of the output, unchanged."""
import pytest
import torch

from wan_accel.model.tiny import TINY_CONFIG, tiny_causal_model
from wan_accel.sampling import loop
from run_helpers import generate_latents

CTX = torch.randn(1, 4, TINY_CONFIG.text_dim, generator=torch.Generator().manual_seed(0))


def _record_forwards(monkeypatch, events: list) -> None:
    """Every model call of either executor, in order, as ('call', kind)."""
    from wan_accel.sampling.runner import Run
    for cls in (loop.EagerExecutor, Run):
        real = cls.forward

        def forward(self, kind, *a, _real=real, **k):
            events.append(("call", kind))
            return _real(self, kind, *a, **k)
        monkeypatch.setattr(cls, "forward", forward)


@pytest.mark.parametrize("path", ["reference", "optimized"])
def test_each_chunk_is_handed_over_before_its_refresh_and_equals_the_output(monkeypatch, path):
    model = tiny_causal_model()
    events, got = [], []
    _record_forwards(monkeypatch, events)

    def ready(ci, n, x0):
        events.append(("ready", ci))
        got.append(x0.clone())
        assert n == 3

    out = generate_latents(model, CTX, 9, 4, 6, seed=1, path=path,
                           on_chunk_latents=ready, on_chunk=lambda ci, n: events.append(("chunk", ci)))
    want = []
    for ci in range(3):
        refresh = [] if path == "optimized" and ci == 2 else [("call", "refresh")]   # it skips the last one
        want += [("call", "denoise")] * 4 + [("ready", ci)] + refresh + [("chunk", ci)]
    assert events == want
    assert torch.equal(torch.cat(got, 1).float(), out)


def test_a_chunk_redone_by_an_out_of_memory_retry_is_handed_over_once():
    model = tiny_causal_model()
    calls = []

    def guard(attempt, on_oom):          # a retry policy that redoes every chunk once after it completed
        attempt()
        on_oom()
        return attempt()

    out = generate_latents(model, CTX, 6, 4, 6, seed=2, path="reference", chunk_guard=guard,
                           on_chunk_latents=lambda ci, n, x0: calls.append((ci, x0.clone())))
    assert [ci for ci, _ in calls] == [0, 1]
    assert torch.equal(torch.cat([x for _, x in calls], 1).float(), out)


def test_a_hook_that_failed_is_called_again_when_the_chunk_is_redone():
    model = tiny_causal_model()
    seen = []

    def ready(ci, n, x0):
        seen.append(ci)
        if seen.count(ci) == 1 and ci == 0:
            raise torch.OutOfMemoryError("CUDA out of memory while decoding")

    def guard(attempt, on_oom):
        try:
            return attempt()
        except torch.OutOfMemoryError:
            on_oom()
            return attempt()

    generate_latents(model, CTX, 6, 4, 6, seed=2, path="reference", chunk_guard=guard, on_chunk_latents=ready)
    assert seen == [0, 0, 1]


def test_matrix_game2_hands_its_chunks_over_in_its_own_layout():
    from wan_accel.model.mg2_model import tiny_mg2_model
    from wan_accel.app.jobs.mg2 import generate_mg2
    from wan_accel.sampling.request import SamplingHooks
    model = tiny_mg2_model()
    a = model.action_config
    g = torch.Generator().manual_seed(0)
    image = torch.randn(1, 16, 1, 4, 6, generator=g)
    tokens = torch.randn(1, model.config.clip_tokens, model.config.clip_dim, generator=g)
    video = 1 + 4 * 5
    mouse = 0.1 * torch.randn(1, video, a.mouse_dim_in, generator=g) if a.enable_mouse else None
    keyboard = (torch.rand(1, video, a.keyboard_dim_in, generator=g) > 0.5).float()
    got = []
    out = generate_mg2(model, image, tokens, (mouse, keyboard), num_frames=6, seed=0,
                       hooks=SamplingHooks(on_chunk_latents=lambda ci, n, x0: got.append(x0.clone())))
    assert [tuple(x.shape) for x in got] == [(1, 16, 3, 4, 6)] * 2
    assert torch.equal(torch.cat(got, 2).float(), out)


def test_with_cuda_graphs_the_first_chunk_is_handed_over_before_its_refresh_and_its_capture(monkeypatch):
    """The optimized path with CUDA graphs (a stand-in backend on the CPU): chunk 0's frames leave as soon as its
    last denoising step is done, before its refresh pass and the refresh graph's capture, exactly as later chunks';
    the run's one-time attention measuring (``warm``) is over before the first chunk starts."""
    from test_fast_sampler_graphs import FakeGraphs
    from wan_accel.sampling import runner
    monkeypatch.setattr(runner, "graphs_device", lambda device: True)
    monkeypatch.setattr(runner, "CudaGraphBackend", FakeGraphs)
    events: list = []
    _record_forwards(monkeypatch, events)
    capture = FakeGraphs.capture
    monkeypatch.setattr(FakeGraphs, "capture", lambda self, fn: events.append(("capture",)) or capture(self, fn))
    warm = runner.Run.warm
    monkeypatch.setattr(runner.Run, "warm", lambda self, req: events.append(("warm",)) or warm(self, req))
    report: dict = {}
    generate_latents(tiny_causal_model(), CTX, 9, 4, 6, seed=1, path="optimized", report=report,
                     on_chunk_latents=lambda ci, n, x0: events.append(("ready", ci)),
                     on_chunk=lambda ci, n: events.append(("chunk", ci)))
    assert report["cuda_graphs"] and report["graphs"]["captures"] > 0
    denoise = [("call", "denoise")] * 2 + [("capture",)] + [("call", "denoise")] * 2   # warm-up, capture, replays
    want = [("warm",)]
    for ci in range(3):
        refresh = [] if ci == 2 else [("call", "refresh"), ("capture",)]
        want += denoise + [("ready", ci)] + refresh + [("chunk", ci)]
    assert events == want
