"""Moved to :mod:`shardopt.wire.blocks`; this alias stays for one release.

``import shardopt.quantize`` gives the same module object as
``shardopt.wire.blocks``.
"""

import sys

from shardopt.wire import blocks as _moved

sys.modules[__name__] = _moved
