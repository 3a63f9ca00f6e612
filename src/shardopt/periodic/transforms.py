"""The public transforms of the periodic family: ``agn``, ``local_sgd``,
``diloco`` and ``hierarchical_local_sgd``.

Each one checks its arguments (:mod:`.checks`) and hands the engine
(:mod:`.engine`) three parts: a schedule (:mod:`.schedules`), a contribution
(:mod:`.contributions`) and an outer step (:mod:`.outer`).

The examples assume 8 devices (for instance a CPU with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` set before jax is
imported).
"""

from __future__ import annotations

from typing import Any

import optax

from shardopt import _args
from shardopt._renamed import renamed_keywords
from shardopt.periodic import checks
from shardopt.periodic import contributions
from shardopt.periodic import eager as eager_updates
from shardopt.periodic import engine
from shardopt.periodic import outer
from shardopt.periodic import schedules


@renamed_keywords(optimizer="inner", communication_period="sync_period")
def agn(
  inner: optax.GradientTransformation,
  axis_name: Any,
  *,
  sync_period: int = 10,
  global_optimizer: optax.GradientTransformation | None = None,
  reduction: str = "mean",
  axis_index_groups=None,
  comm_dtype=None,
  error_feedback: bool = False,
  warmup_steps: int = 0,
) -> optax.GradientTransformationExtraArgs:
  """Accumulated Gradient Normalization (TensorFlow's ``AGNOptimizer``).

  Every step, on every replica: a local step of ``inner`` on this
  replica's params, ``accumulator += grads`` (in float32 for bfloat16/float16
  gradients) and ``count += 1``. Every ``sync_period`` steps (when
  ``count % sync_period == 0``) the replicas synchronise:

  1. normalize: ``a = accumulator / sync_period``;
  2. combine ``a`` across the replicas of ``axis_name`` with ``reduction``
     (within each group of ``axis_index_groups``), leaving out any replica
     whose ``a`` is not finite (the mean is then over the finite replicas; if
     none is finite, the center does not move); ``state.skipped`` counts the
     contributions left out;
  3. ``global_optimizer`` applies the combined ``a`` to ``state.center``;
  4. the returned updates are ``center - params``: they move every
     replica's params onto the new center; the accumulator is zeroed and
     ``sync_count += 1``.

  The all-reduce runs only at a sync step: it is inside the sync branch of a
  ``jax.lax.cond`` whose predicate is the replicated counter, so the other
  steps communicate nothing (parameter bytes / ``sync_period`` per
  step on average).

  TensorFlow's version is asynchronous (every worker commits to a parameter
  server on its own); this one is synchronous SPMD. ``reduction="mean"``
  (default) averages the replicas' normalized accumulators; ``"sum"`` is what
  a parameter server does when it applies each worker's commit in the same
  round.

  Under ``jax.pmap`` every value is per replica. Under ``jax.shard_map`` the
  params differ across replicas between syncs, so they must be typed
  *varying*: give them a leading replica axis sharded over ``axis_name`` (see
  the example), or ``jax.lax.pcast(params, axis_name, to="varying")`` before
  ``jax.grad``. Gradients typed invariant (replicated ``P()`` params, whose
  gradient autodiff has already summed over the axis) are not local gradients
  and raise a ``ValueError``. Keep the scalar counters of the state
  replicated (``P()``).

  ``params + (center - params)`` is not always bitwise ``center`` in floating
  point (it is when ``center/2 <= params <= 2*center``), and it cannot repair
  non-finite params. The center itself is bit-identical on every replica; to
  make the params so after a sync (and to bring back a replica whose params
  went non-finite), snap them::

    updates, new_state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    synced = new_state.sync_count > state.sync_count
    params = jax.tree.map(lambda p, c: jnp.where(synced, c, p), params,
                          new_state.center)

  A replica left out of a combination also restarts the floating-point
  leaves of its local optimizer state (the moments, which may hold the
  non-finite values) from ``inner.init(params)`` at the start of its next
  step (``state.restart`` flags it, one row per replica); integer leaves
  (step counts) are kept.

  Args:
    inner: the local optimizer (sgd, momentum, adam, ...), applied on every
      replica at every step.
    axis_name: the ``pmap``/mesh axis name (or tuple of names) of the replicas.
      ``None`` is an error: the replicas must be mapped over a named axis.
    sync_period: local steps between two synchronisations (T); an
      integer >= 1.
    global_optimizer: the optimizer that applies the combined, normalized
      accumulator to the center. ``None`` uses an independent second instance
      of ``inner`` (its own state, as TensorFlow's separate slots).
      ``optax.sgd(0.7, momentum=0.9, nesterov=True)`` turns AGN toward DiLoCo.
    reduction: ``"mean"`` (default) or ``"sum"``; anything else raises
      ``ValueError("Unsupported reduction: ...")``.
    axis_index_groups: optional equal-size groups of replica indices that
      partition the axis; each group combines and keeps its own center.
    comm_dtype: optional wire dtype of the sync: a floating one (e.g.
      bfloat16), or a quantized one (``jnp.int8``, ``jnp.float8_e4m3fn``,
      ``jnp.float8_e5m2``, ``jnp.int4``, ``shardopt.quantized(...)``); the
      finite flag and counts always travel in float32.
    error_feedback: with a quantized ``comm_dtype``: keep what the wire
      drops from this replica's contribution (``state.error``, float32, per
      replica, in the params' shape) and add it to its next one, so that the
      rounding does not accumulate over syncs.
    warmup_steps: ``W`` steps of synchronous training first (DDP before
      PyTorch's ``start_localSGD_iter``, DiLoCo's synchronous start): for
      steps ``1..W`` the local optimizer receives the mean gradient over
      the axis (within each group), the replicas stay identical and the
      center follows the params; the schedule then runs as if step ``W``
      were step 0 (the first sync after step ``W + sync_period``). The warm-up's
      all-reduce and the center's copy sit in conds on the replicated
      counter: later steps run neither. 0 (the default): no warm-up.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is
    :class:`PeriodicState`. ``update`` needs ``params``. Extra keyword arguments go
    to the local optimizer.

  Example:
    The SGD oracle from TensorFlow's tests: the center moves by ``lr`` times
    the *normalized* accumulator at step 4::

      >>> import jax, jax.numpy as jnp, numpy as np, optax, shardopt
      >>> tx = shardopt.agn(optax.sgd(0.1), "batch", sync_period=4)
      >>> def step(params, state):
      ...   grads = jnp.full_like(params, -1.0)
      ...   updates, state = tx.update(grads, state, params)
      ...   return optax.apply_updates(params, updates), state
      >>> step = jax.pmap(step, axis_name="batch")
      >>> params = jnp.tile(jnp.array([0.0, 0.5]), (8, 1))
      >>> state = jax.pmap(tx.init)(params)
      >>> for _ in range(4):
      ...   params, state = step(params, state)
      >>> np.asarray(state.center[0]), int(state.sync_count[0])
      (array([0.1, 0.6], dtype=float32), 1)

    Under ``jax.shard_map``: one row of params per replica (varying), scalar
    counters replicated::

      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("batch",))
      >>> tx = shardopt.agn(optax.sgd(0.1), "batch", sync_period=2)
      >>> def step(w, state, x):  # w: this replica's params, shape (1, 2)
      ...   grads = jax.grad(lambda w: jnp.sum((w - x) ** 2))(w)
      ...   updates, state = tx.update(grads, state, w)
      ...   return optax.apply_updates(w, updates), state
      >>> specs = jax.tree.map(lambda v: P() if jnp.ndim(v) == 0 else P("batch"),
      ...                      tx.init(jnp.zeros((1, 2))))
      >>> init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P("batch"),
      ...                              out_specs=specs))
      >>> step = jax.jit(jax.shard_map(step, mesh=mesh,
      ...     in_specs=(P("batch"), specs, P("batch")), out_specs=(P("batch"), specs)))
      >>> rows = NamedSharding(mesh, P("batch"))
      >>> w = jax.device_put(jnp.zeros((8, 2)), rows)
      >>> x = jax.device_put(jnp.arange(16.0).reshape(8, 2), rows)
      >>> state = init(w)
      >>> for _ in range(2):
      ...   w, state = step(w, state, x)
      >>> np.round(np.asarray(state.center), 4)[:2]  # 0.1 * 1.8 * mean(x)
      array([[1.26, 1.44],
             [1.26, 1.44]], dtype=float32)

  References:
    Hermans, Spanakis and Möckel, `Accumulated Gradient Normalization
    <https://arxiv.org/abs/1710.02368>`_, ACML 2017.
    TensorFlow, ``tf.contrib.opt.AGNOptimizer`` (r1.14).
  """
  name = "shardopt.agn"
  checks.check_axis_name(axis_name, name)
  period = checks.check_period(sync_period, "sync_period", name)
  if global_optimizer is None:
    global_optimizer = inner
  return engine.periodic(
    name,
    inner,
    axis_name,
    syncs=schedules.every(period),
    contribution=contributions.GradientSums(period),
    outer_step=outer.Optimizer(global_optimizer),
    reduction=reduction,
    axis_index_groups=axis_index_groups,
    comm_dtype=comm_dtype,
    error_feedback=error_feedback,
    warmup_steps=checks.check_warmup_steps(warmup_steps, name),
  )


@renamed_keywords(optimizer="inner", period="sync_period")
def local_sgd(
  inner: optax.GradientTransformation,
  axis_name: Any,
  *,
  sync_period: int,
  axis_index_groups=None,
  comm_dtype=None,
  error_feedback: bool = False,
  warmup_steps: int = 0,
) -> optax.GradientTransformationExtraArgs:
  """Periodic model averaging (local SGD): every ``sync_period`` steps, params ← mean.

  Each replica takes ``sync_period`` local steps of ``inner``; then the params
  of all replicas (of each group) are replaced by their mean. It is the
  engine of :func:`agn` with the contribution ``center - local params`` and
  a global ``optax.sgd(1.0)``: ``center - mean_i(center - local_i) =
  mean_i(local_i)``. The state's ``accumulator`` is an empty tuple (the
  contribution is read from the params at the sync step). For plain SGD it
  equals ``agn(optax.sgd(lr), ..., global_optimizer=optax.sgd(lr * sync_period))``.

  Non-finite replicas are left out of the mean, the collectives run only at
  sync steps, and the same shard_map pattern applies: see :func:`agn`.

  Args:
    inner: the local optimizer.
    axis_name: the ``pmap``/mesh axis name (or tuple of names) of the replicas.
    sync_period: local steps between two averagings; an integer >= 1.
    axis_index_groups: optional equal-size groups; each group averages alone.
    comm_dtype: optional wire dtype, floating or quantized (see
      :func:`agn`).
    error_feedback: with a quantized ``comm_dtype``, keep what the wire
      drops and send it at the next sync (see :func:`agn`).
    warmup_steps: steps of synchronous training (the mean gradient) before
      the local steps start; see :func:`agn`.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is
    :class:`PeriodicState`. ``update`` needs ``params``.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, shardopt
    >>> tx = shardopt.local_sgd(optax.sgd(1.0), "batch", sync_period=2)
    >>> def step(params, state, grads):
    ...   updates, state = tx.update(grads, state, params)
    ...   return optax.apply_updates(params, updates), state
    >>> step = jax.pmap(step, axis_name="batch")
    >>> params = jnp.zeros(8)
    >>> state = jax.pmap(tx.init)(params)
    >>> grads = -jnp.arange(8.0)  # replica i moves by i per step
    >>> params, state = step(params, state, grads)
    >>> np.asarray(params)
    array([0., 1., 2., 3., 4., 5., 6., 7.], dtype=float32)
    >>> params, state = step(params, state, grads)  # mean(2 * i) = 7
    >>> np.asarray(params)
    array([7., 7., 7., 7., 7., 7., 7., 7.], dtype=float32)

  References:
    Stich, `Local SGD Converges Fast and Communicates Little
    <https://arxiv.org/abs/1805.09767>`_, ICLR 2019.
  """
  name = "shardopt.local_sgd"
  checks.check_axis_name(axis_name, name)
  period = checks.check_period(sync_period, "sync_period", name)
  return engine.periodic(
    name,
    inner,
    axis_name,
    syncs=schedules.every(period),
    contribution=contributions.PseudoGradients(),
    outer_step=outer.mean(),
    axis_index_groups=axis_index_groups,
    comm_dtype=comm_dtype,
    error_feedback=error_feedback,
    warmup_steps=checks.check_warmup_steps(warmup_steps, name),
  )


@renamed_keywords(optimizer="inner")
def hierarchical_local_sgd(
  inner: optax.GradientTransformation,
  axis_name: Any,
  *,
  period_group_sizes: dict,
  comm_dtype=None,
) -> optax.GradientTransformationExtraArgs:
  """Hierarchical local SGD: average often in small groups, rarely in big ones.

  ``period_group_sizes`` maps a period to a group size, e.g. ``{2: 2, 8: 8}``
  on 8 replicas: average within pairs after every 2nd step and over all 8
  after every 8th. After local step ``t`` (``t = 1, 2, ...``), among the
  periods ``p`` with ``t % p == 0`` the largest wins, and the params are
  averaged within contiguous groups of its size (replica ``i`` is in group
  ``i // size``); every collective of that sync runs within those groups,
  never over the whole axis. Periods and group sizes must both be strictly
  increasing in the dict's own order; every size must divide the axis size
  (checked when the update is traced). The largest size may be below the
  axis size: then no global average ever happens.

  The params are averaged directly (local SGD semantics, as PyTorch's
  ``HierarchicalModelAverager``), with no global optimizer (its state is an
  empty tuple). ``state.center`` keeps the last average of this replica's
  group (what its params were pulled onto; the initial params before the
  first sync): one params-sized buffer, as ``local_sgd``'s center, which
  lets a step without a sync cost what the plain local step costs (see
  ``benchmarks/README.md``). One level whose size is the axis size is
  :func:`local_sgd` to rounding (a few ulp: ``local_sgd`` averages through its
  center, ``center - mean(center - params)``). A replica whose params are not
  finite is left out of its group's average (and restarts the float leaves of
  its local optimizer state from ``inner.init`` at its next step); if no member of a group
  is finite the group is left as it is. ``state.skipped`` counts the
  contributions left out of this replica's groups, so it can differ between
  groups: under a checking ``jax.shard_map`` it is typed varying, so pass the
  whole state with a leading replica axis (``P(axis)`` on every leaf, the
  counters included: build it stacked with ``jax.vmap(tx.init)``), or carry it
  inside the shard_map (a ``lax.scan``).

  Phase, and porting from PyTorch: shardopt averages after steps ``T, 2T,
  ...`` (as :func:`local_sgd`). PyTorch's averagers read their step counter
  *before* incrementing it, from 0, so they average after steps ``1, T + 1,
  ...``. To get shardopt's schedule in PyTorch, start
  ``HierarchicalModelAverager``'s ``step`` at 1 (``averager.step = 1`` before
  the first ``average_parameters``, ``warmup_steps=0``); for
  ``PeriodicModelAverager(period=T)`` pass ``warmup_steps=T - 1``. PyTorch
  also requires the last group size to be the world size; shardopt does not.

  Args:
    inner: the local optimizer, applied on every replica at every step.
    axis_name: the ``pmap``/mesh axis name (or tuple of names) of the replicas.
    period_group_sizes: ``{period: group_size}``, non-empty, integers >= 1,
      both strictly increasing in the order given.
    comm_dtype: optional floating dtype used on the wire.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is
    :class:`PeriodicState` (``global_state`` and ``accumulator`` empty).
    ``update`` needs ``params``.

  Example:
    Pairs every 2 steps, all 8 replicas every 4 steps::

      >>> import jax, jax.numpy as jnp, numpy as np, optax, shardopt
      >>> tx = shardopt.hierarchical_local_sgd(
      ...     optax.sgd(1.0), "batch", period_group_sizes={2: 2, 4: 8})
      >>> def step(params, state, grads):
      ...   updates, state = tx.update(grads, state, params)
      ...   return optax.apply_updates(params, updates), state
      >>> step = jax.pmap(step, axis_name="batch")
      >>> params = jnp.zeros(8)
      >>> state = jax.pmap(tx.init)(params)
      >>> grads = -jnp.arange(8.0)  # replica i moves by i per step
      >>> for _ in range(2):
      ...   params, state = step(params, state, grads)
      >>> np.asarray(params)  # pairs: mean(2i, 2i + 2)
      array([ 1.,  1.,  5.,  5.,  9.,  9., 13., 13.], dtype=float32)
      >>> for _ in range(2):
      ...   params, state = step(params, state, grads)
      >>> np.asarray(params)  # everyone: mean(4 i) = 14
      array([14., 14., 14., 14., 14., 14., 14., 14.], dtype=float32)

  References:
    Lin et al., `Don't Use Large Mini-Batches, Use Local SGD
    <https://arxiv.org/abs/1808.07217>`_, ICLR 2020 (hierarchical local SGD).
    PyTorch, ``torch.distributed.algorithms.model_averaging.
    hierarchical_model_averager.HierarchicalModelAverager``.
  """
  name = "shardopt.hierarchical_local_sgd"
  checks.check_axis_name(axis_name, name)
  levels = checks.check_period_group_sizes(period_group_sizes, name)
  return engine.periodic(
    name,
    inner,
    axis_name,
    syncs=schedules.hierarchy(levels),
    contribution=contributions.Params(),
    outer_step=outer.Replace(),
    comm_dtype=comm_dtype,
  )


@renamed_keywords(optimizer="inner")
def diloco(
  inner: optax.GradientTransformation,
  axis_name: Any,
  *,
  sync_period: int = 500,
  outer_learning_rate: float = checks.OUTER_DEFAULTS["outer_learning_rate"],
  outer_momentum: float = checks.OUTER_DEFAULTS["outer_momentum"],
  nesterov: bool = checks.OUTER_DEFAULTS["nesterov"],
  outer_optimizer: optax.GradientTransformation | None = None,
  axis_index_groups=None,
  comm_dtype=None,
  error_feedback: bool = False,
  warmup_steps: int = 0,
  num_fragments: int = 1,
  overlap_steps: int = 0,
  overlap_alpha: float = 0.0,
  layer_axes: Any = None,
  sync_offset: int = 0,
  eager: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """DiLoCo: local inner steps, then an outer Nesterov step on the mean delta.

  Each replica takes ``sync_period`` steps of the inner optimizer ``inner``
  (AdamW in the paper); then the outer gradient ``center - mean_i(local params_i)``
  is applied to the center by SGD with (Nesterov) momentum, and every replica
  restarts from the new center. The inner optimizer state is kept across
  rounds, as in the paper. The same engine as :func:`agn` (contribution
  ``center - local params``, global ``optax.sgd(outer_learning_rate,
  momentum=outer_momentum, nesterov=nesterov)``); the state's ``accumulator``
  is an empty tuple.

  **Streaming DiLoCo** (``num_fragments=F > 1``, Douillard et al. 2025): the
  params' leaves are split into ``F`` fragments, contiguous in
  ``jax.tree.leaves`` order and balanced by bytes (each cut where the
  cumulative bytes come closest to a multiple of ``total / F``). Fragment
  ``f`` (0-based) synchronises after local step ``t`` iff
  ``t % sync_period == (f * sync_period) // F``, so fragment 0 keeps
  DiLoCo's phase and the others follow, spread evenly over the period. Only
  that fragment's outer gradient is all-reduced, and only its center, outer
  momentum (``state.global_state[f]``, over the list of its leaves) and params
  move: the peak bytes of a step drop to about ``1 / F`` of DiLoCo's (plus the
  imbalance of the split). ``F = 1`` is DiLoCo, bit for bit (and its state has
  the same structure). Fragments are whole leaves: ``F`` larger than the
  number of leaves raises a ``ValueError`` at ``init``/``update``, unless
  ``layer_axes`` splits layer stacks. With ``F > 1`` do not snap the params
  onto the center after a sync (see :func:`agn`): only one fragment's center
  is current.

  **Fragments over layers** (``layer_axes``): a transformer written with
  ``nn.scan``/``nnx.scan`` keeps its blocks in a few stacked leaves, which
  whole-leaf fragments cannot split. ``layer_axes`` is a pytree prefix of the
  params giving, per leaf, the index of its stacked layer axis (or None):
  layer ``l`` of a stack then belongs to fragment ``l % F`` (*strided*, as in
  the paper: every fragment holds layers from the bottom to the top), and the
  number of layers must be divisible by ``F`` (else a ``ValueError``). The
  leaves that are not stacks are split into ``F`` contiguous groups balanced
  by bytes (with fewer than ``F`` of them, the ``j``-th goes to fragment
  ``j``). A sync all-reduces its fragment's layers of every stack (read and
  written in place: a reshape and an index) plus its other leaves, about
  ``1 / F`` of the params, and each fragment keeps its own outer momentum
  over its pieces (a stack of ``L`` layers contributes a piece of ``L / F``).

  **Overlap** (``overlap_steps=tau``, ``overlap_alpha=alpha``): fragment
  ``f`` still syncs after local step ``t`` (its outer gradient ``center_f -
  mean_i(params_i,f)`` moves ``center_f`` by the outer optimizer), but the
  replicas keep training on their own params; after local step ``t + tau``
  each replica's fragment becomes ``alpha * params_f + (1 - alpha) *
  center_f``. ``tau = 0, alpha = 0`` is the streaming DiLoCo above, bit for
  bit; ``0 <= tau < sync_period`` and ``0 <= alpha < 1``. With ``tau >= 1``
  the sync of step ``t`` runs in the update of step ``t + 1``, from the
  params that update is given, so its all-reduce does not depend on that
  step's gradient: ``state.center`` and ``state.sync_count`` show it one
  step later, and after the last step of a run one sync is still pending
  (its center lands in the next update). XLA does not run a conditional
  concurrently with the rest of the step on its own; what the overlap buys
  is that the collective has no data dependence on the step's forward and
  backward pass (``tests/test_streaming.py`` checks it in the jaxpr). A
  replica whose contribution is not finite is pulled onto the center at the
  sync, as without overlap.

  Islands (DiLoCo as deployed: synchronous data parallelism inside each island
  of accelerators, DiLoCo across islands): nest it over a 2-D mesh
  ``("island", "data")``, ``diloco(shardopt.cross_shard(optax.adamw(lr),
  "data"), "island", sync_period=H)`` inside ``jax.shard_map``: the inner
  optimizer all-reduces over ``"data"`` every step, the outer step runs over
  ``"island"`` every ``H`` steps. Params are ``P("island")`` (a leading
  island axis, replicated over ``"data"``), or also varying over ``"data"``
  (e.g. ``P("island", "data")``); the state's arrays take the params' spec,
  ``count`` and ``sync_count`` ``P()``. With params varying over ``"data"``
  ``skipped`` is typed varying over ``"data"`` too (the same number on every
  data replica): carry the state inside the shard_map (``lax.scan``) or pass
  it stacked (``P(("island", "data"))`` on every leaf). Islands are
  shard_map-only: JAX 0.10's ``pmap`` is built on shard_map and rejects a
  ``pmap`` nested in another. :func:`local_sgd` works across islands the
  same way; for :func:`agn`, which accumulates the gradients it is given,
  reduce them over ``"data"`` first:
  ``optax.chain(shardopt.cross_shard_mean("data"), shardopt.agn(opt,
  "island"))``.

  Args:
    inner: the inner optimizer (e.g. ``optax.adamw(...)``).
    axis_name: the ``pmap``/mesh axis name (or tuple of names) of the replicas.
    sync_period: inner steps per outer step (H in the paper); integer >= 1.
    outer_learning_rate: the outer SGD learning rate (or an optax schedule);
      0.8 by default. The default outer step (Nesterov, lr 0.8, momentum
      0.2) has the momentum-adjusted rate ``lr / (1 - momentum) = 1`` of
      plain averaging: on the digits MLP and section 8's byte-level LM, for
      H = 4 to 128, it never fell behind :func:`local_sgd` beyond the seeds'
      spread (``benchmarks/studies/outer_defaults.py``). The paper's lr 0.7
      with momentum 0.9 (rate 7), tuned for H = 500 on large batches, fell
      3-32% behind plain averaging on that LM; lr 0.7 with momentum 0.5
      (rate 1.4) won on the MLP and lost 0.5-2.6% on the LM. If ``diloco``
      trails ``local_sgd``, lower the rate to 1 or below (see
      ``docs/diloco.md``).
    outer_momentum: the outer momentum in ``[0, 1)``; 0.2 by default. Or a
      schedule of the outer step count (``k = 0`` for the first sync;
      ``shardopt.pier_momentum`` is Pier's warm-up and decay): the outer
      step is then ``optax.inject_hyperparams(optax.sgd)`` with it, the
      schedule read from the outer optimizer's own counter (one per sync,
      per fragment), never from the inner step count.
    nesterov: whether the outer momentum is Nesterov's; True by default.
    outer_optimizer: any optax transform for the outer step instead (its
      gradient is the outer gradient, its params the center; its state is
      replicated, one per fragment with ``num_fragments``).
      ``outer_learning_rate``, ``outer_momentum`` and ``nesterov`` spell the
      default, ``optax.sgd(0.8, momentum=0.2, nesterov=True)``; leave them
      out when you pass it: giving any of them too raises a ``ValueError``,
      whatever its value (the default's included). ``optax.sgd(1.0)`` is
      plain averaging (:func:`local_sgd`'s outer step).
    axis_index_groups: optional equal-size groups; each group has its center.
    comm_dtype: optional wire dtype, floating or quantized (see
      :func:`agn`).
    error_feedback: with a quantized ``comm_dtype``, keep what the wire
      drops and send it at the next sync (see :func:`agn`).
    warmup_steps: steps of synchronous training (the mean gradient) before
      the local steps start; see :func:`agn`.
    num_fragments: Streaming DiLoCo's number of fragments ``F``; an integer
      with ``1 <= F <= sync_period`` (and, without ``layer_axes``, at most
      the number of leaves).
    overlap_steps: local steps ``tau`` between a fragment's sync and its
      merge; an integer in ``[0, sync_period)``.
    overlap_alpha: the weight ``alpha`` of the local params in the merge; a
      number in ``[0, 1)`` (the paper uses 0.5).
    layer_axes: a pytree prefix of the params (or one int or None for all
      leaves): per leaf its stacked layer axis, or None (the default: whole
      leaves).
    sync_offset: moves every sync ``sync_offset`` steps later in its period:
      fragment ``f`` syncs after step ``t`` iff ``t % sync_period == (f *
      sync_period // F + sync_offset) % sync_period`` (its merge follows
      ``overlap_steps`` later); an integer in ``[0, sync_period]``
      (``sync_period`` is the same as 0, the default). torchft's Streaming
      DiLoCo is ``sync_offset = sync_period // F - fragment_sync_delay``
      (see ``docs/diloco.md``, "Coming from torchft").
    eager: Eager updates (Kale et al. 2025): the outer step overlapped with
      the whole next inner phase. At sync ``k`` each replica of ``M``
      applies ``Delta_m(k) / M + (mean(k - 1) - Delta_m(k - 1) / M)``, its
      own fresh outer gradient standing in for its share of the average
      that is still in flight, instead of ``mean(k)``; the all-reduce of
      sync ``k`` (DiLoCo's bytes) feeds only sync ``k + 1``. The centers
      (and outer states) are then per replica and differ by the replicas'
      own terms (see ``docs/eager.md``). Not with ``num_fragments > 1``,
      ``overlap_steps`` or ``overlap_alpha``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is
    :class:`PeriodicState`. ``update`` needs ``params``.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, shardopt
    >>> tx = shardopt.diloco(optax.sgd(1.0), "batch", sync_period=1)
    >>> def step(params, state, grads):
    ...   updates, state = tx.update(grads, state, params)
    ...   return optax.apply_updates(params, updates), state
    >>> step = jax.pmap(step, axis_name="batch")
    >>> params = jnp.zeros(8)
    >>> state = jax.pmap(tx.init)(params)
    >>> params, state = step(params, state, -jnp.arange(8.0))
    >>> # outer gradient 0 - 3.5; Nesterov: 0.8 * (3.5 + 0.2 * 3.5) = 3.36
    >>> np.round(np.asarray(state.center), 4)
    array([3.36, 3.36, 3.36, 3.36, 3.36, 3.36, 3.36, 3.36], dtype=float32)

    Streaming, two fragments over a period of 4: leaf ``"a"`` syncs after
    steps 4, 8, ..., leaf ``"b"`` after steps 2, 6, ...::

      >>> tx = shardopt.diloco(optax.sgd(1.0), "batch", sync_period=4,
      ...                      num_fragments=2)
      >>> params = {"a": jnp.zeros(8), "b": jnp.zeros(8)}
      >>> state = jax.pmap(tx.init)(params)
      >>> grads = {"a": -jnp.arange(8.0), "b": -jnp.arange(8.0)}
      >>> for _ in range(2):
      ...   params, state = step(params, state, grads)
      >>> np.asarray(params["a"])[:3], np.asarray(params["b"])[:3]
      (array([0., 2., 4.], dtype=float32), array([6.72, 6.72, 6.72], dtype=float32))

    Fragments over the layers of a stack (a scanned model's blocks): with
    ``F = 2``, layers 0 and 2 of ``"blocks"`` form fragment 0, which syncs
    after step 2 (and 4, ...), and layers 1 and 3 fragment 1 (after steps 1,
    3, ...); each fragment's outer momentum covers 2 of the 4 layers::

      >>> tx = shardopt.diloco(optax.sgd(1.0), "batch", sync_period=2,
      ...                      num_fragments=2, layer_axes={"blocks": 0})
      >>> params = {"blocks": jnp.zeros((8, 4, 1))}  # 8 replicas, 4 layers
      >>> state = jax.pmap(tx.init)(params)
      >>> [m.shape[1:] for m in jax.tree.leaves(state.global_state)]
      [(2, 1), (2, 1)]
      >>> grads = {"blocks": -jnp.ones((8, 4, 1)) * jnp.arange(8.0)[:, None, None]}
      >>> params, state = step(params, state, grads)
      >>> np.asarray(params["blocks"])[:3, :, 0]  # layers 1, 3 at 3.36
      array([[0.  , 3.36, 0.  , 3.36],
             [1.  , 3.36, 1.  , 3.36],
             [2.  , 3.36, 2.  , 3.36]], dtype=float32)

  References:
    Douillard et al., `DiLoCo: Distributed Low-Communication Training of
    Language Models <https://arxiv.org/abs/2311.08105>`_, 2023.
    Douillard et al., `Streaming DiLoCo with overlapping communication
    <https://arxiv.org/abs/2501.18512>`_, 2025.
  """
  name = "shardopt.diloco"
  checks.check_axis_name(axis_name, name)
  period = checks.check_period(sync_period, "sync_period", name)
  given = checks.given_outer_args(
    outer_learning_rate=outer_learning_rate,
    outer_momentum=outer_momentum,
    nesterov=nesterov,
  )
  outer_learning_rate = checks.outer_arg(outer_learning_rate)
  outer_momentum = checks.outer_arg(outer_momentum)
  nesterov = checks.outer_arg(nesterov)
  checks.check_outer_args(name, outer_learning_rate, outer_momentum, nesterov)
  if outer_optimizer is None and callable(outer_momentum):
    # Pier: a momentum schedule of the outer step count (inject_hyperparams
    # counts the outer optimizer's own updates, one per sync).
    outer_optimizer = optax.inject_hyperparams(
      optax.sgd, static_args=("nesterov",)
    )(
      learning_rate=outer_learning_rate,
      momentum=outer_momentum,
      nesterov=bool(nesterov),
    )
  elif outer_optimizer is None:
    outer_optimizer = optax.sgd(
      outer_learning_rate,
      momentum=outer_momentum or None,
      nesterov=bool(nesterov),
    )
  else:
    checks.check_outer_optimizer(name, outer_optimizer, given)
  fragments = checks.check_num_fragments(num_fragments, period, name)
  tau, alpha = checks.check_overlap(overlap_steps, overlap_alpha, period, name)
  offset = checks.check_sync_offset(sync_offset, period, name)
  overlaps = tau > 0 or alpha > 0
  outer_step = outer.Optimizer(outer_optimizer)
  if _args.flag(
    eager, "eager", name, "False (the default) waits for the average"
  ):
    checks.check_eager(name, fragments, tau, alpha)
    outer_step = eager_updates.Eager(
      outer_optimizer, axis_name, axis_index_groups
    )
  return engine.periodic(
    name,
    inner,
    axis_name,
    # With overlap, the sync of step t runs in the update of step t + 1, so
    # that its all-reduce reads the params as given, not that step's
    # gradient: it can run alongside the step's forward and backward pass.
    syncs=schedules.streaming(period, fragments, min(tau, 1), offset),
    contribution=contributions.PseudoGradients(),
    outer_step=outer_step,
    axis_index_groups=axis_index_groups,
    comm_dtype=comm_dtype,
    error_feedback=error_feedback,
    warmup_steps=checks.check_warmup_steps(warmup_steps, name),
    num_fragments=fragments,
    layer_axes=layer_axes,
    merges=(
      schedules.merges(period, fragments, tau, offset) if overlaps else ()
    ),
    merge=outer.Merge(alpha) if overlaps else None,
  )
