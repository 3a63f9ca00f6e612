"""DiLoCo across islands that may die and come back (shardopt.elastic).

    python examples/elastic_diloco.py --coordinator HOST:PORT --num-processes N \
        --process-id I --steps S --sync-period H --out DIR [--step-seconds X]

Start one process per island, each with the same arguments but its own
``--process-id`` (0 is the coordinator and must outlive the others); with
``--processes-per-island K``, K consecutive processes form one island. Each
island trains a small MLP on its own data shard with AdamW, data parallel
over its devices (2 forced CPU devices per process unless XLA_FLAGS says
otherwise); every H steps the live islands run a DiLoCo round
(``shardopt.diloco``'s outer Nesterov step on the mean of their outer
gradients) through ``shardopt.elastic``. Kill an island (SIGKILL) and the
others carry on; start it again with the same ``--process-id`` and it heals
in the round it joins.

Each committed round appends one JSON line to ``DIR/p{I}.jsonl``::

  {"round": r, "step": t, "live": [process ids], "joined": [the processes
   that healed in it], "params_sha256": hex,
   "loss": held-out MSE of the center, "contributions": {process: [digest,
   weight]} (what the round combined), "incarnation": pid, "attempts": the
   failed attempts it retried, "failures": why each failed}

(and ``"time"``, the Unix time of the log; with ``"resumed": true`` on the
row of an island that returned after every island died and took the
dedicated coordinator's last committed round: no new round, the same bits
as that round's).

``--dedicated-coordinator``: process 0 trains nothing and keeps the center
(it writes no ``p0.jsonl`` but ``coordinator.jsonl``, one row per committed
round with its contributors and their ``contributions``); the islands are
processes 1..N-1, and any of them may die, all of them at once too. Each
island incarnation keeps its start (Unix time), the number of inner steps
it took, the seconds they took and the seconds since it joined in
``DIR/steps.{I}.{pid}`` (JSON), and appends to ``DIR/sent.{I}.jsonl`` a
line per contribution it sends, before the round's collective: the round,
the digest and weight its row carries, and the inner steps and seconds
since its last committed round (examples/elastic_chaos.py's ``audit``
reads them: goodput, lost contributions).

``--asynchronous`` (with ``--dedicated-coordinator``; ``--min-quorum Q``,
``--grace-seconds G``): islands never wait; each exchanges with the
coordinator alone every H steps (``shardopt.elastic.Island(...,
asynchronous=True)``, the outer step delayed Nesterov). Each island row
(one per exchange, its join included) also carries ``"version"`` (the
center version it received; ``params_sha256`` is that center's),
``"wall"`` (Unix time when the exchange returned), ``"exchange_seconds"``,
``"inner_seconds"`` (this incarnation's seconds in inner steps so far),
``"started"``, ``"offer"`` (the id of the contribution it offered; None
when it offered none) and ``"weight"``; the coordinator writes one row per
outer step with ``"version"``, ``"params_sha256"``, ``"contributors"``,
``"weights"`` and ``"offers"`` (``[process, offer id, weight]`` per
contribution combined: examples/elastic_chaos.py's asynchronous audit).

(rounds 1, 2, ... at steps H, 2H, ..., S; the start-up handshake is not
logged). It prints one line per committed round (``round 5 step 20 live
[0, 1, 2] healed [2] retried 1x (ProcessFailureError) (0.31s) loss
0.00812``; ``--verbose`` also prints each failed attempt as it fails), and
the process exits 0 after S steps, leaving its final params
in ``DIR/p{I}.npz``. ``--step-seconds X`` sleeps
X seconds per inner step, standing in for compute.

Options beyond the issue's command line: ``--num-fragments F`` (Streaming
DiLoCo: a round every H/F steps, one fragment each; no last round off the
schedule), ``--comm-dtype int8`` (any dtype name, or ``topk:K``: the top
K of every 4096-element chunk) and ``--error-feedback`` (the outer
gradient's wire), ``--processes-per-island K`` and
``--round-timeout-seconds`` (``shardopt.elastic.Island``'s watchdog).

A process other than 0 that finds nothing listening at ``--coordinator``
for ``--connect-timeout-seconds`` (default 60) prints why and exits with
code 1: it was started after the job ended, or its coordinator is gone.
gloo prints a ``[Gloo] Rank ... connected`` line to stderr (from C++, with
no switch in jaxlib 0.10.2) whenever a process opens a communicator;
``examples/elastic_launch.py`` keeps them in the logs, out of what it
prints.

For tests: ``ELASTIC_EXAMPLE_KILL=R:started`` (or ``R:gathered``) makes the
process ``ELASTIC_EXAMPLE_KILL_PROCESS`` (default: the last) SIGKILL itself
inside round R's ``live_devices`` block, before (after) its collective, once
per ``DIR``; ``ELASTIC_EXAMPLE_HANG=R`` makes it hang there instead, alive.
``ELASTIC_EXAMPLE_STOP=PATH``: an island ends after the first round it
commits once ``PATH`` exists (the chaos run's end).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time

import numpy as np

# -------------------------------------------------------- model and data (numpy)
D_IN, D_HIDDEN = 16, 64
SIZES = (D_IN, D_HIDDEN, D_HIDDEN, 1)
BATCH = 64  # per island and step, split over its local devices
LEARNING_RATE, WEIGHT_DECAY = 3e-3, 1e-4


def init_mlp(seed: int, sizes=SIZES) -> dict:
  """float32 params {"w0", "b0", ...} (the same on every island)."""
  rng = np.random.default_rng(seed)
  params = {}
  for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
    params[f"w{i}"] = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(
      np.float32
    )
    params[f"b{i}"] = np.zeros((b,), np.float32)
  return params


def mlp(params: dict, x, xp=np):
  layers = len(params) // 2
  for i in range(layers):
    x = x @ params[f"w{i}"] + params[f"b{i}"]
    if i < layers - 1:
      x = xp.tanh(x)
  return x[..., 0]


TEACHER = init_mlp(1234, (D_IN, 32, 1))


def batch(island: int, step: int, n: int = BATCH, shift=None):
  """Island ``island``'s batch of step ``step`` (1-based): its inputs are
  shifted by 0.3 * island (each island its own shard), teacher targets."""
  rng = np.random.default_rng([island, step])
  offset = 0.3 * island if shift is None else shift
  x = (rng.standard_normal((n, D_IN)) + offset).astype(np.float32)
  return x, mlp(TEACHER, x).astype(np.float32)


EVAL_X, EVAL_Y = batch(10_000, 0, 512, shift=0.3)


def eval_loss(params: dict) -> float:
  """Held-out MSE, in float64."""
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  return float(np.mean((mlp(p, EVAL_X) - EVAL_Y) ** 2))


def params_sha256(params: dict) -> str:
  """sha256 of the leaves' float32 bytes, in tree (sorted key) order."""
  leaves = [np.asarray(params[k], np.float32) for k in sorted(params)]
  return hashlib.sha256(
    b"".join(np.ascontiguousarray(v).tobytes() for v in leaves)
  ).hexdigest()


# -------------------------------------------------------------------- training
def _wire(text: str) -> str:
  """``--comm-dtype``'s value, checked: a dtype name or ``topk:K``."""
  if text.startswith("topk:"):
    k = text.split(":", 1)[1]
    if not k.isdigit() or int(k) < 1:
      raise argparse.ArgumentTypeError(
        f"--comm-dtype {text}: K must be a positive integer, e.g. topk:64"
      )
  return text


def _comm_dtype(text: str | None):
  """The transform's ``comm_dtype`` for ``--comm-dtype`` (after jax's
  import): None, ``shardopt.topk(K)`` or a dtype."""
  import jax  # noqa: PLC0415 (XLA's flags are set first)

  import shardopt  # noqa: PLC0415

  if text is None:
    return None
  if text.startswith("topk:"):
    return shardopt.topk(int(text.split(":", 1)[1]))
  return jax.numpy.dtype(text)


def _per_process(text: str) -> tuple[float, ...]:
  """``--step-seconds``: ``0.1`` or ``0.05,0.1,0.2`` (per process id)."""
  try:
    values = tuple(float(v) for v in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(
      f"--step-seconds {text}: a number of seconds, or one per process id"
      " separated by commas (0.05,0.1,0.2)"
    ) from None
  if any(v < 0 for v in values):
    raise argparse.ArgumentTypeError(f"--step-seconds {text}: must be >= 0")
  return values


def parse(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--coordinator", required=True, help="HOST:PORT")
  ap.add_argument("--num-processes", type=int, required=True)
  ap.add_argument("--process-id", type=int, required=True)
  ap.add_argument("--steps", type=int, required=True)
  ap.add_argument("--sync-period", type=int, required=True)
  ap.add_argument("--out", required=True)
  ap.add_argument(
    "--step-seconds",
    type=_per_process,
    default=(0.0,),
    help=(
      "seconds of sleep per inner step (compute): one value, or one per"
      " process id, comma-separated (islands of unequal speed)"
    ),
  )
  ap.add_argument(
    "--round-seconds",
    type=float,
    default=None,
    help=(
      "rounds on the clock: a round every T seconds, each island weighted by"
      " the inner steps it took (--sync-period is then unused)"
    ),
  )
  ap.add_argument(
    "--rounds",
    type=int,
    default=None,
    help="end after this many committed rounds (--steps still bounds steps)",
  )
  ap.add_argument("--heartbeat-seconds", type=int, default=5)
  ap.add_argument(
    "--connect-timeout-seconds",
    type=float,
    default=60.0,
    help=(
      "a process other than 0 that finds no coordinator at --coordinator"
      " for this long exits with code 1 and says so (started after the job"
      " ended, or its coordinator is gone)"
    ),
  )
  ap.add_argument(
    "--verbose",
    action="store_true",
    help="also print each failed attempt of a round (retried) as it fails",
  )
  ap.add_argument(
    "--num-fragments", type=int, default=1, help="Streaming DiLoCo"
  )
  ap.add_argument(
    "--comm-dtype",
    default=None,
    type=_wire,
    help=(
      "the outer gradient's wire: a dtype name (bfloat16, int8,"
      " float8_e4m3fn, int4, ...) or topk:K (the top K of every 4096-element"
      " chunk; needs --error-feedback)"
    ),
  )
  ap.add_argument("--error-feedback", action="store_true")
  ap.add_argument(
    "--round-timeout-seconds",
    type=float,
    default=900,
    help="exit (code 75) if a round does not commit within this",
  )
  ap.add_argument(
    "--timeout-seconds",
    type=float,
    default=None,
    help=(
      "how long a joining island waits for the others' next round"
      " (default: 600, or half of --round-timeout-seconds if that is less)"
    ),
  )
  ap.add_argument(
    "--stall-timeout-seconds",
    type=float,
    default=None,
    help=(
      "evict a stuck island (exit code 76) this many seconds after the"
      " others reached the end of a round, rather than end the job"
    ),
  )
  ap.add_argument(
    "--model-parallel",
    type=int,
    default=1,
    metavar="M",
    help=(
      "shard the MLP's hidden dimension over M of each island's devices"
      " (data parallel over the rest); rounds run shard by shard"
    ),
  )
  ap.add_argument(
    "--dedicated-coordinator",
    action="store_true",
    help=(
      "process 0 trains nothing: it keeps the center, so that any island"
      " may die, all of them at once too (islands: processes 1..N-1)"
    ),
  )
  ap.add_argument(
    "--asynchronous",
    action="store_true",
    help=(
      "islands never wait (with --dedicated-coordinator): each exchanges"
      " with the coordinator alone when its round is due; the outer step is"
      " delayed Nesterov (shardopt.delayed_nesterov, period: islands /"
      " --min-quorum)"
    ),
  )
  ap.add_argument(
    "--min-quorum",
    type=int,
    default=1,
    help="asynchronous: contributions that make an outer step due",
  )
  ap.add_argument(
    "--grace-seconds",
    type=float,
    default=None,
    help=(
      "asynchronous: an outer step this long after the first pending"
      " contribution, quorum or not"
    ),
  )
  ap.add_argument(
    "--processes-per-island",
    type=int,
    default=1,
    help="consecutive processes that form one island (fail together)",
  )
  return ap.parse_args(argv)


def main(argv=None) -> None:
  started = time.time()  # this incarnation's start (goodput counts from it)
  args = parse(argv)
  me = args.process_id
  os.makedirs(args.out, exist_ok=True)
  # The inner steps since this incarnation's last committed round, and their
  # seconds: what its next contribution carries (DIR/sent.{I}.jsonl).
  since = {"steps": 0, "inner_seconds": 0.0}
  # This incarnation's seconds in inner steps (asynchronous rows carry it:
  # the time-based goodput of benchmarks/perf/elastic.py --asynchronous).
  totals = {"inner_seconds": 0.0}
  if "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
  ):
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + " --xla_force_host_platform_device_count=2"
      " --xla_cpu_collective_timeout_seconds=10"
    )
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

  import jax
  import optax
  from jax.sharding import Mesh
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  try:
    import shardopt
  except ImportError:  # run from a checkout without installing it
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
    import shardopt

  def say(message: str) -> None:
    print(f"[p{me} {time.time():.3f}] {message}", flush=True)

  k = args.processes_per_island
  try:
    shardopt.elastic.initialize(
      args.coordinator,
      num_processes=args.num_processes,
      process_id=me,
      heartbeat_timeout_seconds=args.heartbeat_seconds,
      processes_per_island=k,
      dedicated_coordinator=args.dedicated_coordinator,
      connect_timeout_seconds=args.connect_timeout_seconds,
    )
  except ConnectionError as e:  # a late or lost process: say so, exit 1
    print(f"[p{me} {time.time():.3f}] {e}", file=sys.stderr, flush=True)
    raise SystemExit(1) from None

  tx = shardopt.diloco(
    optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY),
    "island",
    sync_period=args.sync_period,
    # The library's default outer step (Nesterov, lr 0.8, momentum 0.2:
    # docs/diloco.md "Why these defaults"); the paper's 0.7 / 0.9 loses to
    # plain averaging at this H and swings the center from round to round.
    num_fragments=args.num_fragments,
    comm_dtype=_comm_dtype(args.comm_dtype),
    error_feedback=args.error_feedback,
    **_asynchronous_outer(args, shardopt),
  )
  island = shardopt.elastic.Island(
    tx,
    processes_per_island=k,
    timeout_s=args.timeout_seconds
    or min(600.0, args.round_timeout_seconds / 2),
    round_timeout_s=args.round_timeout_seconds,
    stall_timeout_s=args.stall_timeout_seconds,
    dedicated_coordinator=args.dedicated_coordinator,
    round_seconds=args.round_seconds,
    on_event=_events(say, args, me, since),
    **(
      {
        "asynchronous": True,
        "min_quorum": args.min_quorum,
        "grace_seconds": args.grace_seconds,
      }
      if args.asynchronous
      else {}
    ),
  )
  step_seconds = args.step_seconds[min(me, len(args.step_seconds) - 1)]

  # The island: its devices, data parallel (params replicated, the batch
  # split; XLA sums the gradients over the island's devices only); with
  # --model-parallel M, the hidden dimension split over M of them.
  m = args.model_parallel
  devices = np.array(island.devices)
  if m > 1 and (devices.size % m or D_HIDDEN % m or k > 1):
    raise SystemExit(
      f"--model-parallel {m}: M must divide the island's {devices.size}"
      f" devices and the hidden width {D_HIDDEN}, with one process per island"
    )
  mesh = (
    Mesh(devices.reshape(-1, m), ("data", "model"))
    if m > 1
    else Mesh(devices, ("data",))
  )
  replicated = NamedSharding(mesh, P())
  split_batch = NamedSharding(mesh, P("data"))
  layout = {  # the hidden dimension over "model" (all replicated if M = 1)
    "w0": P(None, "model"),
    "b0": P("model"),
    "w1": P("model", None),
  }
  shardings = {
    name: NamedSharding(mesh, layout.get(name, P()) if m > 1 else P())
    for name in init_mlp(0)
  }
  rank = island.devices[0].process_index  # the island's first process
  rank = me - rank  # this process's rank in its island
  rows_here = slice(rank * BATCH // k, (rank + 1) * BATCH // k)
  data_shard = island.island - (1 if args.dedicated_coordinator else 0)

  def island_batch(step):
    """This process's rows of its island's batch, as the island's array."""
    x, y = batch(data_shard, step)
    return (
      jax.make_array_from_process_local_data(split_batch, a[rows_here])
      for a in (x, y)
    )

  def host(tree):
    """The values of the arrays: whole on this process, or replicated over
    several processes (then any copy)."""
    return jax.tree.map(
      lambda a: np.asarray(
        a if a.is_fully_addressable else a.addressable_data(0)
      ),
      tree,
    )

  def loss_fn(params, x, y):
    return jax.numpy.mean((mlp(params, x, jax.numpy) - y) ** 2)

  def inner_step(params, state, x, y):
    grads = jax.grad(loss_fn)(params, x, y)
    updates, state = island.tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = jax.device_put(init_mlp(0), shardings)
  if m > 1:  # the state's params-shaped leaves sharded like the params
    state = island.init(params)
    inner_step = jax.jit(
      inner_step,
      out_shardings=(shardings, jax.tree.map(lambda a: a.sharding, state)),
    )
  else:
    state = jax.jit(island.tx.init, out_shardings=replicated)(params)
    inner_step = jax.jit(inner_step)
  if not island.trains:  # the dedicated coordinator: rounds only

    def committed(params, state, done):
      row = {
        "round": done.number,
        "step": done.step,
        "live": list(done.live),
        "contributors": list(done.contributors),
        "joined": list(done.joined),
        "attempts": done.attempts,
        "params_sha256": params_sha256(host(params)),
        "contributions": _contributions(done),
        "time": time.time(),
      }
      if done.version is not None:  # asynchronous: one row per outer step
        row["version"] = done.version
        row["weights"] = [w for _, w in done.weights]
        # [process, offer id, weight] per contribution, in the order the
        # outer step combined them (a process can appear twice)
        row["offers"] = [
          [p, d, w]
          for (p, d), (_, w) in zip(done.digests, done.weights, strict=True)
        ]
      with open(os.path.join(args.out, "coordinator.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")

    params, state = island.coordinate(params, state, on_round=committed)
    held = sum(np.asarray(x).nbytes for x in jax.tree.leaves((params, state)))
    size = sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))
    say(
      f"islands done; the center's loss {eval_loss(host(state.center)):.5f};"
      f" the coordinator held {held:,} bytes of params and state"
      f" ({held / size:.2f}x the params)"
    )
    island.finish()

  def log(done, resumed: bool = False) -> None:
    center = host(state.center)
    row = {
      "round": done.number,
      "step": done.step,
      "live": list(done.live),
      "joined": list(done.joined),
      "params_sha256": params_sha256(host(params)),
      "loss": eval_loss(center),
      "contributions": _contributions(done),
      "incarnation": os.getpid(),
    }
    if resumed:  # took the last committed round's center, committed none
      row["resumed"] = True
    else:  # the failed attempts before it committed (retried), and why
      row["attempts"] = done.attempts
      row["failures"] = list(done.failures)
    if args.round_seconds is not None:  # the inner steps each contributed
      row["steps_by_process"] = {str(p): w for p, w in done.weights}
    if done.version is not None:  # asynchronous: the center it received
      row["version"] = done.version
      # the offer this exchange carried (None: a fresh island's, nothing;
      # or one the coordinator could not pull, "ContributionDropped" in
      # "failures": not applied)
      row["offer"] = done.digests[0][1] if done.digests else None
      row["weight"] = done.weights[0][1] if done.weights else 0.0
      row["exchange_seconds"] = done.seconds
      row["wall"] = time.time()
      row["inner_seconds"] = totals["inner_seconds"]
      row["started"] = started
    if m > 1:
      row["local_shard_shapes"] = {
        name: list(a.addressable_shards[0].data.shape)
        for name, a in params.items()
      }
    row["time"] = time.time()
    with open(os.path.join(args.out, f"p{me}.jsonl"), "a") as f:
      f.write(json.dumps(row) + "\n")
    say(round_line(row, done, resumed))

  # Join: the handshake at the job's start, or the healing round of a
  # restarted island (weight 0; it takes the center and the counters).
  params, state, done = island.sync(params, state)
  if done.version is not None:  # asynchronous: the center it starts from
    log(done)
  elif done.number:  # a heal, or a resume from the coordinator's last round
    log(done, resumed=not done.contributors)
  count = done.step
  stop = os.environ.get("ELASTIC_EXAMPLE_STOP")
  trained = 0  # inner steps this incarnation took
  inner_s, joined_at = 0.0, time.monotonic()  # time in inner steps; since
  steps_file = os.path.join(args.out, f"steps.{me}.{os.getpid()}")

  def record(steps: int, seconds: float) -> None:
    """This incarnation's inner steps and their seconds, and the seconds
    since it joined (a file a SIGKILL leaves behind: chaos, goodput)."""
    with open(steps_file + ".tmp", "w") as f:
      json.dump(
        {
          "steps": steps,
          "inner_seconds": seconds,
          "seconds": time.monotonic() - joined_at,
          "started": started,
          "incarnation": os.getpid(),
        },
        f,
      )
    os.replace(steps_file + ".tmp", steps_file)  # a kill never cuts it

  while count < args.steps:
    count += 1
    began = time.monotonic()
    try:
      params, state = inner_step(params, state, *island_batch(count))
      jax.block_until_ready(state.count)
    except jax.errors.JaxRuntimeError as e:
      if k == 1:
        raise
      raise shardopt.elastic.IslandBrokenError(
        f"island {island.island} lost a process during a local step; restart"
        " all of its processes"
      ) from e
    if step_seconds:
      time.sleep(step_seconds)
    trained += 1
    took = time.monotonic() - began
    inner_s += took
    since["steps"] += 1
    since["inner_seconds"] += took
    totals["inner_seconds"] += took
    record(trained, inner_s)
    due = island.due(state)
    # A last round at the end, due or not (one fragment only).
    if due or (count == args.steps and args.num_fragments == 1):
      params, state, done = island.sync(params, state, early=not due)
      since.update(steps=0, inner_seconds=0.0)
      count = done.step
      log(done)
      record(trained, inner_s)
      if stop and os.path.exists(stop):  # the chaos run is over
        break
      if args.rounds is not None and done.number >= args.rounds:
        break
  np.savez(os.path.join(args.out, f"p{me}.npz"), **host(params))
  say("done")
  island.finish()  # process 0 hosts the coordination service: it leaves last


def round_line(row: dict, done, resumed: bool = False) -> str:
  """A committed round in one line: who took part, who healed in it, how
  many failed attempts it retried (and why), the center's loss."""
  if resumed:
    return (
      f"resumed at round {done.number} step {done.step} from the"
      f" coordinator's center, loss {row['loss']:.5f}"
    )
  line = f"round {done.number} step {done.step} live {list(done.live)}"
  if done.version is not None:
    line += f" version {done.version}"
  if done.joined:
    line += f" healed {list(done.joined)}"
  if done.attempts:
    kinds = sorted({why.split(":", 1)[0] for why in done.failures})
    line += f" retried {done.attempts}x ({', '.join(kinds)})"
  return line + f" ({done.seconds:.2f}s) loss {row['loss']:.5f}"


def _asynchronous_outer(args, shardopt) -> dict:
  """``--asynchronous``: diloco's outer step as delayed Nesterov, with the
  library's default learning rate and momentum, one momentum update per
  islands / --min-quorum outer steps (about one contribution per island)."""
  if not args.asynchronous:
    return {}
  islands = (args.num_processes - 1) // args.processes_per_island
  return {
    "outer_optimizer": shardopt.delayed_nesterov(
      learning_rate=0.8,
      momentum=0.2,
      momentum_period=max(1, islands // args.min_quorum),
    )
  }


def _contributions(done) -> dict:
  """``{process: [digest, weight]}`` of a committed round's contributors."""
  weights = dict(done.weights)
  return {str(p): [d, weights[p]] for p, d in done.digests}


def _events(say, args, me, since):
  """Logs the rounds' events (each contribution this process sends, before
  the collective: ``DIR/sent.{I}.jsonl``); the fault-injection hook for
  tests."""
  kill = os.environ.get("ELASTIC_EXAMPLE_KILL", "")
  hang = os.environ.get("ELASTIC_EXAMPLE_HANG", "")
  victim = int(
    os.environ.get("ELASTIC_EXAMPLE_KILL_PROCESS", args.num_processes - 1)
  )
  marker = os.path.join(args.out, "killed.marker")
  rounds = {"next": None}

  def on_event(name: str, info: dict) -> None:
    if name == "round_committed":
      rounds["next"] = info["number"] + 1
    if name == "round_started" and info["sent"]["counted"]:
      row = {
        **info["sent"],
        "round": rounds["next"],
        "incarnation": os.getpid(),
        **since,
        "time": time.time(),
      }
      with open(os.path.join(args.out, f"sent.{me}.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    if name == "round_failed" and args.verbose:  # else: the round's line
      say(f"round failed after {info['seconds']:.2f}s: {info['why']}")
    if hang and me == victim and name == "round_started":
      if rounds["next"] == int(hang):
        say(f"hanging in round {hang} (heartbeats go on)")
        time.sleep(1e9)
    if not kill or me != victim or os.path.exists(marker):
      return
    when, point = kill.split(":")
    if name == f"round_{point}" and rounds["next"] == int(when):
      open(marker, "w").close()
      say(f"SIGKILL in round {when}, {point}")
      os.kill(os.getpid(), signal.SIGKILL)

  return on_event


if __name__ == "__main__":
  main(sys.argv[1:])
