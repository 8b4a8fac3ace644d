"""The ``pytest-msprobe`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pytest-msprobe")
    parser.add_subparsers(dest="command", required=True)
    parser.parse_args(argv)
    return 2


if __name__ == "__main__":
    sys.exit(main())
