"""What differs before any call: the two runs' checklists (data, weights, buffers, hyperparameters, structure,
versions, numerics settings) compared (:func:`compare_checklists`), or read off the records where a run has none
(:func:`from_records`)."""

from __future__ import annotations

from pytest_msprobe.compare.checklist.diff import compare_checklists
from pytest_msprobe.compare.checklist.differences import SETTING, ChecklistResult, Difference
from pytest_msprobe.compare.checklist.from_records import from_records
from pytest_msprobe.compare.checklist.setting_causes import compared_calls, recorded_calls
from pytest_msprobe.moved import names_from

__all__ = [
    "SETTING",
    "ChecklistResult",
    "Difference",
    "compare_checklists",
    "compared_calls",
    "from_records",
    "recorded_calls",
]

# the names of the checklist module of the earlier layout, at this package's path (pytest_msprobe.moved)
__getattr__ = names_from(__name__, ["pytest_msprobe.compare.checklist.differences"])
