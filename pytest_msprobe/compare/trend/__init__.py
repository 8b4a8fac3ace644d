"""The trend over many steps (loss, gradient norm): two runs' trends compared step by step."""

from __future__ import annotations

from pytest_msprobe.compare.trend.compare import compare_trends
from pytest_msprobe.compare.trend.outcome import GRAD_NORM, LOSS, TrendResult, TrendRow, tolerance_text
from pytest_msprobe.moved import names_from

__all__ = [
    "GRAD_NORM",
    "LOSS",
    "TrendResult",
    "TrendRow",
    "compare_trends",
    "tolerance_text",
]

# the names of the trend module of the earlier layout, at this package's path (pytest_msprobe.moved)
__getattr__ = names_from(__name__, ["pytest_msprobe.compare.trend.compare"])
