"""``python -m tierstore``: the same as the ``tierstore`` command, and nothing else."""

import sys

from .cli import main

sys.exit(main())
