"""The result of a compare: one object, of which every report is a view.

Rows are in report order (each dump's execution order, steps then ranks); every API call has an
:class:`ApiResult` (verdict, input and output error, its rows, its execution-order index); the first
divergence points at one of them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pytest_msprobe.compare.load import Leaf
from pytest_msprobe.compare.metrics import StatMetrics, TensorMetrics
from pytest_msprobe.compare.thresholds import Thresholds

PASS, WARNING, ERROR, UNMATCHED, SKIPPED = "pass", "warning", "error", "unmatched", "skipped"
STATUSES = (PASS, WARNING, ERROR, UNMATCHED, SKIPPED)
_SEVERITY = {SKIPPED: 0, PASS: 1, UNMATCHED: 2, WARNING: 3, ERROR: 4}


def worst(statuses: Any) -> str:
    """The most severe status of an iterable (``pass`` for none)."""
    return max(statuses, key=_SEVERITY.__getitem__, default=PASS)


@dataclass(frozen=True)
class RowResult:
    """One compared item (a tensor, a None or a plain value) of one API call."""

    row: str  # the target's row name (the baseline's when the target has none)
    bench_row: str | None
    api_index: int  # into CompareResult.apis
    role: str  # "input", "output" or "parameter"
    target: Leaf | None
    baseline: Leaf | None
    status: str
    error: float | None  # scaled error (None where not measured)
    allowed: float | None  # the error tolerance that applied
    reason: str
    stat: StatMetrics | None = None
    tensor: TensorMetrics | None = None
    msprobe_accuracy: str | None = None  # tensor mode: msprobe 8.3.3's rule, "Yes" / "No"


@dataclass(frozen=True)
class ApiResult:
    """One API (or module) call, paired across the two dumps, with its verdict."""

    api: str  # the target's name (the baseline's when only the baseline has the call)
    bench_api: str | None
    step: int | None
    rank: int | None
    order: int  # execution-order index over the whole compare (steps; calls, ranks ordered by collectives)
    direction: str | None  # "forward", "backward" or None
    status: str
    reason: str
    input_error: float | None
    output_error: float | None
    input_breach: bool
    output_breach: bool
    row_start: int  # rows[row_start:row_stop] are this call's
    row_stop: int
    worst_row: int | None  # index into rows of the row the reason is about
    pair: int = 0  # index into CompareResult.pairs

    @property
    def rows(self) -> range:
        return range(self.row_start, self.row_stop)


@dataclass(frozen=True)
class Divergence:
    """Where the error enters: an API, its worst output row, and why it was chosen."""

    api: str
    row: str
    step: int | None
    rank: int | None
    reason: str
    rule: str  # "enters" (inputs match), "grows" (amplified), "inherited" (inputs already differ)
    api_index: int
    row_index: int


@dataclass(frozen=True)
class DumpPair:
    """Two dump.json files compared with each other."""

    step: int | None
    rank: int | None
    target: str
    baseline: str
    alignment: str  # "names", "ordered" or "fuzzy"
    matched: int
    target_only: int
    baseline_only: int


@dataclass(frozen=True)
class CompareResult:
    """Everything a compare found. ``passed`` is False when any API breaches (a row with status error) or the
    target lacks a step or rank of the baseline."""

    target: str
    baseline: str
    mode: str  # "statistics", "tensor" or "md5"
    rows: tuple[RowResult, ...]
    apis: tuple[ApiResult, ...]
    first_divergence: Divergence | None
    pairs: tuple[DumpPair, ...]
    unpaired: tuple[str, ...]  # dumps (step/rank) present on one side only
    thresholds: Thresholds
    timestamp: str  # YYYYmmddHHMMSS, names the report files
    stacks: dict[str, tuple[str, ...]] = field(default_factory=dict)  # target API name -> call stack
    missing: tuple[str, ...] = ()  # the unpaired dumps that only the baseline has: they fail the compare

    @property
    def passed(self) -> bool:
        """No API breaches, and the target has every step and rank the baseline has."""
        return not self.missing and not any(api.status == ERROR for api in self.apis)

    @property
    def failures(self) -> list[ApiResult]:
        """Breaching API calls in execution order."""
        return sorted((api for api in self.apis if api.status == ERROR), key=lambda a: a.order)

    def counts(self) -> dict[str, Any]:
        rows = Counter(row.status for row in self.rows)
        apis = Counter(api.status for api in self.apis)
        return {
            "rows": len(self.rows),
            **{status: rows.get(status, 0) for status in STATUSES},
            "apis": len(self.apis),
            **{f"apis_{status}": apis.get(status, 0) for status in STATUSES},
            "dump_pairs": len(self.pairs),
            "unpaired_dumps": len(self.unpaired),
            "missing_dumps": len(self.missing),
        }
