"""The result of a compare: one object, of which every report is a view.

Rows are in report order (each dump's execution order, steps then ranks); every API call has an
:class:`ApiResult` (verdict, input and output error, its rows, its execution-order index); the first
divergence points at one of them; :class:`Coverage` says how much of the baseline found a partner.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pytest_msprobe.compare import frame, judging
from pytest_msprobe.compare.alignment import Coverage, collective_op
from pytest_msprobe.compare.checklist import SETTING, ChecklistResult, Difference
from pytest_msprobe.compare.diagnosis import (
    ENTERS,
    INCONSISTENT,
    OUT_OF_LINE,
    OVERFLOW,
    ROUNDING,
    AcrossDevices,
    Divergence,
)
from pytest_msprobe.compare.dumps import OUTPUT, Leaf, Modules
from pytest_msprobe.compare.judging import (
    ERROR,
    STATUSES,
    ApiResult,
    RowResult,
    is_tensor,
)
from pytest_msprobe.compare.trend import TrendResult
from pytest_msprobe.moved import names_from
from pytest_msprobe.thresholds import Thresholds

# what comes first in a compare (Verdict.cause): a checklist difference (a numerics setting, or data, weights,
# hyperparameters, structure), else the first divergence among the calls (an overflow, or another call), else
# the trend, else what was not compared (dumps the target lacks, too little of the baseline paired)
CAUSE_SETTING, CAUSE_CHECKLIST, CAUSE_OVERFLOW, CAUSE_CALL = "setting", "checklist", "overflow", "call"
CAUSE_TREND, CAUSE_MISSING, CAUSE_COVERAGE = "trend", "missing", "coverage"
CAUSES = (
    CAUSE_SETTING,
    CAUSE_CHECKLIST,
    CAUSE_OVERFLOW,
    CAUSE_CALL,
    CAUSE_TREND,
    CAUSE_MISSING,
    CAUSE_COVERAGE,
)


@dataclass(frozen=True)
class Verdict:
    """The test's verdict, worked out once per compare (:attr:`CompareResult.verdict`): whether it passed, and
    what comes first. ``checklist`` is the checklist difference that is the first divergence (it comes before
    the calls' first divergence, ``divergence``, which the reports still show after it); ``text`` names the first
    divergence in a few words (``parameter c2.weight (before step 0)``, ``Functional.relu.2.forward``); ``api``
    and ``row`` are the call and row where it shows first; ``rank`` the rank it is on, where the run had several
    and a rank tells; ``trend_only`` that the trend alone fails (the dumped steps agree)."""

    passed: bool
    cause: str | None  # one of CAUSES; None where nothing differs
    checklist: Difference | None
    divergence: Divergence | None
    text: str
    api: str | None
    row: str | None
    rank: int | None
    trend_only: bool


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
    pairs: tuple[judging.DumpPair, ...]
    unpaired: tuple[str, ...]  # dumps (step/rank) present on one side only
    thresholds: Thresholds
    timestamp: str  # YYYYmmddHHMMSS, names the report files
    coverage: Coverage
    stacks: dict[str, tuple[str, ...]] = field(default_factory=dict)  # target API name -> call stack
    # per dump pair (``pairs`` order), the target's stacks, where every pair's stack.json was read: a name's
    # stack may differ between steps (an optimizer's first step has no momentum buffer yet)
    pair_stacks: tuple[dict[str, tuple[str, ...]], ...] = ()
    missing: tuple[str, ...] = ()  # the unpaired dumps that only the baseline has: they fail the compare
    own: dict[int, judging.OwnErrorVerdict] = field(
        default_factory=dict
    )  # apis index -> own errors, where there are
    self_check: bool = False  # whether an out-of-line call fails the compare (the self-check was asked for)
    checklist: ChecklistResult | None = None  # what differs before any call: data, weights, settings
    overflow: judging.Overflow | None = (
        None  # the first call that overflows on the target only (it fails the compare)
    )
    trend: TrendResult | None = None  # the trend over many steps, where the test records one
    modules: Modules = field(default_factory=Modules)  # the model's modules the calls were made in
    # what was set aside, neither compared nor unmatched, one line per dump pair and cause (an optimizer that
    # records no update per parameter, gradient clipping made of other calls on each side)
    set_aside: tuple[str, ...] = ()
    # how the calls were judged when the runs ran on different devices (None: on one device, values judge)
    across: AcrossDevices | None = None

    @functools.cached_property
    def verdict(self) -> Verdict:
        """Whether the compare passed and what comes first, decided once: every report and the test's outcome
        read this."""
        first = self._checklist_first()
        fd = self.first_divergence
        trend_only = (
            self.trend is not None
            and not self.trend.passed
            and not self.missing
            and self.coverage.passed
            and not self.failures
            and not (self.self_check and self.out_of_line)
        )
        cause: str | None
        if first is not None:
            cause = CAUSE_SETTING if first.kind == SETTING else CAUSE_CHECKLIST
        elif fd is not None:
            cause = CAUSE_OVERFLOW if fd.rule == OVERFLOW else CAUSE_CALL
        elif self.trend is not None and not self.trend.passed:
            cause = CAUSE_TREND
        elif self.missing:
            cause = CAUSE_MISSING
        elif not self.coverage.passed:
            cause = CAUSE_COVERAGE
        else:
            cause = None
        if first is None:
            rank = fd.rank if fd is not None else None
        else:  # a setting: the rank of the first call it changes; another difference names no rank
            rank = first.rank if first.kind == SETTING and self.several_ranks else None
        api, row = self._first_call(first)
        return Verdict(
            passed=(
                not self.missing
                and self.coverage.passed
                and not any(a.status == ERROR for a in self.apis)
                and not (self.self_check and self.out_of_line)
                and (self.checklist is None or self.checklist.passed)
                and self.overflow is None
                and (self.trend is None or self.trend.passed)
            ),
            cause=cause,
            checklist=first,
            divergence=fd,
            text=self._first_text(first),
            api=api,
            row=row,
            rank=rank,
            trend_only=trend_only,
        )

    @property
    def passed(self) -> bool:
        """No API breaches, the target has every step and rank the baseline has, enough of the baseline found
        a partner, (with the self-check) no call's own error is out of line, the checklists agree on the data,
        the weights, the structure and the hyperparameters, and the trend (where there is one) agrees."""
        return self.verdict.passed

    @property
    def checklist_first(self) -> Difference | None:
        """The checklist difference that is the first divergence (:attr:`Verdict.checklist`)."""
        return self.verdict.checklist

    def first_call(self) -> tuple[str | None, str | None]:
        """The call and row where the first divergence shows first (:attr:`Verdict.api`, :attr:`Verdict.row`)."""
        return self.verdict.api, self.verdict.row

    def first_divergence_text(self) -> str:
        """What the first divergence is, in a few words (:attr:`Verdict.text`)."""
        return self.verdict.text

    def _checklist_first(self) -> Difference | None:
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

    def _first_call(self, first: Difference | None) -> tuple[str | None, str | None]:
        """The call and row where the first divergence shows first, whatever names it: a checklist difference's
        call (a setting's first changed call, the first reader of an input read off the records), else the first
        divergence among the calls; (None, None) where no call is named."""
        fd = self.first_divergence
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

    def _first_text(self, first: Difference | None) -> str:
        """What the first divergence is, in a few words: ``parameter c2.weight (before step 0)``,
        ``Functional.relu.2.forward`` (empty for none): the junitxml property and the terminal summary."""
        if first is not None and first.kind == SETTING:  # (its values are in the headline)
            return f"{first.kind} {first.name}"
        if first is not None:
            return first.headline(self.several_ranks).split(": ", 1)[0]
        return self.first_divergence.api if self.first_divergence is not None else ""

    @property
    def several_ranks(self) -> bool:
        return len({p.rank for p in self.pairs if p.rank is not None}) > 1

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
        return frame.row_records(self.rows, self.apis, self.first_divergence)

    def to_pandas(self) -> Any:
        """The compared rows as a pandas DataFrame, one row per compared item (see :meth:`row_records` for the
        columns); needs pandas (``pip install 'pytest-msprobe[pandas]'``).

            >>> frame = compare("npu_dump", "gpu_dump").to_pandas()           # doctest: +SKIP
            >>> frame[frame.status == "error"].groupby("api").error.max()   # doctest: +SKIP
        """
        return frame.to_pandas(self.rows, self.apis, self.first_divergence)

    def breaching_inputs(self, api: ApiResult) -> list[RowResult]:
        """The rows of a call that breach and are not its outputs (inputs and parameters), in row order."""
        return [
            self.rows[i] for i in api.rows if self.rows[i].role != OUTPUT and self.rows[i].status == ERROR
        ]


def _record(side: judging.RowSide) -> Leaf | None:
    """A tensor's record without what names its place (row name, role, file): what it holds; None for a
    record that holds nothing to tell two tensors apart by (no statistics, no CRC) and for other items."""
    if not is_tensor(side) or all(v is None for v in (*side.stats, side.md5)):
        return None
    return side._replace(name="", suffix="", role="", data_name=None, requires_grad=None)


def collective(api: ApiResult) -> str | None:
    """The collective a call is (``all_reduce`` for ``Distributed.all_reduce.3.forward``), None for any other."""
    return collective_op(api.api)


# the names this module handed on in the package's earlier layout, now read from their packages (pytest_msprobe.moved)
_HOMES = "judging judging.metrics judging.overflow judging.self_check diagnosis diagnosis.rules alignment"
_HOMES += " alignment.coverage dumps dumps.modules trend checklist"
__getattr__ = names_from(__name__, [f"pytest_msprobe.compare.{home}" for home in _HOMES.split()])
