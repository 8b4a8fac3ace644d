"""``python -m pytest_msprobe compare ...`` runs the same command as ``pytest-msprobe``."""

from __future__ import annotations

import sys

from pytest_msprobe.cli import main

if __name__ == "__main__":
    sys.exit(main())
