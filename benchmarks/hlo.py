"""Count the collectives in a compiled step: kinds, bytes, and where they sit.

Two readers, one per text format:

* :func:`compiled_collectives` reads the compiled HLO text
  (``jax.jit(f).lower(*args).compile().as_text()``, or the same from
  ``jax.pmap``). It sees what XLA will actually run, after its passes have
  combined collectives, and knows whether each one sits in the entry
  computation or inside the branch of a ``conditional`` (``lax.cond``) or the
  body of a ``while`` loop, following ``calls=``/``to_apply=``/
  ``branch_computations=`` references transitively.
* :func:`lowered_collectives` reads the lowered StableHLO
  (``jax.jit(f).lower(*args).as_text()``) and reports the dtype each
  collective was *asked* to move. XLA's CPU backend widens bfloat16
  all-reduces to float32 during optimisation, so the compiled HLO of a
  ``comm_dtype=jnp.bfloat16`` step shows float32 on this machine; the wire
  dtype on an accelerator is the one in the StableHLO.

Bytes: every collective is described by its *buffer*, the full-size array it
reduces or assembles: an all-reduce's operand, a reduce-scatter's operand
(``group size x`` its result) and an all-gather's result. A ring all-reduce of
a buffer of ``B`` bytes moves ``2 (n - 1) / n * B`` bytes per device; a
reduce-scatter or an all-gather of the same buffer moves half of that. So
:func:`summarize` reports ``allreduce_equivalent_bytes`` = all-reduce buffers +
(reduce-scatter + all-gather buffers) / 2: the number to compare with
"parameter bytes" for every method.

An all-to-all of a buffer of ``B`` bytes moves ``(n - 1) / n * B`` per
device, as a reduce-scatter does, so it counts half (the quantized wire's
two-phase reduction, an all-to-all then an all-gather of the narrow chunks,
is one all-reduce of its buffer). Collective-permutes count in full.
:func:`sent_bytes` gives what a device actually sends, with each
collective's own group size.

Example (8 devices, e.g. ``XLA_FLAGS=--xla_force_host_platform_device_count=8``):
  >>> import jax, jax.numpy as jnp
  >>> from benchmarks import hlo
  >>> f = jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")
  >>> ops = hlo.compiled_collectives(f.lower(jnp.ones((8, 256))).compile().as_text())
  >>> [(op.kind, op.context, op.buffer_bytes) for op in ops]
  [('all-reduce', 'top', 1024)]
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

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
class Collective:
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


def _array_bytes(shape_text: str) -> tuple[int, tuple, list]:
  """Total bytes, dtypes and per-array byte sizes of an HLO/MLIR shape text."""
  sizes, dtypes = [], []
  for dtype, dims in _ARRAY.findall(shape_text):
    if dtype not in DTYPE_BYTES:
      continue
    count = 1
    for d in filter(None, dims.split(",")):
      count *= int(d)
    sizes.append(count * DTYPE_BYTES[dtype])
    dtypes.append(dtype)
  return sum(sizes), tuple(sorted(set(dtypes))), sizes


def _group_size(attrs: str, default: int) -> int:
  match = _GROUPS_LIST.search(attrs)
  if match:
    first = match.group(1).split("}")[0].strip("{")
    return len([i for i in first.split(",") if i])
  match = _GROUPS_IOTA.search(attrs)
  if match:
    return int(match.group(2))
  return default


def _buffer_bytes(
  kind: str, result_bytes: int, sizes: list, group: int, is_start: bool
) -> int:
  if (
    is_start
    and kind in ("all-gather", "collective-permute")
    and len(sizes) >= 2
  ):
    # Async start ops return (operands..., results...): keep the results.
    result_bytes = sum(sizes[len(sizes) // 2 :])
  if kind == "reduce-scatter":
    return result_bytes * max(group, 1)
  return result_bytes


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

  ``context`` and the branch are as in :class:`Collective` (``|``-joined when
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
) -> Collective | None:
  """The :class:`Collective` an HLO instruction line runs, or None."""
  inst = _INSTRUCTION.match(line)
  if not inst:
    return None
  opcode = inst.group(3)
  is_start = opcode.endswith("-start")
  kind = opcode[: -len("-start")] if is_start else opcode
  if kind not in COLLECTIVE_KINDS:
    return None
  result_bytes, dtypes, sizes = _array_bytes(inst.group(2))
  group = _group_size(inst.group(4), num_devices)
  op_name = _OP_NAME.search(line)
  return Collective(
    kind=kind,
    context=context,
    dtypes=dtypes,
    result_bytes=result_bytes,
    buffer_bytes=_buffer_bytes(kind, result_bytes, sizes, group, is_start),
    group_size=group,
    op_name=op_name.group(1) if op_name else "",
    branch=branch,
  )


def compiled_collectives(
  hlo_text: str, *, num_devices: int = 0
) -> list[Collective]:
  """Lists the collectives in compiled HLO text, with their context and bytes.

  Args:
    hlo_text: ``Compiled.as_text()`` of a jitted or pmapped function.
    num_devices: group size to assume when an instruction names no groups.

  Returns:
    One :class:`Collective` per collective instruction, in text order.
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
) -> list[list[list[Collective]]]:
  """The collectives of every branch of every ``conditional``, in text order.

  ``lax.cond``/``lax.switch`` compile to a ``conditional`` whose branches are
  indexed as in ``switch`` (a ``cond`` is ``[false branch, true branch]``).
  Each branch lists what it runs, following calls into its sub-computations
  (context ``"branch"``). With ``outermost``, only the conditionals that do
  not sit inside another conditional's branch (a nested one's collectives
  are listed in the branch that holds it).

  Returns:
    ``[conditional][branch] -> [Collective, ...]``.
  """
  computations, _ = _computations(hlo_text, "branch_collectives")
  edges = _edges(computations)

  def reachable(root: str) -> list[Collective]:
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
_MLIR_TENSOR = re.compile(r"tensor<((?:\d+x)*)([a-z][a-z0-9]*)>")


def _mlir_bytes(types_text: str) -> tuple[int, tuple, list]:
  sizes, dtypes = [], []
  for dims, dtype in _MLIR_TENSOR.findall(types_text):
    if dtype not in DTYPE_BYTES:
      continue
    count = 1
    for d in filter(None, dims.split("x")):
      count *= int(d)
    sizes.append(count * DTYPE_BYTES[dtype])
    dtypes.append(
      {"i1": "pred", "i8": "s8", "i16": "s16", "i32": "s32", "i64": "s64"}.get(
        dtype, dtype
      )
    )
  return sum(sizes), tuple(sorted(set(dtypes))), sizes


def lowered_collectives(
  stablehlo_text: str, *, num_devices: int = 0
) -> list[Collective]:
  """Lists the collectives in lowered StableHLO text, with their wire dtypes.

  The context is always ``"lowered"`` (this reader does not follow regions);
  use :func:`compiled_collectives` for where an op runs.

  Args:
    stablehlo_text: ``Lowered.as_text()`` of a jitted or pmapped function.
    num_devices: group size to assume when an op names no groups.

  Returns:
    One :class:`Collective` per collective op, in text order.
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
    operand_bytes, dtypes, _ = _mlir_bytes(signature.group(1))
    result_bytes, _, _ = _mlir_bytes(signature.group(2))
    groups = _MLIR_GROUPS.search(stablehlo_text, match.end(), signature.start())
    group = int(groups.group(2)) if groups else num_devices
    buffer = (
      operand_bytes
      if kind in ("all-reduce", "reduce-scatter")
      else (result_bytes)
    )
    found.append(
      Collective(
        kind=kind,
        context="lowered",
        dtypes=dtypes,
        result_bytes=result_bytes,
        buffer_bytes=buffer,
        group_size=group,
      )
    )
  return found


def allreduce_equivalent_bytes(op: Collective) -> float:
  """``op``'s buffer in all-reduce-equivalent bytes (see the module docstring)."""
  weight = 1.0 if op.kind in ("all-reduce", "collective-permute") else 0.5
  return weight * op.buffer_bytes


def sent_bytes(op: Collective, num_devices: int = 8) -> float:
  """Bytes one device sends for ``op`` in a bandwidth-optimal algorithm, in
  its own groups of ``g`` (``op.group_size``, or ``num_devices`` when the
  text does not say): a ring all-reduce ``2 (g - 1) / g`` of its buffer, a
  reduce-scatter, all-gather or all-to-all ``(g - 1) / g``, a
  collective-permute its buffer."""
  if op.kind == "collective-permute":
    return float(op.buffer_bytes)
  g = op.group_size or num_devices
  return 2 * allreduce_equivalent_bytes(op) * (g - 1) / g


def by_branch(collectives: list[Collective], measure=None) -> dict:
  """All-reduce-equivalent bytes of the top level and of each conditional branch.

  A step runs its ``top`` collectives every time and, for each conditional,
  the collectives of the one branch it takes. Which branch a step takes is
  the transform's schedule (``benchmarks/schedules.py`` turns the two into
  bytes per step).

  Returns:
    ``{"top": bytes, "branches": {label: {"bytes", "group_sizes", "count"}}}``
    with ``label`` the outermost branch (:attr:`Collective.branch`),
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


def summarize(collectives: list[Collective]) -> dict:
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


def instruction_mix(hlo_text: str) -> dict:
  """``{"opcode shape": count}`` over every instruction of compiled HLO text.

  Two steps with the same mix run the same kernels on the same shapes: a
  cheap, name-independent way to show that a wrapper compiles away.
  """
  mix: dict = defaultdict(int)
  for line in hlo_text.splitlines():
    inst = _INSTRUCTION.match(line)
    if inst and inst.group(3) not in (
      "parameter",
      "get-tuple-element",
      "tuple",
      "bitcast",
      "copy",
    ):
      shape = re.sub(r"\{[\d,]*\}", "", inst.group(2))  # drop layouts
      mix[f"{inst.group(3)} {shape}"] += 1
  return dict(mix)


def mix_difference(a: dict, b: dict) -> int:
  """Number of instructions by which two :func:`instruction_mix` results differ."""
  return sum(abs(a.get(k, 0) - b.get(k, 0)) for k in set(a) | set(b))
