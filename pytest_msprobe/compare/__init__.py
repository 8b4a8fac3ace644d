"""The compare layer: read msprobe-format dumps, align them, judge every row, find the first divergence.

Never imports torch (tensor files are read with numpy; torch only for files of its legacy format) nor pytest.
The entry point is :func:`pytest_msprobe.compare.run.compare`; :func:`validate` checks a dump without
comparing it.

By feature, from the bottom up (each package's ``__init__`` names what the rest reads; nothing imports upwards):
``dumps/`` (reading a dump), ``judging/`` (metrics, row checks, overflow, the self-check,
the judged rows and calls), ``alignment/`` (pairing the calls, coverage), ``trend/``, ``diagnosis/`` (the first
divergence, devices), ``checklist/`` (what differs before any call); then ``build``, ``explain``, ``pool``, the
row table (``frame``), ``result`` (the one result object and its :class:`~pytest_msprobe.compare.result.Verdict`)
and ``run`` (the entry point).
"""

from __future__ import annotations

import sys

from pytest_msprobe.compare.diagnosis import Divergence
from pytest_msprobe.compare.dumps import DumpCheck, validate
from pytest_msprobe.compare.judging import ApiResult, RowResult
from pytest_msprobe.compare.result import CompareResult
from pytest_msprobe.compare.run import compare
from pytest_msprobe.thresholds import ApiRule, Thresholds, Tolerance

# the old module path of validate(), whose name this package gives the function (pytest_msprobe.moved)
sys.modules.setdefault(__name__ + ".validate", sys.modules[__name__ + ".dumps.validate"])

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
