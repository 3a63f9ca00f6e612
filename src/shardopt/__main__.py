"""``python -m shardopt``: says where the demo is (it is not in the package).

The demo trains with scikit-learn, matplotlib and tqdm, which shardopt does
not need, so it lives in the repository: ``python -m examples.demo`` from a
checkout (``make demo`` installs what it needs and runs it).
"""

import sys

if __name__ == "__main__":
  sys.exit(
    "The demo is not part of the shardopt package: from a clone of the"
    " repository, run `make demo` (or `python -m examples.demo` after"
    ' pip install -e ".[demo]").'
  )
