"""Host-scheduled steps: the host picks each step's program.

A transform with a schedule (the periodic family, ``accumulate``) decides in
the graph, from its replicated counter, whether a step communicates: a
``lax.cond`` per sync. XLA does not fuse across a conditional, and a cond
carries every sync's program on every step, so on an accelerator a step
that does not sync costs more than the plain optax step (issue 54:
``local_sgd`` 1.20x Adam on an H100). A hand-written DiLoCo loop (torchft,
MaxText) decides on the host instead. This module gives shardopt's
transforms that mode:

1. :func:`due` (``shardopt.due(tx, t)``): which program the ``t``-th update
   of ``tx`` runs (``t = 1, 2, ...``), a Python int: 0 for the plain local
   step, ``k >= 1`` for the ``k``-th sync of the schedule, :data:`WARM_UP`
   for a warm-up step of synchronous training;
2. ``tx.update(grads, state, params, sync=due(tx, t))`` (a static Python
   int, handed on by ``optax.chain``, ``shardopt.accumulate`` and
   ``shardopt.apply_if_finite`` through optax's extra-args protocol) builds
   that program alone: with ``sync=0`` no conditional, no collective, no read
   of the center;
3. :func:`check`: the program checks the host's choice against the state's
   counter. A step that communicates raises (a host callback, only when
   they disagree) naming both; a step that does not cannot stop the run
   without a conditional, so it marks the state's counter (negative) and
   returns NaN updates, and the next step that communicates raises.

A transform takes part by :func:`attach`-ing a :class:`Scheduled` (its
``due``) to its update function; :func:`due` finds the one inside
``optax.chain`` and shardopt's wrappers by walking the closures of
``tx.update`` (optax has no public door to a chain's members).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from shardopt import _args

# The value of ``due`` for a warm-up step (synchronous training: the mean
# gradient every step).
WARM_UP = -1

_DUE = "shardopt.due"


class Scheduled(Protocol):
  """What a transform with a host schedule tells :func:`due`."""

  name: str  # the public transform's name, for messages

  def due(self, t: int) -> int:
    """The program of the ``t``-th update (``t >= 1``)."""

  def programs(self) -> str:
    """The values ``due`` can return, in words (for error messages)."""


# update function -> its Scheduled. Weak: a transform that goes away takes
# its entry with it.
_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def attach(update_fn, scheduled: Scheduled):
  """Registers ``scheduled`` as the schedule of ``update_fn``; returns it."""
  _ATTACHED[update_fn] = scheduled
  return update_fn


def attached(tx: Any) -> Scheduled | None:
  """The schedule ``tx`` itself was built with (not one inside it)."""
  try:
    return _ATTACHED.get(getattr(tx, "update", None))
  except TypeError:  # not weak-referenceable: nothing attached
    return None


def _members(obj: Any):
  """What a closure, partial or container holds, for :func:`scheduled_in`."""
  if isinstance(obj, functools.partial):
    yield obj.func
    yield from obj.args
    yield from obj.keywords.values()
  elif callable(obj) and hasattr(obj, "__code__"):
    for cell in obj.__closure__ or ():
      try:
        yield cell.cell_contents
      except ValueError:  # an empty cell
        continue
    wrapped = getattr(obj, "__wrapped__", None)
    if wrapped is not None:
      yield wrapped
  elif isinstance(obj, (tuple, list)):
    yield from obj
  elif isinstance(obj, dict):
    yield from obj.values()


def scheduled_in(tx: Any, limit: int = 12) -> list[Scheduled]:
  """The outermost schedules reachable from ``tx.update``: its own, or those
  of the transforms it wraps (``optax.chain``'s members, ``apply_if_finite``'s
  inner), not looking inside a transform that has one."""
  found, seen = [], set()

  def walk(obj, depth):
    if depth > limit or id(obj) in seen:
      return
    seen.add(id(obj))
    try:
      scheduled = _ATTACHED.get(obj)
    except TypeError:
      scheduled = None
    if scheduled is not None:
      found.append(scheduled)
      return
    if hasattr(obj, "update") and hasattr(obj, "init"):  # a transform
      walk(obj.update, depth + 1)
      return
    for member in _members(obj):
      walk(member, depth + 1)

  walk(getattr(tx, "update", tx), 0)
  return found


def due(tx: Any, t: int) -> int:
  """Which program the ``t``-th update of ``tx`` runs, chosen on the host.

  For a transform with a schedule (``agn``, ``local_sgd``,
  ``hierarchical_local_sgd``, ``diloco`` with any options, ``accumulate``),
  also inside ``optax.chain`` or ``shardopt.apply_if_finite``: 0 for a step
  that runs the local update alone, ``k >= 1`` for one that runs the
  ``k``-th sync of the schedule as the engine numbers them (a fragment, a
  level; ``accumulate``: 1 + its inner's value on an emit step), and
  ``shardopt.WARM_UP`` (-1) for a step of ``warmup_steps``. Pass it as
  ``tx.update(grads, state, params, sync=due(tx, t))`` in a step jitted
  with ``sync`` static: each value compiles once, and a step with ``sync=0``
  is the plain local optimizer's program.

  Args:
    tx: the transform the step runs.
    t: which update, counting from 1 (the state's ``count`` after it).

  Returns:
    A Python int.

  Example:
    >>> import optax, shardopt
    >>> tx = shardopt.local_sgd(optax.sgd(0.1), "batch", sync_period=4)
    >>> [shardopt.due(tx, t) for t in range(1, 9)]
    [0, 0, 0, 1, 0, 0, 0, 1]
    >>> tx = shardopt.diloco(optax.adam(1e-3), "batch", sync_period=4,
    ...                      num_fragments=2, warmup_steps=2)
    >>> [shardopt.due(tx, t) for t in range(1, 9)]
    [-1, -1, 0, 2, 0, 1, 0, 2]
    >>> chained = optax.chain(optax.clip(1.0), shardopt.accumulate(optax.sgd(1.0), 2))
    >>> [shardopt.due(chained, t) for t in range(1, 5)]
    [0, 1, 0, 1]
  """
  if not _args.is_integer(t) or t < 1:
    raise ValueError(
      f"{_DUE}: t={t!r} must be a positive int, which update of tx the step"
      " runs (1 for the first; the state's count after the step)."
    )
  found = scheduled_in(tx)
  if not found:
    raise TypeError(
      f"{_DUE}: tx={tx!r} holds no transform with a schedule (agn,"
      " local_sgd, hierarchical_local_sgd, diloco, accumulate): every one of"
      " its steps runs the same program, so there is nothing to choose. Call"
      " tx.update without sync=."
    )
  if len(found) > 1:
    names = ", ".join(s.name for s in found)
    raise ValueError(
      f"{_DUE}: tx holds {len(found)} transforms with a schedule ({names}),"
      " side by side; one sync= cannot choose for both. Nest them instead"
      " (shardopt.accumulate(inner, k) chooses for its inner), or leave"
      " sync= out (the in-graph schedule)."
    )
  return found[0].due(int(t))


def take_sync(extra_args: dict, name: str, scheduled: Scheduled):
  """Pops ``sync`` from ``extra_args``: None (the in-graph schedule) or a
  valid static Python int; a clear error otherwise."""
  sync = extra_args.pop("sync", None)
  if sync is None:
    return None
  if not _args.is_integer(sync):
    raise TypeError(
      f"{name}: sync={sync!r} must be a static Python int, the value"
      f" shardopt.due(tx, t) returns for the step ({scheduled.programs()});"
      " mark it static (jax.jit(step, static_argnames='sync')) or leave"
      " sync= out for the in-graph schedule."
    )
  return int(sync)


def bad_value(name: str, sync: int, scheduled: Scheduled) -> ValueError:
  return ValueError(
    f"{name}: sync={sync} is not a program of this schedule; its steps run"
    f" {scheduled.programs()}. Pass shardopt.due(tx, t) for the step."
  )


def _raise_if_disagree(ok, given, counter, expected, name, t_hint):
  ok, counter, expected = (np.asarray(x) for x in (ok, counter, expected))
  if np.all(ok):
    return
  bad = np.flatnonzero(~np.ravel(ok))[0]
  counter = int(np.ravel(counter)[bad])
  expected = int(np.ravel(expected)[bad])
  if counter < 0:
    raise ValueError(
      f"{name}: an earlier step's host schedule disagreed with the state's"
      f" counter, on a step that does not communicate: it marked the"
      f" counter negative ({counter}) and returned NaN updates. This step has"
      f" sync={given}. Restore a state from before that step and pass"
      f" sync=shardopt.due(tx, t) with {t_hint}."
    )
  raise ValueError(
    f"{name}: the host schedule says sync={given} for this step, but the"
    f" state's counter ({counter} before the step) says sync={expected}."
    f" Pass sync=shardopt.due(tx, t) with {t_hint} of the state the step is"
    " given (a step that apply_if_finite skipped does not count)."
  )


def check(
  given: int,
  expected: jax.Array,
  counter: jax.Array,
  *,
  name: str,
  t_hint: str,
  communicates: bool,
) -> jax.Array:
  """Checks the host's ``given`` program against ``expected`` (the one the
  state's counter asks for); returns ``ok``.

  ``counter`` is the state's counter before the step: negative, it was
  marked by an earlier disagreement (never ok). With ``communicates`` (the
  program runs a collective or emits), a disagreement raises at run time
  through a host callback inside a ``lax.cond`` that runs only then
  (where :func:`can_raise`). Otherwise the caller marks the counter and
  poisons its updates where ``ok`` is False (:func:`mark`, :func:`poison`):
  a program that does not communicate has no conditional to raise from,
  and the next one that can raises.
  ``t_hint`` says how ``t`` follows from the state.
  """
  ok = (expected == given) & (counter >= 0)
  if communicates and can_raise():
    report = functools.partial(_raise_if_disagree, name=name, t_hint=t_hint)
    jax.lax.cond(
      jnp.all(ok),
      lambda *_: None,
      lambda *a: jax.debug.callback(report, *a),
      ok,
      given,
      counter,
      expected,
    )
  return ok


def can_raise() -> bool:
  """Whether a program can raise from a host callback here: not inside a
  partial-manual shard_map over a mesh with an Explicit axis, where JAX
  refuses to close over inputs sharded on Explicit axes. There a
  disagreement is marked and poisoned only, as on a step that does not
  communicate."""
  mesh = jax.sharding.get_abstract_mesh()
  return mesh.empty or all(
    kind != jax.sharding.AxisType.Explicit for kind in mesh.axis_types
  )


def mark(ok: jax.Array, counter: jax.Array) -> jax.Array:
  """The counter after the step, negative where the host disagreed."""
  return jnp.where(ok, counter, -1 - jnp.abs(counter)).astype(counter.dtype)


def poison(ok: jax.Array, updates: Any) -> Any:
  """NaN updates where the host disagreed (a select the local step fuses)."""
  return jax.tree.map(
    lambda u: (
      jnp.where(ok, u, jnp.asarray(jnp.nan, u.dtype))
      if jnp.issubdtype(u.dtype, jnp.inexact)
      else u
    ),
    updates,
  )
