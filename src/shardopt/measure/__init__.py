"""The measuring tools: what a compiled step sends, read from its HLO.

The floor above what it measures (see ``docs/layers.md``): it reads the
compiled program of a step built from the transforms, and asks the periodic
engine's own schedule which steps run which branch. Nothing below it imports
it.

- :func:`traffic` (with :class:`Traffic` and :class:`Collective`): the
  public reader, the bytes one replica sends per step, per sync and per
  run. ``wire.traffic``, ``wire.Traffic`` and ``wire.Collective``, its names
  before it moved here, give the same objects with a
  ``DeprecationWarning`` until shardopt 0.3.
- ``shardopt.measure.hlo``: the HLO reader underneath (collectives by
  branch, bytes per step of a schedule, copies, instructions). It is the
  one internal door for the benchmarks and the tests, which import
  ``from shardopt.measure import hlo`` and use its public names only; they
  may change between releases.

The examples assume 8 devices (for instance a CPU with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` set before jax is
imported).
"""

from shardopt.measure import hlo
from shardopt.measure.traffic import Collective
from shardopt.measure.traffic import Traffic
from shardopt.measure.traffic import traffic

__all__ = ["Collective", "Traffic", "traffic"]

# The examples of the reader and of the HLO reader run with this module's
# doctests (tests/test_docstrings.py walks shardopt's top level).
__test__ = {"traffic": traffic, "hlo": hlo}
