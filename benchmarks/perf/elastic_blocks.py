"""docs/elastic.md's tables, from the files :mod:`benchmarks.perf.elastic`
writes.

:data:`BLOCKS` registers them with :mod:`benchmarks.blocks`.
"""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks._blocks_format import Block
from benchmarks._blocks_format import spread
from benchmarks._blocks_format import table
from benchmarks._blocks_format import top_provenance

ELASTIC = "benchmarks/results/elastic.json"
ROUND_BYTES = "benchmarks/results/elastic_round_bytes.json"


def render_elastic_round_costs(data: Sequence[dict]) -> str:
  """docs/elastic.md: an elastic round against today's sync."""
  (d,) = data
  costs = d["round_costs"]
  m = costs["median_s"]
  rows = [
    ["inner step (island-local, 2 devices)", m["inner_step"]],
    [
      "elastic round (`island.sync`: `live_devices`, one collective program, commit)",
      m["elastic_round"],
    ],
    [
      "today's `diloco` step over all 6 devices, without a sync",
      m["plain_local"],
    ],
    ["today's `diloco` step over all 6 devices, with a sync", m["plain_sync"]],
    ["today's sync (the difference)", costs["todays_sync_s"]],
  ]
  return (
    top_provenance(
      d, ELASTIC, f"; median of {costs['repeats']} interleaved repeats"
    )
    + "\n\n"
    + table(["what", "seconds"], [[w, f"{s:.4f}"] for w, s in rows], "lr")
    + "\n\n"
    + f"An elastic round cost {costs['round_vs_todays_sync']:.2f}x today's"
    f" sync, and an inner step plus a round"
    f" {costs['step_plus_round_vs_todays_sync_step']:.2f}x today's step with a"
    f" sync; today's step without a sync was"
    f" {m['plain_local'] / m['inner_step']:.1f}x the island-local step."
  )


def render_elastic_detection(data: Sequence[dict]) -> str:
  """docs/elastic.md: seconds from the kill to the failed round and to the
  commit without the killed island, both survivors."""
  (d,) = data
  rows, between = [], sum(1 for w, _ in d["detection"] if w == "between")
  seen = 0
  for where, run in d["detection"]:
    survivors = [run[k] for k in sorted(run) if k.startswith("p")]
    if where == "between":
      seen += 1
      label = "between syncs" + (f" (run {seen})" if between > 1 else "")
    else:
      label = "inside a round"
    rows.append(
      [
        label,
        spread([s["failed_after_s"] for s in survivors]),
        spread([s["committed_without_it_after_s"] for s in survivors]),
      ]
    )
  return (
    top_provenance(d, ELASTIC)
    + "\n\n"
    + table(
      ["killed", "survivors' round failed", "committed without it"],
      rows,
      "lrr",
    )
  )


def render_elastic_round_bytes(data: Sequence[dict]) -> str:
  """docs/elastic.md: one island's bytes per plain round."""
  (d,) = data
  payload = d["payload_bytes"]
  two, gather = d["round_bytes_per_island"], d["all_gather_bytes_per_island"]
  rows = [
    [
      n,
      f"{two[n]:,.0f}",
      f"{two[n] / payload:.2f}",
      f"{gather[n]:,.0f}",
      f"{gather[n] / payload:.2f}",
    ]
    for n in sorted(two, key=int)
  ]
  return (
    top_provenance(d, ROUND_BYTES, f"; payload {payload:,} bytes")
    + "\n\n"
    + table(
      [
        "islands",
        "two-phase round (bytes)",
        "/ payload",
        "one `all_gather` of the rows, before (bytes)",
        "/ payload",
      ],
      rows,
      "rrrrr",
    )
  )


MODEL_PARALLEL = "benchmarks/results/elastic_model_parallel.json"
UNEQUAL = "benchmarks/results/elastic_unequal.json"


def render_elastic_unequal(data: Sequence[dict]) -> str:
  """docs/elastic.md: islands of unequal speed, clock vs steps."""
  (d,) = data
  speeds = "/".join(f"{v:g}" for v in d["speeds_s"])
  rows = [
    [
      label,
      ", ".join(f"{v:.0%}" for v in r["goodput_by_island"].values()),
      f"{r['goodput']:.0%}",
      f"{r['inner_step_ratio']:.0%}",
      len(r["contributions_lost"]),
      ", ".join(f"{v:,}" for v in r["inner_steps_by_island"].values()),
      r["rounds"],
      f"{r['final_loss']:.5f}",
      ", ".join(sorted({str(c) for c in r["exit_codes"].values()})),
    ]
    for label, r in d["runs"].items()
  ]
  return (
    top_provenance(
      d,
      UNEQUAL,
      f"; 3 islands x 2 CPU devices, {speeds} s per inner step (equal"
      f" islands: the fastest's), {d['seconds']:g} s of training each",
    )
    + "\n\n"
    + table(
      [
        "run",
        "goodput per island",
        "goodput",
        "inner-step ratio",
        "contributions lost",
        "inner steps per island",
        "rounds",
        "center's held-out loss at the end",
        "exit codes",
      ],
      rows,
      "lrrrrlrrl",
    )
  )


CHAOS = "benchmarks/results/elastic_chaos.json"


ASYNCHRONOUS = "benchmarks/results/elastic_async.json"


def render_elastic_async(data: Sequence[dict]) -> str:
  """docs/elastic.md: asynchronous rounds against rounds on the clock, one
  row per run (``python -m benchmarks.perf.elastic --asynchronous``)."""
  (d,) = data

  def shares(values: dict) -> str:
    return ", ".join(f"{v:.1%}" for v in values.values()) or "-"

  rows = []
  for r in d["runs"]:
    gap = r.get("island_1_longest_gap_s")
    rows.append(
      [
        r["speeds"],
        r["setup"],
        r["repeat"] + 1,
        shares(r["inner_share_by_island"]),
        shares(r["exchange_share_by_island"]),
        f"{r['goodput']:.1%}" if "goodput" in r else "-",
        r["coordinator_rows"],
        r["center_loss"],
        "-" if gap is None else f"{gap:.2f} s",
      ]
    )
  load = d.get("load_average")
  extra = (
    f"; load average {load['start'][0]:.1f} at the start, {load['end'][0]:.1f}"
    " at the end"
    if load
    else ""
  )
  codes = {c for r in d["runs"] for c in r["exit_codes"].values()}
  return (
    top_provenance(
      d,
      ASYNCHRONOUS,
      f"; {d['seconds']:g} s of training per run, H = {d['sync_period']}"
      + extra,
    )
    + "\n\n"
    + table(
      [
        "speeds",
        "setup",
        "run",
        "inner-step share per island",
        "exchange share per island",
        "goodput",
        "outer steps",
        "center loss",
        "island 1 longest gap",
      ],
      rows,
      "llrllrrrr",
    )
    + "\n\n"
    + f"Exit codes of every process in every run: {sorted(codes)}."
  )


CHAOS_RUNS = (
  "benchmarks/results/elastic_chaos.json",
  "benchmarks/results/elastic_chaos_async.json",
  "benchmarks/results/elastic_chaos_gentle.json",
  "benchmarks/results/elastic_chaos_async_gentle.json",
)


def _chaos_column(d: dict) -> list[str]:
  """One chaos run's figures, in :func:`render_elastic_chaos_compared`'s
  rows (synchronous or asynchronous rounds)."""
  st = d["settings"]
  load = d.get("load_average")
  if d.get("asynchronous"):
    gaps = d["exchange_gaps"]
    spanning, every = gaps["spanning_a_kill_s"], gaps["every_s"]
    rounds = f"{d['versions']:,}"
    stall = (
      f"gap across a kill: median {spanning['median']:.2f} s, max"
      f" {spanning['max']:.2f} s (every gap: median {every['median']:.2f} s)"
    )
    twice = str(len(d["contributions_applied_twice"]))
    dropped = str(len(d["contributions_dropped"]))
    other = str(len(d["versions_with_other_bits"]))
  else:
    stall_s = d["stall_after_kill_s"]
    rounds = f"{d['rounds_committed']:,}"
    stall = (
      f"to the next round: median {stall_s['median']:.1f} s, max"
      f" {stall_s['max']:.1f} s"
      if stall_s["median"] is not None
      else "-"
    )
    twice = "(counted as lost)"
    dropped = "-"
    other = str(len(d["rounds_with_other_bits"]))
  return [
    d["command"].removeprefix("python -m benchmarks.perf.elastic "),
    f"{d['started_utc'][:16].replace('T', ' ')} UTC, {d['commit']}",
    f"{st['kill_every_s'][0]:g}-{st['kill_every_s'][1]:g} s",
    f"{d['kills']} ({d['kills_of_every_island']} of every island)",
    rounds,
    f"{len(d['contributions_lost'])} of {d['contributions_combined']:,}",
    twice,
    dropped,
    other,
    f"{d['goodput']:.1%}",
    f"{d['inner_step_ratio']:.1%}",
    f"{d['inner_seconds'] / d['island_seconds']:.1%}",
    stall,
    ", ".join(map(str, sorted(set(d["exit_codes"].values()), key=str))),
    f"{d['wall_s']:.0f} s",
    f"{load['start'][0]:.1f} / {load['end'][0]:.1f}" if load else "-",
  ]


def render_elastic_chaos_compared(data: Sequence[dict]) -> str:
  """docs/elastic.md: chaos runs, synchronous against asynchronous rounds,
  at issue 41's failure rate and a gentler one."""
  names = [
    "command (python -m benchmarks.perf.elastic ...)",
    "started, commit",
    "a kill every",
    "kills",
    "outer steps (rounds committed / versions)",
    "contributions lost (of applied)",
    "applied twice",
    "not pulled, and the island told so",
    "rounds / versions whose bits differ",
    "goodput (time)",
    "inner-step ratio",
    "island-seconds in any inner step",
    "survivors after a kill",
    "exit codes",
    "wall time",
    "load average, start / end",
  ]
  columns = [_chaos_column(d) for d in data]
  header = [
    "",
    *("asynchronous" if d.get("asynchronous") else "synchronous" for d in data),
  ]
  rows = [[n, *(c[k] for c in columns)] for k, n in enumerate(names)]
  st = data[0]["settings"]
  starts = sorted(d["started_utc"][:16].replace("T", " ") for d in data)
  return (
    "_`python -m benchmarks.perf.elastic --chaos N [--asynchronous]"
    f" [--gentle]`, runs started {starts[0]} to {starts[-1]} UTC (each run's"
    " start and commit in the table); numbers from"
    f" {', '.join(f'`{f}`' for f in CHAOS_RUNS)} (each as its"
    f" command wrote it); {st['islands']} islands x"
    f" {st['devices_per_process']} CPU devices and a dedicated coordinator,"
    f" H = {st['sync_period']}, {st['step_seconds']} s per inner step, back"
    f" after {st['back_after_s'][0]:g}-{st['back_after_s'][1]:g} s, seed"
    f" {st['seed']}._\n\n" + table(header, rows, "l" + "r" * len(data))
  )


def render_elastic_model_parallel(data: Sequence[dict]) -> str:
  """docs/elastic.md: bytes per device of a model-parallel island."""
  (d,) = data

  def held(r: dict) -> int:
    return r["params_bytes_per_device"] + r["state_bytes_per_device"]

  base = held(d["by_m"]["1"])
  rows = []
  for m, r in d["by_m"].items():
    rows.append(
      [
        m,
        f"{r['params_bytes_per_device']:,}",
        f"{r['state_bytes_per_device']:,}",
        f"{r['plain_round_rows_bytes_per_device']:,}",
        f"{r['healing_row_bytes_per_device']:,}",
        f"{held(r) / base:.3f}",
      ]
    )
  return (
    top_provenance(
      d,
      MODEL_PARALLEL,
      f"; {d['layers']} layers of width {d['width']}, {d['devices']} CPU"
      " devices per island",
    )
    + "\n\n"
    + table(
      [
        "M (model-parallel)",
        "params / device (bytes)",
        "state / device",
        "a plain round's rows",
        "a healing round's row",
        "params + state vs M = 1",
      ],
      rows,
      "rrrrrr",
    )
  )


def render_elastic_chaos(data: Sequence[dict]) -> str:
  """docs/elastic.md: the chaos run's report."""
  (d,) = data
  st = d["settings"]
  stall = d["stall_after_kill_s"]
  codes = sorted(set(d["exit_codes"].values()), key=str)
  rows = [
    [
      "kills",
      f"{d['kills']} ({d['kills_of_every_island']} of every island at once)",
    ],
    [
      "rounds committed",
      f"{d['rounds_committed']} ({d['failed_attempts']} failed attempts)",
    ],
    [
      "contributions lost (the islands' logs against the coordinator's)",
      f"{len(d['contributions_lost'])} (of"
      f" {d['contributions_combined']:,} combined)",
    ],
    ["rounds whose bits differ", f"{len(d['rounds_with_other_bits'])}"],
    [
      "goodput (island-seconds in inner steps that reached a committed"
      " center / island-seconds since each island's first start)",
      f"{d['goodput']:.1%} ({d['useful_island_seconds']:,.1f} of"
      f" {d['island_seconds']:,.0f} s); per island "
      + ", ".join(f"{v:.1%}" for v in d["goodput_by_island"].values()),
    ],
    [
      "island-seconds in any inner step",
      f"{d['inner_seconds'] / d['island_seconds']:.1%}",
    ],
    [
      "inner-step ratio (inner steps that reached a committed center /"
      " inner steps taken)",
      f"{d['inner_step_ratio']:.1%} ({d['useful_inner_steps']:,} of"
      f" {d['inner_steps']:,})",
    ],
    [
      "stall from a kill to the next committed round",
      f"median {stall['median']:.1f} s, max {stall['max']:.1f} s"
      f" ({stall['count']} kills with survivors)",
    ],
    ["exit codes", ", ".join(map(str, codes))],
    ["wall time", f"{d['wall_s']:.0f} s"],
  ]
  return (
    top_provenance(
      d,
      CHAOS,
      f"; {st['islands']} islands x {st['devices_per_process']} CPU devices"
      f" and a dedicated coordinator, H = {st['sync_period']},"
      f" {st['step_seconds']} s per inner step, a kill every"
      f" {st['kill_every_s'][0]:g}-{st['kill_every_s'][1]:g} s, back after"
      f" {st['back_after_s'][0]:g}-{st['back_after_s'][1]:g} s, seed {st['seed']}",
    )
    + "\n\n"
    + table(["what", "measured"], rows, "lr")
  )


BLOCKS = (
  Block(
    "elastic-round-costs",
    (ELASTIC,),
    render_elastic_round_costs,
    ("docs/elastic.md",),
  ),
  Block(
    "elastic-detection",
    (ELASTIC,),
    render_elastic_detection,
    ("docs/elastic.md",),
  ),
  Block(
    "elastic-round-bytes",
    (ROUND_BYTES,),
    render_elastic_round_bytes,
    ("docs/elastic.md",),
  ),
  Block(
    "elastic-model-parallel",
    (MODEL_PARALLEL,),
    render_elastic_model_parallel,
    ("docs/elastic.md",),
  ),
  Block(
    "elastic-async",
    (ASYNCHRONOUS,),
    render_elastic_async,
    ("docs/elastic.md",),
  ),
  Block("elastic-chaos", (CHAOS,), render_elastic_chaos, ("docs/elastic.md",)),
  Block(
    "elastic-chaos-compared",
    CHAOS_RUNS,
    render_elastic_chaos_compared,
    ("docs/elastic.md",),
  ),
  Block(
    "elastic-unequal",
    (UNEQUAL,),
    render_elastic_unequal,
    ("docs/elastic.md",),
  ),
)
