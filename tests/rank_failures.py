"""Rank functions for run_ranks that fail on purpose (importable by the spawned worker ranks)."""
from __future__ import annotations


def raises_on(sp, rank: int, message: str) -> int:
    """Rank ``rank`` raises ValueError(message); the others return their rank."""
    if sp.rank == rank:
        raise ValueError(message)
    return sp.rank
