"""Differences that are not of precision, forgiven in the rows of one dump pair before the calls are judged.

Three cases, recognised by the records alone: an input that one side recorded after an in-place op updated it
(:func:`explain_in_place`), inputs that are the outputs of a call only one side makes
(:func:`explain_structural`), and a weight updated from rounding noise (:func:`explain_noise_updates`).
"""

from __future__ import annotations

from typing import Any

from pytest_msprobe.compare.build import Builder
from pytest_msprobe.compare.judge import Check, amend, check_statistics
from pytest_msprobe.compare.records import OUTPUT, TENSOR, Leaf
from pytest_msprobe.compare.result import ERROR, PASS, WARNING
from pytest_msprobe.compare.thresholds import Thresholds
from pytest_msprobe.format.names import FORWARD


def explain_in_place(builder: Builder) -> None:
    """Forgive input rows that differ only because one side recorded an in-place op's input after the update.

    msprobe versions disagree on when an in-place module (``nn.ReLU(inplace=True)``) records its input:
    before the op, or after it, when it already equals the output. When one side's input equals its own
    output, the other's does not, and the first side's input matches the other side's output, the two
    recorded the same tensor at different moments; that row is compared with the other side's output.
    """
    for api in builder.apis:
        if api.one_side:
            continue
        drafts = builder.drafts[api.row_start : api.row_stop]
        outputs = [d for d in drafts if d.role == OUTPUT and d.target is not None and d.baseline is not None]
        for d in drafts:
            check = d.check
            if d.role == OUTPUT or check is None or check.status not in (ERROR, WARNING):
                continue
            if d.target is None or d.baseline is None or d.target.kind != TENSOR or d.baseline.kind != TENSOR:
                continue
            for out in outputs:
                assert out.target is not None and out.baseline is not None
                for mine, theirs_in, theirs_out, side in (
                    (d.target, d.baseline, out.baseline, "target"),
                    (d.baseline, d.target, out.target, "baseline"),
                ):
                    own_out = out.target if side == "target" else out.baseline
                    if not (_same_record(mine, own_out) and not _same_record(theirs_in, theirs_out)):
                        continue
                    pair = (mine, theirs_out) if side == "target" else (theirs_out, mine)
                    tol, _ = builder.thresholds.tolerance(pair[1].dtype, d.api, d.row, statistics=True)
                    again = check_statistics(pair[0], pair[1], tol)
                    if again.status == PASS:
                        note = (
                            f"the {side} recorded this input after the in-place update (it equals its output "
                            f"{own_out.suffix[1:]}); compared with the other side's output instead"
                        )
                        d.check = Check(PASS, again.error, again.allowed, note, again.stat)
                        break
                if d.check is not check:
                    break


def explain_structural(builder: Builder) -> None:
    """Forgive a call whose differing inputs are the outputs of a call only one side makes.

    An inserted or removed call (one extra relu after a max-pool, say) changes the structure of the run,
    and with it what flows into the next call: a relu's backward zeroes the gradient where its input is 0,
    so the max-pool's backward reads a different gradient although every weight gradient stays the same.
    The call that reads the one-side call's output is then a warning, not an error; the one-side call
    itself is reported as unmatched. When the difference really changes the numbers, it reaches the calls
    after that one through matched calls, and those still fail (the first divergence then names the
    one-side call: see :mod:`pytest_msprobe.compare.divergence`). A tensor is recognised by its record (shape, dtype
    and statistics), which the producing and the consuming call share within one dump.
    """
    produced: dict[tuple[int, str, tuple[Any, ...]], int] = {}
    for index, api in enumerate(builder.apis):
        if not api.one_side:
            continue
        for d in builder.drafts[api.row_start : api.row_stop]:
            for side, leaf in (("target", d.target), ("baseline", d.baseline)):
                if leaf is not None and d.role == OUTPUT and leaf.kind == TENSOR and None not in leaf.stats:
                    produced.setdefault((api.pair, side, _fingerprint(leaf)), index)
    if not produced:
        return
    for index, api in enumerate(builder.apis):
        if api.one_side:
            continue
        drafts = builder.drafts[api.row_start : api.row_stop]
        failing = [d for d in drafts if d.check is not None and d.check.status == ERROR]
        inputs = [d for d in failing if d.role != OUTPUT]
        if not inputs:
            continue
        sources = []
        for d in inputs:
            found = None
            for side, leaf in (("target", d.target), ("baseline", d.baseline)):
                if leaf is not None and leaf.kind == TENSOR and None not in leaf.stats:
                    found = produced.get((api.pair, side, _fingerprint(leaf)))
                    if found is not None:
                        break
            if found is None:
                break
            sources.append(found)
        else:
            source = sources[0]
            only = (
                "target" if builder.drafts[builder.apis[source].row_start].target is not None else "baseline"
            )
            note = (
                f"follows {builder.apis[source].api}, a call only the {only} makes: a difference of structure, "
                "not of precision"
            )
            for d in failing:
                assert d.check is not None
                d.check = amend(d.check, note, WARNING)
            builder.structural[index] = source


def _same_record(x: Leaf, y: Leaf) -> bool:
    return x.shape == y.shape and x.dtype == y.dtype and x.stats == y.stats and None not in x.stats


def _fingerprint(leaf: Leaf) -> tuple[Any, ...]:
    return (leaf.shape, leaf.dtype, leaf.stats)


def below_measure(
    target: Leaf | None, baseline: Leaf | None, error: float | None, thresholds: Thresholds
) -> bool:
    """Whether two tensors differ by no more than their dtype's ``atol`` (so the difference counts as none) while
    their values are so small that such a difference is beyond the tolerance relative to them: not measured, they
    cannot be shown to match either (Adam's moments of a gradient that is rounding noise)."""
    if target is None or baseline is None or target.kind != TENSOR or baseline.kind != TENSOR:
        return False
    if target.stats == baseline.stats or error != 0.0:
        return False
    values = [abs(v) for v in (target.max, target.min, baseline.max, baseline.min) if v is not None]
    tol = thresholds.for_dtype(baseline.dtype)
    return len(values) == 4 and tol.error > 0 and max(values) * tol.error <= tol.atol


def explain_noise_updates(builder: Builder) -> None:
    """Forgive the drift of a weight that an optimizer updates from rounding noise.

    A gradient that is zero in exact arithmetic (an attention key's bias, which the softmax ignores) is rounding
    noise, below measure on both sides, and so are Adam's moments of it; but the update divides one by the root of
    the other (``param.addcdiv_(m, sqrt(v) + eps, value=-lr)``), which makes of that noise a step of up to the
    learning rate, another on each device. The weight then differs by what no precision of either device decides.
    An in-place call of a tensor method (its name ends in ``_``) with an input below measure (see
    :func:`below_measure`) and no other input that differs measurably is such an update: its failing rows, and
    those of every record of the weight it updates in this dump pair (the same tensor record on both sides:
    its forward uses, the in-place calls before the update), are warnings that say so.
    """
    thresholds = builder.thresholds
    # the records (target, baseline) of a weight updated from noise -> the update's name (None, the key of a
    # row that holds no tensor, is looked up, never stored)
    weights: dict[tuple[Any, Any] | None, str] = {}
    for api in builder.apis:
        if not _in_place(api) or not api.api.startswith("Tensor."):
            continue
        drafts = builder.drafts[api.row_start : api.row_stop]
        self_rows = [d for d in drafts if d.role != OUTPUT and d.row.endswith(".input.0")]
        others = [d for d in drafts if d.role != OUTPUT and not d.row.endswith(".input.0")]
        noise = [
            d
            for d in others
            if d.check is not None and below_measure(d.target, d.baseline, d.check.error, thresholds)
        ]
        measured = [
            d for d in others if d not in noise and d.check is not None and d.check.status in (ERROR, WARNING)
        ]
        if not noise or measured or len(self_rows) != 1:
            continue
        for d in (self_rows[0], *(d for d in drafts if d.role == OUTPUT)):
            key = _records(d)
            if key is not None:
                weights[key] = api.api
    if not weights:
        return
    # the in-place calls before an update (AdamW's weight decay) make the record it updates: their inputs too
    for api in reversed(builder.apis):
        if not _in_place(api):
            continue
        drafts = builder.drafts[api.row_start : api.row_stop]
        update = next(
            (u for d in drafts if d.role == OUTPUT if (u := weights.get(_records(d))) is not None), None
        )
        if update is not None:
            for d in drafts:
                key = _records(d)
                if d.role != OUTPUT and d.row.endswith(".input.0") and key is not None:
                    weights.setdefault(key, update)
    for d in builder.drafts:
        check = d.check
        update = weights.get(_records(d))
        if check is not None and check.status == ERROR and update is not None:
            note = (
                f"a weight {update} updates from rounding noise (inputs below measure, divided one by another): "
                "its difference is that noise's, not a precision problem of either device"
            )
            d.check = amend(check, note, WARNING)


def _in_place(api: Any) -> bool:
    """Whether a call (of both sides) is the forward of an in-place method (``add_``, not ``__iadd__``)."""
    base = api.base
    return not api.one_side and api.direction == FORWARD and base.endswith("_") and not base.endswith("__")


def _records(d: Any) -> tuple[Any, Any] | None:
    """A tensor row's records (target, baseline), by which a tensor is recognised within a dump pair."""
    if d.target is None or d.baseline is None or d.target.kind != TENSOR or d.baseline.kind != TENSOR:
        return None
    return (_fingerprint(d.target), _fingerprint(d.baseline))
