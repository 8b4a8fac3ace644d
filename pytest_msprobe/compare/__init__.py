"""The compare layer: read msprobe-format dumps, align them, judge every row, find the first divergence.

Never imports torch (tensor files are read with numpy; torch only for files of its legacy format) nor pytest.
The entry point is :func:`pytest_msprobe.compare.run.compare`; :func:`validate` checks a dump without
comparing it.
"""

from __future__ import annotations

from pytest_msprobe.compare.result import ApiResult, CompareResult, Divergence, RowResult
from pytest_msprobe.compare.run import compare
from pytest_msprobe.compare.thresholds import ApiRule, Thresholds, Tolerance
from pytest_msprobe.compare.validate import DumpCheck, validate

__all__ = [
    "ApiResult",
    "ApiRule",
    "CompareResult",
    "Divergence",
    "DumpCheck",
    "RowResult",
    "Thresholds",
    "Tolerance",
    "compare",
    "validate",
]
