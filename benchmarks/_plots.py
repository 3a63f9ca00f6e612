"""One horizontal bar chart helper for the sections' PNGs (matplotlib, Agg)."""

from __future__ import annotations

import os
from collections.abc import Sequence


def bars(
  path: str,
  labels: Sequence[str],
  values: Sequence[float],
  *,
  title: str,
  xlabel: str,
  reference: float | None = None,
  reference_label: str = "",
  log: bool = False,
) -> str:
  """Writes a horizontal bar chart to ``path`` and returns the path."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(9, 0.45 * len(labels) + 1.4))
  positions = range(len(labels))
  ax.barh(list(positions), list(values), color="#4c72b0")
  ax.set_yticks(list(positions), list(labels), fontsize=8)
  ax.invert_yaxis()
  if reference is not None:
    ax.axvline(
      reference, color="#c44e52", linestyle="--", label=reference_label
    )
    ax.legend(fontsize=8, loc="lower right")
  if log:
    ax.set_xscale("log")
  ax.set_title(title, fontsize=10)
  ax.set_xlabel(xlabel)
  ax.grid(axis="x", alpha=0.3)
  fig.tight_layout()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
