"""Where the error enters: the rules that place the first divergence (:func:`first_divergence`), the calls'
inputs and where they come from, and how calls are judged when the runs ran on different devices
(:func:`judge_across`)."""

from __future__ import annotations

from pytest_msprobe.compare.diagnosis.devices import AcrossDevices, judge_across
from pytest_msprobe.compare.diagnosis.divergence import first_divergence
from pytest_msprobe.compare.diagnosis.rules import (
    BUFFER_SOURCE,
    DATA_SOURCE,
    ENTERS,
    GROWS,
    INCONSISTENT,
    INHERITED,
    OUT_OF_LINE,
    OVERFLOW,
    PARAMETER_SOURCE,
    ROUNDING,
    RULES,
    SOURCE,
    SOURCE_KINDS,
    STRUCTURAL,
    UNRECORDED_SOURCE,
    Divergence,
)
from pytest_msprobe.compare.diagnosis.sources import ALONE, CHANGED_SINCE

__all__ = [
    "ALONE",
    "BUFFER_SOURCE",
    "CHANGED_SINCE",
    "DATA_SOURCE",
    "ENTERS",
    "GROWS",
    "INCONSISTENT",
    "INHERITED",
    "OUT_OF_LINE",
    "OVERFLOW",
    "PARAMETER_SOURCE",
    "ROUNDING",
    "RULES",
    "SOURCE",
    "SOURCE_KINDS",
    "STRUCTURAL",
    "UNRECORDED_SOURCE",
    "AcrossDevices",
    "Divergence",
    "first_divergence",
    "judge_across",
]
