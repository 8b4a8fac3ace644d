"""The first divergence's rules for when no call is shown to let the error in (see
:mod:`pytest_msprobe.compare.diagnosis.divergence`): *grows* (errors flow into every call, the one that amplifies
them), *inherited* (the earliest breaching call, whose inputs already differ) and *structural* (a call only
one side makes, after which the numbers differ)."""

from __future__ import annotations

import math
from collections.abc import Mapping

from pytest_msprobe.compare.diagnosis.calls import Calls, inputs_of_other_shapes
from pytest_msprobe.compare.diagnosis.rules import GROWS, INHERITED, STRUCTURAL, Divergence
from pytest_msprobe.compare.dumps import OUTPUT
from pytest_msprobe.compare.judging import ERROR, UNMATCHED, fmt_number


def grows(calls: Calls, breaching: list[int], amplification: float) -> Divergence | None:
    """The earliest of ``breaching`` (the candidates, in order) whose output error is ``amplification`` times its
    input error; in a step whose weights drift, the one whose output grows most over its other inputs and the
    drift's scale before it (the largest output error of a call reading a drifting input; the weights' own
    statistics for the step's first such call, where no drift is measured yet)."""
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
            if not so_far:  # no drift measured yet in the step: the weights' own statistics are all there is
                others += [
                    e
                    for j in api.rows
                    if rows[j].role != OUTPUT and j in drifting and (e := rows[j].error) is not None
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


def _grown(calls: Calls, i: int, in_err: float, out_err: float) -> Divergence:
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


def inherited(calls: Calls, candidates: list[int], amplification: float) -> Divergence | None:
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


def structural(calls: Calls, one_side: Mapping[int, int]) -> Divergence | None:
    """The one-side call that the calls reading its output follow, when the first error shows at or after
    one of them (``one_side``: call -> the one-side call it follows)."""
    apis, rows = calls.apis, calls.rows
    failing = [api for api in apis if api.status == ERROR]
    if not failing or not one_side:
        return None
    first = min(failing, key=lambda a: a.order)
    before = [(apis[c].order, source) for c, source in one_side.items() if apis[c].order <= first.order]
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
