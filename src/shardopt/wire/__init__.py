"""What crosses the wire: one protocol for every reduction in shardopt.

``comm_dtype=`` (of :func:`shardopt.reduce`, the ``cross_shard``
transforms, ``tower``, ``powersgd``, the periodic family and
``shardopt.elastic``'s rounds) names a wire; ``of`` turns it into a
:class:`~shardopt.wire.Wire`, which says what it can do and does
the encoding, the exchange's arithmetic and the decoding:

- ``None`` or a float dtype (``jnp.bfloat16``, ``jnp.float16``):
  ``dense``, a cast;
- ``jnp.int8``, ``jnp.float8_e4m3fn``, ``jnp.float8_e5m2``, ``jnp.int4``
  or :func:`shardopt.quantized`: ``blocks``, quantized blocks with
  float32 scales, two phases;
- :func:`shardopt.topk`: ``sparse``, the top k of every chunk, gathered
  (needs error feedback).

Every public entry point canonicalises its ``comm_dtype`` once, when the
transform is built, and passes the ``Wire`` down: what runs below asks the
wire what it can do and calls its methods (:class:`Wire`, a
``typing.Protocol``), never which class it is.

Error feedback lives in ``feedback``, the mean over the contributors in
``mean``, the protocol in ``protocol``. What a compiled step sends is read
on the measuring floor, above the transforms: :func:`shardopt.measure.traffic`
(``traffic``, ``Traffic`` and ``Collective`` here, its names before it
moved, warn and lead there until shardopt 0.3).
"""

from __future__ import annotations

import warnings
from typing import Any

import jax.numpy as jnp

from shardopt._renamed import REMOVED_IN
from shardopt.wire import blocks
from shardopt.wire import dense
from shardopt.wire import sparse
from shardopt.wire.protocol import Wire
from shardopt.wire.sparse import TopKSpec

# The specs' builders are shardopt.quantized and shardopt.topk.
__all__ = ["Wire", "of"]

_USE = (
  "use a float dtype such as jnp.bfloat16 or jnp.float16, a quantized one"
  " (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int4), or"
  " shardopt.quantized(dtype, block_size=...), or a sparse one,"
  " shardopt.topk(k) (with error_feedback=True)."
)


def of(comm_dtype: Any, transform: str = "shardopt.wire.of", axis_name=None):
  """The ``Wire`` a ``comm_dtype`` names: the one place that reads it.

  None and float dtypes give a dense wire (``spec`` None or the
  ``np.dtype``), ``jnp.int8``, ``jnp.float8_e4m3fn``, ``jnp.float8_e5m2``,
  ``jnp.int4`` and :func:`shardopt.quantized` specs the quantized blocks
  (``spec`` a ``QuantizedSpec``), :func:`shardopt.topk` specs the sparse
  wire; a ``Wire`` is returned as it is. Anything else raises
  ``TypeError`` naming ``transform``, the axis and the dtypes that work.
  Each public transform calls it once, when it is built.

  Example:
    >>> import jax.numpy as jnp, shardopt
    >>> w = shardopt.wire.of(jnp.int8)
    >>> w.spec, w.two_phase, w.takes_error_feedback, w.carries_counts
    (quantized(int8, block_size=256), True, True, False)
    >>> shardopt.wire.of(shardopt.topk(64)).needs_error_feedback
    True
    >>> shardopt.wire.of(None).carries_counts
    True
    >>> shardopt.wire.of(w) is w  # already canonical
    True
  """
  if isinstance(comm_dtype, Wire):
    return comm_dtype
  if comm_dtype is None:
    return dense.OWN
  if isinstance(comm_dtype, TopKSpec):
    return sparse.Sparse(comm_dtype)
  spec = blocks.as_spec(comm_dtype)
  if spec is not None:
    return blocks.Blocks(spec)
  on = (
    f" (the wire dtype of reductions over axis {axis_name!r})"
    if axis_name is not None
    else ""
  )
  try:
    dtype = jnp.dtype(comm_dtype)
  except TypeError as e:
    raise TypeError(
      f"{transform}: comm_dtype={comm_dtype!r}{on} is not a dtype; {_USE}"
    ) from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
      f"{transform}: comm_dtype={dtype}{on} is neither a floating dtype nor"
      f" a quantized one; {_USE}"
    )
  return dense.Dense(dtype)


# The traffic reader's names before it moved up a floor to shardopt.measure
# (docs/layers.md); removed in shardopt REMOVED_IN.
_MOVED_TO_MEASURE = ("Collective", "Traffic", "traffic")


def __getattr__(name: str) -> Any:
  """``shardopt.wire.traffic``, ``.Traffic`` and ``.Collective``: the names
  :mod:`shardopt.measure`'s reader had before it moved, until shardopt 0.3.

  The one import from a floor above in ``src/`` (docs/layers.md): it runs
  when the name is read, after every module is built, never while
  ``shardopt.wire`` is imported.
  """
  if name not in _MOVED_TO_MEASURE:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  from shardopt import measure  # noqa: PLC0415 (the deprecated alias)

  warnings.warn(
    f"shardopt.wire.{name} moved to shardopt.measure.{name} (the same"
    f" object); the old name is removed in shardopt {REMOVED_IN}.",
    DeprecationWarning,
    stacklevel=2,
  )
  return getattr(measure, name)
