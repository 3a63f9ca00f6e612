"""Checks every transform's arguments share: one error type per kind of mistake.

- A flag that is not ``True``/``False``: ``TypeError`` (:func:`flag`).
- A count, period, size or rate that is not a number in its range (a float
  where an integer is needed, a bool, a negative, a NaN): ``ValueError``
  (:func:`is_integer` is the one test behind every integer argument).
- A wrapped optimizer that is not an optax transform, a ``comm_dtype`` that
  is not a wire: ``TypeError`` (``_axes.check_transform``,
  ``shardopt.wire.of``).

Every message names the transform, the argument, the value and the fix.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def is_integer(value: Any) -> bool:
  """True for a Python or NumPy integer that is not a bool (the one test
  behind every integer argument: periods, counts, replica indices)."""
  return isinstance(value, (int, np.integer)) and not isinstance(
    value, (bool, np.bool_)
  )


def flag(value: Any, arg: str, transform: str, meaning: str = "") -> bool:
  """``value`` as a bool; a ``TypeError`` naming ``transform`` and ``arg``
  unless it is ``True`` or ``False`` (a NumPy bool counts)."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(
      f"{transform}: {arg}={value!r} must be True or False"
      + (f" ({meaning})." if meaning else ".")
    )
  return bool(value)
