"""Benchmarks: each module takes ``add_arguments(parser)`` and ``run(args) -> int`` (``python -m wan_accel bench``)."""


def print_columns(cols, table, tails=None, rule=False) -> None:
    """Print ``table`` (rows of cells, None shown as 'n/a') under ``cols``, each column as wide as its widest cell;
    ``tails[i]`` follows row i; ``rule`` underlines the header with dashes and trims each line's trailing blanks."""
    table = [[str("n/a" if s is None else s) for s in t] for t in table]
    widths = [max([len(c)] + [len(t[i]) for t in table]) for i, c in enumerate(cols)]
    lines = [cols] + ([["-" * w for w in widths]] if rule else []) + table
    for i, vals in enumerate(lines):
        text = "  ".join(v.ljust(w) for v, w in zip(vals, widths))
        print(text.rstrip() if rule else text + (tails[i - 1] if tails and i else ""))


def bench_timer(device, cpu_repeats: int):
    """The operator store's own timer on a GPU (GPU time per call from CUDA-graph replays), so a table ranks
    implementations as the store does; wall time over ``cpu_repeats`` calls on a CPU."""
    from ..cache.autotune import cpu_timer, default_timer
    return default_timer if str(device).startswith("cuda") else (lambda fn: cpu_timer(fn, repeats=cpu_repeats))
