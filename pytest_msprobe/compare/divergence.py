"""The first divergence: where the error enters, not where it shows.

Over all compared API calls in execution order (forward, then backward; steps; ranks ordered through the
collectives they share, see :mod:`pytest_msprobe.compare.rank_order`), the first of these rules that applies
places it (the rule names are :data:`pytest_msprobe.compare.result.RULES`):

00. *overflow*: the earliest call whose output holds inf/nan on the target while the baseline's does not (see
   :mod:`pytest_msprobe.compare.overflow`), with where the inf/nan is first seen (a weight, an input no recorded
   call made, or its own output): whatever else breaches, an overflow is where to look first.

0. *out of line*: where calls have own errors (each call's output against the float64 replay of its own
   inputs, see :mod:`pytest_msprobe.compare.own`), the earliest call whose own error is out of line, at any
   step and whatever flowed into it, unless rule 1 finds a call without own errors earlier.
1. *enters*: the earliest call whose outputs breach while its inputs match (every input within a tenth of its
   tolerance: an input close to its line may have pushed the output over). The inputs of a backward call are
   the gradients flowing in plus the tensors its forward call saw (a backward kernel reads them); a module's
   ``parameters_grad`` has the inputs of the module's backward. The inputs of a collective are its inputs on
   every rank of its group: an all_reduce whose output differs on rank 0 while rank 0's own input matches
   does not let the error in when rank 1's input already differs.
1b. *source*: or, when it comes earlier, the earliest call with an input that differs and that no recorded call
   made (see :mod:`pytest_msprobe.compare.sources`): a weight, a buffer, the data or the output of an operation
   that is not recorded; the error enters with that input, at its first reader. A weight that drifts (every
   weight differs a little after an earlier step) is no source, and does not match the baseline as an input.
2. *structural*: otherwise, when the first error shows at or after a call that reads the output of a call
   only one side makes (an inserted or removed call, see :func:`pytest_msprobe.compare.explain.explain_structural`),
   the earliest such one-side call: the error enters with it. Not when rule 4 would find inputs of other
   shapes: then the dumps come from another model or data, which is more than a call added or removed.
3. *inconsistent*: the earliest breaching call without own errors whose statistics break a relation that
   its inputs' statistics fix, on the target, and keep on the baseline (a relu's Max is its input's, an add's
   Mean the sum of its inputs', see :mod:`pytest_msprobe.compare.stat_relations`): a statistics dump's own
   error, where no replay gives one. It comes before rule 1 when it is earlier, and applies whatever flowed in.
3b. *grows*: otherwise, if every breaching call already has breaching inputs (errors flow in everywhere: a later step after
   an earlier fault moved the weights, a dump that starts mid-run), the earliest call whose output error is at
   least ``amplification`` (10) times its input error.
4. *inherited*: otherwise the earliest breaching call; its inputs already differ, so the error entered before
   this dump.
5. *rounding*: when rule 1 or 3 lands on a call whose own error is in line and no call is out of line, the
   difference is no call's fault: it builds up from rounding (a new device may need a looser tolerance).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from pytest_msprobe.compare.records import OUTPUT
from pytest_msprobe.compare.result import (
    ENTERS,
    ERROR,
    GROWS,
    INCONSISTENT,
    INHERITED,
    OUT_OF_LINE,
    OVERFLOW,
    ROUNDING,
    SOURCE,
    STRUCTURAL,
    UNMATCHED,
    ApiResult,
    Divergence,
    Overflow,
    OwnVerdict,
    RowResult,
    fmt_number,
    shape_differs,
)
from pytest_msprobe.compare.sources import KIND_TEXT, NO_SOURCES, Sources, find_sources
from pytest_msprobe.format.own_errors import OwnError

# an input whose error exceeds this fraction of its tolerance does not count as matching the baseline (the
# warning level of the default dtype table): an output can only be where the error enters if its inputs are clean
NEAR_FRACTION = 0.1


def first_divergence(
    apis: Sequence[ApiResult],
    rows: Sequence[RowResult],
    feeds: Mapping[int, Sequence[int]],
    amplification: float,
    opaque: Collection[int] = (),
    peers: Mapping[int, Sequence[int]] | None = None,
    structural: Mapping[int, int] | None = None,
    own: Mapping[int, OwnVerdict] | None = None,
    self_check: bool = False,
    noise: Collection[int] = (),
    relations: Mapping[int, str] | None = None,
    overflow: Overflow | None = None,
) -> Divergence | None:
    """Where the error enters (see the module docstring). ``feeds[i]`` are the calls whose tensors call ``i``
    also reads (a backward call's forward call; a parameters_grad's module backward); the inputs of the
    calls in ``opaque`` are unknown, so the error cannot be shown to enter there. ``peers[i]`` are the same
    collective as call ``i`` on the other ranks of its group: their inputs are inputs of call ``i`` too (an
    all_reduce sums every rank's input), their outputs are not (they are the same result, and differ when
    call ``i``'s does). ``structural[i]`` is the call only one side makes whose output call ``i`` reads.
    ``own[i]`` is call ``i``'s own-error verdict, where it has one; an out-of-line call is a divergence of
    its own only with ``self_check`` (then it fails the compare), otherwise where something breaches.
    ``noise`` are the rows whose difference is too small to measure (every value within atol): as inputs they
    do not match the baseline, they are unknown. ``relations[i]`` says how call ``i``'s statistics break a
    relation on the target that they keep on the baseline. ``overflow`` is the first call that overflows on the
    target only (rule 00), where there is one."""
    if overflow is not None and overflow.api_index is not None and overflow.row_index is not None:
        return Divergence(
            overflow.api,
            overflow.row,
            overflow.step,
            overflow.rank,
            overflow.reason,
            OVERFLOW,
            overflow.api_index,
            overflow.row_index,
            overflow.where,
        )
    own = own or {}
    calls = _Calls.of(apis, rows, feeds, opaque, peers or {}, frozenset(noise))
    compared = sorted((api.order, i) for i, api in enumerate(apis) if api.status != UNMATCHED)
    breaching = [i for _, i in compared if apis[i].output_breach]
    failing = self_check or any(apis[i].status == ERROR for _, i in compared)
    # (an input from outside that differs names where the error enters only where something fails, and not
    # between two models: tensors of other shapes say the dumps are of another model or data)
    outside = failing and not any(r.status == ERROR and shape_differs(r) for r in rows)
    found = _earliest(apis, _enters(calls, breaching), _source(calls) if outside else None)
    out_of_line = min(((apis[i].order, i) for i, v in own.items() if v.out_of_line), default=None)
    if (
        out_of_line is not None
        and failing
        and (found is None or out_of_line[0] <= apis[found.api_index].order or found.api_index in own)
    ):
        return _out_of_line(calls, out_of_line[1], own[out_of_line[1]])
    inconsistent = _inconsistent(calls, breaching, relations or {}, own)
    if found is not None and (
        inconsistent is None or apis[found.api_index].order <= apis[inconsistent.api_index].order
    ):
        return _rounding(calls, found, own)
    fallback = inconsistent
    if fallback is None:
        fallback = _grows(calls, breaching, amplification)
    if fallback is not None and fallback.rule == GROWS:
        fallback = _rounding(calls, fallback, own)
    if fallback is None:
        fallback = _inherited(
            calls, breaching or [i for _, i in compared if apis[i].status == ERROR], amplification
        )
        if fallback is None:
            return None
        if inputs_of_other_shapes(apis[fallback.api_index], rows):
            return fallback  # another model or data, more than a call added or removed
    return _structural(calls, structural or {}) or fallback


def inputs_matcher(
    apis: Sequence[ApiResult],
    rows: Sequence[RowResult],
    feeds: Mapping[int, Sequence[int]],
    opaque: Collection[int],
    peers: Mapping[int, Sequence[int]],
    noise: Collection[int],
) -> Callable[[int], bool]:
    """Whether every input of call ``i`` matches the baseline (within a tenth of its tolerance; see rule 1):
    then an output that breaches shows the error entering at this call. The calls (and the inputs from outside
    them) are read once, for every call asked about."""
    calls = _Calls.of(apis, rows, feeds, opaque, peers, frozenset(noise))
    return lambda i: not calls.effective_inputs(i)[2]


def inputs_of_other_shapes(api: ApiResult, rows: Sequence[RowResult]) -> list[int]:
    """The breaching input rows of a call whose two tensors have other shapes (indices into ``rows``)."""
    return [
        j for j in api.rows if rows[j].role != OUTPUT and rows[j].status == ERROR and shape_differs(rows[j])
    ]


@dataclass(frozen=True)
class _Calls:
    """The compared calls with what their inputs are made of."""

    apis: Sequence[ApiResult]
    rows: Sequence[RowResult]
    feeds: Mapping[int, Sequence[int]]
    opaque: Collection[int]
    peers: Mapping[int, Sequence[int]]
    noise: frozenset[int] = frozenset()
    sources: Sources = NO_SOURCES

    @classmethod
    def of(
        cls,
        apis: Sequence[ApiResult],
        rows: Sequence[RowResult],
        feeds: Mapping[int, Sequence[int]],
        opaque: Collection[int],
        peers: Mapping[int, Sequence[int]],
        noise: frozenset[int],
    ) -> _Calls:
        """The calls, with the inputs that came from outside the recorded calls."""
        # (a tensor of another shape is another model's or data's, not an input that came in from outside)
        differs = frozenset(
            j
            for j, r in enumerate(rows)
            if (r.status == ERROR or (j not in noise and _close_to_line(r))) and not shape_differs(r)
        )
        return cls(apis, rows, feeds, opaque, peers, noise, find_sources(apis, rows, differs))

    def near(self, j: int) -> bool:
        # within a tenth of its tolerance: a row this close to the line does not "match" the baseline; nor
        # does one whose difference is too small to measure, nor a weight that drifts
        return j in self.noise or j in self.sources.drifting or _close_to_line(self.rows[j])

    def effective_inputs(self, i: int) -> tuple[float | None, bool, bool]:
        """(largest input error, whether an input breaches, whether an input is near or over its tolerance)."""
        apis, rows, near = self.apis, self.rows, self.near
        api = apis[i]
        errors = [api.input_error] if api.input_error is not None else []
        breach = api.input_breach or i in self.opaque
        tainted = breach or any(near(j) for j in api.rows if rows[j].role != OUTPUT)
        for j in self.feeds.get(i, ()):
            other = apis[j]
            if other.status == UNMATCHED:
                continue
            errors.extend(e for e in (other.input_error, other.output_error) if e is not None)
            breach = breach or other.input_breach or other.output_breach
            tainted = tainted or breach or any(near(k) for k in other.rows)
        for j in self.peers.get(i, ()):
            other = apis[j]
            if other.status == UNMATCHED:
                continue
            if other.input_error is not None:
                errors.append(other.input_error)
            breach = breach or other.input_breach
            tainted = tainted or breach or any(near(k) for k in other.rows if rows[k].role != OUTPUT)
        return (max(errors) if errors else None), breach, tainted

    def at(self, i: int, rule: str, why: str, row: int | None = None) -> Divergence:
        """The divergence at call ``i``, pointing at ``row`` (by default its worst output row)."""
        api = self.apis[i]
        if row is None:
            row = _worst_output_row(api, self.rows)
        return Divergence(api.api, self.rows[row].row, api.step, api.rank, why, rule, i, row)


def _close_to_line(r: RowResult) -> bool:
    """Whether a row's measured difference is over a tenth of its tolerance."""
    return r.error is not None and r.allowed is not None and r.error > r.allowed * NEAR_FRACTION


def _enters(calls: _Calls, breaching: list[int]) -> Divergence | None:
    apis, rows = calls.apis, calls.rows
    for i in breaching:
        _, _, in_tainted = calls.effective_inputs(i)
        if in_tainted:
            continue
        api = apis[i]
        row = _worst_output_row(api, rows)
        group = {apis[j].rank for j in calls.peers.get(i, ())} | {api.rank}
        ranks = sorted(r for r in group if r is not None)
        inputs = f"its inputs on ranks {', '.join(map(str, ranks))}" if len(ranks) > 1 else "its inputs"
        if rows[row].error is None:  # not a measured difference: the record itself cannot be compared
            why = (
                f"its output cannot be compared ({_suffix(api, rows, row)}: {rows[row].reason}) while {inputs} "
                "match the baseline: the first row to fix is here"
            )
        else:
            why = (
                f"its output differs ({_suffix(api, rows, row)}: {rows[row].reason}) while {inputs} match "
                f"the baseline: the error enters here"
            )
        return calls.at(i, ENTERS, why, row)
    return None


def _source(calls: _Calls) -> Divergence | None:
    """The earliest call that reads an input from outside the recorded calls that differs (rule 1b)."""
    first = calls.sources.first(calls.apis)
    if first is None:
        return None
    api, row = calls.apis[first.api_index], calls.rows[first.row_index]
    why = (
        f"{first.kind}: its {_suffix(api, calls.rows, first.row_index).lstrip('.')} ({KIND_TEXT[first.kind]}) "
        f"differs from the baseline's ({row.reason or 'near its tolerance'}) and no recorded call made it: the "
        "error comes in here, from outside the recorded calls"
    )
    found = calls.at(first.api_index, SOURCE, why, first.row_index)
    return replace(found, source=first.kind)


def _earliest(apis: Sequence[ApiResult], *found: Divergence | None) -> Divergence | None:
    """The divergence at the earliest call of those found."""
    return min((d for d in found if d is not None), key=lambda d: apis[d.api_index].order, default=None)


def _inconsistent(
    calls: _Calls, breaching: list[int], relations: Mapping[int, str], own: Mapping[int, OwnVerdict]
) -> Divergence | None:
    for i in breaching:
        if i in relations and i not in own:
            why = f"{relations[i]}: the error enters here, whatever flowed into it"
            return calls.at(i, INCONSISTENT, why)
    return None


def _grows(calls: _Calls, breaching: list[int], amplification: float) -> Divergence | None:
    drifting, rows, apis = calls.sources.drifting, calls.rows, calls.apis
    # the drift's scale so far: the largest output error of a call that reads a drifting input, by step and rank
    # (a weight's statistics say too little of how much it changed: its readers' outputs say it)
    scale: dict[tuple[int | None, int | None], float] = {}
    by_order = sorted((a.order, k) for k, a in enumerate(apis) if a.status != UNMATCHED)
    candidates = set(breaching)
    best: tuple[float, int, float, float] | None = None  # in a drifting step: the largest growth
    for _, i in by_order:
        api = apis[i]
        place = (api.step, api.rank)
        drifts = any(j in drifting for j in api.rows)
        out_err, so_far = api.output_error, scale.get(place, 0.0)
        if drifts and out_err is not None and math.isfinite(out_err):
            scale[place] = max(so_far, out_err)
        if i not in candidates:
            continue
        if drifts:  # measured from the other inputs and the drift's scale before it
            others = [
                e
                for j in api.rows
                if rows[j].role != OUTPUT and j not in drifting and (e := rows[j].error) is not None
            ]
            in_err: float | None = max([*others, so_far])
        else:
            in_err, _, _ = calls.effective_inputs(i)
        # a ratio means something only for a finite input error: inputs that differ beyond measure (another
        # shape, NaN/Inf on one side) cannot show the error growing
        if not in_err or not math.isfinite(in_err) or out_err is None or out_err < amplification * in_err:
            continue
        if place in scale:  # the weights drift: every call grows a little, the one that grows most is it
            if best is None or out_err / in_err > best[0]:
                best = (out_err / in_err, i, in_err, out_err)
            continue
        return _grown(calls, i, in_err, out_err)
    if best is not None:
        return _grown(calls, best[1], best[2], best[3])
    return None


def _grown(calls: _Calls, i: int, in_err: float, out_err: float) -> Divergence:
    if math.isfinite(out_err):
        growth = (
            f"the output error {fmt_number(out_err)} is {out_err / in_err:.0f}x the input error "
            f"{fmt_number(in_err)}"
        )
    else:
        growth = (
            f"the output differs beyond measure (NaN/Inf on one side only, or another shape) while the input "
            f"error is {fmt_number(in_err)}"
        )
    why = f"errors already flow into every call; here {growth}: the error grows here"
    return calls.at(i, GROWS, why)


def _inherited(calls: _Calls, candidates: list[int], amplification: float) -> Divergence | None:
    """The earliest of ``candidates`` (the breaching calls, else the failing ones), whose inputs already differ."""
    if not candidates:
        return None
    apis, rows = calls.apis, calls.rows
    i = candidates[0]
    if not any(rows[j].role != OUTPUT and rows[j].status == ERROR for j in apis[i].rows):
        # a collective whose own inputs match: the error came in with another rank's input to it
        for j in sorted(calls.peers.get(i, ()), key=lambda j: apis[j].order):
            if apis[j].input_breach:
                i = j
                break
    api = apis[i]
    in_rows = [j for j in api.rows if rows[j].role != OUTPUT and rows[j].status == ERROR]
    if not in_rows:  # (its inputs are unknown)
        return calls.at(
            i, INHERITED, "its inputs cannot be compared, and no call's error is shown to enter later"
        )
    first_in = in_rows[0]
    reshaped = inputs_of_other_shapes(api, rows)
    if reshaped:  # a shape is not a matter of precision
        first_in = reshaped[0]
        why = (
            f"its inputs have other shapes ({rows[first_in].row}: {rows[first_in].reason}): the two dumps may not "
            "come from the same model or data (another architecture, other layer sizes, another batch), so no "
            "call's error can be shown to enter or grow"
        )
    elif all(rows[j].error is not None and math.isinf(rows[j].error or 0.0) for j in in_rows):
        why = (
            f"its inputs differ beyond measure ({rows[first_in].row}: {rows[first_in].reason}): one run "
            "overflowed before this dump (dump an earlier step), so no call's error can be shown to enter or grow"
        )
    else:
        why = (
            f"its inputs already differ ({rows[first_in].row}): the error entered before this dump (an earlier "
            f"step, the weights or the data), and no later call's output error is {amplification:g}x its input "
            "error"
        )
    # the row to look at is the input that already differs
    return calls.at(i, INHERITED, why, first_in)


def _structural(calls: _Calls, structural: Mapping[int, int]) -> Divergence | None:
    """The one-side call that the calls reading its output follow, when the first error shows at or after
    one of them (``structural``: call -> the one-side call it follows)."""
    apis, rows = calls.apis, calls.rows
    failing = [api for api in apis if api.status == ERROR]
    if not failing or not structural:
        return None
    first = min(failing, key=lambda a: a.order)
    before = [(apis[c].order, source) for c, source in structural.items() if apis[c].order <= first.order]
    if not before:
        return None
    _, source = min(before)
    api = apis[source]
    out_rows = [j for j in api.rows if rows[j].role == OUTPUT] or list(api.rows)
    side = "target" if rows[out_rows[0]].target is not None else "baseline"
    why = (
        f"{api.api} is a call only the {side} makes, and the numbers after it differ (first breach: {first.api}, "
        f"{first.reason}): the error enters with this extra call"
    )
    return calls.at(source, STRUCTURAL, why, out_rows[0])


def _out_of_line(calls: _Calls, i: int, v: OwnVerdict) -> Divergence:
    base = v.baseline
    theirs = (
        f"; the baseline's own error: {own_summary(base)}"
        if base is not None
        else "; the baseline has no own error to hold it to"
    )
    why = (
        f"its own error is out of line ({v.reason}): against the float64 replay of its own inputs, "
        f"{own_summary(v.target)}{theirs}: the error enters here, whatever flowed into it"
    )
    return calls.at(i, OUT_OF_LINE, why)


def own_summary(err: OwnError | None) -> str:
    """``0.900% of 4096 elements off, max rel 0.0101, RMSE 1.2e-05`` for an own error; ``none`` for None."""
    if err is None:
        return "none"
    return (
        f"{err.rel_share:.3%} of {err.elements} elements off, max rel {fmt_number(err.max_rel)}, "
        f"RMSE {fmt_number(err.rmse)}"
    )


def _rounding(calls: _Calls, found: Divergence, own: Mapping[int, OwnVerdict]) -> Divergence:
    """``found`` (rule 1 or 3) renamed for what it is when its call's own error is in line and none is out
    of line: the difference builds up from rounding."""
    v = own.get(found.api_index)
    if (
        found.rule == SOURCE
        or v is None
        or v.out_of_line
        or v.skipped
        or any(o.out_of_line for o in own.values())
    ):
        return found
    unreplayed = [
        calls.apis[i].api
        for i in sorted(own, key=lambda i: calls.apis[i].order)
        if own[i].skipped
        and calls.apis[i].status == ERROR
        and calls.apis[i].order <= calls.apis[found.api_index].order
    ]
    suspects = (
        f"; calls not replayed that breach before it: {', '.join(unreplayed[:3])}" if unreplayed else ""
    )
    why = (
        f"no API is out of line: the difference builds up from rounding ({found.api}'s own error, against "
        f"the float64 replay of its own inputs, is within its standard: {own_summary(v.target)}){suspects}. If the two devices are both right, "
        "the new device may need a looser tolerance for this dtype"
    )
    return Divergence(
        found.api, found.row, found.step, found.rank, why, ROUNDING, found.api_index, found.row_index
    )


def _worst_output_row(api: ApiResult, rows: Sequence[RowResult]) -> int:
    candidates = [i for i in api.rows if rows[i].role == OUTPUT and rows[i].status == ERROR]
    if not candidates:
        candidates = [i for i in api.rows if rows[i].status == ERROR] or list(api.rows)
    return max(candidates, key=lambda i: (rows[i].error or 0.0, -i))


def _suffix(api: ApiResult, rows: Sequence[RowResult], i: int) -> str:
    return rows[i].row[len(api.api) :] if rows[i].row.startswith(api.api) else rows[i].row
