"""Old keyword spellings that keep working for one release, with a warning.

shardopt spells one concept one way across its public API (``sync_period``
for the steps between two syncs, ``inner`` for the wrapped optimizer). A
transform that used to spell it otherwise is decorated with
:func:`renamed_keywords`: the old keyword still gives the same call, with a
``DeprecationWarning`` that names the new one.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

# The release after which the old spellings stop working.
REMOVED_IN = "0.3"


def renamed_keywords(**new_by_old: str) -> Callable:
  """Decorates a public function so that each old keyword maps to its new one.

  ``@renamed_keywords(period="sync_period")`` makes ``f(period=4)`` call
  ``f(sync_period=4)`` after a ``DeprecationWarning``; passing both spellings
  is a ``TypeError``. The decorated function keeps its signature and
  docstring (``functools.wraps``), so the docs show only the new names.
  """

  def decorate(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
      for old, new in new_by_old.items():
        if old not in kwargs:
          continue
        if new in kwargs:
          raise TypeError(
            f"shardopt.{fn.__name__}: got both {new}= and {old}=, its old"
            f" spelling. Pass {new}= only."
          )
        warnings.warn(
          f"shardopt.{fn.__name__}({old}=...) is deprecated: spell it"
          f" {new}=... (the same value, the same numbers); {old}= is removed"
          f" in shardopt {REMOVED_IN}.",
          DeprecationWarning,
          stacklevel=2,
        )
        kwargs[new] = kwargs.pop(old)
      return fn(*args, **kwargs)

    return call

  return decorate
