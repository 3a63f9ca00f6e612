"""A skippable update without a ``lax.cond``: :func:`update_or_skip`.

A guard (``apply_if_finite``) runs ``inner.update`` when a step is good and
keeps the old state with zero updates when it is not. Written as a
``lax.cond``, the update is cut off from the caller's ``optax.apply_updates``:
XLA does not fuse across a conditional, so the updates are written to memory
by the branch and read back by the caller, and the step costs 1.3-1.4x the
unguarded one on CPU (``benchmarks/cost.py``, group 5). Written as a select
of ``inner``'s outputs (``where(ok, new_state, state)``), XLA fuses each
select into the computation of the new state *and* recomputes the new state
inside the caller's fused ``params + updates`` from the old state, which a
donated step has just overwritten in place: XLA copies the whole state.

:func:`update_or_skip` selects each new state leaf **where it is computed**:
it evaluates ``inner.update``'s jaxpr and, as soon as an equation defines a
leaf of the new state, binds ``where(ok, new, old)`` in its place, so that
everything after it (the updates among them) reads the selected leaf. Where
``ok`` holds that is the new leaf, bit for bit, so the numbers are
``inner``'s; where it does not, the updates are replaced by zeros and the
state is the old one. The selected leaf is then an output *and* an operand
of the updates, so XLA materialises it once, in place, and the caller's
fused step reads it: the guarded step costs the unguarded one plus the finite
check (one read of the gradients), and copies nothing more.

The whole of ``inner.update`` runs on every step, its collectives included
(every replica runs the same program, so none can hang); a skipped step's
work is thrown away.

Evaluating a jaxpr equation by equation reads two undocumented JAX names
(:func:`shardopt._jax.equation_binder`). A JAX without them takes the
generic path, :func:`_update_then_select`: the same numbers, selected after
``inner.update`` returns (XLA then copies the state once more per step).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.extend import core as jax_core

from shardopt import _axes
from shardopt import _jax


def _select(ok: jax.Array, new: Any, old: Any) -> jax.Array:
  """``where(ok, new, old)`` with both sides cast to their union type."""
  new_, old_ = _axes.cast_tree_like(new, old), _axes.cast_tree_like(old, new)
  return jnp.where(ok, new_, old_)


def _update_then_select(
  ok: jax.Array,
  update_fn: Callable[..., tuple[Any, Any]],
  updates: Any,
  state: Any,
  params: Any,
  **extra_args: Any,
) -> tuple[Any, Any]:
  """:func:`update_or_skip`'s numbers without evaluating the jaxpr: the
  update runs whole, then each output is selected."""
  new_updates, new_state = update_fn(updates, state, params, **extra_args)
  new_state = optax.tree.cast_like(new_state, state)
  updates_leaves, updates_tree = jax.tree.flatten(new_updates)
  state_leaves, state_tree = jax.tree.flatten(new_state)
  return (
    updates_tree.unflatten(
      [jnp.where(ok, u, jnp.zeros_like(u)) for u in updates_leaves]
    ),
    state_tree.unflatten(
      [
        _select(ok, new, old)
        for new, old in zip(state_leaves, jax.tree.leaves(state), strict=True)
      ]
    ),
  )


def update_or_skip(
  ok: jax.Array,
  update_fn: Callable[..., tuple[Any, Any]],
  updates: Any,
  state: Any,
  params: Any = None,
  **extra_args: Any,
) -> tuple[Any, Any]:
  """``update_fn(updates, state, params)`` where ``ok``, else zeros and ``state``.

  The new state comes back in the old state's dtypes (as ``optax.MultiSteps``
  keeps it), so that a skipped step and an applied one have the same types.

  Args:
    ok: a bool scalar, True to apply the update.
    update_fn: an optax ``update`` function.
    updates, state, params: its arguments; ``extra_args`` are passed on.

  Returns:
    ``(updates, new_state)``: ``update_fn``'s, bit for bit, where ``ok``;
    zeros of the updates' types and ``state`` itself where not.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from shardopt._skip import update_or_skip
    >>> adam = optax.adam(0.1)
    >>> g, state = jnp.array([1.0, -2.0]), adam.init(jnp.zeros(2))
    >>> updates, new = update_or_skip(jnp.array(False), adam.update, g, state)
    >>> updates, new[0].count  # skipped: zeros, the old state
    (Array([0., 0.], dtype=float32), Array(0, dtype=int32))
    >>> updates, new = update_or_skip(jnp.array(True), adam.update, g, state)
    >>> updates, new[0].count  # applied: adam's update
    (Array([-0.09999934,  0.09999934], dtype=float32), Array(1, dtype=int32))
  """
  bind = _jax.equation_binder()
  if bind is None:  # this JAX lacks what the fast path reads
    return _update_then_select(
      ok, update_fn, updates, state, params, **extra_args
    )
  args, args_tree = jax.tree.flatten((updates, state, params))

  def flat_update(*flat):
    updates_, state_, params_ = jax.tree.unflatten(args_tree, flat)
    new_updates, new_state = update_fn(updates_, state_, params_, **extra_args)
    return new_updates, optax.tree.cast_like(new_state, state_)

  closed, out_types = jax.make_jaxpr(flat_update, return_shape=True)(*args)
  jaxpr = closed.jaxpr
  out_tree = jax.tree.structure(out_types)
  num_updates = len(jax.tree.leaves(out_types[0]))
  old_leaves = jax.tree.leaves(state)
  # Each new state leaf an equation defines -> the old leaf it replaces (a
  # variable that is two leaves of the state is selected at the end only).
  state_vars = jaxpr.outvars[num_updates:]
  leaves_of = collections.Counter(
    v for v in state_vars if isinstance(v, jax_core.Var)
  )
  inputs = set(jaxpr.invars)
  old_of = {
    var: old
    for var, old in zip(state_vars, old_leaves, strict=True)
    if isinstance(var, jax_core.Var)
    and var not in inputs
    and leaves_of[var] == 1
  }

  env: dict = {}
  read = lambda v: v.val if isinstance(v, jax_core.Literal) else env[v]
  selected = set()
  env.update(zip(jaxpr.constvars, closed.consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  for eqn in jaxpr.eqns:
    for var, value in zip(
      eqn.outvars, bind(eqn, [read(v) for v in eqn.invars]), strict=True
    ):
      if var in old_of:
        chosen = _select(ok, value, old_of[var])
        if jax.typeof(chosen) == jax.typeof(value):
          value = chosen  # every later equation reads the selected leaf
          selected.add(var)
      env[var] = value

  outs = [read(v) for v in jaxpr.outvars]
  new_updates = [
    jnp.where(ok, u, jnp.zeros_like(u)) for u in outs[:num_updates]
  ]
  new_state = [
    value if var in selected else _select(ok, value, old)
    for var, value, old in zip(
      state_vars, outs[num_updates:], old_leaves, strict=True
    )
  ]
  return jax.tree.unflatten(out_tree, new_updates + new_state)
