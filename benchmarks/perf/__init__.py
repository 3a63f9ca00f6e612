"""Performance benchmarks: what a step costs (see :mod:`benchmarks`)."""
