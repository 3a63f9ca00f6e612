"""Diagnostic (not a committed row): MT-DAO's optimizer in synchronous
training, cross_shard(chain(scale_by_mt_dao, decayed step)), to attribute
the local_sgd(mt_dao) rows' loss to the optimizer or to the local steps."""
import sys
from benchmarks._xla_flags import force_cpu_devices
force_cpu_devices(quick=False)
import optax, shardopt
from benchmarks import methods
from benchmarks.studies import quality_per_byte as q
from shardopt.measure import hlo

def sync_mt_dao(beta, scale=1.0):
  return methods.Method(
    f"cross_shard(mt_dao(beta={beta:g}, omega=0.7)) [sync] lr x{scale:g}",
    ("cross_shard", "scale_by_mt_dao"),
    lambda opt: shardopt.cross_shard(
      optax.chain(shardopt.scale_by_mt_dao((beta,), (0.7,)), opt(), optax.scale(scale)), methods.AXIS),
    hlo.Schedule(), family="mt_dao", optimizer="decayed step")

original = methods.quality_per_byte
methods.quality_per_byte = lambda steps, quick=False: original(steps, quick) + [sync_mt_dao(0.995), sync_mt_dao(0.995, 3.0), sync_mt_dao(0.9), methods.mt_dao(16, 0.9)]
sys.exit(q.main(sys.argv[1:]))
