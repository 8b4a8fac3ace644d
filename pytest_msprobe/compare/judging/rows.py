"""The judged rows and calls of a compare, and the statuses they carry: the data types every judging step
fills in and every later step reads (the compare's result, :mod:`pytest_msprobe.compare.result`, holds them)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeGuard

from pytest_msprobe.compare.dumps import NONE, TENSOR, Leaf
from pytest_msprobe.compare.judging.metrics import STAT_NAMES, StatMetrics, TensorMetrics
from pytest_msprobe.format.own_errors import OwnError

PASS, WARNING, ERROR, UNMATCHED, SKIPPED = "pass", "warning", "error", "unmatched", "skipped"
STATUSES = (PASS, WARNING, ERROR, UNMATCHED, SKIPPED)
_SEVERITY = {SKIPPED: 0, PASS: 1, UNMATCHED: 2, WARNING: 3, ERROR: 4}


# the kind of problem of a row that no tolerance could change (RowResult.problem; None for any other row)
SHAPE = "shape"  # its two tensors have other shapes
NONFINITE = "nonfinite"  # NaN/Inf on one side only
UNUSABLE = "unusable"  # a side's statistics cannot be compared (NaN or null in a non-empty tensor)
DTYPE = "dtype"  # its two tensors are of other floating dtypes (float16 where the baseline has bfloat16)

# where an overflow is first seen (Overflow.where, Divergence.overflow), as msprobe's guide sorts them
OVERFLOW_PARAMETER = "parameter"  # a weight already holds inf/nan: the previous step's backward / update
OVERFLOW_INPUT = "input"  # an input holds inf/nan that no recorded call made: a call that was not recorded
OVERFLOW_OUTPUT = "output"  # finite inputs, inf/nan output: this call is the suspect
OVERFLOW_PLACES = (OVERFLOW_PARAMETER, OVERFLOW_INPUT, OVERFLOW_OUTPUT)


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
    problem: str | None = None  # SHAPE, NONFINITE, UNUSABLE, DTYPE, or None


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
    # where in the model it was made: module path, outermost first (see pytest_msprobe.compare.dumps.modules)
    module: tuple[str, ...] = ()

    @property
    def rows(self) -> range:
        return range(self.row_start, self.row_stop)


@dataclass(frozen=True)
class OwnErrorVerdict:
    """A call's own error (its output against the float64 replay of its own inputs) on both sides, and
    whether the target's is out of line: beyond its dtype's standard and, where the baseline has its own
    error too, beyond the baseline's by the standard's ratios. ``target``/``baseline`` are the worst
    output's own error on each side (None where a side has none)."""

    target: OwnError | None
    baseline: OwnError | None
    out_of_line: bool
    reason: str  # why it is out of line, or why it is not though the standard alone would say so
    skipped: str = ""  # why the target's call was not replayed (then target is None)


@dataclass(frozen=True)
class Overflow:
    """The first call whose output holds inf/nan (on the target and not on the baseline, in a compare), and
    where the inf/nan is first seen (``where``, one of :data:`OVERFLOW_PLACES`): ``row`` is the row that holds
    it first (an input or parameter for ``parameter`` and ``input``, the output for ``output``), ``output_row``
    the overflowing output; ``values`` the statistics that show it (``Max inf, Min -inf``); ``source`` the
    recorded call whose output the overflowing input is, where one is. ``api_index`` / ``row_index`` point into
    :class:`CompareResult` (None in the self-check without a baseline)."""

    api: str
    step: int | None
    rank: int | None
    where: str
    row: str
    output_row: str
    values: str
    dtype: str | None
    reason: str
    api_index: int | None = None
    row_index: int | None = None
    source: str | None = None


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


# the groups of calls that are no module of the model (ApiResult.module; parentheses keep them apart from any

RowSide: TypeAlias = Leaf | None
"""What one side of a row holds (:attr:`RowResult.target`, :attr:`RowResult.baseline`): the dump's record of the
item, None where that side lacks it."""


def is_tensor(side: RowSide) -> TypeGuard[Leaf]:
    """Whether the side's item is a tensor (not a None, a plain value, or a missing side)."""
    return side is not None and side.kind == TENSOR


def is_none(side: RowSide) -> bool:
    """Whether the side's item is a None (an argument or output that was None), not a missing side."""
    return side is not None and side.kind == NONE


def shape_differs(row: RowResult) -> bool:
    """Whether a row's two tensors have other shapes (never a matter of precision)."""
    t, b = row.target, row.baseline
    return is_tensor(t) and is_tensor(b) and t.shape != b.shape


def row_metric(row: RowResult) -> str:
    """Which metric judged the row: the worst statistic in statistics mode, the scaled error otherwise."""
    if row.error is None and row.stat is None and row.tensor is None and row.status == ERROR:
        return "statistics"  # NaN or missing statistics: nothing measured
    if row.stat is not None and row.stat.worst is not None:
        return f"{STAT_NAMES[row.stat.worst]} (scaled)"
    if row.tensor is not None:
        t = row.tensor
        if t.rel_l2 is not None:  # (the verdict's error: TensorMetrics.error)
            return "RelL2Err" if t.rest_rel_l2 is None else "RelL2Err (outside the fill)"
        return "tensor"
    if row.target is not None and row.target.md5 is not None:
        return "md5"
    return "value"


def fmt_number(x: float | None) -> str:
    """A number for messages: three significant digits, ``n/a`` for none."""
    if x is None:
        return "n/a"
    if math.isinf(x) or math.isnan(x):
        return str(x)
    return f"{x:.3g}"


@dataclass(frozen=True)
class SelfCheckCall:
    """One recorded call of a dump judged by its own error alone (the self-check without a baseline)."""

    name: str
    step: int | None
    rank: int | None
    own: OwnErrorVerdict
    stack: tuple[str, ...] = ()  # where the call was made (its stack.json frames), for the message


@dataclass(frozen=True)
class SelfCheckResult:
    """Every recorded call of a dump with its own error: the gate of a run without a baseline."""

    dump: str
    calls: tuple[SelfCheckCall, ...]  # in execution order: steps, ranks, then each dump's own order
    overflow: Overflow | None = None  # the dump's first call whose output holds inf/nan (it fails the check)

    @property
    def out_of_line(self) -> list[SelfCheckCall]:
        return [c for c in self.calls if c.own.out_of_line]

    @property
    def passed(self) -> bool:
        return not self.out_of_line and self.overflow is None

    @property
    def checked(self) -> int:
        return sum(1 for c in self.calls if not c.own.skipped)

    @property
    def skipped(self) -> int:
        return sum(1 for c in self.calls if c.own.skipped)
