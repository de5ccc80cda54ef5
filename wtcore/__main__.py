"""``python -m wtcore`` is the ``wtcore`` command."""

import sys

from wtcore.cli import main

sys.exit(main())
