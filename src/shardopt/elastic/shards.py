"""Model-parallel islands: a round run shard by shard.

An island's params may be sharded over its devices (any ``NamedSharding``
on the island's mesh: tensor parallel, FSDP, both), with the state's
params-shaped leaves sharded like the params (:meth:`Island.init` lays them
out so) and its other leaves replicated. A round then never gathers a leaf:

1. every device of the island builds the rows of *its own* shards (the
   jitted row builders of :mod:`.rows`, run on that device's local arrays);
2. one collective program over a device matrix, one row of devices per
   island (island order) and one column per device position: the round's
   collectives run over the ``"islands"`` axis only, so column ``p``
   exchanges the shards that position ``p`` holds on every island (the same
   shards: every island lays its params out alike);
3. every device commits its own shards (the same jitted commit), and the
   results are put back together as arrays with the original shardings.

The outer optimizer then runs shard by shard, which is exact for the
element-wise ones (the default Nesterov SGD, any ``outer_*`` setting,
Adam-like ones); one that mixes the elements of a leaf (Muon's
orthogonalization) would see only its shard: that is not checked, so do not
pass such an ``outer_optimizer`` with sharded params. Streaming fragments
(``num_fragments > 1``) and ``layer_axes`` are refused with sharded params
(they are assigned from the leaves' shapes, which a shard does not have). A
device that holds a replica of another's shards (data parallel inside the
island) runs its own column: the same bytes twice, bit-identical.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def sharded(tree) -> bool:
  """Whether any leaf of ``tree`` is split over devices (not replicated)."""
  return any(
    isinstance(x, jax.Array) and not x.sharding.is_fully_replicated
    for x in jax.tree.leaves(tree)
  )


def local_trees(tree, devices: list, what: str) -> dict:
  """``{device: tree of that device's local shards}`` over ``devices``."""
  leaves, treedef = jax.tree.flatten(tree)
  per: dict = {d: [] for d in devices}
  for path, x in zip(
    jax.tree_util.tree_flatten_with_path(tree)[0], leaves, strict=True
  ):
    shards = (
      {s.device: s.data for s in x.addressable_shards}
      if isinstance(x, jax.Array)
      else {}
    )
    missing = [d for d in devices if d not in shards]
    if missing:
      raise ValueError(
        f"shardopt.elastic.Island: {what} leaf"
        f" {jax.tree_util.keystr(path[0])} is not laid out on every device of"
        f" the island (missing {missing}); put params on the island's mesh"
        " and build the state with island.init(params)."
      )
    for d in devices:
      per[d].append(shards[d])
  return {d: treedef.unflatten(v) for d, v in per.items()}


def global_tree(per_device: dict, like):
  """The arrays of ``like``'s shapes and shardings whose local shards are
  ``per_device``'s trees."""
  like_leaves, treedef = jax.tree.flatten(like)
  local = {d: jax.tree.leaves(t) for d, t in per_device.items()}
  out = []
  for i, x in enumerate(like_leaves):
    arrays = [
      jax.device_put(leaves[i].astype(x.dtype), d)
      for d, leaves in local.items()
    ]
    out.append(
      jax.make_array_from_single_device_arrays(x.shape, x.sharding, arrays)
    )
  return treedef.unflatten(out)


def run(
  jit: Callable, key: tuple, matrix: list, body: Callable, rows: dict
) -> dict:
  """``body`` over the device ``matrix`` (one row per island), its
  collectives over ``"islands"``: ``rows`` are this process's devices'
  inputs, the result ``{device: its outputs}``. ``jit(key, fn)`` caches the
  compiled program."""
  mesh = Mesh(np.array(matrix), ("islands", "pos"))
  blocks = []
  for d, row in rows.items():
    row = row[None] if row.ndim == 1 else row
    blocks.append(row[None, None])
  shape = (len(matrix), len(matrix[0])) + blocks[0].shape[2:]
  rows_in = jax.make_array_from_single_device_arrays(
    shape, NamedSharding(mesh, P("islands", "pos")), blocks
  )
  fn = jit(
    key + tuple(d.id for row in matrix for d in row),
    jax.shard_map(
      lambda r: body(r[0, 0]),
      mesh=mesh,
      in_specs=P("islands", "pos"),
      out_specs=P(),
      check_vma=False,
    ),
  )
  out = fn(rows_in)
  leaves, treedef = jax.tree.flatten(out)
  per = {d: [] for d in rows}
  for x in leaves:
    shards = {s.device: s.data for s in x.addressable_shards}
    for d in rows:
      per[d].append(shards[d])
  return {d: treedef.unflatten(v) for d, v in per.items()}
