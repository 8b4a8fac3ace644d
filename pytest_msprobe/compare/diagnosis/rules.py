"""The rules that place the first divergence, and the place they name (:class:`Divergence`)."""

from __future__ import annotations

from dataclasses import dataclass

# the rules that place the first divergence (Divergence.rule), in the order they are tried; see
# pytest_msprobe.compare.diagnosis.divergence
OUT_OF_LINE = "out of line"  # the earliest call whose own error (against its float64 replay) is out of line
ENTERS = "enters"  # the earliest call whose outputs breach while its inputs match
SOURCE = "source"  # the earliest call that reads an input no recorded call made, and that differs
# what an input from outside the recorded calls is (Divergence.source)
PARAMETER_SOURCE, BUFFER_SOURCE, DATA_SOURCE, UNRECORDED_SOURCE = "parameter", "buffer", "data", "unrecorded"
SOURCE_KINDS = (PARAMETER_SOURCE, BUFFER_SOURCE, DATA_SOURCE, UNRECORDED_SOURCE)
STRUCTURAL = "structural"  # a call only one side makes, after which the numbers differ
INCONSISTENT = (
    "inconsistent"  # errors flow in everywhere: the earliest call whose statistics break a relation
)
GROWS = "grows"  # errors flow in everywhere: the earliest call that amplifies its input error
INHERITED = "inherited"  # the earliest breaching call: its inputs already differ
ROUNDING = "rounding"  # no call is out of line: the difference builds up from rounding
OVERFLOW = "overflow"  # the earliest call whose output holds inf/nan on the target and not on the baseline
RULES = (OVERFLOW, OUT_OF_LINE, ENTERS, SOURCE, STRUCTURAL, INCONSISTENT, GROWS, INHERITED, ROUNDING)


@dataclass(frozen=True)
class Divergence:
    """Where the error enters: an API, its worst output row, and why it was chosen."""

    api: str
    row: str
    step: int | None
    rank: int | None
    reason: str
    rule: str  # one of RULES
    api_index: int
    row_index: int
    overflow: str | None = None  # rule OVERFLOW: one of OVERFLOW_PLACES
    # rule SOURCE: what the input from outside the recorded calls is (parameter, buffer, data, unrecorded), and
    # whether it is the one tensor a later step starts with that changed since the step before
    source: str | None = None
    changed: bool = False
