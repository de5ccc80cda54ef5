"""Make the worker-process kit importable here and in the spawned worker processes.

``spawn`` children import their target by module name and inherit ``sys.path``, so the
kit's folder goes on ``sys.path`` once, before any test spawns a worker.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
