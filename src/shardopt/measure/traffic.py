"""The bytes a step sends, read from the compiled step: the reader behind
``make demo``'s table and the benchmarks' "MB sent".

:func:`~shardopt.measure.traffic` compiles a ``jax.jit``- or
``jax.pmap``-wrapped step for example arguments and reads the collectives
XLA will run (after its passes have combined them), then counts what one
replica *sends* for each in a bandwidth-optimal (ring) algorithm, within its
replica group of ``g``:

* an all-reduce of a ``B``-byte buffer: ``2 (g - 1) / g * B`` (reduce-scatter
  then all-gather, each member sends ``g - 1`` chunks of ``B / g`` twice);
* a reduce-scatter (of its ``B``-byte operand), an all-gather (of its
  ``B``-byte result) or an all-to-all: ``(g - 1) / g * B``;
* a collective-permute: its whole buffer.

A step of a periodic transform holds every collective it can ever run:
those outside any ``lax.cond`` run on every step, those inside a branch only
on the steps that take it. The transform's own schedule says which steps
those are (``tx``: ``diloco``, ``local_sgd``, ``agn`` and
``hierarchical_local_sgd`` carry it), so :class:`~shardopt.measure.Traffic` has
the bytes of a step on average and at its peak, of each sync, and of a run
of ``N`` steps.

The numbers are those of the compiled program on the backend that compiled
it. XLA's CPU backend widens some narrow floating collectives (bfloat16
runs in float32, float8 in float16; float16 stays), so on a CPU a
``comm_dtype=jnp.bfloat16`` step counts float32 bytes;
:attr:`~shardopt.measure.Traffic.wire_dtypes` lists the dtypes the program
asked for (from the lowered StableHLO), which are what an accelerator moves,
and :attr:`~shardopt.measure.Traffic.widened` those the compiled step does not
move. shardopt's quantized wires (``comm_dtype=jnp.int8``, ``jnp.int4``,
``jnp.float8_e4m3fn``, :func:`shardopt.topk`) travel as bytes (``uint8``)
and are counted exactly everywhere.

The parsing is ``shardopt.measure.hlo``'s, the schedule
``shardopt.periodic.schedules``' own: the demo and the benchmarks count
with the same code.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, NamedTuple

import jax

from shardopt.measure import hlo
from shardopt.periodic import schedules
from shardopt.periodic.engine import engine_of

_TRAFFIC = "shardopt.measure.traffic"

# HLO element types -> NumPy names (the rest are spelled alike).
_NUMPY_NAMES = {
  "pred": "bool",
  "i1": "bool",
  "bf16": "bfloat16",
  "f16": "float16",
  "f32": "float32",
  "f64": "float64",
  "c64": "complex64",
  "c128": "complex128",
  "f8e4m3fn": "float8_e4m3fn",
  "f8e5m2": "float8_e5m2",
  "f8e4m3": "float8_e4m3",
  "f8e5m2fnuz": "float8_e5m2fnuz",
  "f8e4m3fnuz": "float8_e4m3fnuz",
  "f8e4m3b11fnuz": "float8_e4m3b11_fnuz",
}


def _numpy_name(hlo_dtype: str) -> str:
  """``"f32"`` -> ``"float32"``, ``"s8"``/``"i8"`` -> ``"int8"``,
  ``"u8"``/``"ui8"`` -> ``"uint8"``."""
  if hlo_dtype in _NUMPY_NAMES:
    return _NUMPY_NAMES[hlo_dtype]
  match = re.fullmatch(r"(s|i|u|ui)(\d+)", hlo_dtype)
  if match:
    return ("uint" if match.group(1).startswith("u") else "int") + match.group(
      2
    )
  return hlo_dtype


class Collective(NamedTuple):
  """One collective of a compiled step, and what one replica sends for it.

  Attributes:
    kind: ``"all-reduce"``, ``"reduce-scatter"``, ``"all-gather"``,
      ``"all-to-all"`` or ``"collective-permute"``.
    dtypes: the element types it moves in the compiled program, as NumPy
      names (``("float32",)``; ``("uint8",)`` for a quantized wire). On a
      CPU a bfloat16 collective shows ``float32``: see
      :attr:`~shardopt.measure.Traffic.wire_dtypes`.
    elements: elements of its full-size buffer (summed over the arrays of a
      collective XLA combined from several).
    group_size: replicas per group.
    buffer_bytes: bytes of its full-size buffer: an all-reduce's or a
      reduce-scatter's operand, an all-gather's result (the gathered
      array), an all-to-all's or a collective-permute's result.
    sent_bytes: what one replica sends for it in a ring algorithm (see
      :func:`~shardopt.measure.traffic`).
    where: when it runs: ``"every step"`` (outside any ``lax.cond``),
      ``"warm-up"`` (the branch of the warm-up steps), ``"sync k"`` (the
      branch of the ``k``-th sync of the schedule, from 1), or ``"branch
      <conditional>#<index>"`` where the branches do not match the schedule
      (:attr:`~shardopt.measure.Traffic.warning` says how).
  """

  kind: str
  dtypes: tuple
  elements: int
  group_size: int
  buffer_bytes: int
  sent_bytes: float
  where: str


@dataclasses.dataclass(frozen=True)
class Traffic:
  """What one replica sends, per step and per run, for a compiled step.

  Built by :func:`~shardopt.measure.traffic`. Bytes are what one replica sends
  in a ring algorithm (:attr:`~shardopt.measure.Collective.sent_bytes`),
  summed over the collectives a step runs. ``print(t)`` shows
  :meth:`~shardopt.measure.Traffic.table`.

  Attributes:
    per_step: mean bytes per step over one cycle of the schedule, after any
      warm-up (for one sync every ``H`` steps: ``quiet_step + per_sync[0] /
      H``). The number to multiply by a long run's steps.
    peak_step: bytes of the busiest step (a sync step, or a warm-up step).
    quiet_step: bytes of a step that runs no sync: the collectives outside
      every ``lax.cond`` (0 for ``diloco``; the whole step for
      ``cross_shard``).
    per_sync: bytes of each sync's branch, in schedule order (one per
      fragment for streaming ``diloco``, one per level for
      ``hierarchical_local_sgd``); a step that runs sync ``k`` sends
      ``quiet_step + per_sync[k - 1]``. ``()`` without a schedule.
    warmup_step: bytes of one of the first ``warmup_steps`` steps (0
      without a warm-up).
    warmup_steps: the transform's ``warmup_steps`` (0 without).
    cycle: bytes of each step of one cycle of the schedule, after the
      warm-up (``(per_step,)`` without a schedule).
    schedule: the schedule in words (``"once per 16 steps"``, ``"every
      step"``).
    num_devices: replicas assumed where a collective names no groups.
    collectives: every :class:`~shardopt.measure.Collective` of the step, in
      program order.
    wire_dtypes: the dtypes the program asks its collectives to move, from
      the lowered StableHLO (NumPy names, sorted): what an accelerator
      moves. ``None`` when only the compiled step (or its HLO text) was
      given. Where it holds a dtype that
      :attr:`~shardopt.measure.Collective.dtypes` lack (``bfloat16`` against
      ``float32``), the compiling backend widened it: see
      :attr:`~shardopt.measure.Traffic.widened`.
    warning: ``""``, or how the step's branches do not look like the
      schedule (say two branches with collectives where the schedule has
      four fragments): the numbers are then a best guess.
  """

  per_step: float
  peak_step: float
  quiet_step: float
  per_sync: tuple
  warmup_step: float
  warmup_steps: int
  cycle: tuple
  schedule: str
  num_devices: int
  collectives: tuple
  wire_dtypes: tuple | None
  warning: str
  # What run() replays (set by traffic(), not a constructor argument).
  _schedule: Any = dataclasses.field(
    default=None, init=False, repr=False, compare=False
  )
  _measured: Any = dataclasses.field(
    default=None, init=False, repr=False, compare=False
  )

  def run(self, steps: int) -> float:
    """Bytes one replica sends over a run of ``steps`` steps from the
    transform's initial state: the warm-up's steps, then on every step the
    sync the schedule runs in it (none, or one). A sync that a streaming
    ``diloco`` with overlap runs one step late is counted on the step it
    runs in, so one due in the run's last step is not."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
      raise ValueError(
        f"{_TRAFFIC}: Traffic.run(steps={steps!r}); pass the number of"
        " training steps, a non-negative int (e.g. 1000)."
      )
    return float(hlo.run_bytes(self._measured, self._schedule, steps))

  @property
  def widened(self) -> tuple:
    """The dtypes the program asks for on the wire (``wire_dtypes``) that
    the compiled collectives do not move, e.g. ``("bfloat16",)`` on a CPU,
    which runs a bfloat16 all-reduce in float32 (and float8 in float16):
    the bytes counted here are then more than an accelerator sends. ``()``
    when nothing was widened or the StableHLO was not read."""
    compiled = {d for op in self.collectives for d in op.dtypes}
    return tuple(d for d in self.wire_dtypes or () if d not in compiled)

  def table(self) -> str:
    """A readable summary: the bytes per step, per sync and per
    collective."""
    head = (
      f"Bytes one replica sends ({self.num_devices} devices, ring"
      f" algorithms); schedule: {self.schedule}"
    )
    rows = [("per step (mean)", self.per_step), ("peak step", self.peak_step)]
    rows.append(("quiet step", self.quiet_step))
    if self.warmup_steps:
      rows.append((f"warm-up step (1..{self.warmup_steps})", self.warmup_step))
    rows += [(f"sync {k}", b) for k, b in enumerate(self.per_sync, 1)]
    width = max(len(name) for name, _ in rows)
    lines = [head]
    lines += [f"  {name:<{width}}  {_bytes(b):>14}" for name, b in rows]
    columns = ("where", "kind", "dtypes", "elements", "group", "sent bytes")
    cells = [
      (
        op.where,
        op.kind,
        ",".join(op.dtypes),
        f"{op.elements:,}",
        str(op.group_size),
        _bytes(op.sent_bytes),
      )
      for op in self.collectives
    ]
    if cells:
      widths = [
        max(len(c) for c in col) for col in zip(columns, *cells, strict=True)
      ]
      lines.append("  collectives:")
      for row in [columns, *cells]:
        lines.append(
          "    "
          + "  ".join(
            c.ljust(w) if i < 3 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
          ).rstrip()
        )
    else:
      lines.append("  collectives: none")
    if self.widened:
      lines.append(
        f"  note: the program asks for {', '.join(self.widened)} on the"
        " wire, which this backend widened: an accelerator sends fewer"
        " bytes than counted here."
      )
    if self.warning:
      lines.append(f"  warning: {self.warning}")
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.table()


def _bytes(value: float) -> str:
  return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.1f}"


def _texts(step: Any, example_args: tuple) -> tuple[str, str | None]:
  """``(compiled HLO text, lowered StableHLO text or None)`` of ``step``."""
  given = type(step).__name__
  if isinstance(step, (str, jax.stages.Compiled, jax.stages.Lowered)):
    if example_args:
      raise TypeError(
        f"{_TRAFFIC}: got a {given} and {len(example_args)} example"
        " argument(s); a lowered or compiled step (or its HLO text) is"
        " already built for its arguments: pass it alone, or pass the"
        " jitted function with the arguments."
      )
  if isinstance(step, str):
    if "ENTRY" not in step:
      raise ValueError(
        f"{_TRAFFIC}: the text has no ENTRY computation, so it is not"
        " compiled HLO (lowered StableHLO cannot say which collectives XLA"
        " runs, nor in which lax.cond branch). Pass"
        " jax.jit(f).lower(*args).compile().as_text(), or the jitted"
        " function and its arguments."
      )
    return step, None
  if isinstance(step, jax.stages.Compiled):
    return step.as_text(), None
  if isinstance(step, jax.stages.Lowered):
    lowered = step
  elif callable(getattr(step, "lower", None)):
    lowered = step.lower(*example_args)
  else:
    raise TypeError(
      f"{_TRAFFIC}: expected a jax.jit- or jax.pmap-wrapped step (or its"
      f" jax.stages.Lowered / Compiled, or compiled HLO text), got {given}"
      f" {step!r}. Wrap it: traffic(jax.jit(step), *args) (with"
      " jax.shard_map inside), or traffic(jax.pmap(step, axis_name=...),"
      " *args)."
    )
  return lowered.compile().as_text(), lowered.as_text()


def _num_devices(hlo_text: str) -> int:
  """Replicas x partitions from the ``HloModule`` header, else every
  device JAX sees."""
  header = hlo_text.split("\n", 1)[0]
  counts = [
    int(n)
    for n in re.findall(r"\b(?:replica_count|num_partitions)=(\d+)", header)
  ]
  total = 1
  for n in counts:
    total *= n
  return total if counts else jax.device_count()


def _maker(tx: Any) -> str:
  """``"accumulate"`` for ``shardopt.accumulate(...)``'s transform."""
  update = getattr(tx, "update", None)
  name = getattr(update, "__qualname__", "") or type(tx).__name__
  return name.split(".<locals>")[0]


def _schedule(tx: Any, sync_period: Any, ops: list) -> hlo.Schedule:
  """Which steps take the step's ``lax.cond`` branches with collectives."""
  branches = hlo.branch_labels(ops)
  if tx is not None and sync_period is not None:
    raise ValueError(
      f"{_TRAFFIC}: pass tx or sync_period, not both; tx={_maker(tx)}'s"
      " schedule already says when its syncs run."
    )
  if sync_period is not None:
    if (
      isinstance(sync_period, bool)
      or not isinstance(sync_period, int)
      or sync_period < 1
    ):
      raise ValueError(
        f"{_TRAFFIC}: sync_period={sync_period!r} must be a positive int:"
        " the step's lax.cond branches run once every sync_period steps"
        " (e.g. 4 for shardopt.accumulate(inner, 4))."
      )
    return hlo.Schedule(schedules.every(sync_period))
  if tx is not None and not callable(getattr(tx, "update", None)):
    raise TypeError(
      f"{_TRAFFIC}: tx={tx!r} is not an optax GradientTransformation; pass"
      " the transform the step runs (its schedule says when its syncs run),"
      " or leave tx out."
    )
  engine = engine_of(tx)
  if engine is not None:
    return hlo.Schedule(tuple(engine.syncs), engine.warmup_steps)
  if branches:
    given = (
      "no tx says" if tx is None else f"tx (built by {_maker(tx)}) does not say"
    )
    raise ValueError(
      f"{_TRAFFIC}: the step runs collectives inside {len(branches)}"
      f" lax.cond branch(es) ({', '.join(branches)}), and {given}"
      " on which steps they run. Pass tx= the periodic transform"
      " itself (shardopt.diloco, local_sgd, agn or hierarchical_local_sgd,"
      " not wrapped in optax.chain or apply_if_finite), whose schedule"
      " says; or sync_period=k if they run once every k steps"
      " (shardopt.accumulate(inner, k): sync_period=k)."
    )
  return hlo.Schedule()


def _where(ops: list, schedule: hlo.Schedule) -> dict:
  """``{branch label: "warm-up" | "sync k" | "branch <label>"}``, as
  ``shardopt.measure.hlo.per_step`` assigns the branches to the schedule."""
  labels = hlo.branch_labels(ops)
  names = {"": "every step"}
  if schedule.warmup_steps and labels:
    names[labels.pop(0)] = "warm-up"
  count = len(schedule.syncs)
  for k, label in enumerate(labels, 1):
    if count == 1:
      names[label] = "sync 1"
    elif len(labels) == count:
      names[label] = f"sync {k}"
    else:
      names[label] = f"branch {label}"
  return names


def traffic(
  step: Any,
  *example_args: Any,
  tx: Any = None,
  sync_period: int | None = None,
  num_devices: int | None = None,
) -> Traffic:
  """Reads what one replica sends, per step and per run, for a compiled step.

  The reader ``make demo`` counts its table with: it compiles ``step`` for
  ``example_args`` (as ``step.lower(*example_args).compile()``; nothing
  runs), lists the collectives of the compiled program, counts what one
  replica sends for each in a ring algorithm, and weights the collectives
  inside ``lax.cond`` branches by the steps that take them.

  Args:
    step: a ``jax.jit``-wrapped step (with ``jax.shard_map`` inside) or a
      ``jax.pmap``-wrapped one, called as ``step(*example_args)``; or a
      ``jax.stages.Lowered`` / ``jax.stages.Compiled`` of one, or the
      compiled HLO text (``Compiled.as_text()``), each without arguments.
    *example_args: arguments the step is compiled for (arrays, or
      ``jax.ShapeDtypeStruct`` with the shardings a jitted step needs).
    tx: the transform the step runs, whose schedule says on which steps
      its ``lax.cond`` branches run: ``shardopt.diloco``, ``local_sgd``,
      ``agn`` or ``hierarchical_local_sgd`` (with their ``warmup_steps``,
      fragments, overlap and groups). Any other transform (or None) is
      taken to run every collective on every step; a step whose
      collectives sit in ``lax.cond`` branches then raises, unless
      ``sync_period`` says when they run.
    sync_period: instead of ``tx``, for a step whose ``lax.cond`` branches
      with collectives run once every ``sync_period`` steps, at steps
      ``sync_period, 2 sync_period, ...`` (``shardopt.accumulate(inner,
      k)``'s emit step: ``sync_period=k``).
    num_devices: the group size of a collective that names no replica
      groups; default: the replicas and partitions the step was compiled
      for.

  Returns:
    A :class:`~shardopt.measure.Traffic`: ``per_step``, ``peak_step``,
    ``per_sync``, ``collectives``, ``run(steps)`` and a printable
    ``table()``.

  Raises:
    ValueError: for collectives in ``lax.cond`` branches that neither
      ``tx`` nor ``sync_period`` schedules, or bad ``sync_period`` /
      HLO text.
    TypeError: for a ``step`` that is neither jitted, pmapped, lowered,
      compiled nor HLO text, or a ``tx`` that is not a transform.

  Example: a pmapped ``psum`` of 256 float32 (1,024 bytes) over 8 devices;
  a ring all-reduce sends ``2 (8 - 1) / 8`` of the buffer from each
  replica:

    >>> import jax, jax.numpy as jnp, shardopt
    >>> step = jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")
    >>> t = shardopt.measure.traffic(step, jnp.ones((8, 256)))
    >>> t.per_step, t.peak_step, t.run(10)
    (1792.0, 1792.0, 17920.0)
    >>> op = t.collectives[0]
    >>> op.kind, op.dtypes, op.buffer_bytes, op.sent_bytes, op.where
    ('all-reduce', ('float32',), 1024, 1792.0, 'every step')

  A ``psum`` that runs once every 4 steps, in a ``lax.cond`` branch (how
  ``shardopt.accumulate(inner, 4)`` and the periodic transforms
  communicate):

    >>> step = jax.pmap(lambda t, x: jax.lax.cond(
    ...     t % 4 == 0, lambda: jax.lax.psum(x, "i"), lambda: x),
    ...     axis_name="i")
    >>> t = shardopt.measure.traffic(
    ...     step, jnp.arange(8), jnp.ones((8, 256)), sync_period=4)
    >>> t.per_sync, t.cycle, t.per_step, t.run(10)
    ((1792.0,), (0.0, 0.0, 0.0, 1792.0), 448.0, 3584.0)
    >>> print(t)  # doctest: +NORMALIZE_WHITESPACE
    Bytes one replica sends (8 devices, ring algorithms); schedule: once per
    4 steps
      per step (mean)             448
      peak step                 1,792
      quiet step                    0
      sync 1                    1,792
      collectives:
        where   kind        dtypes   elements  group  sent bytes
        sync 1  all-reduce  float32       256      8       1,792
  """
  if num_devices is not None and (
    isinstance(num_devices, bool)
    or not isinstance(num_devices, int)
    or num_devices < 1
  ):
    raise ValueError(
      f"{_TRAFFIC}: num_devices={num_devices!r} must be a positive int (the"
      " replicas of a collective that names no groups) or None."
    )
  compiled_text, stablehlo = _texts(step, example_args)
  devices = num_devices or _num_devices(compiled_text)
  ops = hlo.compiled_collectives(compiled_text, num_devices=devices)
  schedule = _schedule(tx, sync_period, ops)
  sent = functools.partial(hlo.sent_bytes, num_devices=devices)
  measured = hlo.per_step(ops, schedule, measure=sent)
  warning = measured["warning"]
  if schedule.syncs and not any(op.branch for op in ops):
    warning = warning or (
      "the schedule has syncs, but the step runs no collective inside a"
      " lax.cond branch: is it the step of this tx?"
    )
  where = _where(ops, schedule)
  wire_dtypes = None
  if stablehlo is not None:
    wire_dtypes = tuple(
      sorted(
        {
          _numpy_name(d)
          for op in hlo.lowered_collectives(stablehlo, num_devices=devices)
          for d in op.dtypes
        }
      )
    )
  result = Traffic(
    per_step=float(measured["mean_bytes"]),
    peak_step=float(measured["peak_bytes"]),
    quiet_step=float(measured["quiet_bytes"]),
    per_sync=tuple(float(b) for b in measured["sync_bytes"]),
    warmup_step=float(measured["warmup_bytes"]),
    warmup_steps=schedule.warmup_steps,
    cycle=tuple(float(b) for b in measured["cycle"]),
    schedule=schedule.describe(),
    num_devices=devices,
    collectives=tuple(
      Collective(
        kind=op.kind,
        dtypes=tuple(_numpy_name(d) for d in op.dtypes),
        elements=op.elements,
        group_size=op.group_size or devices,
        buffer_bytes=op.buffer_bytes,
        sent_bytes=float(sent(op)),
        where=where.get(op.branch, f"branch {op.branch}"),
      )
      for op in ops
    ),
    wire_dtypes=wire_dtypes,
    warning=warning,
  )
  object.__setattr__(result, "_schedule", schedule)  # frozen: set once here
  object.__setattr__(result, "_measured", measured)
  return result
