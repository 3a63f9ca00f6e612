"""Elastic islands: how fast a death is noticed, and what a round costs.

    python -m benchmarks.perf.elastic [--rounds 200] [--kills 2]
    python -m benchmarks.perf.elastic --round-bytes
    python -m benchmarks.perf.elastic --chaos 100 [--seed 0]
    python -m benchmarks.perf.elastic --model-parallel-memory
    python -m benchmarks.perf.elastic --unequal [--seconds 40]
    python -m benchmarks.perf.elastic --asynchronous [--seconds 30] [--repeats 2]

``--asynchronous`` alone (issue 50): asynchronous rounds against rounds on
the clock, at equal and unequal speeds, and a kill
(:mod:`benchmarks.perf.elastic_async`); saved to
``benchmarks/results/elastic_async.json``.

``--unequal`` alone (issue 42): 3 islands whose inner steps take 0.03,
0.06 and 0.12 s (1x, 2x, 4x; a sleep standing in for compute), for the same
wall time each: rounds on the clock (a round every 4 s, each island weighted
by its steps) against rounds every H = 32 steps (about 4 s of the slowest
island) and against three equal islands at the fastest speed (H = 32),
each once as it is and once with the slowest island killed halfway and
restarted 3 s later. Per run: goodput per island and overall
(``examples/elastic_chaos.py``'s ``audit``: island-seconds in inner steps
whose contribution reached a committed center over island-seconds from each
island's first start to the run's end; process 0, never killed, is the
reference the others' logs are checked against), the inner-step ratio, the
contributions lost, the rounds and the center's held-out loss at the end;
saved to ``benchmarks/results/elastic_unequal.json``.

``--model-parallel-memory`` alone (no processes, seconds): an MLP of 4
layers of width 2048 under ``diloco(adamw)``, its params on 4 forced CPU
devices replicated or with the hidden dimension sharded over M = 2 and 4 of
them: per device, the bytes of the params' and the state's shards
(``Island.init``'s layout) and of one plain round's rows (3 islands,
float32 wire) and one healing round's row, built from that device's shards
as a round builds them; saved to
``benchmarks/results/elastic_model_parallel.json``.

``--chaos N [--asynchronous] [--gentle]``: ``examples/elastic_launch.py``'s chaos run
(:mod:`examples.elastic_chaos`) under a dedicated coordinator, 3 islands x
4 CPU devices, H=4, 0.05 s per inner step, until N kills (a kill every 3-8
s, one in ten of every island at once, each island back 1-6 s later); its
report (kills, rounds committed, contributions lost, rounds with other
bits, goodput in island-seconds and the inner-step ratio, the stall after a
kill) printed and saved to
``benchmarks/results/elastic_chaos.json``. With ``--asynchronous`` the
islands run asynchronous rounds (``--asynchronous``, quorum 1, delayed
Nesterov) and the report is ``elastic_chaos.report_asynchronous``'s
(versions, contributions lost and applied twice matched by offer id,
versions with other bits, the same time-based goodput, the survivors' gaps
between exchanges across a kill), saved to
``benchmarks/results/elastic_chaos_async.json``. ``--gentle``: a kill every
10-30 s (about one per island a minute) instead of every 3-8 s; the file's
name gains ``_gentle``.

``--round-bytes`` alone (no processes, under a minute): compiles one plain
round's collective program (``shardopt.elastic.rows.exchange``, float32
wire) for 2, 4 and 8 islands on forced CPU devices, reads what one island
sends from the compiled HLO with ``shardopt.measure.traffic``, and prints one
JSON line: ``{"payload_bytes": P, "round_bytes_per_island": {"2": B2, "4":
B4, "8": B8}, ...}`` (plus, for comparison, the one ``all_gather`` of whole
rows that rounds were before, ``all_gather_bytes_per_island``), also saved
to ``benchmarks/results/elastic_round_bytes.json``.

Two parts, 3 processes x 2 CPU devices on localhost (gloo, heartbeat 5 s,
CPU collective timeout 10 s), printed as tables and saved to
``benchmarks/results/elastic.json``:

1. **Round cost, same run**: each process alternates (interleaved, median
   over ``--rounds`` repeats) an elastic round (``shardopt.elastic``: a
   ``live_devices`` block, one all_gather, the commit) with today's sync
   (``shardopt.diloco`` inside one jit + shard_map over every island's
   devices) at a step that syncs and one that does not
   (``benchmarks/perf/_elastic_worker.py``).
2. **Detection latency**: ``examples/elastic_diloco.py`` runs (H=4, 0.15 s
   per inner step); island 2 is SIGKILLed between syncs (``--kills`` runs)
   and once inside a round (before its collective). Latency: from the kill
   to the survivors' failed round, and to the round they commit without it.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import _report

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "elastic.json"
ROUND_BYTES = ROOT / "benchmarks" / "results" / "elastic_round_bytes.json"
CHAOS = ROOT / "benchmarks" / "results" / "elastic_chaos.json"
MODEL_PARALLEL = ROOT / "benchmarks" / "results" / "elastic_model_parallel.json"
UNEQUAL = ROOT / "benchmarks" / "results" / "elastic_unequal.json"
ASYNCHRONOUS = ROOT / "benchmarks" / "results" / "elastic_async.json"
_spec = importlib.util.spec_from_file_location(
  "elastic_launch", ROOT / "examples" / "elastic_launch.py"
)
launch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(launch)
_spec = importlib.util.spec_from_file_location(
  "elastic_chaos", ROOT / "examples" / "elastic_chaos.py"
)
chaos_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chaos_run)

N = 3
H = 4
STEP_S = 0.15
_LINE = re.compile(r"^\[p(\d+) ([0-9.]+)\] (.*)$")


def round_costs(rounds: int) -> dict:
  """Part 1: per-process medians, then the median over processes."""
  out = Path(tempfile.mkdtemp(prefix="elastic_bench_"))
  port = launch.free_port()
  worker = ROOT / "benchmarks" / "perf" / "_elastic_worker.py"
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        str(worker),
        str(i),
        str(N),
        str(port),
        str(out),
        str(rounds),
      ],
      stdout=open(out / f"w{i}.log", "w"),
      stderr=subprocess.STDOUT,
      start_new_session=True,
    )
    for i in range(N)
  ]
  try:
    for p in procs:
      p.wait(timeout=600)
  finally:
    for p in procs:
      launch._kill_group(p)
  per = [json.loads((out / f"p{i}.json").read_text()) for i in range(N)]
  med = {
    k: statistics.median(statistics.median(p[k]) for p in per) for k in per[0]
  }
  sync_cost = med["plain_sync"] - med["plain_local"]
  return {
    "repeats": rounds,
    "median_s": med,
    "todays_sync_s": sync_cost,
    "round_vs_todays_sync": med["elastic_round"] / sync_cost
    if sync_cost > 0
    else None,
    "step_plus_round_vs_todays_sync_step": (
      med["inner_step"] + med["elastic_round"]
    )
    / med["plain_sync"],
  }


def _events(text: str, island: int) -> list[tuple[float, str]]:
  return [
    (float(m.group(2)), m.group(3))
    for m in map(_LINE.match, text.splitlines())
    if m and int(m.group(1)) == island
  ]


def detection(where: str) -> dict:
  """Part 2, one run: island 2 killed ``where`` ("between" syncs or
  "inside" a round)."""
  out = Path(tempfile.mkdtemp(prefix="elastic_detect_"))
  env = {}
  if where == "inside":
    env = {
      "ELASTIC_EXAMPLE_KILL": "3:started",
      "ELASTIC_EXAMPLE_KILL_PROCESS": "2",
    }
  with launch.Islands(
    out,
    num_processes=N,
    steps=32,
    sync_period=H,
    step_seconds=STEP_S,
    env=env,
    extra=("--verbose",),  # each failed attempt's line: when it failed
  ) as islands:
    islands.start_all()
    if where == "between":
      assert islands.wait_for_step(0, 2 * H, 120), islands.log(0)
      time.sleep(H * STEP_S / 2)
      islands.kill(2)
    codes = islands.wait(150)
    killed_at = (
      islands.kills[0][1]
      if where == "between"
      else next(t for t, e in _events(islands.log(2), 2) if "SIGKILL" in e)
    )
    result = {"exit_codes": codes}
    for survivor in (0, 1):
      events = _events(islands.log(survivor), survivor)
      failed = next(
        t for t, e in events if e.startswith("round failed") and t > killed_at
      )
      recovered = next(
        t for t, e in events if "live [0, 1] " in e and t > killed_at
      )
      result[f"p{survivor}"] = {
        "failed_after_s": failed - killed_at,
        "committed_without_it_after_s": recovered - killed_at,
        "why": next(e for t, e in events if t == failed).split(": ", 1)[-1],
      }
  return result


def round_bytes(islands=(2, 4, 8), shape=(512, 512)) -> dict:
  """What one island sends in a plain round (float32 wire), read from the
  compiled collective program, for each number of ``islands``."""
  import os  # noqa: PLC0415 (the flag must precede jax's import)

  os.environ.setdefault(
    "XLA_FLAGS", f"--xla_force_host_platform_device_count={max(islands)}"
  )
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  import optax  # noqa: PLC0415
  from jax.sharding import Mesh  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  import shardopt  # noqa: PLC0415
  from shardopt.elastic import rows  # noqa: PLC0415
  from shardopt.periodic import split  # noqa: PLC0415

  if jax.device_count() < max(islands):
    raise SystemExit(
      f"--round-bytes needs {max(islands)} devices, found"
      f" {jax.device_count()}: run it in a fresh process (XLA_FLAGS is set"
      " before jax is imported)."
    )
  params = {"w": jnp.zeros(shape, jnp.float32), "b": jnp.zeros(shape[-1:])}
  tx = shardopt.diloco(optax.adam(1e-3), "islands", sync_period=4)
  engine = split.engine_of(tx, "benchmarks.perf.elastic")
  state = jax.eval_shape(tx.init, params)
  payload = sum(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(params))
  sizes = rows.sizes_of(engine, 1, params)

  def sent(body, block) -> float:
    n = block[0]
    mesh = Mesh(np.array(jax.devices()[:n]), ("islands",))
    fn = jax.jit(
      jax.shard_map(
        body, mesh=mesh, in_specs=P("islands"), out_specs=P(), check_vma=False
      )
    )
    rows_in = jax.ShapeDtypeStruct((n * block[1],) + block[2:], jnp.uint8)
    return shardopt.measure.traffic(fn, rows_in, num_devices=n).per_step

  two_phase, gather = {}, {}
  for n in islands:
    shaped = jax.eval_shape(
      lambda s, p, o, n=n: rows.plain_rows(engine, 0, 0, 1, s, p, o, n)[0],
      state,
      params,
      jnp.zeros(n, jnp.int32),
    )
    two_phase[str(n)] = sent(
      lambda r, n=n: rows.exchange(engine, sizes, r, "islands", n),
      (n,) + shaped.shape,
    )
    whole = rows.HEADER_BYTES + payload  # one row of every island, gathered
    gather[str(n)] = sent(
      lambda r: jax.lax.all_gather(r, "islands", tiled=True), (n, 1, whole)
    )
  return {
    "payload_bytes": payload,
    "round_bytes_per_island": two_phase,
    "all_gather_bytes_per_island": gather,
    "command": "python -m benchmarks.perf.elastic --round-bytes",
    "measured_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds"
    ),
    "commit": _report.git_commit(mark_dirty=True),
  }


CHAOS_GAPS_S = {"as issue 41 ran it": (3.0, 8.0), "gentle": (10.0, 30.0)}


def chaos_file(asynchronous: bool, gentle: bool) -> Path:
  """Where ``--chaos`` saves its report (the module's docstring)."""
  name = "elastic_chaos" + ("_async" if asynchronous else "")
  return CHAOS.with_name(name + ("_gentle" if gentle else "") + ".json")


def chaos(
  kills: int, seed: int, asynchronous: bool = False, gentle: bool = False
) -> dict:
  """The chaos run of ``--chaos``: the report of
  ``examples/elastic_chaos.py``, with its settings."""
  module = chaos_run
  settings = {
    "islands": N,
    "devices_per_process": 4,
    "sync_period": H,
    "step_seconds": 0.05,
    "kill_every_s": list(
      CHAOS_GAPS_S["gentle" if gentle else "as issue 41 ran it"]
    ),
    "back_after_s": [1.0, 6.0],
    "seed": seed,
    "asynchronous": asynchronous,
  }
  with tempfile.TemporaryDirectory() as out:
    with launch.Islands(
      out,
      num_processes=N + 1,
      steps=10**6,
      sync_period=H,
      step_seconds=settings["step_seconds"],
      env=module.environment(out),
      extra=("--dedicated-coordinator",)
      + (("--asynchronous",) if asynchronous else ()),
    ) as islands:
      start = time.time()
      result = module.run(
        islands,
        seed=seed,
        duration_s=3600,
        timeout_s=300,
        gap_s=tuple(settings["kill_every_s"]),
        down_s=tuple(settings["back_after_s"]),
        max_kills=kills,
      )
      result["wall_s"] = time.time() - start
  print(module.show(result))
  return {"settings": settings, **result}


def model_parallel_memory(width: int = 2048, layers: int = 4) -> dict:
  """Bytes per device of a model-parallel island (see the module doc)."""
  import os  # noqa: PLC0415 (the flag must precede jax's import)

  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  import optax  # noqa: PLC0415
  from jax.sharding import Mesh  # noqa: PLC0415
  from jax.sharding import NamedSharding  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  import shardopt  # noqa: PLC0415
  from shardopt.elastic import rows  # noqa: PLC0415
  from shardopt.elastic import shards  # noqa: PLC0415
  from shardopt.periodic import split  # noqa: PLC0415

  tx = shardopt.diloco(optax.adamw(1e-3), "island", sync_period=H)
  engine = split.engine_of(tx, "benchmark")
  local_tx = optax.GradientTransformationExtraArgs(tx.init, tx.update)
  devices = jax.devices()[:4]
  out = {"width": width, "layers": layers, "devices": len(devices), "by_m": {}}
  for m in (1, 2, 4):
    mesh = Mesh(np.array(devices).reshape(-1, m), ("data", "model"))
    specs = {}
    for i in range(layers):
      specs[f"w{i}"] = P(None, "model") if i % 2 == 0 else P("model", None)
      specs[f"b{i}"] = P("model") if i % 2 == 0 else P()
    params = {
      k: jax.device_put(
        np.zeros((width, width) if k[0] == "w" else (width,), np.float32),
        NamedSharding(mesh, spec),
      )
      for k, spec in specs.items()
    }
    state = jax.jit(local_tx.init)(params)
    state = optax.tree_map_params(
      local_tx,
      lambda s, p: jax.device_put(s, p.sharding),
      state,
      params,
      transform_non_params=lambda s: jax.device_put(
        s, NamedSharding(mesh, P())
      ),
    )
    d = devices[0]
    lp = shards.local_trees(params, [d], "a params")[d]
    ls = shards.local_trees(state, [d], "a state")[d]
    owners = np.arange(3, dtype=np.int32)
    plain, _ = jax.jit(
      lambda s, p: rows.plain_rows(engine, 1, 1, 1, s, p, owners, 3)
    )(ls, lp)
    healing, _ = jax.jit(
      lambda s, p: rows.healing_row(engine, 1, 1, 1, True, s, p)
    )(ls, lp)
    nbytes = lambda t: sum(x.nbytes for x in jax.tree.leaves(t))  # noqa: E731
    out["by_m"][str(m)] = {
      "params_bytes_per_device": nbytes(lp),
      "state_bytes_per_device": nbytes(ls),
      "plain_round_rows_bytes_per_device": int(plain.nbytes),
      "healing_row_bytes_per_device": int(healing.nbytes),
    }
  return out


def unequal_run(speeds: str, extra: tuple, seconds: float, kill: bool) -> dict:
  """One run of ``--unequal``: the example for ``seconds`` of training,
  then every island stops after its next round."""
  with tempfile.TemporaryDirectory() as out:
    with launch.Islands(
      out,
      num_processes=N,
      steps=10**6,
      sync_period=32,
      step_seconds=speeds,
      env={"ELASTIC_EXAMPLE_STOP": str(Path(out) / "stop")},
      extra=extra,
    ) as islands:
      islands.start_all()
      if not islands.wait_for_step(0, 1, 120):
        raise RuntimeError(islands.log(0)[-3000:])
      start = time.time()
      if kill:
        time.sleep(seconds / 2)
        islands.kill(N - 1)
        time.sleep(3.0)
        islands.start(N - 1)
        time.sleep(max(0.0, start + seconds - time.time()))
      else:
        time.sleep(seconds)
      (Path(out) / "stop").write_text("now")
      codes = islands.wait(180)
      end = time.time()
      rows = islands.rows(0)
      logs = chaos_run.read_logs(out, range(N))
      # No dedicated coordinator here: process 0 (never killed) is the
      # reference the others' logs are checked against.
      ledger = chaos_run.audit(chaos_run.committed(rows), logs, end)
  return {
    "exit_codes": {str(i): c for i, c in sorted(codes.items())},
    "rounds": rows[-1]["round"] if rows else 0,
    "final_loss": rows[-1]["loss"] if rows else None,
    **ledger,
    "inner_steps_by_island": {
      str(i): sum(r["steps"] for r in log["incarnations"])
      for i, log in sorted(logs.items())
    },
  }


def unequal(seconds: float) -> dict:
  """Every run of ``--unequal``."""
  setups = {
    "on the clock (4 s)": ("0.03,0.06,0.12", ("--round-seconds", "4")),
    "every 32 steps": ("0.03,0.06,0.12", ()),
    "equal islands, every 32 steps": ("0.03,0.03,0.03", ()),
  }
  out = {"seconds": seconds, "speeds_s": [0.03, 0.06, 0.12], "runs": {}}
  for name, (speeds, extra) in setups.items():
    for kill in (False, True):
      label = name + (", slowest killed and back" if kill else "")
      result = unequal_run(speeds, extra, seconds, kill)
      out["runs"][label] = result
      gp = ", ".join(f"{v:.0%}" for v in result["goodput_by_island"].values())
      print(
        f"| {label} | {gp} | {result['rounds']} |"
        f" {result['final_loss']:.5f} | {result['exit_codes']} |",
        flush=True,
      )
  return out


def _save(path: Path, started, result: dict) -> None:
  """A results file: the command, when it started, the commit, ``result``."""
  path.write_text(
    json.dumps(
      {
        "command": " ".join(
          ["python -m benchmarks.perf.elastic", *sys.argv[1:]]
        ),
        "started_utc": started.isoformat(timespec="seconds"),
        "commit": _report.git_commit(mark_dirty=True),
        **result,
      },
      indent=1,
      default=str,
    )
    + "\n"
  )


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=200)
  ap.add_argument("--kills", type=int, default=2)
  ap.add_argument(
    "--chaos", type=int, default=None, metavar="KILLS", help="the chaos run"
  )
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--model-parallel-memory", action="store_true")
  ap.add_argument("--unequal", action="store_true")
  ap.add_argument("--seconds", type=float, default=40.0)
  ap.add_argument("--asynchronous", action="store_true")
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument(
    "--round-bytes",
    action="store_true",
    help="only the bytes one island sends per plain round at 2, 4, 8 islands",
  )
  ap.add_argument(
    "--gentle", action="store_true", help="--chaos: a kill every 10-30 s"
  )
  args = ap.parse_args()
  if args.chaos is not None:
    started = datetime.datetime.now(datetime.timezone.utc)
    result = chaos(args.chaos, args.seed, args.asynchronous, args.gentle)
    _save(chaos_file(args.asynchronous, args.gentle), started, result)
    return
  if args.asynchronous:
    from benchmarks.perf import elastic_async  # noqa: PLC0415

    started = datetime.datetime.now(datetime.timezone.utc)
    result = elastic_async.measure(launch, args.seconds, args.repeats)
    _save(ASYNCHRONOUS, started, result)
    return
  if args.unequal:
    started = datetime.datetime.now(datetime.timezone.utc)
    print("| run | goodput per island | rounds | final loss | exit codes |")
    print("|---|---|---:|---:|---|")
    result = unequal(args.seconds)
    _save(UNEQUAL, started, result)
    return
  if args.model_parallel_memory:
    started = datetime.datetime.now(datetime.timezone.utc)
    result = model_parallel_memory()
    print(
      "| M | params / device | state / device | plain round rows | healing row |"
    )
    print("|---:|---:|---:|---:|---:|")
    for m, r in result["by_m"].items():
      print(
        f"| {m} | {r['params_bytes_per_device']:,} |"
        f" {r['state_bytes_per_device']:,} |"
        f" {r['plain_round_rows_bytes_per_device']:,} |"
        f" {r['healing_row_bytes_per_device']:,} |"
      )
    _save(MODEL_PARALLEL, started, result)
    return
  if args.round_bytes:
    measured = round_bytes()
    ROUND_BYTES.write_text(json.dumps(measured, indent=1) + "\n")
    print(json.dumps(measured))
    return
  started = datetime.datetime.now(datetime.timezone.utc)
  costs = round_costs(args.rounds)
  m = costs["median_s"]
  print(
    f"Round cost, 3 islands x 2 CPU devices, median of {args.rounds} interleaved repeats:"
  )
  print("| what | seconds |")
  print("|---|---:|")
  print(f"| inner step (island-local) | {m['inner_step']:.4f} |")
  print(f"| elastic round (`island.sync`) | {m['elastic_round']:.4f} |")
  print(f"| today's diloco step without a sync | {m['plain_local']:.4f} |")
  print(f"| today's diloco step with a sync | {m['plain_sync']:.4f} |")
  print(f"| today's sync (difference) | {costs['todays_sync_s']:.4f} |")
  ratio = costs["round_vs_todays_sync"]
  print(
    f"elastic round / today's sync: {ratio:.1f}x"
    if ratio
    else "today's sync: below noise"
  )
  print(
    "inner step + elastic round / today's step with a sync:"
    f" {costs['step_plus_round_vs_todays_sync_step']:.2f}x"
  )
  runs = [("between", detection("between")) for _ in range(args.kills)]
  runs.append(("inside", detection("inside")))
  print(
    "\nDetection latency (island 2 SIGKILLed; heartbeat 5 s, collective timeout 10 s):"
  )
  print(
    "| killed | survivor | round failed after (s) | committed without it after (s) | error |"
  )
  print("|---|---|---:|---:|---|")
  for where, run in runs:
    for s in ("p0", "p1"):
      r = run[s]
      print(
        f"| {where} syncs | {s} | {r['failed_after_s']:.2f} |"
        f" {r['committed_without_it_after_s']:.2f} | {r['why'][:70]} |"
        if where == "between"
        else f"| inside a round | {s} | {r['failed_after_s']:.2f} |"
        f" {r['committed_without_it_after_s']:.2f} | {r['why'][:70]} |"
      )
  _save(RESULTS, started, {"round_costs": costs, "detection": runs})
  print(f"\nsaved {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
  main()
