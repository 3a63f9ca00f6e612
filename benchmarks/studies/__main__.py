"""``python -m benchmarks.studies [--quick] [--only NAME] [--out DIR]``."""

import sys

from benchmarks._xla_flags import force_cpu_devices

force_cpu_devices(quick="--quick" in sys.argv[1:])

from benchmarks.studies import harness  # noqa: E402

sys.exit(harness.main())
