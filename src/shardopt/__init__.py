"""shardopt: optax gradient transformations for distributed training in JAX.

Fewer bytes and fewer rounds for data-parallel training: averaging,
accumulation, PowerSGD, quantized wires, local SGD, DiLoCo and ZeRO-1-style
sharded state, on ``jax.lax`` collectives inside ``jax.shard_map`` or
``jax.pmap``. It began as a port of TensorFlow 1's CrossShardOptimizer,
TowerOptimizer and AGNOptimizer.
"""

from shardopt import elastic
from shardopt import measure
from shardopt import wire
from shardopt._axes import AxisNotBoundError
from shardopt._host_schedule import WARM_UP
from shardopt._host_schedule import due
from shardopt.accumulate import AccumulateState
from shardopt.accumulate import accumulate
from shardopt.collectives import broadcast
from shardopt.collectives import reduce
from shardopt.collectives import replica_divergence
from shardopt.cross_shard import ErrorFeedbackState
from shardopt.cross_shard import cross_shard
from shardopt.cross_shard import cross_shard_mean
from shardopt.cross_shard import cross_shard_sum
from shardopt.cross_shard import scale_loss
from shardopt.decoupled import DecoupledMomentumState
from shardopt.decoupled import decoupled_momentum
from shardopt.delayed_nesterov import DelayedNesterovState
from shardopt.delayed_nesterov import delayed_nesterov
from shardopt.finite import all_finite
from shardopt.finite import apply_if_finite
from shardopt.mt_dao import MTDAOState
from shardopt.mt_dao import mt_dao
from shardopt.mt_dao import scale_by_mt_dao
from shardopt.periodic import AGNState
from shardopt.periodic import PeriodicState
from shardopt.periodic import PierOuterState
from shardopt.periodic import agn
from shardopt.periodic import desloc
from shardopt.periodic import diloco
from shardopt.periodic import hierarchical_local_sgd
from shardopt.periodic import local_sgd
from shardopt.periodic import noloco
from shardopt.periodic import pier
from shardopt.periodic import pier_learning_rate
from shardopt.periodic import pier_momentum
from shardopt.periodic.describe import describe_fragments
from shardopt.periodic.fragments import fragment_of
from shardopt.powersgd import PowerSGDState
from shardopt.powersgd import powersgd
from shardopt.quantize import quantized
from shardopt.sparse import topk
from shardopt.specs import state_specs
from shardopt.specs import vmap_axes
from shardopt.tower import clip_by_global_norm
from shardopt.tower import tower

__version__ = "0.2.0.dev0"

__all__ = [
  "AxisNotBoundError",
  "WARM_UP",
  "due",
  "broadcast",
  "ErrorFeedbackState",
  "cross_shard",
  "cross_shard_mean",
  "cross_shard_sum",
  "reduce",
  "replica_divergence",
  "scale_loss",
  "AGNState",
  "PeriodicState",
  "PierOuterState",
  "agn",
  "desloc",
  "diloco",
  "describe_fragments",
  "fragment_of",
  "hierarchical_local_sgd",
  "local_sgd",
  "pier",
  "pier_learning_rate",
  "pier_momentum",
  "noloco",
  "PowerSGDState",
  "powersgd",
  "DecoupledMomentumState",
  "decoupled_momentum",
  "DelayedNesterovState",
  "delayed_nesterov",
  "MTDAOState",
  "mt_dao",
  "scale_by_mt_dao",
  "quantized",
  "topk",
  "clip_by_global_norm",
  "state_specs",
  "vmap_axes",
  "tower",
  "AccumulateState",
  "accumulate",
  "all_finite",
  "apply_if_finite",
  "elastic",
  "measure",
  "wire",
]
