"""``python -m benchmarks.remote``: the command (:func:`benchmarks.remote.command.main`)."""

import sys

from benchmarks.remote.command import main

sys.exit(main())
