"""What the approximate attention modes' tests share: inputs in Wan 2.1 1.3B's head layout, exact attention in
float64, and the error of an output against it in units of a mode's stated bound."""
from __future__ import annotations

import torch

ROWS = slice(0, 48)      # a bound's Q term costs rows x keys x head_dim^2: bound a sample of queries


def wan_qkv(dtype, lq=256, lk=384, heads=12, head_dim=128, seed=0, v_spread=0.0):
    """[B, L, 12, 128] q/k/v; keys with an offset (what int8's smoothing removes); ``v_spread``: the values'
    token scales spread by exp(N(0, v_spread)) (what fp8's folding of V's scales into P has to carry)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, lq, heads, head_dim, generator=g) * 2
    k = torch.randn(1, lk, heads, head_dim, generator=g) * 1.5 + 0.7
    v = torch.randn(1, lk, heads, head_dim, generator=g)
    v = v * torch.exp(torch.randn(1, lk, heads, 1, generator=g) * v_spread)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def exact(q, k, v):
    qf, kf, vf = (t.transpose(1, 2).double() for t in (q, k, v))
    w = torch.softmax(qf @ kf.transpose(-1, -2) / qf.shape[-1] ** 0.5, dim=-1)
    return (w @ vf).transpose(1, 2).float()


def ratio(out, q, k, v, error_bound, kernel="torch"):
    """(|out - exact|, that / error_bound) over the sampled query rows."""
    err = (out.float() - exact(q, k, v))[:, ROWS].abs()
    return err, err / error_bound(q, k, v, kernel=kernel, rows=ROWS)


def loader_runs(module, torch_fn: str, mode: str, path: str, monkeypatch) -> tuple[dict, dict]:
    """The loader node's tiny model run on ``path`` with exact attention ('sdpa') and with ``mode``: ({mode:
    latents}, {mode: the run's report}), asserting the mode's torch version (``module.torch_fn``) ran in the
    ``mode`` run only."""
    from wan_accel.nodes.model_nodes import CausalWanModelLoader
    from run_helpers import generate_latents
    calls = []
    real = getattr(module, torch_fn)
    monkeypatch.setattr(module, torch_fn, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    outs, reports = {}, {}
    for m in ("sdpa", mode):
        handle = CausalWanModelLoader().load("(built-in tiny model)", "fp32", "float32", m)[0]
        reports[m] = {}
        with torch.no_grad():
            outs[m] = generate_latents(handle.model, torch.randn(1, 8, handle.model.config.text_dim,
                                       generator=torch.Generator().manual_seed(1)), 6, 4, 4, seed=3,
                                       schedule="self_forcing", report=reports[m], path=path)
        assert bool(calls) == (m == mode)
    return outs, reports


def forget_choices() -> None:
    """Drop this process's memo of 'auto' attention choices (the next call reads the store again, as a new process
    would)."""
    from wan_accel.model import attention as att
    att._AUTO.clear()
    att._AUTO_UNMEASURED.clear()
