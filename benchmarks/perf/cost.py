"""Cost of every new path: each new step timed side by side with what it replaces.

All steps train the same MLP under ``jax.pmap`` on 8 replicas, and every
timing is :func:`benchmarks.perf.harness.compare`'s interleaved median (warm-up
excluded). Every comparison runs twice, with the same donation setting for a
step and its baseline each time:

* **no donation**: every call starts from the same params and state, so a
  step is timed in a fixed phase of its schedule (below);
* **donated** (params and state, ``donate_argnums=(0, 1)``, what a training
  loop does): every call continues from the previous one's outputs. These
  steps run on ``jax.jit`` + ``shard_map(check_vma=False)`` (pmap's
  semantics), per-replica params as ``P(axis)`` blocks
  (:func:`benchmarks.perf.workload.concat_shard_map_step`): jit's donation aliases
  buffers, where pmap's (jax 0.10, CPU) copies every donated output, so a
  donated pmap step would pay copies no jit training loop pays. To time
  only non-sync steps, the periodic methods run with a period of 1,000,000
  (a non-sync step runs the same code whatever the period: it is a static
  constant of the predicate), ``accumulate`` with k = 1,000,000 for its mid
  step; its emit step is timed without donation only.

1. **Non-sync step** of ``agn`` (T = 8), ``local_sgd`` (H = 16), ``diloco``
   (H = 16), streaming ``diloco`` (H = 64, F = 4) and
   ``hierarchical_local_sgd`` ({4: 2, 16: 8}), from ``tx.init`` (count 0, so
   the call is local step 1: no sync for any of them), vs the same local
   ``optax.adam`` step without shardopt. Goal <= 1.03 (``agn`` also adds the
   gradient to its accumulator: that add is part of its ratio). Two
   hand-written floors time what a schedule adds on purpose: adam + the
   accumulator add (``agn``'s), adam + the select that pulls the params onto
   a kept center at a sync (the others'); each non-sync step is also reported
   over its floor.
2. ``accumulate(cross_shard(adam), 4)``: a **mid step** (from ``tx.init``:
   mini-step 1 of 4) vs a hand-written bare gradient add (``acc += grads``,
   params untouched), and an **emit step** (from the state after 3 mini-steps)
   vs ``cross_shard(adam)``. Goal <= 1.02.
3. ``apply_if_finite(cross_shard(adam))`` vs ``cross_shard(adam)``. Goal <= 1.02.
4. ``chain(powersgd(rank r), adam)`` for r = 1, 2, 4 vs
   ``chain(cross_shard_mean, adam)``, with the projection of when it pays off
   on 100 Gb/s and 1 Gb/s links (:mod:`benchmarks.perf.projection`'s ring formula):
   PowerSGD saves ``ring(P) - ring(B)`` seconds of communication per step (B
   its bytes per step, from the HLO) and costs ``t_powersgd - t_cross_shard``
   of compute (measured here, on CPU, where the all-reduce itself is a
   shared-memory rendezvous); it pays off on links slower than the break-even
   bandwidth ``2 (n - 1) / n x (P - B) / (t_powersgd - t_cross_shard)``.

5. **Finite guards**: the free guard ``chain(cross_shard_mean,
   apply_if_finite(adam, 5, axis_name=None))`` (gradients already reduced: no flag
   collective) vs ``chain(cross_shard_mean, adam)`` and vs
   ``optax.apply_if_finite`` in the same place; the flagged guards
   ``apply_if_finite(cross_shard(adam), 5, axis_name=axis)`` and
   ``apply_if_finite(tower(adam), 5, axis_name=axis)`` vs their unguarded step (and
   the first vs ``optax.apply_if_finite(cross_shard(adam))``, which
   deadlocks on a one-replica NaN under pmap: timed on finite inputs).
   Goal <= 1.05. A hand-written floor times the finite check alone
   (``adam`` plus ``all_finite`` of the gradients, deciding nothing): what
   one more read of the gradients costs here. ``run(quick,
   only_guards=True)`` times this group alone.

The host-scheduled programs of issue 54 (``tx.update(..., sync=0)`` and
``sync=1``, chosen by ``shardopt.due``) are not timed here: their XLA bytes
accessed, conditionals, collectives and copies beside the in-graph
schedule's, for every periodic transform and wire, are
:mod:`benchmarks.perf.step_bytes`'s table (``benchmarks/results/
step_bytes.json``, benchmarks/README.md section 9d); their time against
Adam on an accelerator, :mod:`benchmarks.accelerator`'s ``overhead``.

Every entry whose transform this shardopt does not have yet is skipped and
listed. A ``max |Δparam|`` column checks that each step computes what its
baseline does where it should (the non-sync steps, the mid step and
``apply_if_finite``: equal up to float rounding; donated runners compare
their params after the same number of calls).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import shardopt
from benchmarks import methods
from benchmarks.perf import harness
from benchmarks.perf import projection
from benchmarks.perf import workload
from shardopt.measure import hlo
from shardopt.periodic import schedules

NAME = "cost"
GOALS = {
  "non-sync": 1.03,
  "accumulate": 1.02,
  "apply_if_finite": 1.02,
  "guard": 1.05,
}
ACCUMULATE_K = 4
POWERSGD_LINKS = ("100 Gb/s Ethernet (12.5 GB/s)", "1 Gb/s WAN (0.125 GB/s)")


HUGE_PERIOD = 1_000_000
NON_SYNC_REPEATS = 101  # timed rounds of the non-sync group (21 elsewhere)


def _adam():
  return optax.adam(1e-3)


def _adam_and_center_select() -> optax.GradientTransformation:
  """``optax.adam`` plus a kept ``center`` and the select that pulls the
  params onto it at a sync (``where(sync, center - params, updates)``),
  hand-written, never syncing: the floor of the center-based schedules'
  non-sync step (local_sgd, diloco, streaming, hierarchical), one read of
  the center more than adam."""
  adam = _adam()

  def init(params):
    center = jax.tree.map(jnp.asarray, params)
    return adam.init(params), center, jnp.zeros([], jnp.int32)

  def update(grads, state, params=None):
    inner, center, count = state
    updates, inner = adam.update(grads, inner, params)
    count = count + 1
    sync = count % HUGE_PERIOD == 0
    updates = jax.tree.map(
      lambda u, c, p: jnp.where(sync, c - p, u), updates, center, params
    )
    return updates, (inner, center, count)

  return optax.GradientTransformation(init, update)


def _adam_and_finite_check() -> optax.GradientTransformation:
  """``optax.adam`` plus :func:`shardopt.all_finite` of the gradients kept
  in its state, deciding nothing, hand-written: the floor of a finite guard
  (one more read of the gradients)."""
  adam = _adam()

  def init(params):
    return adam.init(params), jnp.asarray(True)

  def update(grads, state, params=None):
    updates, inner = adam.update(grads, state[0], params)
    return updates, (inner, shardopt.all_finite(grads))

  return optax.GradientTransformation(init, update)


def _bare_add_step(mesh, donate: bool):
  """Hand-written accumulation: ``acc += grads``, params untouched."""

  def step(params, acc, x, y):
    grads = jax.grad(workload.mlp_loss)(params, x, y)
    return params, jax.tree.map(lambda a, g: a + g, acc, grads)

  if not donate:
    return jax.pmap(step, axis_name=workload.AXIS)
  return jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=P(workload.AXIS),
      out_specs=P(workload.AXIS),
      check_vma=False,
    ),
    donate_argnums=(0, 1),
  )


class _Runner:
  """A zero-argument callable running one step; fixed inputs or threaded."""

  def __init__(
    self, step, params, state, batch, donate: bool, replicas: int = 0
  ):
    self.step, self.params, self.state = step, params, state
    self.batch, self.donate = batch, donate
    self.replicas = replicas  # > 0: params are unstacked (replica blocks)

  def __call__(self):
    out = self.step(self.params, self.state, *self.batch)
    if self.donate:  # the inputs are gone: continue from the outputs
      self.params, self.state = out
    return out

  def copied(self) -> dict:
    """:func:`shardopt.measure.hlo.copied_bytes` of this step's compiled HLO."""
    return hlo.copied_bytes(
      self.step.lower(self.params, self.state, *self.batch).compile().as_text()
    )

  def final_params(self) -> np.ndarray:
    """Replica 0's params after one call (fixed) or after every call so far."""
    params = (
      self.params
      if self.donate
      else self.step(self.params, self.state, *self.batch)[0]
    )
    first = (
      (lambda a: a.reshape((self.replicas, -1) + a.shape[1:])[0])
      if (self.replicas)
      else (lambda a: a[0])
    )
    return np.concatenate(
      [np.ravel(first(np.asarray(leaf))) for leaf in jax.tree.leaves(params)]
    )


class _Bench:
  """The MLP, its params and batch, and :class:`_Runner` factories."""

  def __init__(self, quick: bool):
    self.quick = quick
    self.sizes = (32, 64, 10) if quick else (512, 1024, 1024, 10)
    self.per_replica = 4 if quick else 16
    self.n = jax.device_count()
    params = workload.mlp_init(jax.random.key(0), self.sizes)
    self.param_count = workload.count_params(params)
    self.param_bytes = workload.tree_bytes(params)
    self._host = jax.tree.map(np.asarray, workload.replicate(params, self.n))
    self._identity = jax.pmap(lambda t: t)
    self.mesh = jax.make_mesh((self.n,), (workload.AXIS,))
    self.params = self.fresh_params()
    self.batch = self._identity(
      workload.batch(
        jax.random.key(1),
        self.n,
        self.per_replica,
        self.sizes[0],
        self.sizes[-1],
      )
    )

  def fresh_params(self):
    """New device buffers of the replicated params (donation consumes them)."""
    return self._identity(self._host)

  def _donated(self, step, params, state) -> _Runner:
    """A donated runner on jit + shard_map (:func:`workload.unstack` layout)."""

    on_mesh = lambda tree: workload.on_mesh(tree, self.mesh)
    return _Runner(
      step,
      on_mesh(params),
      on_mesh(state),
      on_mesh(self.batch),
      donate=True,
      replicas=self.n,
    )

  def runner(self, tx, donate: bool, *, warm_steps: int = 0) -> _Runner:
    """``tx``'s step from ``tx.init``, after ``warm_steps`` untimed steps.

    Not donated: ``jax.pmap``. Donated: ``jax.jit`` + ``shard_map`` with the
    same stacked layout (see :func:`benchmarks.perf.workload.concat_shard_map_step`).
    """
    state = jax.pmap(tx.init, axis_name=workload.AXIS)(self.fresh_params())
    params = self.fresh_params() if donate else self.params
    for _ in range(warm_steps):  # fixed params: only the state moves
      _, state = jax.block_until_ready(
        workload.pmap_step(tx)(params, state, *self.batch)
      )
    if donate:
      specs = workload.concat_specs(workload.unstack(state))
      return self._donated(
        workload.concat_shard_map_step(tx, self.mesh, specs, donate=True),
        params,
        state,
      )
    return _Runner(workload.pmap_step(tx), params, state, self.batch, donate)

  def bare_add(self, donate: bool) -> _Runner:
    acc = self._identity(jax.tree.map(np.zeros_like, self._host))
    step = _bare_add_step(self.mesh, donate)
    if donate:
      return self._donated(step, self.fresh_params(), acc)
    return _Runner(step, self.params, acc, self.batch, donate)

  def hlo_bytes(self, tx, schedule) -> dict:
    state = jax.pmap(tx.init, axis_name=workload.AXIS)(self.params)
    text = (
      workload.pmap_step(tx)
      .lower(self.params, state, *self.batch)
      .compile()
      .as_text()
    )
    return hlo.per_step(
      hlo.compiled_collectives(text, num_devices=self.n), schedule
    )

  def compare(self, runners: dict, baseline: str, repeats: int = 21) -> dict:
    return harness.compare(
      runners,
      baseline=baseline,
      repeats=7 if self.quick else repeats,
      inner=1 if self.quick else 2,
    )


def _streaming_variants(period: int, num_layers: int) -> list:
  """Streaming DiLoCo (F = 4) with overlap (tau = 1, alpha = 0.5), and with
  fragments over layers (every weight matrix's rows dealt to the fragments
  as a stack's layers; the biases as whole leaves)."""
  layers = {f"layer{i}": {"w": 0, "b": None} for i in range(num_layers)}
  variants = {
    "overlap tau=1, alpha=0.5": {"overlap_steps": 1, "overlap_alpha": 0.5},
    "layer fragments": {"layer_axes": layers},
  }
  return [
    methods.Method(
      f"streaming diloco(adam, H={period}, F=4, {label})",
      ("diloco",),
      lambda opt, kwargs=kwargs: shardopt.diloco(
        opt(), workload.AXIS, sync_period=period, num_fragments=4, **kwargs
      ),
      hlo.Schedule(schedules.streaming(period, 4)),
    )
    for label, kwargs in variants.items()
  ]


def _periodic_methods(donate: bool, num_layers: int) -> list:
  """The periodic transforms; with donation, periods no call reaches."""
  if donate:
    h = HUGE_PERIOD
    return [
      methods.agn(h, name="adam"),
      methods.local_sgd(h, name="adam"),
      methods.diloco(h, name="adam"),
      methods.streaming_diloco(h, 4, name="adam"),
      *_streaming_variants(h, num_layers),
      methods.hierarchical({h: 2, 4 * h: 8}, name="adam"),
    ]
  return [
    methods.agn(8, name="adam"),
    methods.local_sgd(16, name="adam"),
    methods.diloco(16, name="adam"),
    methods.streaming_diloco(64, 4, name="adam"),
    *_streaming_variants(64, num_layers),
    methods.hierarchical({4: 2, 16: 8}, name="adam"),
  ]


def _apply_if_finite() -> methods.Method:
  return methods.Method(
    "apply_if_finite(cross_shard(adam))",
    ("apply_if_finite",),
    lambda opt: shardopt.apply_if_finite(
      shardopt.cross_shard(opt(), workload.AXIS),
      5,
      axis_name=workload.AXIS,
    ),
    hlo.Schedule(),
  )


def _guard_rows() -> list:
  """The finite guards, each with its unguarded step and optax's guard in
  the same place: ``(group, name, transform, baseline name)``; the first of
  each pair of baselines is the unguarded step."""
  axis, adam = workload.AXIS, _adam
  mean = "chain(cross_shard_mean, adam)"
  cross = "cross_shard(adam) [guard group]"
  tower = "tower(adam)"
  return [
    (None, mean, optax.chain(shardopt.cross_shard_mean(axis), adam()), None),
    (
      "floor",
      "chain(cross_shard_mean, adam + finite check) (floor: no skip)",
      optax.chain(shardopt.cross_shard_mean(axis), _adam_and_finite_check()),
      mean,
    ),
    (
      "guard",
      "chain(cross_shard_mean, apply_if_finite(adam, 5, axis_name=None)) (free guard)",
      optax.chain(
        shardopt.cross_shard_mean(axis),
        shardopt.apply_if_finite(adam(), 5, axis_name=None),
      ),
      mean,
    ),
    (
      None,
      "chain(cross_shard_mean, optax.apply_if_finite(adam, 5))",
      optax.chain(
        shardopt.cross_shard_mean(axis), optax.apply_if_finite(adam(), 5)
      ),
      mean,
    ),
    (None, cross, shardopt.cross_shard(adam(), axis), None),
    (
      "guard",
      "apply_if_finite(cross_shard(adam), 5, axis_name=axis) (flag)",
      shardopt.apply_if_finite(
        shardopt.cross_shard(adam(), axis), 5, axis_name=axis
      ),
      cross,
    ),
    (
      None,
      "optax.apply_if_finite(cross_shard(adam), 5) (unsafe: finite inputs)",
      optax.apply_if_finite(shardopt.cross_shard(adam(), axis), 5),
      cross,
    ),
    (None, tower, shardopt.tower(adam(), axis), None),
    (
      "guard",
      "apply_if_finite(tower(adam), 5, axis_name=axis) (flag)",
      shardopt.apply_if_finite(shardopt.tower(adam(), axis), 5, axis_name=axis),
      tower,
    ),
  ]


def _time_guards(bench: _Bench, donate: bool, record) -> None:
  """5. Every finite guard vs its unguarded step and vs optax's guard placed
  the same way (``optax.apply_if_finite`` around a transform that
  communicates deadlocks under pmap on a one-replica NaN; timed here on
  finite gradients only)."""
  tag = ", donated" if donate else ""
  rows = [(g, n + tag, tx, b and b + tag) for g, n, tx, b in _guard_rows()]
  runners = {name: bench.runner(tx, donate) for _, name, tx, _ in rows}
  timing = bench.compare(runners, rows[0][1])
  theirs = {b: n for g, n, _, b in rows if g is None and b is not None}
  for group, name, _, baseline in rows:
    if baseline is None:
      continue
    if group is None:  # optax's guard vs the unguarded step
      record("optax guard", name, baseline, runners, timing, donate)
      continue
    if group == "floor":  # the check alone vs the unguarded step
      record("floor", name, baseline, runners, timing, donate)
      continue
    record(group, name, baseline, runners, timing, donate, GOALS[group], True)
    if baseline in theirs:
      record("vs optax guard", name, theirs[baseline], runners, timing, donate)


def _powersgd_projection(
  bench: _Bench, timing: dict, mean: str, name: str, rank: int
) -> dict:
  """Bytes from the HLO, extra compute from ``timing``; seconds per link."""
  base_bytes = bench.param_bytes
  tx, _ = methods.build(methods.powersgd(rank, name="adam"), _adam)
  moved = bench.hlo_bytes(tx, hlo.Schedule(taken="min"))["mean_bytes"]
  extra = (
    timing["candidates"][name]["median_s"]
    - timing["candidates"][mean]["median_s"]
  )
  links = {}
  for link in POWERSGD_LINKS:
    bandwidth = projection.LINKS[link]
    saved = projection.ring_allreduce_seconds(
      base_bytes, bandwidth, bench.n
    ) - projection.ring_allreduce_seconds(moved, bandwidth, bench.n)
    links[link] = {
      "saved_s": saved,
      "net_s": saved - extra,
      "pays_off": saved > 0 and saved > extra,
    }
  ring = 2 * (bench.n - 1) / bench.n
  if moved >= base_bytes:
    break_even = None  # saves nothing: never pays off
  elif extra <= 0:
    break_even = float("inf")  # no measurable extra compute: any link
  else:
    break_even = ring * (base_bytes - moved) / extra
  return {
    "bytes_per_step": moved,
    "cross_shard_bytes_per_step": base_bytes,
    "extra_compute_s": extra,
    "links": links,
    "break_even_bandwidth": break_even,
  }


def _break_even_text(bandwidth) -> str:
  if bandwidth is None:
    return "never pays off (moves no fewer bytes)"
  if bandwidth == float("inf"):
    return "pays off on any link (no measurable extra compute here)"
  return (
    f"break-even link {bandwidth / 1e9:,.3f} GB/s (pays off on slower links)"
  )


def _copies_text(copies: dict) -> str:
  """``top MB`` plus ``[cond.N#branch: MB, ...]`` when some copies sit in
  branches (``#0``: a cond's false branch, the one a non-sync step takes)."""
  text = f"{copies['top'] / 1e6:.1f}"
  if copies["conditional"]:
    text += (
      " + ["
      + ", ".join(
        f"{b.replace('conditional', 'cond')}: {copies['conditional'][b] / 1e6:.1f}"
        for b in sorted(copies["conditional"])
      )
      + "]"
    )
  return text


def run(quick: bool, only_guards: bool = False, only_nonsync=False) -> dict:
  """Times every available path against its baseline; returns the section.

  ``only_guards=True`` times group 5 (the finite guards) alone,
  ``only_nonsync=True`` group 1 (the periodic family's non-sync steps).
  """
  bench = _Bench(quick)
  rows, comparisons, skipped, powersgd = [], {}, {}, {}
  over_floor = {}  # a non-sync step over adam + what its schedule may add

  def available(method):
    tx, why = methods.build(method, _adam)
    if tx is None:
      skipped.setdefault(why, method.label)
    return tx

  def record(
    group, name, baseline, runners, timing, donate, goal=None, expect_same=False
  ):
    r = harness.ratio(timing, name, baseline)
    c = timing["candidates"][name]
    diff = float(
      np.max(
        np.abs(runners[name].final_params() - runners[baseline].final_params())
      )
    )
    met = None if goal is None else r["ratio"] <= goal
    copies = runners[name].copied()
    base_copies = runners[baseline].copied()
    # A step compared with two baselines (a guard: unguarded, optax's) keeps
    # both entries.
    key = name if name not in comparisons else f"{name} vs {baseline}"
    comparisons[key] = {
      "copied_bytes": copies,
      "baseline_copied_bytes": base_copies,
      "group": group,
      "baseline": baseline,
      "donated": donate,
      "median_ms": c["median_s"] * 1e3,
      "baseline_median_ms": timing["candidates"][baseline]["median_s"] * 1e3,
      "ratio": r["ratio"],
      "paired_ratio": r["paired_ratio"],
      "iqr_rel": c["iqr_rel"],
      "goal": goal,
      "goal_met": met,
      "max_abs_param_diff": diff,
      "expect_same_params": expect_same,
    }
    rows.append(
      [
        name,
        baseline,
        f"{c['median_s'] * 1e3:.2f}",
        f"{r['ratio']:.3f} (paired {r['paired_ratio']:.3f})",
        f"±{c['iqr_rel'] * 50:.1f}%",
        "-" if goal is None else f"<= {goal}",
        "-" if goal is None else ("met" if met else "NOT met"),
        f"{diff:.1e}",
        f"{_copies_text(copies)} (vs {_copies_text(base_copies)})",
      ]
    )

  # The smoke run times the no-donation pass only (it checks that the code runs).
  passes = (False,) if quick else (False, True)
  for donate in passes:
    tag = ", donated" if donate else ""
    # 5. The finite guards (first, so that only_guards can stop here).
    if not only_nonsync:
      _time_guards(bench, donate, record)
    if only_guards:
      continue
    # 1. Non-sync steps vs the same local optax step.
    local = f"optax.adam local step (no shardopt){tag}"
    floor = f"optax.adam + hand-written acc += grads (agn's floor){tag}"
    select = f"optax.adam + hand-written center select (floor){tag}"
    runners = {
      local: bench.runner(_adam(), donate),
      floor: bench.runner(workload.adam_and_accumulator_add(), donate),
      select: bench.runner(_adam_and_center_select(), donate),
    }
    for method in _periodic_methods(donate, len(bench.sizes) - 1):
      tx = available(method)
      if tx is not None:
        runners[f"{method.label}: non-sync step{tag}"] = bench.runner(
          tx, donate
        )
    if len(runners) > 1:
      # The few-percent differences this group is about need more rounds
      # than the others (with 21 the same program moves +-3% between runs).
      timing = bench.compare(runners, local, repeats=NON_SYNC_REPEATS)
      record("non-sync floor", floor, local, runners, timing, donate)
      record("non-sync floor", select, local, runners, timing, donate)
      for name in list(runners)[3:]:
        record(
          "non-sync",
          name,
          local,
          runners,
          timing,
          donate,
          GOALS["non-sync"],
          True,
        )
        if name.startswith("agn"):
          what, base = "adam + the accumulator add the goal allows", floor
        else:
          what, base = "adam + the select onto the center", select
        over_floor[name] = (what, harness.ratio(timing, name, base))
    if only_nonsync:
      continue

    # 2-3. accumulate (mid, emit) and apply_if_finite vs their baselines.
    sync = f"cross_shard(adam){tag}"
    runners = {
      sync: bench.runner(shardopt.cross_shard(_adam(), workload.AXIS), donate)
    }
    pairs = []
    k_mid = HUGE_PERIOD if donate else ACCUMULATE_K
    mid_tx = available(methods.accumulate(k_mid, name="adam"))
    if mid_tx is not None:
      bare = f"hand-written acc += grads{tag}"
      mid = f"accumulate(cross_shard(adam), {k_mid}): mid step{tag}"
      runners[bare] = bench.bare_add(donate)
      runners[mid] = bench.runner(mid_tx, donate)
      pairs.append(("accumulate", mid, bare, True))
      if not donate:
        emit = f"accumulate(cross_shard(adam), {ACCUMULATE_K}): emit step"
        runners[emit] = bench.runner(mid_tx, False, warm_steps=ACCUMULATE_K - 1)
        pairs.append(("accumulate", emit, sync, False))
    guarded = available(_apply_if_finite())
    if guarded is not None:
      name = f"apply_if_finite(cross_shard(adam)){tag}"
      runners[name] = bench.runner(guarded, donate)
      pairs.append(("apply_if_finite", name, sync, True))
    if pairs:
      timing = bench.compare(runners, sync)
      for group, name, baseline, same in pairs:
        record(
          group, name, baseline, runners, timing, donate, GOALS[group], same
        )

    # 4. PowerSGD vs cross_shard_mean.
    mean = f"chain(cross_shard_mean, adam){tag}"
    runners = {
      mean: bench.runner(
        optax.chain(shardopt.cross_shard_mean(workload.AXIS), _adam()), donate
      )
    }
    ranks = {}
    for rank in (1, 2, 4):
      method = methods.powersgd(rank, name="adam")
      tx = available(method)
      if tx is not None:
        ranks[f"{method.label}{tag}"] = rank
        runners[f"{method.label}{tag}"] = bench.runner(tx, donate)
    if ranks:
      timing = bench.compare(runners, mean)
      for name, rank in ranks.items():
        record("powersgd", name, mean, runners, timing, donate)
        if donate == passes[-1]:  # donated (a training loop's setting) if run
          powersgd[name] = _powersgd_projection(bench, timing, mean, name, rank)

  notes = [
    f"MLP {list(bench.sizes)} = {bench.param_count:,} params"
    f" (P = {bench.param_bytes:,} bytes), Adam lr 1e-3,"
    f" {bench.per_replica} examples per replica, {bench.n} replicas under"
    f" pmap; median of {7 if quick else 21} interleaved rounds"
    f" ({7 if quick else NON_SYNC_REPEATS} for the non-sync group;"
    f" {1 if quick else 2} step(s) per sample) within each group, warm-up"
    " excluded. Ratio = median / median of the baseline in the same group;"
    " paired = median of per-round ratios; ± = half the interquartile range.",
    "No donation: every call restarts from the same params and state"
    " (periodic methods from tx.init: local step 1, never a sync step;"
    f" accumulate's emit step from the state after {ACCUMULATE_K - 1}"
    " mini-steps). Donated: params and state donated and threaded from call"
    f" to call, periods {HUGE_PERIOD:,} so that no timed call syncs.",
    "copied MB/step: bytes of `copy` instructions in the step's compiled"
    " HLO (memory traffic, no communication), entry computation + [each"
    " outermost conditional's branch that copies, as cond.N#branch; a"
    " nested cond's copies count in the branch holding it], vs the"
    " baseline's. A non-sync step takes every cond's #0 (false) branch.",
    "max |Δparam|: params after one call (no donation) or after the same"
    " number of calls (donated) vs the baseline's; equal up to float"
    " rounding expected for the non-sync steps, the mid step and"
    " apply_if_finite.",
  ]
  for group, goal in GOALS.items():
    for donate in (False, True):
      group_rows = {
        k: v
        for k, v in comparisons.items()
        if v["group"] == group and v["donated"] == donate
      }
      if group_rows:
        worst = max(group_rows, key=lambda k: group_rows[k]["ratio"])
        notes.append(
          f"Goal {group} <= {goal}, {'donated' if donate else 'no donation'}:"
          f" worst `{worst}` at {group_rows[worst]['ratio']:.3f} (paired"
          f" {group_rows[worst]['paired_ratio']:.3f}) -> "
          + ("met" if group_rows[worst]["ratio"] <= goal else "NOT met")
          + "."
        )
  for name, (what, r) in over_floor.items():
    notes.append(
      f"`{name}` over its floor ({what}): {r['ratio']:.3f} (paired"
      f" {r['paired_ratio']:.3f})"
      f" -> {'met' if r['ratio'] <= GOALS['non-sync'] else 'NOT met'}."
    )
  for name, p in powersgd.items():
    link_text = "; ".join(
      f"{link.split(' (')[0]}: saves {v['saved_s'] * 1e3:,.2f} ms of"
      f" communication -> {'pays off' if v['pays_off'] else 'does not pay off'}"
      for link, v in p["links"].items()
    )
    notes.append(
      f"**{name}**: {p['bytes_per_step'] / 1e3:,.1f} kB/step vs"
      f" {p['cross_shard_bytes_per_step'] / 1e3:,.1f} kB"
      f" ({p['bytes_per_step'] / p['cross_shard_bytes_per_step']:.3f} of"
      f" it), {p['extra_compute_s'] * 1e3:+,.2f} ms of step time here;"
      f" {link_text}; {_break_even_text(p['break_even_bandwidth'])}."
      " The break-even bandwidth stays the same if bytes and"
      " compute both grow linearly with the model; the compute term is"
      " this CPU's."
    )
  if skipped:
    notes.append(
      "Skipped, not available in this shardopt: "
      + "; ".join(f"{v} ({k})" for k, v in skipped.items())
      + "."
    )
  return {
    "title": "9. Cost of every new path: step time vs what it replaces",
    "table": {
      "columns": [
        "step",
        "compared with",
        "median ms",
        "ratio",
        "spread",
        "goal",
        "verdict",
        "max |Δparam|",
        "copied MB/step (HLO)",
      ],
      "rows": rows,
    },
    "notes": notes,
    "data": {
      "sizes": list(bench.sizes),
      "params": bench.param_count,
      "param_bytes": bench.param_bytes,
      "goals": GOALS,
      "huge_period": HUGE_PERIOD,
      "skipped": skipped,
      "comparisons": comparisons,
      "powersgd_projection": powersgd,
      "over_floor": {
        name: {"floor": what, **r} for name, (what, r) in over_floor.items()
      },
    },
  }


def plot(result: dict, directory: str) -> list[str]:
  """Writes ``cost.png``: every ratio, with the goal of its group."""
  from benchmarks import _plots

  rows = result["data"]["comparisons"]
  return [
    _plots.bars(
      f"{directory}/cost.png",
      [f"{k} / {v['baseline']}" for k, v in rows.items()],
      [v["ratio"] for v in rows.values()],
      title="Step time / baseline step time (interleaved medians)",
      xlabel="ratio",
      reference=GOALS["non-sync"],
      reference_label=f"goal {GOALS['non-sync']} (non-sync), 1.02 (others)",
    )
  ]
