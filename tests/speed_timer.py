"""A stand-in for the operator store's timer, for the speed verdicts of the opt-in approximate modes (int8 attention,
fp8 linear layers): the approximate candidate is timed first, then exact, with set times."""


def install(monkeypatch, slow: bool) -> list:
    """Give the process's autotuner a timer that runs each candidate once and says 4 ms (``slow``) or 1 ms for the
    approximate one and 2 ms for exact; returns the list that counts the timed calls.

    The CPU is made one without Triton's interpreter, whatever this process's TRITON_INTERPRET says: under it the
    fused kernels would tune their tiles with this same timer first and take its approximate/exact turns."""
    from wan_accel.cache.autotune import get_autotuner
    from wan_accel.kernels import _common
    monkeypatch.setattr(_common, "interpreter_usable", lambda: False)
    timed = []

    def timer(fn, *a, **kw):
        fn()
        timed.append(1)
        return (0.004 if slow else 0.001) if len(timed) % 2 else 0.002

    monkeypatch.setattr(get_autotuner(), "timer", timer)
    return timed
