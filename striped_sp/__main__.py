"""``python -m striped_sp``: the ``striped-sp`` command line."""

import sys

from .cli import main

sys.exit(main())
