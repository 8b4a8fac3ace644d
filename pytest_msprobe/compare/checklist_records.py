"""The checklist of dumps that carry none (plain msprobe dumps), read off their records where it can be.

At step 0, when the first divergence is a call whose inputs already differ (rule ``inherited``: no call is wrong by its own
evidence) and a differing input is made by no recorded call of its dump (no earlier output has its dtype, shape
and statistics), that input came from outside the recorded calls: in a weight's place of the call (a conv's or
linear's ``weight`` and ``bias``, a norm's affine weights) a ``parameter``, in a batch_norm's running statistics
a ``buffer``, anywhere else ``data``. It is the first divergence as the checklist's own differences are, named
by the row (plain dumps carry no parameter names).
"""

from __future__ import annotations

from collections.abc import Sequence

from pytest_msprobe.compare.checklist import BUFFER, DATA, PARAMETER, Difference
from pytest_msprobe.compare.overflow import WEIGHT_INPUTS
from pytest_msprobe.compare.records import INPUT, Leaf
from pytest_msprobe.compare.result import ERROR, INHERITED, ApiResult, Divergence, RowResult
from pytest_msprobe.format.names import parse_name

_BUFFER_INPUTS = {"batch_norm": (".input.1", ".input.2", ".input.running_mean", ".input.running_var")}


def _signature(leaf: Leaf) -> tuple[object, ...]:
    return (leaf.dtype, leaf.shape, leaf.max, leaf.min, leaf.mean, leaf.norm)


def from_records(
    apis: Sequence[ApiResult], rows: Sequence[RowResult], fd: Divergence | None
) -> Difference | None:
    """The outside input the first divergence reads (see the module docstring), None when there is none."""
    if fd is None or fd.rule != INHERITED:
        return None
    api = apis[fd.api_index]
    # at the start of training only: later, every weight differs after the steps before, dumped or not
    if api.direction != "forward" or api.step not in (0, None):
        return None
    made = {
        _signature(r.target)
        for a in apis
        if a.pair == api.pair and a.order < api.order
        for r in (rows[i] for i in a.rows)
        if r.role != INPUT and r.target is not None
    }
    op = parse_name(api.api).base.rpartition(".")[2]
    for i in api.rows:
        row = rows[i]
        t = row.target
        if row.role != INPUT or row.status != ERROR or t is None or t.shape is None or _signature(t) in made:
            continue
        suffix = t.suffix
        if suffix in _BUFFER_INPUTS.get(op, ()):
            kind, what = BUFFER, "a running statistic"
        elif suffix in WEIGHT_INPUTS.get(op, ()):
            kind, what = PARAMETER, "a weight"
        else:
            kind, what = DATA, "an input"
        detail = (
            f"{what} of {api.api} ({row.row}, {list(t.shape)} {str(t.dtype).removeprefix('torch.')}) differs "
            f"from the baseline's ({row.reason}) and no recorded call made it: it comes from outside the dumped "
            "calls (read off the records; the dumps carry no checklist)"
        )
        where = f"before step {api.step}" if kind != DATA else f"step {api.step}"
        return Difference(kind, row.row, api.step, api.rank, "", "", detail, where=where)
    return None
