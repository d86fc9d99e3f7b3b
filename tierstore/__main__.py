"""``python -m tierstore``: the same as the ``tierstore`` command."""

import sys

from .cli import main

sys.exit(main())
