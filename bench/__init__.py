"""Benchmarks: each module takes ``add_arguments(parser)`` and ``run(args) -> int`` (``python -m wan_accel bench``)."""
