"""docs/diloco.md's outer-step tables, from the files
:mod:`benchmarks.studies.outer_defaults` writes (the digits MLP) and merges
(``--lm-report``: section 8's LM, run by
:mod:`benchmarks.studies.outer_sweep`).

The tables themselves are :mod:`benchmarks.studies.outer_defaults`'s own
(``table``, ``lm_table``), imported when a block is rendered: that module
imports JAX. :data:`BLOCKS` registers them with :mod:`benchmarks.blocks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from benchmarks._blocks_format import Block
from benchmarks._blocks_format import provenance
from benchmarks._blocks_format import when

OUTER_DIGITS = "benchmarks/results/outer_defaults.json"
OUTER_LM = (
  "benchmarks/results/outer_defaults_lm.json",
  "benchmarks/results/outer_defaults_lm_seed1.json",
  "benchmarks/results/outer_defaults_lm_low_momentum.json",
)


def render_outer_lm(data: Sequence[dict]) -> str:
  """docs/diloco.md: section 8's LM, each outer step vs plain averaging
  (:func:`benchmarks.studies.outer_defaults.lm_table` of the three files)."""
  from benchmarks.studies import outer_defaults  # noqa: PLC0415

  text = outer_defaults.lm_table(outer_defaults.lm_finals_of(data))
  runs = "; ".join(
    f"`{Path(s).name}` {when(d.get('date'))}, seed"
    + ("s" if d["seeds"] > 1 else "")
    + " "
    + ", ".join(str(d.get("first_seed", 0) + i) for i in range(d["seeds"]))
    for s, d in zip(OUTER_LM, data, strict=True)
  )
  return (
    f"_`python -m benchmarks.studies.outer_sweep` runs ({runs}), commit not"
    " recorded (see `git log -- benchmarks/results/outer_defaults_lm.json`);"
    " merged by `outer_defaults --lm-report`._\n\n" + text
  )


def outer_digits_command(d: dict) -> str:
  """The file's command, or (an older file) the command its settings give:
  ``--outer`` less the plain step the script appends, other flags only
  where they differ from the defaults."""
  if d.get("command"):
    return d["command"]
  outer = [tuple(o) for o in d["outer_steps"]]
  if outer[-1] == (1.0, 0.0):
    outer = outer[:-1]
  parts = ["python -m benchmarks.studies.outer_defaults"]
  if d["steps"] != 512:
    parts.append(f"--steps {d['steps']}")
  if d["seeds"] != 3:
    parts.append(f"--seeds {d['seeds']}")
  periods = ",".join(d["runs"])
  if periods != "4,8,16,32,64,128":
    parts.append(f"--periods {periods}")
  parts.append('--outer "' + ";".join(f"{a:g},{b:g}" for a, b in outer) + '"')
  return " ".join(parts)


def render_outer_digits(data: Sequence[dict]) -> str:
  """docs/diloco.md: the digits MLP, every outer step
  (:func:`benchmarks.studies.outer_defaults.table`)."""
  from benchmarks.studies import outer_defaults  # noqa: PLC0415

  (d,) = data
  recorded = bool(d.get("command"))
  return (
    provenance(
      OUTER_DIGITS,
      command=outer_digits_command(d),
      date=d.get("date"),
      commit=d.get("commit"),
      extra=("" if recorded else " (the command rebuilt from its settings)")
      + f"; {d['steps']} steps, {d['seeds']} seeds, mean ± std",
    )
    + "\n\n"
    + outer_defaults.table(d)
  )


BLOCKS = (
  Block("outer-lm", OUTER_LM, render_outer_lm, ("docs/diloco.md",)),
  Block(
    "outer-digits", (OUTER_DIGITS,), render_outer_digits, ("docs/diloco.md",)
  ),
)
