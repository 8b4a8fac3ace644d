"""The first divergence: where the error enters, not where it shows.

Over all compared API calls in execution order (forward, then backward; steps; ranks ordered through the
collectives they share, see :mod:`pytest_msprobe.compare.alignment.rank_order`), the first of these rules that applies
places it (the rule names are :data:`pytest_msprobe.compare.result.RULES`):

00. *overflow*: the earliest call whose output holds inf/nan on the target while the baseline's does not (see
   :mod:`pytest_msprobe.compare.judging.overflow`), with where the inf/nan is first seen (a weight, an input no recorded
   call made, or its own output): whatever else breaches, an overflow is where to look first.

0. *out of line*: where calls have own errors (each call's output against the float64 replay of its own
   inputs, see :mod:`pytest_msprobe.compare.judging.self_check`), the earliest call whose own error is out of line, at any
   step and whatever flowed into it, unless rule 1 finds a call without own errors earlier.
1. *enters*: the earliest call whose outputs breach while its inputs match (every input within a tenth of its
   tolerance, and of its output's where that is tighter, as a float32 loss's of bfloat16 logits: an input close
   to the line may have pushed the output over). The inputs of a backward call are
   the gradients flowing in plus the tensors its forward call saw (a backward kernel reads them); a module's
   ``parameters_grad`` has the inputs of the module's backward. The inputs of a collective are its inputs on
   every rank of its group: an all_reduce whose output differs on rank 0 while rank 0's own input matches
   does not let the error in when rank 1's input already differs.
1a. *enters*, too: where every call of a step before it matches the baseline exactly (a same-device rerun of
   the same code: the differences start somewhere), the earliest call whose output differs, by at least a
   tenth of its tolerance or beyond it, while its inputs match exactly, when a later call breaches: the
   difference starts there, however far below its tolerance (a softmax computed in float16 whose own
   statistics stay within float32's). Not at a step whose weights drift, nor across devices (their rounding
   differs from the first call that computes).
1b. *source*: or, when it comes earlier, the earliest call with an input that differs and that no recorded call
   made (see :mod:`pytest_msprobe.compare.diagnosis.sources`): a weight, a buffer, the data or the output of an operation
   that is not recorded; the error enters with that input, at its first reader. A weight that drifts (every
   weight differs a little after an earlier step) is no source, and does not match the baseline as an input.
1c. *source*, changed: at a later step, the one tensor the step starts with that changed since the step before
   (see :mod:`pytest_msprobe.compare.diagnosis.sources`), at its first reader; after rule 3 (the update that changes it
   again may show its own error), before rules 3b and 4.
2. *structural*: otherwise, when the first error shows at or after a call that reads the output of a call
   only one side makes (an inserted or removed call, see :func:`pytest_msprobe.compare.explain.explain_structural`),
   the earliest such one-side call: the error enters with it. Not when rule 4 would find inputs of other
   shapes: then the dumps come from another model or data, which is more than a call added or removed.
3. *inconsistent*: the earliest breaching call without own errors whose statistics break a relation that
   its inputs' statistics fix, on the target, and keep on the baseline (a relu's Max is its input's, an add's
   Mean the sum of its inputs', see :mod:`pytest_msprobe.compare.judging.stat_relations`): a statistics dump's own
   error, where no replay gives one; or any breaching call whose output has another floating dtype than the
   baseline's while its inputs' dtypes match (no value flowing in changes a dtype). It comes before rule 1
   when it is earlier, and applies whatever flowed in.
3b. *grows*: otherwise, if every breaching call already has breaching inputs (errors flow in everywhere: a later step after
   an earlier fault moved the weights, a dump that starts mid-run), the earliest call whose output error is at
   least ``amplification`` (10) times its input error (where the weights drift, the one that grows it most).
   A call before the first breach of its step whose output stays within its tolerance but over a tenth of it
   may be that call too: a bfloat16 activation grown 100x within bfloat16's tolerance, only the float32 loss
   after it breaching.
4. *inherited*: otherwise the earliest breaching call; its inputs already differ, so the error entered before
   this dump.
5. *rounding*: when rule 1 or 3 lands on a call whose own error is in line and no call is out of line, the
   difference is no call's fault: it builds up from rounding (a new device may need a looser tolerance).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

from pytest_msprobe.compare.diagnosis import fallback
from pytest_msprobe.compare.diagnosis.calls import (
    Calls,
    close_to_line,
    inputs_of_other_shapes,
    suffix,
    worst_output_row,
)
from pytest_msprobe.compare.diagnosis.rules import (
    ENTERS,
    GROWS,
    INCONSISTENT,
    OUT_OF_LINE,
    OVERFLOW,
    ROUNDING,
    SOURCE,
    UNRECORDED_SOURCE,
    Divergence,
)
from pytest_msprobe.compare.diagnosis.sources import ALONE, CHANGED_SINCE, KIND_TEXT, Source
from pytest_msprobe.compare.dumps import OUTPUT, Leaf
from pytest_msprobe.compare.judging import (
    DTYPE,
    ERROR,
    UNMATCHED,
    ApiResult,
    Overflow,
    OwnErrorVerdict,
    RowResult,
    fmt_number,
    shape_differs,
)
from pytest_msprobe.format.own_errors import OwnError


def first_divergence(
    apis: Sequence[ApiResult],
    rows: Sequence[RowResult],
    feeds: Mapping[int, Sequence[int]],
    amplification: float,
    opaque: Collection[int] = (),
    peers: Mapping[int, Sequence[int]] | None = None,
    structural: Mapping[int, int] | None = None,
    own: Mapping[int, OwnErrorVerdict] | None = None,
    self_check: bool = False,
    noise: Collection[int] = (),
    relations: Mapping[int, str] | None = None,
    overflow: Overflow | None = None,
    across_devices: bool = False,
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
    target only (rule 00), where there is one. ``across_devices``: the checklists say the runs ran on different
    devices or numerics settings, where rounding makes the first difference (rule 1a says nothing there)."""
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
    calls = Calls.of(apis, rows, feeds, opaque, peers or {}, frozenset(noise))
    compared = sorted((api.order, i) for i, api in enumerate(apis) if api.status != UNMATCHED)
    breaching = [i for _, i in compared if apis[i].output_breach]
    failing = self_check or any(apis[i].status == ERROR for _, i in compared)
    # (an input from outside that differs names where the error enters only where something fails, and not
    # between two models: tensors of other shapes say the dumps are of another model or data)
    outside = failing and not any(r.status == ERROR and shape_differs(r) for r in rows)
    found = _earliest(
        apis,
        _enters(calls, breaching),
        _source(calls) if outside else None,
        _first_difference(calls, compared) if failing and not across_devices else None,
    )
    out_of_line = min(((apis[i].order, i) for i, v in own.items() if v.out_of_line), default=None)
    if (
        out_of_line is not None
        and failing
        and (found is None or out_of_line[0] <= apis[found.api_index].order or found.api_index in own)
    ):
        return _out_of_line(calls, out_of_line[1], own[out_of_line[1]])
    inconsistent = _inconsistent(calls, breaching, relations or {}, own)
    changed = _changed(calls) if outside else None
    if found is not None and all(
        other is None or apis[found.api_index].order <= apis[other.api_index].order
        for other in (inconsistent, changed)
    ):
        return _rounding(calls, found, own)
    late = inconsistent or changed
    if late is None:
        late = fallback.grows(calls, _may_grow(calls, compared, breaching), amplification)
    if late is not None and late.rule == GROWS:
        late = _rounding(calls, late, own)
    if late is None:
        late = fallback.inherited(
            calls, breaching or [i for _, i in compared if apis[i].status == ERROR], amplification
        )
        if late is None:
            return None
        if inputs_of_other_shapes(apis[late.api_index], rows):
            return late  # another model or data, more than a call added or removed
    return fallback.structural(calls, structural or {}) or late


def _enters(calls: Calls, breaching: list[int]) -> Divergence | None:
    apis, rows = calls.apis, calls.rows
    for i in breaching:
        if not calls.inputs_match(i):
            continue
        api = apis[i]
        row = worst_output_row(api, rows)
        group = {apis[j].rank for j in calls.peers.get(i, ())} | {api.rank}
        ranks = sorted(r for r in group if r is not None)
        inputs = f"its inputs on ranks {', '.join(map(str, ranks))}" if len(ranks) > 1 else "its inputs"
        if rows[row].error is None:  # not a measured difference: the record itself cannot be compared
            why = (
                f"its output cannot be compared ({suffix(api, rows, row)}: {rows[row].reason}) while {inputs} "
                "match the baseline: the first row to fix is here"
            )
        else:
            why = (
                f"its output differs ({suffix(api, rows, row)}: {rows[row].reason}) while {inputs} match "
                f"the baseline: the error enters here"
            )
        return calls.at(i, ENTERS, why, row)
    return None


def _first_difference(calls: Calls, compared: Sequence[tuple[int, int]]) -> Divergence | None:
    """Rule 1a: where the calls of a step match the baseline exactly up to one whose output differs while its
    inputs match exactly, the earliest such call (the difference starts there, however small)."""
    apis, rows = calls.apis, calls.rows
    # (a step whose weights drift starts with differences: where they show first says nothing)
    done = {(apis[rows[j].api_index].step, apis[rows[j].api_index].rank) for j in calls.sources.drifting}
    exact: set[tuple[int | None, int | None]] = set()  # places with a call that matched exactly so far
    for _, i in compared:
        api = apis[i]
        place = (api.step, api.rank)
        if place in done:
            continue
        # (a backward call reads its forward call's tensors; a collective, its peers' inputs)
        ins = [rows[j] for j in api.rows if rows[j].role != OUTPUT]
        ins += [rows[k] for f in calls.feeds.get(i, ()) for k in apis[f].rows]
        ins += [rows[k] for p in calls.peers.get(i, ()) for k in apis[p].rows if rows[k].role != OUTPUT]
        outs = [rows[j] for j in api.rows if rows[j].role == OUTPUT]
        if i in calls.opaque or any(_differs(r) for r in ins):
            done.add(place)  # an input differs before any output does: a source, or not exact
            continue
        differs = [j for j in api.rows if rows[j].role == OUTPUT and _differs(rows[j])]
        if not differs:
            if outs:
                exact.add(place)
            continue
        row = max(differs, key=lambda j: (rows[j].error or 0.0, -j))
        if api.status != ERROR and not close_to_line(rows[row]):
            continue  # a difference too small to start anything (a reduction's last bit)
        done.add(place)
        if place not in exact:
            continue
        if api.status != ERROR and not any(
            apis[k].status == ERROR and apis[k].order > api.order for _, k in compared
        ):
            continue  # nothing breaches after it
        if api.status == ERROR:
            how = "while its inputs match the baseline exactly: the error enters here"
        else:
            how = (
                "while its inputs, and every call before it in the step, match the baseline exactly: the "
                "difference starts here, and breaches later"
            )
        why = f"its output differs ({suffix(api, rows, row)}: {rows[row].reason or 'within its tolerance'}) {how}"
        return calls.at(i, ENTERS, why, row)
    return None


def _may_grow(calls: Calls, compared: Sequence[tuple[int, int]], breaching: list[int]) -> list[int]:
    """The calls rule 3b may name, in order: the breaching ones, and those before the first breach of their step
    and rank whose output stays within its tolerance but over a tenth of it (under autocast a bfloat16
    activation 100x off stays within bfloat16's, and only the float32 loss after it breaches)."""
    apis, rows = calls.apis, calls.rows
    first: dict[tuple[int | None, int | None], int] = {}
    for i in breaching:
        first.setdefault((apis[i].step, apis[i].rank), apis[i].order)
    near = [
        i
        for _, i in compared
        if not apis[i].output_breach
        and apis[i].order < first.get((apis[i].step, apis[i].rank), -1)
        and any(rows[j].role == OUTPUT and close_to_line(rows[j]) for j in apis[i].rows)
    ]
    return sorted(breaching + near, key=lambda i: apis[i].order)


def _differs(r: RowResult) -> bool:
    """Whether a row's two sides differ at all (a row not measured differs only where it breaches)."""
    return r.status == ERROR if r.error is None else r.error != 0.0


def _source(calls: Calls) -> Divergence | None:
    """The earliest call that reads an input from outside the recorded calls that differs (rule 1b)."""
    first = calls.sources.first(calls.apis)
    if first is None:
        return None
    how = "and no recorded call made it: the error comes in here, from outside the recorded calls"
    if first.kind == UNRECORDED_SOURCE and not any(a.api.startswith("Module.") for a in calls.apis):
        how += " (a dump at level mix records the modules too, and names the one whose output it is)"
    return _at_source(calls, first, how)


def _changed(calls: Calls) -> Divergence | None:
    """The earliest reader of the one tensor a later step starts with that differs (rule 1c)."""
    found = min(calls.sources.changed, key=lambda s: calls.apis[s.api_index].order, default=None)
    if found is None:
        return None
    how = (
        f"at the start of step {calls.apis[found.api_index].step}, where everything else the step starts with "
        f"matches or differs at least {ALONE:g}x less: {CHANGED_SINCE}, and the error comes in here"
    )
    return replace(_at_source(calls, found, how), changed=True)


def _at_source(calls: Calls, found: Source, how: str) -> Divergence:
    """The divergence at an input from outside the recorded calls, its kind and slot said, then ``how``."""
    api, row = calls.apis[found.api_index], calls.rows[found.row_index]
    why = (
        f"{found.kind}: its {suffix(api, calls.rows, found.row_index).lstrip('.')} ({KIND_TEXT[found.kind]}) "
        f"differs from the baseline's ({row.reason or 'near its tolerance'}) {how}"
    )
    return replace(calls.at(found.api_index, SOURCE, why, found.row_index), source=found.kind)


def _earliest(apis: Sequence[ApiResult], *found: Divergence | None) -> Divergence | None:
    """The divergence at the earliest call of those found."""
    return min((d for d in found if d is not None), key=lambda d: apis[d.api_index].order, default=None)


def _inconsistent(
    calls: Calls, breaching: list[int], relations: Mapping[int, str], own: Mapping[int, OwnErrorVerdict]
) -> Divergence | None:
    for i in breaching:
        if i in relations and i not in own:
            why = f"{relations[i]}: the error enters here, whatever flowed into it"
            return calls.at(i, INCONSISTENT, why)
        changed = _dtype_changed(calls, i)
        if changed is not None:
            row = calls.rows[changed]
            why = (
                f"its output is {_dtype(row.target)} where the baseline's is {_dtype(row.baseline)} while its "
                "inputs' dtypes match: no difference in the values flowing in changes a dtype, the error enters "
                "here, whatever flowed into it"
            )
            return calls.at(i, INCONSISTENT, why, changed)
    return None


def _dtype_changed(calls: Calls, i: int) -> int | None:
    """Call ``i``'s first output row of another floating dtype than the baseline's, when every input has the
    baseline's dtype; None otherwise."""
    rows = calls.rows
    out = [j for j in calls.apis[i].rows if rows[j].role == OUTPUT and rows[j].problem == DTYPE]
    if not out:
        return None
    same = all(
        _dtype(rows[j].target) == _dtype(rows[j].baseline)
        for j in calls.apis[i].rows
        if rows[j].role != OUTPUT and rows[j].target is not None and rows[j].baseline is not None
    )
    return out[0] if same else None


def _dtype(leaf: Leaf | None) -> str | None:
    return None if leaf is None else leaf.dtype


def _out_of_line(calls: Calls, i: int, v: OwnErrorVerdict) -> Divergence:
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


def _rounding(calls: Calls, found: Divergence, own: Mapping[int, OwnErrorVerdict]) -> Divergence:
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
