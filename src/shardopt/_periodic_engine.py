"""The schedule engine behind ``agn``, ``local_sgd``, ``diloco`` and
``hierarchical_local_sgd``.

Every replica trains on its own params with a local optimizer. A *schedule*
(a tuple of :class:`Sync`) says which leaves synchronise, over which groups of
replicas, after which local step. ``update`` runs these steps, one small
function each:

1. :func:`_local_step`: the local optimizer's step on this replica's params
   (restarting first the local state of a replica left out of the last sync);
   :func:`_accumulate`: ``accumulator += grads`` (``agn`` only).
2. :func:`_branch`: ``count += 1``; the index of the sync that fires after
   this step (0: none), read from the replicated counter.
3. One ``lax.cond`` per sync (:func:`_when`), on ``index == k``: at most one
   fires per step. Its operands are the sync's fragment of the state; its
   false branch hands them back, its true branch is the only place the engine
   communicates:

   a. :func:`_contribution`: this replica's contribution for the sync's leaves
      (accumulated gradients / period, ``center - local params``, or the local
      params themselves);
   b. :func:`_combine`: one collective round within the sync's groups, a
      non-finite contribution left out (flagged to restart, step 1);
   c. :func:`_global_step`: the global optimizer moves the center (for plain
      averaging the combined params are the new center);
   d. :func:`_pull` (only where this step's updates go through the conds,
      see below): updates that move the synced leaves onto the center.

4. :func:`_pull_after`: updates onto the center for the leaves a sync moved,
   the local optimizer's for the others.

Cost of a step without a sync (``benchmarks/cost.py``,
``tests/test_schedules.py``): nothing is communicated and, with the params
and state donated (``jax.jit(step, donate_argnums=...)``), XLA copies nothing:
every cond's untaken branch aliases its operands (no branch hands back state
it does not own, and every new value is computed after the last read of the
buffer it replaces). Without donation XLA copies what the step leaves
unchanged (center, global state) into fresh output buffers.

XLA does not fuse across a conditional: updates handed through a cond would
be written out and read back by the caller's ``apply_updates``, two passes
over a params-sized buffer that plain optax does not make. So this step's
updates stay out of the conds: ``agn``'s sync does not read them, and the
others' syncs (whose contribution ``center - (params + updates)`` does)
recompute them in their own branch from the state before the step; the local
step proper then runs after the conds (:func:`_after` orders it) and step 4
selects per leaf. What a step without a sync adds to the plain local step is
one read of the center in that select (and ``agn``'s accumulator add). The
exception: a local optimizer that communicates (``cross_shard`` inside
``diloco`` across islands) would run its all-reduce a second time in the
sync branch, so its updates go through the conds as before (step 3d).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from shardopt import _axes
from shardopt.collectives import reduce
from shardopt.finite import all_finite

GRADIENTS = "gradients"  # a_i = accumulated gradients / period
PSEUDO_GRADIENT = "pseudo_gradient"  # a_i = center - local params
PARAMS = "params"  # a_i = local params (plain averaging)


class AGNState(NamedTuple):
  """State of :func:`agn`, :func:`local_sgd`, :func:`diloco` and
  :func:`hierarchical_local_sgd`.

  Every field is an array (or a pytree of arrays), so a checkpoint taken in
  the middle of a communication period restores and continues bit-identically
  (``jax.tree.map(np.asarray, state)`` round-trips).

  Attributes:
    count: int32 scalar, local steps taken (the same on every replica).
    sync_count: int32 scalar, synchronisations done (TensorFlow's global step
      of the center variables); one collective round each. With
      ``num_fragments`` every fragment's sync counts once.
    accumulator: the sum of this replica's gradients since the last sync,
      float32 for low-precision gradients (``agn`` only; the others keep an
      empty tuple here: their contribution is read from the params at the
      sync step).
    center: the shared params every replica is pulled onto at a sync,
      bit-identical on every replica (within a group with
      ``axis_index_groups``). For ``hierarchical_local_sgd``, which averages
      the params directly, the last average of this replica's group (the
      initial params before the first sync), bit-identical within the group.
    local_state: this replica's state of the local ``optimizer``.
    global_state: the global optimizer's state (for the center), the same on
      every replica (within a group). With ``num_fragments=F > 1`` a tuple of
      ``F`` states, fragment ``f``'s over the list of its leaves. An empty
      tuple for ``hierarchical_local_sgd``.
    skipped: int32 scalar, how many replica contributions were left out of a
      combination because they were not finite, summed over all syncs and
      over the whole axis (for ``hierarchical_local_sgd``: over this
      replica's groups, so it can differ between groups; there it has shape
      (1,), one row per replica like ``restart``).
    restart: bool of shape (1,), this replica's own (one row per replica, like
      the params: ``P(axis)`` in a shard_map's specs): its contribution was
      left out of the last sync (not finite), so its local state, which may
      hold the non-finite values, restarts from ``optimizer.init(params)``
      (float leaves; step counts are kept) at the start of its next step.
  """

  count: chex.Array
  sync_count: chex.Array
  accumulator: Any
  center: Any
  local_state: Any
  global_state: Any
  skipped: chex.Array
  restart: chex.Array


class Sync(NamedTuple):
  """One synchronisation of a schedule.

  Attributes:
    period: with ``phase``: the sync fires after local step ``t`` (1, 2, ...)
      iff ``t % period == phase``. When several fire at the same step, the
      last one in the schedule wins.
    phase: see ``period``.
    fragment: index of the fragment of the params' leaves it synchronises.
    group_size: replicas per contiguous group (replica ``i`` is in group
      ``i // group_size``); None: the transform's ``axis_index_groups``, or
      the whole axis.
  """

  period: int
  phase: int = 0
  fragment: int = 0
  group_size: int | None = None


class _Carry(NamedTuple):
  """What a sync may change: the operands and results of its cond."""

  updates: list
  accumulator: list
  center: list
  global_state: Any
  sync_count: jax.Array
  skipped: jax.Array
  left_out: jax.Array  # bool: this replica's contribution was left out


# --------------------------------------------------------------------------
# Schedules.


def every(period: int) -> tuple[Sync, ...]:
  """Everything, over the whole axis (or each group), after T, 2T, ..."""
  return (Sync(period),)


def hierarchy(period_group_sizes: dict) -> tuple[Sync, ...]:
  """One level per ``{period: group_size}``; the largest period wins."""
  return tuple(Sync(p, 0, 0, s) for p, s in period_group_sizes.items())


def streaming(period: int, num_fragments: int) -> tuple[Sync, ...]:
  """Fragment ``f`` after step t iff ``t % period == (f * period) // F``."""
  return tuple(
    Sync(period, (f * period) // num_fragments, f) for f in range(num_fragments)
  )


def split_fragments(
  leaf_bytes: Sequence[int], num_fragments: int
) -> tuple[tuple[int, ...], ...]:
  """Contiguous fragments of leaf indices, balanced by bytes.

  The ``k``-th cut goes where the cumulative bytes come closest to ``k *
  total / num_fragments`` (the first such place on a tie), keeping every
  fragment non-empty. Needs ``1 <= num_fragments <= len(leaf_bytes)``.
  """
  n = len(leaf_bytes)
  cumulative = np.cumsum(leaf_bytes)
  total = float(cumulative[-1]) if n else 0.0
  cuts = [0]
  for k in range(1, num_fragments):
    target = k * total / num_fragments
    candidates = range(cuts[-1] + 1, n - (num_fragments - k) + 1)
    cuts.append(min(candidates, key=lambda j: abs(cumulative[j - 1] - target)))
  cuts.append(n)
  return tuple(tuple(range(a, b)) for a, b in zip(cuts[:-1], cuts[1:]))


def _leaf_bytes(params: Any) -> list[int]:
  return [
    int(np.prod(np.shape(p))) * np.dtype(p.dtype).itemsize
    for p in jax.tree.leaves(params)
  ]


def check_fragments(
  params: Any, num_fragments: int, transform: str
) -> tuple[tuple[int, ...], ...]:
  """The fragments of ``params``, or a ValueError naming the fix."""
  n = len(jax.tree.leaves(params))
  if num_fragments > max(n, 1):
    raise ValueError(
      f"{transform}: num_fragments={num_fragments} but the params have only"
      f" {n} leaves; fragments are made of whole leaves (contiguous in"
      f" jax.tree.leaves order), so use num_fragments <= {n}."
    )
  return split_fragments(_leaf_bytes(params), num_fragments)


# --------------------------------------------------------------------------
# Small helpers.


def _zeros_after(like: jax.Array, after: jax.Array) -> jax.Array:
  """Zeros shaped like ``like``, computed from the scalar ``after``.

  A restarted accumulator written as ``zeros_like`` has no data dependence on
  the accumulator's last read (the contribution), so XLA cannot write it in
  the accumulator's buffer and copies the accumulator on every step instead.
  Computed from a result of the collective, they come after that read.
  """
  zero = (after * 0).astype(like.dtype)
  return jnp.broadcast_to(zero, like.shape)


def _after(tree: Any, scalar: jax.Array) -> Any:
  """``tree``'s values, as data that depends on ``scalar``, so that XLA
  computes what reads them after ``scalar``.

  ``x - 0.0`` is ``x`` for every float (-0.0, inf and NaN included), and
  XLA does not fold a float multiply by zero away.
  """
  zero = scalar.astype(jnp.float32) * 0.0
  return jax.tree.map(lambda x: x - zero.astype(x.dtype), tree)


def _zeros_accumulator(p: jax.Array) -> jax.Array:
  """agn's accumulator for leaf ``p`` (float32 for low-precision params)."""
  return jnp.zeros_like(p, dtype=_axes.accumulation_dtype(p.dtype))


def _flags(leaves: list, axis_name: Any, whole_axis_count: bool):
  """The initial ``skipped`` and ``restart``, typed as the syncs will make
  them under a checking shard_map: varying over the axes the params vary
  over (other than the engine's own axis, unless it counts skips within
  groups; ``restart`` is always this replica's), so that a ``lax.scan`` can
  carry the state."""
  # Counted within groups, skips are this replica's own: shape (1,), like
  # ``restart``, so that the state lays out as concatenated P(axis) blocks.
  skipped = jnp.zeros([] if whole_axis_count else [1], jnp.int32)
  restart = jnp.zeros([1], bool)
  if _axes.vma_checked():
    axes = frozenset().union(*(_axes.varying_axes(p) for p in leaves))
    own = frozenset(_axes.axis_names(axis_name))
    axes = axes - own if whole_axis_count else axes | own
    skipped = _axes.cast_varying(skipped, axes)
    restart = _axes.cast_varying(restart, own | axes)
  return skipped, restart


# Primitives that move data between devices.
_COLLECTIVES = (
  "all_gather",
  "all_to_all",
  "pmax",
  "pmin",
  "ppermute",
  "psum",
  "ragged_all_to_all",
  "reduce_scatter",
)


def _communicates(fn, *args) -> bool:
  """Whether ``fn(*args)`` runs a collective (read from its jaxpr)."""

  def walk(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
      if eqn.primitive.name.startswith(_COLLECTIVES):
        return True
      for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns") and walk(inner):
            return True
    return False

  return walk(jax.make_jaxpr(fn)(*args).jaxpr)


def _fragment_tree(leaves: list, treedef, num_fragments: int) -> Any:
  """What the global optimizer sees: the whole tree, or a fragment's list."""
  return treedef.unflatten(leaves) if num_fragments == 1 else list(leaves)


def _groups(
  group_size: int | None,
  axis_index_groups,
  size: int,
  transform: str,
  axis_name: Any,
) -> tuple | None:
  """A sync's replica groups: contiguous ones of ``group_size``, or the
  transform's ``axis_index_groups`` (None: the whole axis)."""
  if group_size is None:
    return _axes.validate_groups(axis_index_groups, size, transform, axis_name)
  if size % group_size:
    raise ValueError(
      f"{transform}: group size {group_size} does not divide the size"
      f" {size} of axis {axis_name!r}; every group size in"
      " period_group_sizes must divide the axis size (contiguous groups of"
      f" that many replicas), e.g. one of {_divisors(size)}."
    )
  if group_size == size:
    return None
  return tuple(
    tuple(range(g, g + group_size)) for g in range(0, size, group_size)
  )


def _divisors(size: int) -> list[int]:
  return [d for d in range(1, size + 1) if size % d == 0]


# --------------------------------------------------------------------------
# The steps of update, in order.


def _local_step(optimizer, local, grads, state, params, extra_args):
  """Step 1: the local optimizer's step on this replica's params.

  A replica left out of the last sync (``state.restart``) first restarts the
  float leaves of its local state (moments, which may hold the non-finite
  values) from ``optimizer.init(params)``; integer leaves (step counts) are
  kept. A select on the step's inputs, which XLA fuses into the step: a
  restart written into the state at the sync, after the local step, would
  keep XLA from fusing the local step with the caller's ``apply_updates``.
  """
  fresh = _axes.cast_tree_like(optimizer.init(params), state.local_state)
  local_state = jax.tree.map(
    lambda old, new: (
      jnp.where(jnp.reshape(state.restart, ()), new, old)
      if jnp.issubdtype(old.dtype, jnp.floating)
      else old
    ),
    state.local_state,
    fresh,
  )
  updates, local_state = local.update(grads, local_state, params, **extra_args)
  # Updates are in the params' dtype on every step (a sync step's updates
  # are target - params), so both branches of a cond agree even when the
  # gradients are narrower (bfloat16 grads for float32 params).
  updates = jax.tree.map(lambda u, p: u.astype(p.dtype), updates, params)
  return jax.tree.leaves(updates), local_state


def _accumulate(accumulator: Any, grads: Any) -> list:
  """Step 1 (``agn``): ``accumulator += grads``, in the accumulator's dtype."""
  return [
    a + g.astype(a.dtype)
    for a, g in zip(jax.tree.leaves(accumulator), jax.tree.leaves(grads))
  ]


def _branch(step: jax.Array, syncs: Sequence[Sync]) -> jax.Array:
  """Step 2: which sync fires after ``step`` (0: none; later syncs win)."""
  index = jnp.zeros([], jnp.int32)
  for k, sync in enumerate(syncs):
    index = jnp.where(step % sync.period == sync.phase, k + 1, index)
  return index


def _synced_leaves(
  index: jax.Array, syncs: Sequence[Sync], fragments, num_leaves: int
) -> list:
  """One flag per leaf: whether sync ``index`` moves it (0: none does)."""
  synced = [jnp.zeros([], bool)] * num_leaves
  for k, sync in enumerate(syncs):
    for i in fragments[sync.fragment]:
      synced[i] = synced[i] | (index == k + 1)
  return synced


def _contribution(
  kind: str, part: _Carry, params: list, updates: list, period: int
) -> list:
  """Step 3a: this replica's contribution for the sync's leaves (``params``
  and this step's local ``updates`` of them)."""
  if kind == GRADIENTS:  # AGN: a_i = (g_1 + ... + g_T) / T
    return [a / jnp.asarray(period, a.dtype) for a in part.accumulator]
  mine = []
  for p, u, c in zip(params, updates, part.center or params):
    wide = _axes.accumulation_dtype(p.dtype)
    local = optax.apply_updates(p, u).astype(wide)  # after the local update
    mine.append(c.astype(wide) - local if kind == PSEUDO_GRADIENT else local)
  return mine


def _combine(
  mine: list,
  axis_name,
  groups,
  *,
  reduction: str,
  comm_dtype,
  whole_axis_count: bool,
  transform: str,
):
  """Step 3b: one collective round; a non-finite contribution is left out.

  Returns the combined contribution (sum or mean over the finite replicas of
  the group), this replica's finiteness, the number of finite replicas in its
  group and (with ``whole_axis_count`` and groups) in the whole axis.
  """
  finite = all_finite(mine)
  masked = [jnp.where(finite, a, jnp.zeros_like(a)) for a in mine]
  flag = finite.astype(jnp.float32)
  if _axes.vma_checked():
    flag = _axes.cast_varying(flag, _axes.axis_names(axis_name))
  # The finite flag (a count once summed) never travels in a narrow dtype:
  # a bfloat16 sum of 299 ones reads 298 (bfloat16 steps by 2 above 256).
  # With a float32 (or wider) wire it rides with the contributions, one
  # round; with a narrow or a quantized wire it has its own float32
  # all-reduce (same groups).
  wide = comm_dtype is None or (
    isinstance(comm_dtype, np.dtype) and comm_dtype.itemsize >= 4
  )
  if wide:
    *total, in_group = reduce(
      masked + [flag],
      axis_name,
      reduction="sum",
      axis_index_groups=groups,
      comm_dtype=comm_dtype,
      _transform=transform,
    )
  else:
    total = reduce(
      masked,
      axis_name,
      reduction="sum",
      axis_index_groups=groups,
      comm_dtype=comm_dtype,
      _transform=transform,
    )
    in_group = reduce(
      flag,
      axis_name,
      reduction="sum",
      axis_index_groups=groups,
      _transform=transform,
    )
  in_group = jnp.round(in_group)
  in_axis = in_group
  if groups is not None and whole_axis_count:
    in_axis = jnp.round(
      reduce(flag, axis_name, reduction="sum", _transform=transform)
    )
  if reduction == "mean":
    divisor = jnp.maximum(in_group, 1.0)
    total = [t / divisor.astype(t.dtype) for t in total]
  return total, finite, in_group, in_axis


def _global_step(
  global_optimizer,
  combined: list,
  mine: list,
  part: _Carry,
  any_finite: jax.Array,
  view,
):
  """Step 3c: the new center and global state, if any replica of the group
  was finite; otherwise they stay as they are.

  The global optimizer moves the center with the combined contribution;
  without one (``global_optimizer=None``, plain averaging) the combined
  params are the new center (or, if none was finite, this replica's own).
  """
  if global_optimizer is None:
    center = [
      jnp.where(any_finite, t, m).astype(c.dtype)
      for t, m, c in zip(combined, mine, part.center)
    ]
    return center, part.global_state

  def step(operands):
    center, state = operands
    wire = [t.astype(c.dtype) for t, c in zip(combined, center)]
    center_updates, state = global_optimizer.update(
      view(wire), state, view(center)
    )
    center = optax.apply_updates(view(center), center_updates)
    return jax.tree.leaves(center), state

  return _cond(any_finite, step, lambda o: o, (part.center, part.global_state))


def _pull(target: list, params: list) -> list:
  """Step 3d: updates that move the synced leaves onto ``target``.

  ``params + (target - params)`` lands on the target exactly when
  ``target/2 <= params <= 2*target`` (Sterbenz), within one rounding otherwise.
  """
  return [t.astype(p.dtype) - p for t, p in zip(target, params)]


def _pull_after(
  synced: list, center: list, params: list, updates: list
) -> list:
  """Step 4: updates onto the center for the leaves a sync moved
  (``synced``, one flag per leaf), the local optimizer's elsewhere.

  Outside every cond, so that on a step without a sync XLA fuses the local
  step, this select and the caller's ``apply_updates`` as it does for plain
  optax.
  """
  return [
    jnp.where(f, c.astype(p.dtype) - p, u)
    for f, c, p, u in zip(synced, center, params, updates)
  ]


def _cond(pred: jax.Array, true_fn, false_fn, operands: Any) -> Any:
  """``lax.cond``, its branches typed alike under a checking shard_map (a
  psum turns varying into invariant, a grouped one keeps it varying: both
  are cast to the union of the two) and under Explicit model axes (zeros
  take the sharding of the other branch's leaf)."""
  if not _axes.vma_checked() and not _axes.explicit_axes_present():
    return jax.lax.cond(pred, true_fn, false_fn, operands)
  types = [jax.eval_shape(f, operands) for f in (true_fn, false_fn)]
  typed = [
    lambda o, f=f: _axes.cast_tree_like(f(o), *types)
    for f in (true_fn, false_fn)
  ]
  return jax.lax.cond(pred, *typed, operands)


def _when(
  pred: jax.Array,
  sync,
  carry: _Carry,
  leaves: Sequence[int],
  fragment: int | None,
) -> _Carry:
  """``sync`` on ``leaves`` (and global state ``fragment``) if ``pred``.

  A ``lax.cond`` whose operands are only what the sync may change: the
  fragment's slice of the carry, so that no branch hands back leaves it does
  not own (XLA copies such pass-through outputs of a multi-branch
  conditional), and the other branch returns its operands unchanged.
  """
  part = _Carry(
    updates=[carry.updates[i] for i in leaves] if carry.updates else [],
    accumulator=[carry.accumulator[i] for i in leaves]
    if carry.accumulator
    else [],
    center=[carry.center[i] for i in leaves] if carry.center else [],
    global_state=carry.global_state
    if fragment is None
    else carry.global_state[fragment],
    sync_count=carry.sync_count,
    skipped=carry.skipped,
    left_out=carry.left_out,
  )
  part = _cond(pred, sync, lambda c: c, part)

  def scatter(full: list, new: list) -> list:
    full = list(full)
    for i, x in zip(leaves, new):
      full[i] = x
    return full

  global_state = part.global_state
  if fragment is not None:
    global_state = tuple(
      part.global_state if f == fragment else g
      for f, g in enumerate(carry.global_state)
    )
  return _Carry(
    updates=scatter(carry.updates, part.updates),
    accumulator=scatter(carry.accumulator, part.accumulator),
    center=scatter(carry.center, part.center),
    global_state=global_state,
    sync_count=part.sync_count,
    skipped=part.skipped,
    left_out=part.left_out,
  )


# --------------------------------------------------------------------------
# Checks at trace time, before any state is touched.


def _check_update_args(
  name, grads, state, params, axis_name, syncs, axis_index_groups
):
  """Checks everything ``update`` is given; returns the axis size and each
  sync's replica groups."""
  if params is None:
    raise ValueError(
      f"{name}: params are required; call tx.update(grads, state, params)."
      " At a sync the returned updates move params onto the target, which"
      " needs the current params."
    )
  size = _axes.axis_size(axis_name, name)
  groups = [
    _groups(s.group_size, axis_index_groups, size, name, axis_name)
    for s in syncs
  ]
  _axes.scalar_counter(state.count, name, "state.count", axis_name)
  _check_local_gradients(grads, params, axis_name, name)
  center_def = jax.tree.structure(state.center)
  if center_def != jax.tree.structure(params):
    raise ValueError(
      f"{name}: the state does not match the params tree over axis"
      f" {axis_name!r}: state.center has structure {center_def}, params"
      f" have {jax.tree.structure(params)}. Build the state with"
      " tx.init(params) from these params."
    )
  if axis_index_groups is not None and _axes.vma_checked():
    for c in jax.tree.leaves(state.center):
      _, invariant = _axes.split_axes(c, axis_name)
      if invariant:
        raise ValueError(
          f"{name}: with axis_index_groups each group keeps its own center,"
          f" so the center must be typed varying over {axis_name!r}, but it"
          " is invariant (it was initialised from replicated params). Build"
          " the state with tx.init(params) from params that carry a leading"
          f" replica axis sharded over {axis_name!r}, or from"
          f" jax.lax.pcast(params, {axis_name!r}, to='varying')."
        )
  return size, groups


def _check_local_gradients(
  grads: Any, params: Any, axis_name: Any, transform: str
) -> None:
  """Checks grads: params' tree structure, floating point, not invariant.

  Gradients typed invariant were summed by autodiff: not local gradients.
  """
  grads_def = jax.tree.structure(grads)
  params_def = jax.tree.structure(params)
  if grads_def != params_def:
    raise ValueError(
      f"{transform}: the gradient tree does not match the params tree over"
      f" axis {axis_name!r}: grads have structure {grads_def}, params have"
      f" {params_def}. Pass the gradient of the same params the state was"
      " built from (tx.init(params))."
    )
  checked = _axes.vma_checked()

  def leaf(path, g):
    _axes.check_float_leaf(path, g, transform, axis_name)
    if not checked:
      return
    _, invariant = _axes.split_axes(g, axis_name)
    if invariant:
      raise ValueError(
        f"{transform}: the gradient at {jax.tree_util.keystr(path) or '<root>'}"
        f" is invariant over axis {_axes.as_axis(invariant)!r}: the params were"
        " replicated (P()), so autodiff has already summed the gradient over"
        " every replica. That is the synchronous gradient, not this"
        f" replica's local gradient, and {transform} needs the local one"
        " (the replicas train apart between synchronisations). Fix: give each"
        " replica its own params, typed varying: a leading replica axis"
        f" sharded over {axis_name!r} (in_specs=P({axis_name!r})), or"
        f" params = jax.lax.pcast(params, {axis_name!r}, to='varying') before"
        " jax.grad."
      )

  jax.tree_util.tree_map_with_path(leaf, grads)


# --------------------------------------------------------------------------
# The engine.


def _init(
  params,
  *,
  name: str,
  optimizer,
  global_optimizer,
  contribution: str,
  axis_name,
  whole_axis_count: bool,
  num_fragments: int,
) -> AGNState:
  """The engine's ``init``: counters at 0, the center at ``params``, the
  local and global optimizers' states (one global state per fragment)."""
  fragments = check_fragments(params, num_fragments, name)
  leaves, treedef = jax.tree.flatten(params)
  view = functools.partial(
    _fragment_tree, treedef=treedef, num_fragments=num_fragments
  )
  if global_optimizer is None:
    global_state = ()
  elif num_fragments == 1:
    global_state = global_optimizer.init(params)
  else:
    global_state = tuple(
      global_optimizer.init(view([leaves[i] for i in f])) for f in fragments
    )
  skipped, restart = _flags(leaves, axis_name, whole_axis_count)
  return AGNState(
    count=jnp.zeros([], jnp.int32),
    sync_count=jnp.zeros([], jnp.int32),
    accumulator=(
      jax.tree.map(_zeros_accumulator, params)
      if contribution == GRADIENTS
      else ()
    ),
    center=jax.tree.map(jnp.asarray, params),
    local_state=optimizer.init(params),
    global_state=global_state,
    skipped=skipped,
    restart=restart,
  )


def periodic(
  name: str,
  optimizer: optax.GradientTransformation,
  global_optimizer: optax.GradientTransformation | None,
  axis_name: Any,
  *,
  syncs: Sequence[Sync],
  contribution: str,
  reduction: str = "mean",
  axis_index_groups=None,
  comm_dtype=None,
  num_fragments: int = 1,
) -> optax.GradientTransformationExtraArgs:
  """The engine: ``optimizer`` every step, the ``syncs`` on their schedule.

  Args:
    name: the public transform's name, used in error messages.
    optimizer: the local optimizer, applied on every replica at every step.
    global_optimizer: the optimizer that moves the center at a sync; None with
      the ``PARAMS`` contribution (the average is the new center).
    axis_name: the replica axis (or tuple of axes).
    syncs: the schedule (see :class:`Sync`); validated by the caller.
    contribution: ``GRADIENTS``, ``PSEUDO_GRADIENT`` or ``PARAMS``.
    reduction: how contributions combine across replicas.
    axis_index_groups: optional groups for syncs without a ``group_size``;
      each group keeps its own center.
    comm_dtype: optional wire dtype of the contributions, floating or
      quantized; the finite flag and counts always travel in float32.
    num_fragments: how many fragments the params' leaves are split into.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state :class:`AGNState`.
  """
  _axes.check_transform(optimizer, name, "optimizer")
  if global_optimizer is not None:
    _axes.check_transform(global_optimizer, name, "global_optimizer")
  _axes.check_reduction(reduction, name, axis_name)
  comm_dtype = _axes.check_comm_dtype(comm_dtype, name, axis_name)
  local = optax.with_extra_args_support(optimizer)
  # Skips counted over the whole axis keep `skipped` replicated; a schedule
  # of contiguous groups (hierarchical) counts within them (per replica).
  whole_axis_count = all(s.group_size is None for s in syncs)
  period = syncs[0].period

  init_fn = functools.partial(
    _init,
    name=name,
    optimizer=optimizer,
    global_optimizer=global_optimizer,
    contribution=contribution,
    axis_name=axis_name,
    whole_axis_count=whole_axis_count,
    num_fragments=num_fragments,
  )

  def update_fn(grads, state, params=None, **extra_args):
    size, groups = _check_update_args(
      name, grads, state, params, axis_name, syncs, axis_index_groups
    )
    fragments = check_fragments(params, num_fragments, name)
    param_leaves, treedef = jax.tree.flatten(params)
    view = functools.partial(
      _fragment_tree, treedef=treedef, num_fragments=num_fragments
    )

    def local_step(g):
      return _local_step(optimizer, local, g, state, params, extra_args)

    # Where this step's local updates come from. agn's sync does not read
    # them; the others' does (its contribution is center - (params +
    # updates)). Handing them through the conds would keep XLA from fusing
    # the local step with the caller's apply_updates, so a sync recomputes
    # them in its own branch, unless the local optimizer communicates (an
    # inner all-reduce would then run twice): then they go through.
    through = contribution != GRADIENTS and _communicates(
      lambda g: local_step(g)[0], grads
    )

    def sync(k: int, part: _Carry) -> _Carry:
      """Sync ``k`` on its fragment's slice of the carry (steps 3a-3d)."""
      leaves = fragments[syncs[k].fragment]
      params_part = [param_leaves[i] for i in leaves]
      if part.updates:
        updates_part = part.updates
      elif contribution == GRADIENTS:
        updates_part = []
      else:  # this step's, recomputed from the state before it
        updates_part = [local_step(grads)[0][i] for i in leaves]
      mine = _contribution(
        contribution, part, params_part, updates_part, period
      )
      combined, finite, in_group, in_axis = _combine(
        mine,
        axis_name,
        groups[k],
        reduction=reduction,
        comm_dtype=comm_dtype,
        whole_axis_count=whole_axis_count,
        transform=name,
      )
      center, global_state = _global_step(
        global_optimizer, combined, mine, part, in_group > 0, view
      )
      skipped = part.skipped + jnp.round(
        (size if whole_axis_count else _axes.group_size(groups[k], size))
        - in_axis
      ).astype(jnp.int32)
      return _Carry(
        updates=_pull(center, params_part) if part.updates else [],
        accumulator=[_zeros_after(a, in_group) for a in part.accumulator],
        center=center,
        global_state=global_state,
        sync_count=part.sync_count + 1,
        skipped=skipped,
        left_out=jnp.logical_not(finite),
      )

    count = state.count + 1
    _axes.check_replicated_predicate(count, name)
    if through or contribution == GRADIENTS:
      updates, local_state = local_step(grads)
    carry = _Carry(
      updates=updates if through else [],
      accumulator=_accumulate(state.accumulator, grads),
      center=jax.tree.leaves(state.center),
      global_state=state.global_state,
      sync_count=state.sync_count,
      skipped=state.skipped,
      left_out=jnp.zeros([], bool),
    )
    index = _branch(jnp.reshape(count, ()), syncs)
    for k, s in enumerate(syncs):
      carry = _when(
        index == k + 1,
        functools.partial(sync, k),
        carry,
        fragments[s.fragment],
        s.fragment if num_fragments > 1 else None,
      )
    if through:
      updates = carry.updates
    else:
      if contribution != GRADIENTS:
        # The syncs read the local state before this step; the local step,
        # which overwrites it in place, reads grads that depend on the
        # syncs, so XLA runs it after them (else it copies the state).
        updates, local_state = local_step(_after(grads, carry.sync_count))
      synced = _synced_leaves(index, syncs, fragments, len(param_leaves))
      updates = _pull_after(synced, carry.center, param_leaves, updates)
    return treedef.unflatten(updates), AGNState(
      count=count,
      sync_count=carry.sync_count,
      accumulator=(
        treedef.unflatten(carry.accumulator)
        if contribution == GRADIENTS
        else ()
      ),
      center=treedef.unflatten(carry.center),
      local_state=local_state,
      global_state=carry.global_state,
      skipped=carry.skipped,
      restart=jnp.reshape(carry.left_out, (1,)),
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
