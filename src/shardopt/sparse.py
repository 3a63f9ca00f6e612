"""Moved to :mod:`shardopt.wire.sparse`; this alias stays for one release.

``import shardopt.sparse`` gives the same module object as
``shardopt.wire.sparse``.
"""

import sys

from shardopt.wire import sparse as _moved

sys.modules[__name__] = _moved
