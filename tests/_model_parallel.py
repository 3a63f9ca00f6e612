"""A 2-layer MLP trained with a shardopt transform over a "data" axis while
its params are sharded over a "model" axis (tensor parallel), in a
partial-manual ``jax.shard_map``; and the same run without the model axis.

Shared by tests/test_model_parallel.py (and usable from a notebook): one
training loop, the layouts, and a reader of which mesh axes each collective
of a compiled step runs over.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardopt

STEPS = 6
BATCH = 4  # rows per replica per step
IN, HIDDEN, OUT = 16, 32, 16
# Tensor parallel: w1 column-parallel, w2 row-parallel, b with w1's columns.
MODEL_SPECS = {"w1": P(None, "model"), "b": P("model"), "w2": P("model", None)}


def params0(seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  return {
    "w1": (rng.normal(size=(IN, HIDDEN)) / np.sqrt(IN)).astype(np.float32),
    "b": (0.1 * rng.normal(size=(HIDDEN,))).astype(np.float32),
    "w2": (rng.normal(size=(HIDDEN, OUT)) / np.sqrt(HIDDEN)).astype(np.float32),
  }


def batches(replicas: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
  """(STEPS, replicas * BATCH, IN) inputs and (..., OUT) targets."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(STEPS, replicas * BATCH, IN)).astype(np.float32)
  y = rng.normal(size=(STEPS, replicas * BATCH, OUT)).astype(np.float32)
  return x, y


def loss(p, x, y, explicit: bool = False):
  h = jnp.tanh(x @ p["w1"] + p["b"])
  # Under Explicit axes the contraction over the model-sharded hidden
  # dimension needs its output sharding spelled out (the user's model).
  out = (
    jnp.matmul(h, p["w2"], out_sharding=P(None, None))
    if explicit
    else h @ p["w2"]
  )
  return jnp.mean((out - y) ** 2)


def make_mesh(shape: dict, axis_type=AxisType.Auto):
  """A mesh over the first prod(shape) CPU devices, every axis of one type."""
  size = int(np.prod(list(shape.values())))
  return jax.make_mesh(
    tuple(shape.values()),
    tuple(shape),
    axis_types=(axis_type,) * len(shape),
    devices=jax.devices()[:size],
  )


def stacked_sharding(mesh, manual: tuple, spec: P) -> NamedSharding:
  """The sharding of per-replica leaves laid out as concatenated P(manual)
  blocks along dim 0, keeping ``spec``'s model axes where the mesh has them
  (dim 0 is then split over the manual axes first, the model axis within)."""
  spec = only_mesh_axes(spec, mesh)
  first = tuple(manual) + ((spec[0],) if len(spec) and spec[0] else ())
  return NamedSharding(mesh, P(first, *spec[1:]))


def train(
  make_tx, mesh, manual: tuple, *, params_axes=None, explicit=False, host=False
):
  """STEPS steps of ``make_tx()`` in a shard_map whose manual axes are
  ``manual``: the data as concatenated ``P(manual)`` blocks, the params as
  concatenated ``P(params_axes)`` blocks (default: all of ``manual``; e.g.
  ``("island",)`` for params replicated over "data"), every state leaf as
  ``shardopt.state_specs`` says, and the model axis (if the mesh has one)
  sharding the params as MODEL_SPECS. Returns (params per step as numpy with
  a leading replica axis, the compiled step's HLO, the state after the last
  step). ``host``: each step runs the program ``shardopt.due`` picks
  (``tx.update(..., sync=...)``), one compiled step per value."""
  tx = make_tx()
  params_axes = tuple(manual if params_axes is None else params_axes)
  replicas = int(np.prod([mesh.shape[a] for a in params_axes]))
  batch_replicas = int(np.prod([mesh.shape[a] for a in manual]))
  p0 = params0()
  stack = P(params_axes)
  with jax.set_mesh(mesh):
    params = {
      k: jax.device_put(
        np.concatenate([v] * replicas),
        stacked_sharding(mesh, params_axes, MODEL_SPECS[k]),
      )
      for k, v in p0.items()
    }
    local = {
      k: jax.ShapeDtypeStruct(
        v.shape,
        v.dtype,
        sharding=NamedSharding(mesh, only_mesh_axes(MODEL_SPECS[k], mesh)),
      )
      for k, v in p0.items()
    }
    specs = shardopt.state_specs(tx, local, manual, params_axes=params_axes)
    data = P(manual)
    # init from the replicated params (P(): every replica starts equal).
    init = jax.jit(
      jax.shard_map(
        tx.init,
        mesh=mesh,
        in_specs=P(),
        out_specs=specs,
        axis_names=set(manual),
      )
    )

    @functools.cache
    def step_for(sync):
      kw = {} if sync is None else {"sync": sync}

      def step(p, s, x, y):
        g = jax.grad(loss)(p, x, y, explicit)
        u, s = tx.update(g, s, p, **kw)
        return optax.apply_updates(p, u), s

      return jax.jit(
        jax.shard_map(
          step,
          mesh=mesh,
          in_specs=(stack, specs, P(manual), P(manual)),
          out_specs=(stack, specs),
          axis_names=set(manual),
        )
      )

    state = init(
      {
        k: jax.device_put(
          v, NamedSharding(mesh, only_mesh_axes(MODEL_SPECS[k], mesh))
        )
        for k, v in p0.items()
      }
    )
    xs, ys = batches(batch_replicas)
    data = NamedSharding(mesh, data)
    history = []
    hlo = None
    for t in range(STEPS):
      x, y = jax.device_put(xs[t], data), jax.device_put(ys[t], data)
      step = step_for(shardopt.due(tx, t + 1) if host else None)
      if hlo is None:
        hlo = step.lower(params, state, x, y).compile().as_text()
      params, state = step(params, state, x, y)
      jax.block_until_ready(params)
      history.append(
        {
          k: np.asarray(v).reshape((replicas,) + p0[k].shape)
          for k, v in params.items()
        }
      )
  return history, hlo, state


def only_mesh_axes(spec: P, mesh) -> P:
  """``spec`` without the axes ``mesh`` lacks (the data-only reference)."""
  axes = set(mesh.axis_names)
  return P(*(e if e in axes else None for e in spec))


# --- Which mesh axes each collective of a compiled step runs over. ---

_KINDS = (
  "all-reduce",
  "reduce-scatter",
  "all-gather",
  "all-to-all",
  "collective-permute",
)
_OPCODE = re.compile(
  r"=\s*(?P<result>.+?)\s+(?P<kind>"
  + "|".join(_KINDS)
  + r")(?:-start)?\((?P<rest>.*)$"
)
_ARRAY = re.compile(r"\b[a-z][a-z0-9]*\[([\d,]*)\]")
_TYPED_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s32": 4}


def _iota(dims_text: str, perm_text: str | None) -> np.ndarray:
  dims = [int(d) for d in dims_text.split(",")]
  ids = np.arange(int(np.prod(dims))).reshape(dims)
  if perm_text:
    ids = ids.transpose([int(d) for d in perm_text.split(",")])
  return ids.reshape(-1)


def replica_groups(line: str, num_devices: int) -> list[list[int]]:
  """The replica groups of one compiled-HLO collective, in any of the three
  spellings XLA prints: explicit lists, iota (``[G,S]<=[dims]T(perm)``) and
  mesh axes (``mesh['axis_0'=a,...] {'axis_k'}``); for a collective-permute,
  its ``source_target_pairs``, each pair a group."""
  m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
  if m:
    return [
      [int(i) for i in g.split(",") if i]
      for g in re.findall(r"\{([\d,]*)\}", m.group(1))
    ]
  m = re.search(
    r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line
  )
  if m:
    ids = _iota(m.group(3), m.group(4))
    return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
  m = re.search(
    r"replica_groups=mesh\[([^\]]*)\]"
    r"(?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? \{([^}]*)\}",
    line,
  )
  if m:
    axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
    names = [a for a, _ in axes]
    shape = [int(s) for _, s in axes]
    ids = (
      _iota(m.group(2), m.group(3))
      if m.group(2)
      else np.arange(int(np.prod(shape)))
    ).reshape(shape)
    over = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(4))]
    keep = [i for i in range(len(shape)) if i not in over]
    moved = ids.transpose(keep + over)
    size = int(np.prod([shape[i] for i in over])) if over else 1
    return moved.reshape(-1, size).tolist()
  m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
  if m:  # a collective-permute: each (source, target) pair is a group
    return [
      [int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))
    ]
  return [list(range(num_devices))]


def collectives(hlo: str, mesh) -> list[dict]:
  """Every collective instruction of ``hlo`` with the mesh axes it spans
  (the axes along which its group members differ) and its largest array
  (elements) and the bytes of its result on one device, e.g.
  ``{"kind": "all-reduce", "axes": {"data"}, "elems": 256, "bytes": 1028}``.
  Device ids are positions in ``mesh.devices`` (global device ids)."""
  shape = mesh.devices.shape
  found = []
  for line in hlo.splitlines():
    m = _OPCODE.search(line)
    if not m or "-done(" in line:
      continue
    groups = replica_groups(line, mesh.devices.size)
    axes = set()
    for group in groups:
      coords = np.array([np.unravel_index(i, shape) for i in group])
      for dim, name in enumerate(mesh.axis_names):
        if len(set(coords[:, dim])) > 1:
          axes.add(name)
    elems = [
      int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
      for dims in _ARRAY.findall(
        m.group("result") + " " + m.group("rest").split("),")[0]
      )
    ]
    result_bytes = sum(
      _DTYPE_BYTES.get(dtype, 4)
      * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
      for dtype, dims in _TYPED_ARRAY.findall(m.group("result"))
    )
    found.append(
      {
        "kind": m.group("kind"),
        "bytes": result_bytes,
        "axes": frozenset(axes),
        "elems": max(elems or [0]),
        "line": line.strip(),
      }
    )
  return found
