"""Projection: communication time per step of a 1B-parameter model.

From the measured bytes per step (section 3, as a fraction of parameter bytes:
``wire bytes per step / P``), scaled to a model of 1e9 float32 parameters
(P = 4 GB), on a ring all-reduce over ``n = 8`` replicas:

    t = 2 (n - 1) / n * bytes_per_step / bandwidth

(bandwidth per replica, one direction; the latency term ``2 (n - 1) * alpha``
per all-reduce is left out: a few microseconds to milliseconds, negligible
next to gigabyte messages except on the WAN, where it adds ~14 x RTT per
sync). Three links: a TPU-class interconnect at 100 GB/s, 100 Gb/s Ethernet
(12.5 GB/s), and a 1 Gb/s WAN (0.125 GB/s).
"""

from __future__ import annotations

from benchmarks.perf import communication

NAME = "projection"
PARAMS = 1_000_000_000
BYTES_PER_PARAM = 4
REPLICAS = 8
LINKS = {  # name -> bytes per second
  "TPU-class interconnect, 100 GB/s": 100e9,
  "100 Gb/s Ethernet (12.5 GB/s)": 12.5e9,
  "1 Gb/s WAN (0.125 GB/s)": 0.125e9,
}
METHODS = {  # row label -> key in communication's results
  "cross_shard(adam)": "pmap · cross_shard(adam)",
  "cross_shard(adam, comm_dtype=bf16)": "pmap · cross_shard(adam, comm_dtype=bf16)",
  "agn(adam, T=16)": "pmap · agn(adam, T=16)",
  "diloco(adam, H=500)": "pmap · diloco(adam, H=500)",
}
FORMULA = "t = 2 (n - 1) / n * bytes_per_step / bandwidth, n = 8"


def ring_allreduce_seconds(
  num_bytes: float, bandwidth: float, replicas: int = REPLICAS
) -> float:
  """Bandwidth term of a ring all-reduce of ``num_bytes`` over ``replicas``."""
  return 2 * (replicas - 1) / replicas * num_bytes / bandwidth


def _format_seconds(seconds: float) -> str:
  if seconds >= 1:
    return f"{seconds:,.2f} s"
  if seconds >= 1e-3:
    return f"{seconds * 1e3:,.2f} ms"
  return f"{seconds * 1e6:,.1f} µs"


def run(quick: bool, measured: dict | None = None) -> dict:
  """Projects section 3's measured fractions onto a 1B-parameter model.

  Args:
    quick: passed to section 3 when it has to be measured here.
    measured: section 3's ``data`` from this run, if it ran.
  """
  if measured is None:
    measured = communication.measure(quick)
  model_bytes = PARAMS * BYTES_PER_PARAM
  rows, data = [], {}
  for label, key in METHODS.items():
    case = measured["cases"].get(key)
    if case is None:
      rows.append([label, "not yet measured"] + ["-"] * len(LINKS))
      continue
    fraction = case["wire_over_param_bytes"]
    per_step = fraction * model_bytes
    times = {
      link: ring_allreduce_seconds(per_step, bw) for link, bw in LINKS.items()
    }
    data[label] = {
      "fraction_of_param_bytes": fraction,
      "bytes_per_step": per_step,
      "seconds_per_step": times,
    }
    rows.append(
      [label, f"{fraction:.4g} × P = {per_step / 1e9:,.3f} GB"]
      + [_format_seconds(t) for t in times.values()]
    )
  notes = [
    f"Formula: {FORMULA} (bandwidth term only; latency 2 (n - 1) α per"
    " all-reduce not included). Model: 1e9 float32 params, P = 4 GB.",
    "Bytes per step: section 3's measured wire bytes per step as a fraction"
    " of parameter bytes, times 4 GB. Periodic methods amortise one full"
    " all-reduce over T (agn) or H (diloco) steps; on a sync step itself"
    " they pay the full cross_shard time.",
  ]
  return {
    "title": "6. Projection: communication time per step, 1B params, ring all-reduce",
    "table": {
      "columns": ["method", "bytes per step"] + list(LINKS),
      "rows": rows,
    },
    "notes": notes,
    "data": {
      "formula": FORMULA,
      "params": PARAMS,
      "replicas": REPLICAS,
      "links_bytes_per_s": LINKS,
      "methods": data,
    },
  }


def plot(result: dict, directory: str) -> list[str]:
  """Writes ``projection.png``: seconds per step for each method and link."""
  from benchmarks import _plots

  labels, values = [], []
  for method, entry in result["data"]["methods"].items():
    for link, seconds in entry["seconds_per_step"].items():
      labels.append(f"{method} · {link.split(',')[0].split(' (')[0]}")
      values.append(seconds)
  return [
    _plots.bars(
      f"{directory}/projection.png",
      labels,
      values,
      title="Projected communication time per step, 1B params, ring, n=8",
      xlabel="seconds per step (log)",
      log=True,
    )
  ]
