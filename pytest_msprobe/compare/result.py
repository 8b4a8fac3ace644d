"""The result of a compare: one object, of which every report is a view.

Rows are in report order (each dump's execution order, steps then ranks); every API call has an
:class:`ApiResult` (verdict, input and output error, its rows, its execution-order index); the first
divergence points at one of them; :class:`Coverage` says how much of the baseline found a partner.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias, TypeGuard

from pytest_msprobe.compare.checklist import SETTING as SETTING  # (for the reports)
from pytest_msprobe.compare.checklist import ChecklistResult, Difference
from pytest_msprobe.compare.coverage import UNMATCHED_CAUSES as UNMATCHED_CAUSES
from pytest_msprobe.compare.coverage import Coverage as Coverage
from pytest_msprobe.compare.coverage import PairCoverage as PairCoverage
from pytest_msprobe.compare.coverage import unmatched_share as unmatched_share
from pytest_msprobe.compare.metrics import STAT_NAMES, StatMetrics, TensorMetrics
from pytest_msprobe.compare.metrics import is_mask_fill as is_mask_fill  # (for the reports)
from pytest_msprobe.compare.rank_order import collective_op
from pytest_msprobe.compare.records import NONE, OUTPUT, TENSOR, Leaf
from pytest_msprobe.compare.thresholds import Thresholds
from pytest_msprobe.compare.thresholds import is_integral as is_integral  # (for the reports)
from pytest_msprobe.compare.thresholds import normalize_dtype as normalize_dtype  # (for the reports)
from pytest_msprobe.compare.trend_result import GRAD_NORM as GRAD_NORM
from pytest_msprobe.compare.trend_result import LOSS as LOSS
from pytest_msprobe.compare.trend_result import TrendResult as TrendResult
from pytest_msprobe.compare.trend_result import TrendRow as TrendRow
from pytest_msprobe.compare.trend_result import tolerance_text as tolerance_text
from pytest_msprobe.format.own_errors import OwnError

if TYPE_CHECKING:  # (devices.py judges with this module's types)
    from pytest_msprobe.compare.devices import AcrossDevices

PASS, WARNING, ERROR, UNMATCHED, SKIPPED = "pass", "warning", "error", "unmatched", "skipped"
STATUSES = (PASS, WARNING, ERROR, UNMATCHED, SKIPPED)
_SEVERITY = {SKIPPED: 0, PASS: 1, UNMATCHED: 2, WARNING: 3, ERROR: 4}


# the kind of problem of a row that no tolerance could change (RowResult.problem; None for any other row)
SHAPE = "shape"  # its two tensors have other shapes
NONFINITE = "nonfinite"  # NaN/Inf on one side only
UNUSABLE = "unusable"  # a side's statistics cannot be compared (NaN or null in a non-empty tensor)
DTYPE = "dtype"  # its two tensors are of other floating dtypes (float16 where the baseline has bfloat16)

# the rules that place the first divergence (Divergence.rule), in the order they are tried; see
# pytest_msprobe.compare.divergence
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
    # where in the model it was made: module path, outermost first (see pytest_msprobe.compare.modules)
    module: tuple[str, ...] = ()

    @property
    def rows(self) -> range:
        return range(self.row_start, self.row_stop)


@dataclass(frozen=True)
class OwnVerdict:
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
# attribute name)
OUTSIDE_MODULES = ("(outside any module)",)  # before, after or between the model's module calls
OPTIMIZER_MODULE = ("(optimizer)",)  # inside optimizer.step()
UNKNOWN_MODULE = ("(no module known)",)  # neither construct.json nor a stack tells


@dataclass(frozen=True)
class Modules:
    """The model's modules that the calls were made in (:attr:`ApiResult.module`): what each is (its class at
    L0/mix, where it is called at L1) and which files told (``construct.json``, ``stack.json``; none: every
    call's module is unknown)."""

    about: dict[tuple[str, ...], str] = field(default_factory=dict)
    sources: tuple[str, ...] = ()


@dataclass(frozen=True)
class CompareResult:
    """Everything a compare found. ``passed`` is False when any API breaches (a row with status error), the
    target lacks a step or rank of the baseline, or too little of the baseline found a partner (``coverage``)."""

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
    coverage: Coverage
    stacks: dict[str, tuple[str, ...]] = field(default_factory=dict)  # target API name -> call stack
    # per dump pair (``pairs`` order), the target's stacks, where every pair's stack.json was read: a name's
    # stack may differ between steps (an optimizer's first step has no momentum buffer yet)
    pair_stacks: tuple[dict[str, tuple[str, ...]], ...] = ()
    missing: tuple[str, ...] = ()  # the unpaired dumps that only the baseline has: they fail the compare
    own: dict[int, OwnVerdict] = field(default_factory=dict)  # apis index -> own errors, where there are
    self_check: bool = False  # whether an out-of-line call fails the compare (the self-check was asked for)
    checklist: ChecklistResult | None = None  # what differs before any call: data, weights, settings
    overflow: Overflow | None = (
        None  # the first call that overflows on the target only (it fails the compare)
    )
    trend: TrendResult | None = None  # the trend over many steps, where the test records one
    modules: Modules = field(default_factory=Modules)  # the model's modules the calls were made in
    # what was set aside, neither compared nor unmatched, one line per dump pair and cause (an optimizer that
    # records no update per parameter, gradient clipping made of other calls on each side)
    set_aside: tuple[str, ...] = ()
    # how the calls were judged when the runs ran on different devices (None: on one device, values judge)
    across: AcrossDevices | None = None

    @property
    def passed(self) -> bool:
        """No API breaches, the target has every step and rank the baseline has, enough of the baseline found
        a partner, (with the self-check) no call is out of line, the checklists agree on the data, the weights,
        the structure and the hyperparameters, and the trend (where there is one) agrees."""
        return (
            not self.missing
            and self.coverage.passed
            and not any(api.status == ERROR for api in self.apis)
            and not (self.self_check and self.out_of_line)
            and (self.checklist is None or self.checklist.passed)
            and self.overflow is None
            and (self.trend is None or self.trend.passed)
        )

    @property
    def checklist_first(self) -> Difference | None:
        """The checklist difference that is the first divergence: the first failing one, when it comes no
        later than the first divergence among the calls (a difference at the start of a step comes before the
        step's calls: a re-seeded weight is named, not the conv that reads it). A weight's drift at a later
        step (:attr:`ChecklistResult.drifts`) never is.

        A numerics setting stands at the first call it changes: a call found by evidence of its own (an
        overflow, an own error out of line, statistics that break a relation) comes before it, as does a call
        where the error enters earlier in execution order (its inputs match: the setting had changed nothing
        yet); otherwise the setting is the first divergence, however the calls' errors grow after it."""
        # a drift is never it: it says the divergence began before the compared steps, not where
        failures = self.checklist.failures if self.checklist is not None else []
        fd = self.first_divergence
        for first in failures:
            if first.kind == SETTING:
                if fd is not None and self._call_before_setting(fd, first):
                    continue
                return first
            if fd is None or first.step is None or fd.step is None or first.step <= fd.step:
                return first
            return None
        return None

    def _call_before_setting(self, fd: Divergence, setting: Difference) -> bool:
        """Whether the first divergence among the calls comes before a setting's first changed call."""
        if fd.rule in (OVERFLOW, OUT_OF_LINE, INCONSISTENT):
            return True
        if fd.rule not in (ENTERS, ROUNDING) or setting.call_index is None:
            return False
        # (rounding is where the error enters, or grows, on a call whose own error is in line: a breach before
        # the setting changed any call did not come from it either)
        return self.apis[fd.api_index].order < self.apis[setting.call_index].order

    def first_call(self) -> tuple[str | None, str | None]:
        """The call and row where the first divergence shows first, whatever names it: a checklist difference's
        call (a setting's first changed call, the first reader of an input read off the records), else the first
        divergence among the calls; (None, None) where no call is named."""
        first, fd = self.checklist_first, self.first_divergence
        if first is not None and first.call_index is not None:
            api = self.apis[first.call_index]
            names = [self.rows[j].row for j in api.rows]
            if first.name in names:
                return api.api, first.name
            if fd is not None and fd.api_index == first.call_index:
                return api.api, fd.row
            worst = self.rows[api.worst_row].row if api.worst_row is not None else None
            return api.api, worst or (names[0] if names else None)
        if fd is not None:
            return fd.api, fd.row
        return None, None

    @property
    def several_ranks(self) -> bool:
        return len({p.rank for p in self.pairs if p.rank is not None}) > 1

    def first_divergence_text(self) -> str:
        """What the first divergence is, in a few words: ``parameter c2.weight (before step 0)``,
        ``Functional.relu.2.forward`` (empty for none): the junitxml property and the terminal summary."""
        first = self.checklist_first
        if first is not None and first.kind == SETTING:  # (its values are in the headline)
            return f"{first.kind} {first.name}"
        if first is not None:
            return first.headline(self.several_ranks).split(": ", 1)[0]
        return self.first_divergence.api if self.first_divergence is not None else ""

    def stack_of(self, api: ApiResult) -> tuple[str, ...]:
        """A call's stack: from its own dump pair's stack.json where each pair's was read, else by name."""
        if self.pair_stacks:
            return self.pair_stacks[api.pair].get(api.api, ())
        return self.stacks.get(api.api, ())

    @property
    def out_of_line(self) -> list[ApiResult]:
        """The calls whose own error is out of line, in execution order."""
        return sorted((self.apis[i] for i, v in self.own.items() if v.out_of_line), key=lambda a: a.order)

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

    # ------------------------------------------------------------------- what the reports read off the result
    @functools.cached_property
    def ranked_errors(self) -> tuple[RowResult, ...]:
        """The error rows, furthest over their tolerance (error / allowed) first; rows without a measured error
        rank with those exactly at zero. Ranked once: the console summary, the failure message and the HTML
        fragment all show these."""
        flagged = [r for r in self.rows if r.status == ERROR]
        flagged.sort(
            key=lambda r: -((r.error or 0.0) / (r.allowed or 1e-300)) if r.error is not None else 0.0
        )
        return tuple(flagged)

    def worst_rows(self, limit: int = 5) -> list[RowResult]:
        """The first ``limit`` of :attr:`ranked_errors`, the first divergence's row first, without the rows that
        repeat a tensor already shown (a call's output is the next call's input: the same two records), then
        each call's rows together, in the order its first row came."""
        ranked = list(self.ranked_errors)
        fd = self.first_divergence
        if fd is not None:
            first = self.rows[fd.row_index]
            ranked = [first, *(r for r in ranked if r is not first)]
        chosen: list[RowResult] = []
        seen: set[tuple[Leaf | None, Leaf | None]] = set()
        for r in ranked:
            if len(chosen) == limit:
                break
            same = (_record(r.target), _record(r.baseline))
            if None not in same and same in seen:
                continue
            seen.add(same)
            chosen.append(r)
        calls: dict[int, list[RowResult]] = {}
        for r in chosen:
            calls.setdefault(r.api_index, []).append(r)
        return [r for rows in calls.values() for r in rows]

    def row_records(self) -> list[dict[str, Any]]:
        """One flat record per compared row (plain numbers, ``None`` where a value is not there): the table
        :meth:`to_pandas` makes, for analysis in any tool (columns: :data:`pytest_msprobe.compare.frame.ROW_COLUMNS`)."""
        from pytest_msprobe.compare.frame import row_records

        return row_records(self)

    def to_pandas(self) -> Any:
        """The compared rows as a pandas DataFrame, one row per compared item (see :meth:`row_records` for the
        columns); needs pandas (``pip install 'pytest-msprobe[pandas]'``).

            >>> frame = compare("npu_dump", "gpu_dump").to_pandas()           # doctest: +SKIP
            >>> frame[frame.status == "error"].groupby("api").error.max()   # doctest: +SKIP
        """
        from pytest_msprobe.compare.frame import to_pandas

        return to_pandas(self)

    def breaching_inputs(self, api: ApiResult) -> list[RowResult]:
        """The rows of a call that breach and are not its outputs (inputs and parameters), in row order."""
        return [
            self.rows[i] for i in api.rows if self.rows[i].role != OUTPUT and self.rows[i].status == ERROR
        ]


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


def _record(side: RowSide) -> Leaf | None:
    """A tensor's record without what names its place (row name, role, file): what it holds; None for a
    record that holds nothing to tell two tensors apart by (no statistics, no CRC) and for other items."""
    if not is_tensor(side) or all(v is None for v in (*side.stats, side.md5)):
        return None
    return side._replace(name="", suffix="", role="", data_name=None, requires_grad=None)


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


def collective(api: ApiResult) -> str | None:
    """The collective a call is (``all_reduce`` for ``Distributed.all_reduce.3.forward``), None for any other."""
    return collective_op(api.api)


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
    own: OwnVerdict
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
