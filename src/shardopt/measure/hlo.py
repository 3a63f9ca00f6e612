"""What crosses the wire, read from a compiled step's HLO.

The measuring floor's reader of collectives, below
:func:`shardopt.measure.traffic` (the public reader, which counts with it).
It is shardopt's one internal door for the benchmarks and the tests: they
import ``from shardopt.measure import hlo`` and use the names below, never a
private one; the names may change between releases (see
:mod:`shardopt.measure`).

Readers, one per text format:

* :func:`compiled_collectives` reads the compiled HLO text
  (``jax.jit(f).lower(*args).compile().as_text()``, or the same from
  ``jax.pmap``). It sees what XLA will actually run, after its passes have
  combined collectives, and knows whether each one sits in the entry
  computation or inside the branch of a ``conditional`` (``lax.cond``) or the
  body of a ``while`` loop, following ``calls=``/``to_apply=``/
  ``branch_computations=`` references transitively. Each
  :class:`HloCollective` has its kind, dtypes, element count, replica-group
  size and bytes. :func:`branch_collectives` lists them per branch of every
  conditional; :func:`by_branch` sums them per branch;
  :func:`copied_bytes` counts the ``copy`` instructions;
  :func:`instructions` lists every instruction.
* :func:`lowered_collectives` reads the lowered StableHLO
  (``jax.jit(f).lower(*args).as_text()``) and reports the dtype each
  collective was *asked* to move. XLA's CPU backend widens bfloat16
  all-reduces to float32 during optimisation, so the compiled HLO of a
  ``comm_dtype=jnp.bfloat16`` step shows float32 on this machine; the wire
  dtype on an accelerator is the one in the StableHLO.

Bytes: every collective is described by its *buffer*, the full-size array it
reduces or assembles: an all-reduce's operand, a reduce-scatter's operand
(``group size x`` its result), an all-gather's result (the gathered array),
an all-to-all's or a collective-permute's result. Two measures of it:

* :func:`sent_bytes`, what one member of a group of ``g`` sends in a
  bandwidth-optimal algorithm: a ring all-reduce ``2 (g - 1) / g`` of its
  buffer; a reduce-scatter, an all-gather or an all-to-all ``(g - 1) / g``;
  a collective-permute its whole buffer. ``g`` is each collective's own
  replica-group size (:attr:`HloCollective.group_size`).
* :func:`allreduce_equivalent_bytes`, the number to compare with
  "parameter bytes" for every method: all-reduce and collective-permute
  buffers count in full, reduce-scatter, all-gather and all-to-all buffers
  half (a reduce-scatter then an all-gather of the same buffer is one
  all-reduce; so is the quantized wire's all-to-all then all-gather of its
  narrow chunks). :func:`summarize` and :func:`by_branch` count this by
  default.

Bytes per step: one compiled training step holds every collective the
transform can ever run. Those at the top level run on every step, those in a
``conditional`` branch only on the steps that take it. A :class:`Schedule`
says which steps those are by asking the periodic engine's own schedule
(:func:`shardopt.periodic.schedules.firing`, :func:`fired`), and
:func:`per_step` and :func:`run_bytes` weight each branch by the steps that
run it.

Example (8 devices, e.g. ``XLA_FLAGS=--xla_force_host_platform_device_count=8``):
  >>> import jax, jax.numpy as jnp
  >>> from shardopt.measure import hlo
  >>> f = jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")
  >>> ops = hlo.compiled_collectives(f.lower(jnp.ones((8, 256))).compile().as_text())
  >>> [(op.kind, op.context, op.elements, op.buffer_bytes) for op in ops]
  [('all-reduce', 'top', 256, 1024)]
  >>> hlo.sent_bytes(ops[0])  # a ring: 2 (8 - 1) / 8 of 1024 bytes
  1792.0
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from collections.abc import Sequence
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from shardopt.periodic import schedules

DTYPE_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "s32": 4,
  "u32": 4,
  "s64": 8,
  "u64": 8,
  "f16": 2,
  "bf16": 2,
  "f32": 4,
  "f64": 8,
  "c64": 8,
  "c128": 16,
  "f8e4m3fn": 1,
  "f8e5m2": 1,
  "f8e4m3": 1,
  "f8e5m2fnuz": 1,
  "f8e4m3fnuz": 1,
  "f8e4m3b11fnuz": 1,
  "i1": 1,
  "i8": 1,
  "i16": 2,
  "i32": 4,
  "i64": 8,
  "ui8": 1,
  "ui16": 2,
  "ui32": 4,
  "ui64": 8,
}

# Compiled-HLO opcodes that move data between devices. "-done" halves of
# async pairs are skipped: the "-start" carries the shape.
COLLECTIVE_KINDS = (
  "all-reduce",
  "reduce-scatter",
  "all-gather",
  "collective-permute",
  "all-to-all",
)

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_INSTRUCTION = re.compile(
  r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s+([a-z][a-z0-9\-]*)\((.*)$"
)
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_SINGLE_REF = re.compile(
  r"\b(calls|to_apply|body|condition|true_computation|false_computation)"
  r"=%([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class HloCollective:
  """One collective instruction.

  Attributes:
    kind: ``all-reduce``, ``reduce-scatter``, ``all-gather``,
      ``collective-permute`` or ``all-to-all``.
    context: ``top`` (runs every call), ``conditional`` (inside a branch of a
      ``lax.cond``/``switch``), ``loop`` (inside a ``while`` body) or a
      ``+``-joined combination such as ``loop+conditional``.
    dtypes: the element types of the arrays it moves.
    result_bytes: bytes of its result on one device.
    buffer_bytes: bytes of the full-size buffer (see the module docstring).
    group_size: replicas per group (0 when the text does not say).
    elements: elements of the full-size buffer (summed over the arrays of a
      combined collective, whatever their dtypes).
    op_name: JAX's name for the operation that produced it (metadata).
    branch: the outermost ``conditional`` branch it sits in, as
      ``"<conditional instruction>#<branch index>"`` (``lax.cond(pred, t, f)``
      compiles to branch 0 = ``f``, 1 = ``t``); ``""`` outside any
      conditional. Collectives of the same branch run together, on the steps
      that take it: see :func:`by_branch`.
  """

  kind: str
  context: str
  dtypes: tuple
  result_bytes: int
  buffer_bytes: int
  group_size: int
  op_name: str = ""
  branch: str = ""
  elements: int = 0


def _array_bytes(shape_text: str) -> tuple[int, tuple, list, list]:
  """Total bytes, dtypes, per-array byte sizes and per-array element counts
  of an HLO shape text (arrays of a dtype not in :data:`DTYPE_BYTES`, such
  as tokens, are left out)."""
  sizes, dtypes, counts = [], [], []
  for dtype, dims in _ARRAY.findall(shape_text):
    if dtype not in DTYPE_BYTES:
      continue
    count = 1
    for d in filter(None, dims.split(",")):
      count *= int(d)
    sizes.append(count * DTYPE_BYTES[dtype])
    dtypes.append(dtype)
    counts.append(count)
  return sum(sizes), tuple(sorted(set(dtypes))), sizes, counts


def _group_size(attrs: str, default: int) -> int:
  match = _GROUPS_LIST.search(attrs)
  if match:
    first = match.group(1).split("}")[0].strip("{")
    return len([i for i in first.split(",") if i])
  match = _GROUPS_IOTA.search(attrs)
  if match:
    return int(match.group(2))
  return default


def _buffer(
  kind: str, sizes: list, counts: list, group: int, is_start: bool
) -> tuple[int, int]:
  """``(bytes, elements)`` of a collective's full-size buffer, from the byte
  sizes and element counts of the arrays of its result."""
  if (
    is_start
    and kind in ("all-gather", "collective-permute")
    and len(sizes) >= 2
  ):
    # Async start ops return (operands..., results...): keep the results.
    sizes, counts = sizes[len(sizes) // 2 :], counts[len(counts) // 2 :]
  scale = max(group, 1) if kind == "reduce-scatter" else 1
  return sum(sizes) * scale, sum(counts) * scale


def _computations(
  hlo_text: str, caller: str
) -> tuple[dict[str, list[str]], str]:
  """``({computation name: instruction lines}, entry name)`` of compiled HLO."""
  computations: dict[str, list[str]] = {}
  entry = None
  current = None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      current = header.group(2)
      computations[current] = []
      if header.group(1):
        entry = current
      continue
    if current is not None:
      if line.strip() == "}":
        current = None
      else:
        computations[current].append(line)
  if entry is None:
    raise ValueError(
      f"{caller}: no ENTRY computation in the text;"
      " pass Compiled.as_text(), not the lowered StableHLO."
    )
  return computations, entry


def _edges(computations: dict) -> dict:
  """``{caller: [(callee, "loop" | "conditional" | None, branch label)]}``.

  The label of a conditional branch is ``"<instruction>#<branch index>"``
  (``lax.cond(pred, t, f)``: 0 = ``f``, 1 = ``t``); ``""`` for other calls.
  """
  edges: dict[str, list[tuple[str, str | None, str]]] = defaultdict(list)
  for name, lines in computations.items():
    for line in lines:
      inst = _INSTRUCTION.match(line)
      inst_name = inst.group(1) if inst else "?"
      for key, target in _SINGLE_REF.findall(line):
        marker = {
          "body": "loop",
          "condition": "loop",
          "true_computation": "conditional",
          "false_computation": "conditional",
        }.get(key)
        label = {
          "true_computation": f"{inst_name}#1",
          "false_computation": f"{inst_name}#0",
        }.get(key, "")
        edges[name].append((target, marker, label))
      for group in _BRANCHES.findall(line):
        for index, target in enumerate(re.findall(r"%([\w.\-]+)", group)):
          edges[name].append((target, "conditional", f"{inst_name}#{index}"))
  return edges


def _walk(hlo_text: str, caller: str) -> list[tuple[str, str, list[str]]]:
  """``(context, outermost branch, instruction lines)`` per reachable computation.

  ``context`` and the branch are as in :class:`HloCollective` (``|``-joined when
  a computation is reached in several).
  """
  computations, entry = _computations(hlo_text, caller)
  edges = _edges(computations)
  # Which contexts (and outermost conditional branches) each computation is
  # reached in, from ENTRY.
  contexts: dict[str, set] = defaultdict(set)
  branches: dict[str, set] = defaultdict(set)
  seen = set()
  stack = [(entry, (), "")]
  while stack:
    name, markers, branch = stack.pop()
    key = "+".join(markers) or "top"
    if (name, key, branch) in seen:
      continue
    seen.add((name, key, branch))
    contexts[name].add(key)
    branches[name].add(branch)
    for target, marker, label in edges.get(name, ()):
      nxt = (
        markers if marker is None or marker in markers else markers + (marker,)
      )
      stack.append((target, nxt, branch or label))

  return [
    (
      "|".join(sorted(contexts[name])),
      "|".join(sorted(b for b in branches[name] if b)),
      lines,
    )
    for name, lines in computations.items()
    if name in contexts
  ]


def _collective(
  line: str, context: str, num_devices: int, branch: str = ""
) -> HloCollective | None:
  """The :class:`HloCollective` an HLO instruction line runs, or None."""
  inst = _INSTRUCTION.match(line)
  if not inst:
    return None
  opcode = inst.group(3)
  is_start = opcode.endswith("-start")
  kind = opcode[: -len("-start")] if is_start else opcode
  if kind not in COLLECTIVE_KINDS:
    return None
  result_bytes, dtypes, sizes, counts = _array_bytes(inst.group(2))
  group = _group_size(inst.group(4), num_devices)
  buffer_bytes, elements = _buffer(kind, sizes, counts, group, is_start)
  op_name = _OP_NAME.search(line)
  return HloCollective(
    kind=kind,
    context=context,
    dtypes=dtypes,
    result_bytes=result_bytes,
    buffer_bytes=buffer_bytes,
    group_size=group,
    op_name=op_name.group(1) if op_name else "",
    branch=branch,
    elements=elements,
  )


def compiled_collectives(
  hlo_text: str, *, num_devices: int = 0
) -> list[HloCollective]:
  """Lists the collectives in compiled HLO text, with their context and bytes.

  Args:
    hlo_text: ``Compiled.as_text()`` of a jitted or pmapped function.
    num_devices: group size to assume when an instruction names no groups.

  Returns:
    One :class:`HloCollective` per collective instruction, in text order.
  """
  found = []
  for where, branch, lines in _walk(hlo_text, "compiled_collectives"):
    for line in lines:
      op = _collective(line, where, num_devices, branch)
      if op is not None:
        found.append(op)
  return found


def branch_collectives(
  hlo_text: str, *, num_devices: int = 0, outermost: bool = False
) -> list[list[list[HloCollective]]]:
  """The collectives of every branch of every ``conditional``, in text order.

  ``lax.cond``/``lax.switch`` compile to a ``conditional`` whose branches are
  indexed as in ``switch`` (a ``cond`` is ``[false branch, true branch]``).
  Each branch lists what it runs, following calls into its sub-computations
  (context ``"branch"``). With ``outermost``, only the conditionals that do
  not sit inside another conditional's branch (a nested one's collectives
  are listed in the branch that holds it).

  Returns:
    ``[conditional][branch] -> [HloCollective, ...]``.
  """
  computations, _ = _computations(hlo_text, "branch_collectives")
  edges = _edges(computations)

  def reachable(root: str) -> list[HloCollective]:
    seen, stack, found = set(), [root], []
    while stack:
      name = stack.pop()
      if name in seen or name not in computations:
        continue
      seen.add(name)
      for line in computations[name]:
        op = _collective(line, "branch", num_devices)
        if op is not None:
          found.append(op)
      stack.extend(target for target, _, _ in edges.get(name, ()))
    return found

  inside = set()  # computations reached from some conditional's branch
  for name in computations:
    for target, marker, _ in edges.get(name, ()):
      if marker == "conditional":
        stack = [target]
        while stack:
          callee = stack.pop()
          if callee not in inside:
            inside.add(callee)
            stack.extend(t for t, _, _ in edges.get(callee, ()))
  out = []
  for name, lines in computations.items():
    if outermost and name in inside:
      continue
    for line in lines:
      listed = _BRANCHES.search(line)
      if listed:
        out.append(
          [reachable(b) for b in re.findall(r"%([\w.\-]+)", listed.group(1))]
        )
      elif " conditional(" in line:
        refs = dict(_SINGLE_REF.findall(line))
        out.append(
          [
            reachable(refs["false_computation"]),
            reachable(refs["true_computation"]),
          ]
        )
  return out


def copied_bytes(hlo_text: str) -> dict:
  """Bytes written by ``copy`` instructions, by where they run.

  A copy moves a whole buffer in memory (no communication): what a step pays
  when XLA cannot alias an input to an output, for instance state passed
  through the untaken-work branch of a ``conditional``.

  Returns:
    ``{"top": bytes, "conditional": {branch label: bytes}}``: ``top`` runs
    every call; a branch's copies only on the calls that take it.
  """
  top, branches = 0, defaultdict(int)
  for _, branch, lines in _walk(hlo_text, "copied_bytes"):
    for line in lines:
      inst = _INSTRUCTION.match(line)
      if inst and inst.group(3) in ("copy", "copy-start"):
        size = _array_bytes(inst.group(2))[0]
        if inst.group(3) == "copy-start":
          size //= 2  # (operand, result, context): count the result once
        if branch:
          branches[branch] += size
        else:
          top += size
  return {"top": top, "conditional": dict(branches)}


_MLIR_OP = re.compile(
  r'"?stablehlo\.(all_reduce|reduce_scatter|all_gather|collective_permute|'
  r'all_to_all|collective_broadcast)"?'
)
_MLIR_SIGNATURE = re.compile(r":\s*\((tensor<[^)]*)\)\s*->\s*([^\n]*)")
_MLIR_GROUPS = re.compile(
  r"replica_groups\s*=\s*dense<[^>]*>\s*:\s*tensor<(\d+)x(\d+)x"
)
# MLIR spells float8 types in mixed case (f8E4M3FN); HLO in lower case.
_MLIR_TENSOR = re.compile(r"tensor<((?:\d+x)*)([a-zA-Z][a-zA-Z0-9]*)>")


def _mlir_bytes(types_text: str) -> tuple[int, tuple, list]:
  """Total bytes, dtypes (in HLO's spelling) and per-array element counts of
  MLIR tensor types."""
  sizes, dtypes, counts = [], [], []
  for dims, dtype in _MLIR_TENSOR.findall(types_text):
    dtype = dtype.lower()
    if dtype not in DTYPE_BYTES:
      continue
    count = 1
    for d in filter(None, dims.split("x")):
      count *= int(d)
    sizes.append(count * DTYPE_BYTES[dtype])
    counts.append(count)
    dtypes.append(
      {"i1": "pred", "i8": "s8", "i16": "s16", "i32": "s32", "i64": "s64"}.get(
        dtype, dtype
      )
    )
  return sum(sizes), tuple(sorted(set(dtypes))), counts


def lowered_collectives(
  stablehlo_text: str, *, num_devices: int = 0
) -> list[HloCollective]:
  """Lists the collectives in lowered StableHLO text, with their wire dtypes.

  The context is always ``"lowered"`` (this reader does not follow regions);
  use :func:`compiled_collectives` for where an op runs.

  Args:
    stablehlo_text: ``Lowered.as_text()`` of a jitted or pmapped function.
    num_devices: group size to assume when an op names no groups.

  Returns:
    One :class:`HloCollective` per collective op, in text order.
  """
  found = []
  for match in _MLIR_OP.finditer(stablehlo_text):
    kind = match.group(1).replace("_", "-")
    start = match.end()
    if kind in ("all-reduce", "reduce-scatter"):  # skip the reducer region
      close = stablehlo_text.find("})", start)
      start = close if close >= 0 else start
    signature = _MLIR_SIGNATURE.search(stablehlo_text, start)
    if signature is None:
      continue
    operand_bytes, dtypes, operand_counts = _mlir_bytes(signature.group(1))
    result_bytes, _, result_counts = _mlir_bytes(signature.group(2))
    groups = _MLIR_GROUPS.search(stablehlo_text, match.end(), signature.start())
    group = int(groups.group(2)) if groups else num_devices
    operand = kind in ("all-reduce", "reduce-scatter")
    buffer = operand_bytes if operand else result_bytes
    elements = sum(operand_counts if operand else result_counts)
    found.append(
      HloCollective(
        kind=kind,
        context="lowered",
        dtypes=dtypes,
        result_bytes=result_bytes,
        buffer_bytes=buffer,
        group_size=group,
        elements=elements,
      )
    )
  return found


def allreduce_equivalent_bytes(op: HloCollective) -> float:
  """``op``'s buffer in all-reduce-equivalent bytes (see the module docstring)."""
  weight = 1.0 if op.kind in ("all-reduce", "collective-permute") else 0.5
  return weight * op.buffer_bytes


def sent_bytes(op: HloCollective, num_devices: int = 8) -> float:
  """Bytes one device sends for ``op`` in a bandwidth-optimal algorithm, in
  its own groups of ``g`` (``op.group_size``, or ``num_devices`` when the
  text does not say): a ring all-reduce ``2 (g - 1) / g`` of its buffer, a
  reduce-scatter, all-gather or all-to-all ``(g - 1) / g``, a
  collective-permute its buffer."""
  if op.kind == "collective-permute":
    return float(op.buffer_bytes)
  g = op.group_size or num_devices
  return 2 * allreduce_equivalent_bytes(op) * (g - 1) / g


def by_branch(collectives: list[HloCollective], measure=None) -> dict:
  """All-reduce-equivalent bytes of the top level and of each conditional branch.

  A step runs its ``top`` collectives every time and, for each conditional,
  the collectives of the one branch it takes. Which branch a step takes is
  the transform's schedule (:func:`per_step` turns the two into bytes per
  step).

  Returns:
    ``{"top": bytes, "branches": {label: {"bytes", "group_sizes", "count"}}}``
    with ``label`` the outermost branch (:attr:`HloCollective.branch`),
    ``group_sizes`` the sorted replica-group sizes of its collectives and
    ``count`` ``{kind: n}``. Branches without collectives are not listed.
    ``measure(op)`` gives an op's bytes (default
    :func:`allreduce_equivalent_bytes`; :func:`sent_bytes` for what a device
    sends).
  """
  measure = measure or allreduce_equivalent_bytes
  top = 0.0
  branches: dict = {}
  for op in collectives:
    if not op.branch:
      top += measure(op)
      continue
    entry = branches.setdefault(
      op.branch, {"bytes": 0.0, "group_sizes": set(), "count": defaultdict(int)}
    )
    entry["bytes"] += measure(op)
    entry["group_sizes"].add(op.group_size)
    entry["count"][op.kind] += 1
  return {
    "top": top,
    "branches": {
      label: {
        "bytes": e["bytes"],
        "group_sizes": sorted(e["group_sizes"]),
        "count": dict(e["count"]),
      }
      for label, e in branches.items()
    },
  }


def summarize(collectives: list[HloCollective]) -> dict:
  """Counts and bytes by kind and context, plus all-reduce-equivalent bytes.

  Returns:
    ``{"count": {context: {kind: n}}, "buffer_bytes": {context: {kind: bytes}},
    "allreduce_equivalent_bytes": {context: bytes}, "dtypes": [...]}``.
  """
  count: dict = defaultdict(lambda: defaultdict(int))
  buffer: dict = defaultdict(lambda: defaultdict(int))
  equivalent: dict = defaultdict(float)
  dtypes = set()
  for op in collectives:
    count[op.context][op.kind] += 1
    buffer[op.context][op.kind] += op.buffer_bytes
    equivalent[op.context] += allreduce_equivalent_bytes(op)
    dtypes.update(op.dtypes)
  return {
    "count": {c: dict(k) for c, k in count.items()},
    "buffer_bytes": {c: dict(k) for c, k in buffer.items()},
    "allreduce_equivalent_bytes": {c: int(b) for c, b in equivalent.items()},
    "dtypes": sorted(dtypes),
  }


def instructions(hlo_text: str) -> list[tuple[str, str]]:
  """``(opcode, result shape)`` of every instruction of compiled HLO text, in
  text order (shapes as HLO spells them, layouts included)."""
  out = []
  for line in hlo_text.splitlines():
    inst = _INSTRUCTION.match(line)
    if inst:
      out.append((inst.group(3), inst.group(2)))
  return out


# --------------------------------------------------------------------------
# Bytes per step: the branches weighted by the steps that take them.


class Schedule(NamedTuple):
  """Which ``conditional`` branches with collectives the steps of a transform
  take.

  Attributes:
    syncs: the periodic engine's schedule, as the transform builds it
      (:func:`shardopt.periodic.schedules.every` for ``local_sgd``, ``agn``,
      ``diloco`` and ``accumulate``'s emit step,
      :func:`~shardopt.periodic.schedules.hierarchy` for
      ``hierarchical_local_sgd``, :func:`~shardopt.periodic.schedules.streaming`
      for streaming DiLoCo). The engine runs sync ``k`` in its own ``lax.cond``,
      in schedule order, so the branches with collectives, in program order,
      are the syncs'. ``()``: a transform whose steps all run the same
      collectives (``cross_shard``, ``powersgd``, ``apply_if_finite``).
    warmup_steps: the periodic family's ``warmup_steps``: steps ``1..W`` take
      the warm-up's branch (the first in program order: the all-reduce of the
      mean gradient), and the syncs count from step ``W``.
    taken: without syncs, which branch with collectives a step takes:
      ``"max"`` (``apply_if_finite``: the finite branch, which runs the inner
      transform's collectives) or ``"min"`` (``powersgd`` after its warm-up:
      the compressed branch).
  """

  syncs: tuple = ()
  warmup_steps: int = 0
  taken: str = "max"

  @property
  def cycle_length(self) -> int:
    """Steps after which the schedule repeats (1 without syncs)."""
    return math.lcm(*(s.period for s in self.syncs)) if self.syncs else 1

  def describe(self) -> str:
    """In words, e.g. ``"once per 16 steps"``."""
    warm = (
      f"every step for {self.warmup_steps}, then " if self.warmup_steps else ""
    )
    if not self.syncs:
      return "every step"
    if any(s.states or not s.params for s in self.syncs):  # DES-LOC
      parts = {}
      for s in self.syncs:
        for part in ("params",) * s.params + tuple(s.states):
          parts[part] = min(parts.get(part, s.period), s.period)
      return warm + ", ".join(f"{p} every {k}" for p, k in parts.items())
    if any(s.group_size is not None for s in self.syncs):
      return "levels " + ", ".join(
        f"every {s.period}: groups of {s.group_size}" for s in self.syncs
      )
    if len(self.syncs) == 1:
      return f"{warm}once per {self.syncs[0].period} steps"
    if all(s.fragment == 0 for s in self.syncs):  # whole syncs in turn
      every = self.syncs[0].period // len(self.syncs)
      return f"{warm}once per {every} steps ({len(self.syncs)} syncs in turn)"
    return (
      f"{warm}{len(self.syncs)} fragments, each once per"
      f" {self.syncs[0].period} steps"
    )


def fired(schedule: Schedule, steps: Sequence[int]) -> np.ndarray:
  """Which sync runs in the update of each of ``steps`` (1-based local steps,
  as the transforms count): ``k`` for ``schedule.syncs[k - 1]``, 0 for none.

  The periodic engine's own answer
  (:func:`shardopt.periodic.schedules.firing`), not a copy of it.

  Example:
    >>> from shardopt.measure import hlo
    >>> from shardopt.periodic import schedules
    >>> every_4 = hlo.Schedule(schedules.every(4), warmup_steps=2)
    >>> hlo.fired(every_4, range(1, 11)).tolist()
    [0, 0, 0, 0, 0, 1, 0, 0, 0, 1]
  """
  steps = np.asarray(steps, np.int32)
  if not schedule.syncs:
    return np.zeros(steps.shape, np.int64)
  index = schedules.firing(
    jnp.asarray(steps), schedule.syncs, schedule.warmup_steps
  )
  return np.broadcast_to(np.asarray(index), steps.shape).astype(np.int64)


def _main_group_size(collectives: list, label: str) -> int:
  """Group size of the branch's largest collective (a flag may span more)."""
  ops = [op for op in collectives if op.branch == label]
  return max(ops, key=allreduce_equivalent_bytes).group_size


def _label_key(label: str) -> tuple:
  """Branch labels (``conditional.12#1``) in numeric order: one cond per
  sync, numbered in program order, so ``.9`` comes before ``.10``."""
  return tuple(int(n) for n in re.findall(r"\d+", label))


def branch_labels(collectives: list) -> list[str]:
  """The outermost ``conditional`` branches that hold collectives
  (:attr:`HloCollective.branch`), in program order: the order in which
  :func:`per_step` gives them to the warm-up and the syncs."""
  return sorted({op.branch for op in collectives if op.branch}, key=_label_key)


def _sync_bytes(
  collectives: list, schedule: Schedule, labels: list, sizes: dict
) -> tuple[list, str]:
  """Bytes of each sync's branch, and a warning if the HLO does not look
  like the schedule."""
  count = len(schedule.syncs)
  values = [sizes[label] for label in labels]
  if count == 1 or not values:
    return [float(sum(values))] * count, ""
  if len(values) == count:
    for sync, label in zip(schedule.syncs, labels, strict=True):
      found = _main_group_size(collectives, label)
      if sync.group_size is not None and found != sync.group_size:
        return values, (
          f"the branch {label} of a sync in groups of {sync.group_size}"
          f" runs in groups of {found}"
        )
    return values, ""
  warning = (
    f"expected {count} branches with collectives (one per sync), found"
    f" {len(values)}"
  )
  if len(values) == 1:  # one branch runs every sync
    return values * count, warning
  return [sum(values) / count] * count, warning


def per_step(collectives: list, schedule: Schedule, measure=None) -> dict:
  """Mean and peak bytes per step of a transform that runs on ``schedule``.

  Args:
    collectives: :func:`compiled_collectives` of ONE step.
    schedule: which branches the steps take (:class:`Schedule`).
    measure: an op's bytes (default :func:`allreduce_equivalent_bytes`;
      :func:`sent_bytes` for what a member sends).

  Returns:
    ``{"mean_bytes", "peak_bytes", "top_bytes", "cycle": [bytes of step
    W + t for t = 1..cycle length], "warmup_bytes": bytes of a warm-up step
    (0 without one), "sync_bytes": [bytes of sync k's branch], "quiet_bytes":
    bytes of a step no sync runs in, "branches": :func:`by_branch`'s
    branches, "warning"}``; ``warning`` is ``""`` unless the HLO does not
    look like the schedule (say, F fragments expected and a different number
    of branches found). The cycle, mean and peak are those of the steady
    state after the warm-up (a lagged sync runs in the first steps of every
    cycle but the first: :func:`run_bytes` counts a run's own steps).

  Example: a ``psum`` every step and one in a sync branch every 4 steps.
    >>> import jax, jax.numpy as jnp
    >>> from shardopt.measure import hlo
    >>> from shardopt.periodic import schedules
    >>> f = jax.pmap(lambda t, x: jax.lax.psum(x, "i") + jax.lax.cond(
    ...   t % 4 == 0, lambda: jax.lax.psum(x, "i"), lambda: x), axis_name="i")
    >>> text = f.lower(jnp.arange(8), jnp.ones((8, 256))).compile().as_text()
    >>> ops = hlo.compiled_collectives(text)
    >>> measured = hlo.per_step(ops, hlo.Schedule(schedules.every(4)))
    >>> measured["cycle"], measured["mean_bytes"], measured["peak_bytes"]
    ([1024.0, 1024.0, 1024.0, 2048.0], 1280.0, 2048.0)
  """
  split = by_branch(collectives, measure)
  top, branches = split["top"], split["branches"]
  labels = branch_labels(collectives)
  sizes = {label: branches[label]["bytes"] for label in labels}
  warning = ""
  warmup_bytes = 0.0
  if schedule.warmup_steps:
    if not labels:
      raise ValueError(
        f"per_step: warmup_steps={schedule.warmup_steps}, but the step has no"
        " conditional branch with collectives (the warm-up's all-reduce);"
        " pass the HLO of a transform built with warmup_steps, or"
        " Schedule(warmup_steps=0)."
      )
    first = labels.pop(0)
    warmup_bytes = top + sizes[first]
    if branches[first]["count"] != {"all-reduce": 1}:
      warning = (
        f"the warm-up's branch {first} is not one all-reduce:"
        f" {branches[first]['count']}"
      )
  if schedule.taken not in ("max", "min"):
    raise ValueError(
      f"per_step: Schedule(taken={schedule.taken!r}); use 'max' (the branch"
      " with the most bytes, apply_if_finite's) or 'min' (powersgd's)."
    )
  if schedule.syncs:
    quiet = top
    sync_bytes, mismatch = _sync_bytes(collectives, schedule, labels, sizes)
    warning = warning or mismatch
  else:
    pick = max if schedule.taken == "max" else min
    quiet = top + (pick(sizes[label] for label in labels) if labels else 0.0)
    sync_bytes = []
  # One cycle of the steady state: steps W + 1 + i, shifted by whole cycles
  # past the first lagged syncs (a cycle later, the same branches run).
  length = schedule.cycle_length
  lag = max((s.lag for s in schedule.syncs), default=0)
  first_step = schedule.warmup_steps + 1 + length * -(-lag // length)
  index = fired(schedule, np.arange(first_step, first_step + length))
  cycle = [quiet if k == 0 else top + sync_bytes[k - 1] for k in index]
  return {
    "mean_bytes": sum(cycle) / len(cycle),
    "peak_bytes": max(
      cycle + ([warmup_bytes] if schedule.warmup_steps else [])
    ),
    "top_bytes": top,
    "cycle": cycle,
    "warmup_bytes": warmup_bytes,
    "sync_bytes": sync_bytes,
    "quiet_bytes": quiet,
    "branches": branches,
    "warning": warning,
  }


def run_bytes(measured: dict, schedule: Schedule, steps: int) -> float:
  """Bytes of a run of ``steps`` steps: the warm-up's steps, then on every
  step the syncs the engine runs in it (:func:`fired`), from
  :func:`per_step`'s result ``measured``. A lagged sync of one of the last
  ``lag`` steps runs after the run and is not counted."""
  warm = min(schedule.warmup_steps, steps)
  top, quiet = measured["top_bytes"], measured["quiet_bytes"]
  sync_bytes = measured["sync_bytes"]
  total = warm * measured["warmup_bytes"]
  for k in fired(schedule, np.arange(warm + 1, steps + 1)):
    total += quiet if k == 0 else top + sync_bytes[k - 1]
  return total
