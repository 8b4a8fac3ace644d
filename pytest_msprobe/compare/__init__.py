"""The compare layer: load msprobe-format dumps, align them, judge every row, find the first divergence.

Never imports torch (tensor files are read with numpy) nor pytest. The package itself is callable, so that
``pytest_msprobe.compare(target, baseline)`` works whether ``compare`` resolves to this package or to
:func:`pytest_msprobe.compare.engine.compare`.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from pytest_msprobe.compare.engine import compare
from pytest_msprobe.compare.result import ApiResult, CompareResult, Divergence, RowResult
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


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> CompareResult:
        return compare(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
