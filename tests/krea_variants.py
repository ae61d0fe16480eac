"""Krea's context recompute changed in one named way, for tests that show the official tensors tell the change
apart from the real policy."""
from __future__ import annotations

from wan_accel.sampling.krea import KreaRecompute


class UnpaddedRecompute(KreaRecompute):
    """The context's block-causal passes without the zero padding keys a last, partial block attends in Krea's
    recompute: each block of the context is one cached pass over its own frames, nothing more."""

    def _context_pass(self, ex, req, ctx):
        n = ctx.shape[1]
        for j in range(0, n, self.fpb):
            m = min(self.fpb, n - j)
            ex.forward("refresh", ctx[:, j:j + m], float(req.refresh_t), j, ex.begin_chunk(j, m), want_output=False)
