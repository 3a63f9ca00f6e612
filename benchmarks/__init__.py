"""shardopt's benchmark suite (scripts, not tests): ``python -m benchmarks.run``.

One module per section (overhead, groups, communication, memory, convergence,
projection), each with ``run(quick) -> dict`` returning a title, a table,
notes and the raw data; ``run.py`` writes them to ``benchmarks/results/``.
Shared helpers: ``_timing`` (interleaved medians and ratios), ``hlo``
(collectives in compiled HLO / lowered StableHLO), ``_common`` (the MLP and
the pmap / shard_map steps), ``_plots``.
"""
