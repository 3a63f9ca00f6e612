"""Which leaves form each fragment of Streaming DiLoCo, as a table to print.

Above :mod:`.fragments` (the split), :mod:`.checks` and :mod:`.schedules`
(when each fragment syncs), which all sit below it: no import circle.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from shardopt.periodic import checks
from shardopt.periodic import fragments as _fragments
from shardopt.periodic import schedules
from shardopt.periodic.fragments import Piece


def _layers_text(piece: Piece, layers: int) -> str:
  """``"layers 1, 5, 9 of axis 0"`` (the first three and the last if many)."""
  chosen = list(range(piece.index, layers, piece.count))
  shown = ", ".join(str(layer) for layer in chosen[:3])
  if len(chosen) > 4:
    shown += f", ..., {chosen[-1]}"
  elif len(chosen) == 4:
    shown += f", {chosen[-1]}"
  return f"layers {shown} of axis {piece.axis}"


def describe_fragments(
  params: Any,
  num_fragments: int,
  layer_axes: Any = None,
  *,
  sync_period: int | None = None,
  sync_offset: int = 0,
) -> str:
  """A table of the leaves that form each fragment of
  ``shardopt.diloco(..., num_fragments=F)``, to print.

  One block per fragment: the step of the period after which it syncs (with
  ``sync_period``), its bytes (what one replica's outer gradient of it
  holds, before any ``comm_dtype``) and its pieces, one line each: the leaf's
  path, shape and dtype, and the part of it the fragment holds (the whole
  leaf, or its layers with ``layer_axes``). Use it to order the params'
  leaves so that the fragments match another run's (torchft's
  ``model_fragments``, see ``docs/diloco.md``). ``fragment_of`` gives
  the same assignment as a dict.

  Args:
    params: one replica's params (or ``jax.ShapeDtypeStruct`` leaves).
    num_fragments: ``F``, as given to ``diloco``.
    layer_axes: as given to ``diloco``.
    sync_period: as given to ``diloco``; None leaves out the sync steps.
    sync_offset: as given to ``diloco``.

  Returns:
    The table, as text.

  Example:
    >>> import numpy as np
    >>> from shardopt import describe_fragments
    >>> params = {"b": np.zeros(8, np.float32), "w": np.zeros((16, 8), np.float32)}
    >>> print(describe_fragments(params, 2, sync_period=4))
    fragment 0: syncs after step 4 of every 4, 32 bytes
      b  (8,)     float32  whole
    fragment 1: syncs after step 2 of every 4, 512 bytes
      w  (16, 8)  float32  whole
  """
  name = "shardopt.describe_fragments"
  fragments = _fragments._checked_split(params, num_fragments, layer_axes, name)
  steps = None
  if sync_period is not None:
    period = checks.check_period(sync_period, "sync_period", name)
    checks.check_num_fragments(num_fragments, period, name)
    offset = checks.check_sync_offset(sync_offset, period, name)
    steps = [
      s.phase or period
      for s in schedules.streaming(period, len(fragments), offset=offset)
    ]
  leaves = jax.tree.leaves(params)
  names = _fragments._path_names(params)
  blocks = []  # per fragment: (bytes, [(path, shape, dtype, part)])
  for fragment in fragments:
    rows, total = [], 0
    for piece in fragment:
      leaf = leaves[piece.leaf]
      shape = tuple(np.shape(leaf))
      total += _fragments._leaf_bytes([leaf])[0] // piece.count
      part = (
        "whole"
        if piece.axis is None
        else _layers_text(piece, shape[piece.axis])
      )
      rows.append(
        (names[piece.leaf], str(shape), np.dtype(leaf.dtype).name, part)
      )
    blocks.append((total, rows))
  widths = [
    max((len(row[c]) for _, rows in blocks for row in rows), default=0)
    for c in range(3)
  ]
  lines = []
  for f, (total, rows) in enumerate(blocks):
    when = (
      ""
      if steps is None
      else f"syncs after step {steps[f]} of every {period}, "
    )
    lines.append(f"fragment {f}: {when}{total:,} bytes")
    for row in rows:
      # The last column (the part) is not padded: zip stops at the widths.
      cells = [
        cell.ljust(width) for cell, width in zip(row, widths, strict=False)
      ]
      lines.append("  " + "  ".join([*cells, row[3]]))
    if not rows:
      lines.append("  (no leaves)")
  return "\n".join(lines)
