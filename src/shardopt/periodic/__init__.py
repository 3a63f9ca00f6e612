"""AGNOptimizer and the periodic-communication family: ``agn``, ``local_sgd``,
``diloco`` and ``hierarchical_local_sgd``.

One engine (``shardopt.periodic.engine``), thin public wrappers. Every
replica trains on its own (local) copy of the params with ``optimizer``; on a
*schedule* (which leaves, over which group of replicas, after which step) the
replicas combine one *contribution* each, a *global* optimizer moves a shared
``center`` with it, and the returned updates move every replica's params onto
the new center::

  contribution    AGN: a_i = (sum of the gradients since the last sync) / T
                  local_sgd / diloco: a_i = center - local_params_i
                  hierarchical_local_sgd: a_i = local_params_i
  combination     a = mean_i a_i  (or sum_i a_i for agn(reduction="sum"))
  global step     center <- global_optimizer(center, a)
                  (hierarchical_local_sgd: center <- a, no global optimizer)
  pull            params_i <- center

With ``global_optimizer = sgd(1)`` and the params contribution,
``center - mean_i(center - local_i) = mean_i(local_i)``: periodic model
averaging (``local_sgd``). With ``sgd(lr, momentum, nesterov=True)`` it is
DiLoCo's outer step.

Schedules: ``agn``/``local_sgd``/``diloco`` synchronise everything every T
steps; ``hierarchical_local_sgd`` averages within contiguous groups of several
sizes at several periods; ``diloco(..., num_fragments=F)`` (Streaming DiLoCo)
synchronises one fragment of the leaves at a time, staggered over the period.
Communication happens only on sync steps: the collectives sit inside the
sync branch of one ``jax.lax.cond`` per sync, whose predicates are read from
one index computed from the replicated step counter (at most one fires per
step). The other steps run no collective at all.

TensorFlow's AGNOptimizer is asynchronous: each worker commits its normalized
accumulator to a parameter server on its own schedule. shardopt is
synchronous SPMD: all replicas commit in the same step, and the commits are
combined with ``reduction`` ("mean" by default; "sum" is what a parameter
server does when it applies every worker's commit in one round).

The package shows the engine's parts, one module each: ``transforms`` (the
public functions), ``state`` (``PeriodicState``), ``schedules`` (which
fragment, which group, which step), ``fragments`` (whole leaves or strided
layers of stacked leaves), ``contributions`` (gradient sums,
pseudo-gradients, params), ``combine`` (the collective round), ``outer``
(the outer steps: optimizer, mean, replace; the overlap's merge), ``eager``
(Eager updates' outer step), ``gossip`` and ``noloco`` (NoLoCo's exchange
with one peer, its contribution and outer step; the transform), ``engine`` (``update`` as its
numbered steps), ``checks`` (argument checks) and ``_xla`` (the XLA cost
tricks); ``desloc`` (DES-LOC: the local optimizer's moments averaged on
periods of their own, found by ``moments``) and ``pier`` (Pier: a
``diloco`` after a synchronous start that builds the outer momentum, and
its outer schedules). A new schedule touches
``schedules``; a new outer step ``outer`` (and the transform that uses it).

The examples assume 8 devices (for instance a CPU with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` set before jax is
imported).
"""

from shardopt.periodic.desloc import desloc
from shardopt.periodic.noloco import noloco
from shardopt.periodic.pier import PierOuterState
from shardopt.periodic.pier import pier
from shardopt.periodic.pier import pier_learning_rate
from shardopt.periodic.pier import pier_momentum
from shardopt.periodic.state import AGNState
from shardopt.periodic.state import PeriodicState
from shardopt.periodic.transforms import agn
from shardopt.periodic.transforms import diloco
from shardopt.periodic.transforms import hierarchical_local_sgd
from shardopt.periodic.transforms import local_sgd

__all__ = [
  "AGNState",
  "PeriodicState",
  "PierOuterState",
  "agn",
  "desloc",
  "diloco",
  "hierarchical_local_sgd",
  "local_sgd",
  "pier",
  "pier_learning_rate",
  "pier_momentum",
  "noloco",
]
