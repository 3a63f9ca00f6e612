"""Quality studies: what training reaches (see :mod:`benchmarks`)."""
