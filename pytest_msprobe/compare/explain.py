"""Differences that are not of precision, forgiven in the rows of one dump pair before the calls are judged.

Two cases, recognised by the records alone: an input that one side recorded after an in-place op updated it
(:func:`explain_in_place`), and inputs that are the outputs of a call only one side makes
(:func:`explain_structural`).
"""

from __future__ import annotations

from typing import Any

from pytest_msprobe.compare.build import Builder
from pytest_msprobe.compare.judge import Check, amend, check_statistics
from pytest_msprobe.compare.records import OUTPUT, TENSOR, Leaf
from pytest_msprobe.compare.result import ERROR, PASS, WARNING


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
