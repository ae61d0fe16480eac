"""The doctor: self-checks of every accelerated path (core), its probes, the gate that applies its verdicts to
sampling, and its report."""

from . import probes  # noqa: F401 - registers the pack's features (before core is used; core does not need them)
