"""Run as a file (``python benchmarks/<study>.py``), a script has its own folder first on ``sys.path``, not the
repository: this puts the repository there instead, so that ``benchmarks.*`` and the library import as they do
under ``python -m benchmarks.<study>``. Every script imports it first, and only when run as a file."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # no sibling shadows a module by its name
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
