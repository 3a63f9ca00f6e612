"""The exchange: this island's rows, and the one collective program that
carries them over the live islands.

After the quorum has fixed the attempt's devices (:mod:`.quorum`):

1. this island builds its rows (:func:`.rows.plain_rows` on a plain round,
   :meth:`.heal.Heal.row` on a healing one), jitted on its devices, or per
   device of its shards when the params are sharded (:mod:`.shards`);
2. one program over the devices, one per process (a device matrix with
   sharded params), blocked on inside the round's ``live_devices`` block:
   on a two-phase wire an ``all_to_all`` of the rows, each island's owned
   chunk summed, and an ``all_gather`` of the sums (:func:`.rows.exchange`);
   on the top-k wire, and in a healing round, one ``all_gather`` of the
   rows. Every island holds the same bytes after it, for the commit
   (:mod:`.commit`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardopt.elastic import heal as _heal
from shardopt.elastic import quorum
from shardopt.elastic import rows
from shardopt.elastic import shards


class Exchange:
  """This island's rows and collective programs, jitted once each.

  Args:
    engine: the transform's engine (:func:`.split.engine_of`).
    jit: ``jit(key, fn, **kwargs)``, the island's cache of programs.
    heal: the island's :class:`.heal.Heal` (its healing row).
    process, island: this process's index and its island's.
    processes_per_island, dedicated: as :class:`.quorum.Quorum`'s.
    trains: False on the dedicated coordinator (it contributes nothing).
    replicated: a sharding replicated over the island's devices.
  """

  def __init__(
    self,
    engine,
    jit: Callable,
    heal: _heal.Heal,
    *,
    process: int,
    island: int,
    processes_per_island: int,
    dedicated: bool,
    trains: bool,
    replicated,
  ):
    self._engine, self._jit, self._heal = engine, jit, heal
    self._process, self._island = process, island
    self._k, self._dedicated, self._trains = (
      processes_per_island,
      dedicated,
      trains,
    )
    self._replicated = replicated

  def check_shardable(self) -> None:
    """Refuses sharded params where a round cannot run shard by shard."""
    engine = self._engine
    if engine.num_fragments > 1 or engine.layer_axes is not None:
      raise ValueError(
        "shardopt.elastic.Island: params sharded over an island's devices"
        " run their rounds shard by shard, but Streaming DiLoCo's fragments"
        f" (num_fragments={engine.num_fragments}) and layer_axes are"
        " assigned from whole leaves; use num_fragments=1 and no layer_axes,"
        " or replicate the params over the island's devices."
      )

  def rows(
    self,
    healing: bool,
    devices: quorum.Devices,
    sync: int,
    params,
    state,
    up: bool,
    weight,
  ):
    """Step 1: ``(row, dropped)``, this island's rows and what the wire
    dropped from its contribution (error feedback); with sharded params
    both ``{device: ...}`` over ``devices.mine``. ``up``: it took part in
    the last committed round; ``weight``: :func:`.rows.island_weight`'s."""

    def build(p, s, local):
      if healing:
        return self._heal.row(sync, p, s, up, weight, local)
      return self._plain_rows(devices.order, sync, p, s, weight, local)

    if devices.matrix is None:
      return build(params, state, False)
    local_p = shards.local_trees(params, devices.mine, "a params")
    local_s = shards.local_trees(state, devices.mine, "a state")
    made = {d: build(local_p[d], local_s[d], True) for d in devices.mine}
    return {d: m[0] for d, m in made.items()}, {
      d: m[1] for d, m in made.items()
    }

  @staticmethod
  def sent(row, devices: quorum.Devices) -> dict:
    """What this process's row carries in its header (with sharded params,
    its first device's, which carries the digest of that device's shards):
    its contribution's digest and weight, and whether a committed round
    would count it."""
    if devices.matrix is not None:
      row = row[devices.mine[0]]
    head = np.asarray(row[..., : rows.HEADER_BYTES]).reshape(
      -1, rows.HEADER_BYTES
    )
    head = rows.columns(head[:1].copy().view(np.int32))
    return {
      "digest": int(head["digest"][0]),
      "weight": float(head["weight"][0]),
      "counted": bool(head["up_to_date"][0] > 0 and head["finite"][0] > 0),
    }

  def run(self, healing: bool, devices: quorum.Devices, sync: int, params, row):
    """Step 2: the round's collective program over ``devices``, blocked on:
    a healing round's gathered rows, or a plain round's
    :class:`.rows.Exchanged` (with sharded params, ``{device: ...}``)."""
    order = devices.order
    if devices.matrix is not None:
      if healing:
        key, body = ("gather",), _gather_body()
      else:
        like = shards.local_trees(params, devices.mine[:1], "a params")
        key = ("exchange", sync, len(order))
        body = self._exchange_body(order, sync, like[devices.mine[0]])
      exchanged = shards.run(self._jit, key, devices.matrix, body, row)
      jax.block_until_ready(list(exchanged.values()))  # keyed by device
      return exchanged
    if healing:
      exchanged = self._program(("gather",), order, _gather_body(), row)
    else:
      _, islands = quorum.owners(order, self._k, self._dedicated)
      exchanged = self._program(
        ("exchange", sync, islands),
        order,
        self._exchange_body(order, sync, params),
        row,
      )
    return jax.block_until_ready(exchanged)

  def _plain_rows(self, order: list, sync: int, params, state, weight, local):
    """This island's rows of a plain round for the processes of ``order``
    (on its devices; ``local``: of one device's shards, on it), and what
    the wire dropped from its contribution."""
    engine, me, island, trains = (
      self._engine,
      self._process,
      self._island,
      self._trains,
    )
    owners, islands = quorum.owners(order, self._k, self._dedicated)
    fn = self._jit(
      ("plain_rows", sync, islands, len(order), local),
      lambda s, p, o, w: rows.plain_rows(
        engine, island, me, sync, s, p, o, islands, trains, w
      ),
      **({} if local else {"out_shardings": self._replicated}),
    )
    return fn(state, params, jnp.asarray(owners), weight)

  def _exchange_body(self, order: list, sync: int, params):
    engine = self._engine
    sizes = rows.sizes_of(engine, sync, params)
    _, islands = quorum.owners(order, self._k, self._dedicated)
    return lambda r: rows.exchange(engine, sizes, r, "islands", islands)

  def _program(self, key, order: list, body, row: jax.Array):
    """``body`` (of this process's ``row``) as one collective program over
    ``order``'s devices, one per process: its results on this process's
    device of ``order``."""
    mine = next(d for d in order if d.process_index == self._process)
    mesh = Mesh(np.array(order), ("islands",))
    local = next(s.data for s in row.addressable_shards if s.device == mine)
    local = local.reshape((1,) + local.shape) if local.ndim == 1 else local
    rows_in = jax.make_array_from_single_device_arrays(
      (len(order) * local.shape[0],) + local.shape[1:],
      NamedSharding(mesh, P("islands")),
      [local],
    )
    fn = self._jit(
      key + (tuple(d.id for d in order),),
      jax.shard_map(
        body, mesh=mesh, in_specs=P("islands"), out_specs=P(), check_vma=False
      ),
    )
    return jax.tree.map(lambda x: x.addressable_shards[0].data, fn(rows_in))


def _gather_body():
  """One all_gather of the islands' rows: every island's rows."""
  return lambda r: jax.lax.all_gather(r, "islands", tiled=True)
