"""The doctor: self-checks of every accelerated path (core), its probes, the gate that applies its verdicts to
sampling, and its report."""
