"""The checklist of dumps that carry none (plain msprobe dumps), read off their records where it can be.

When the first divergence is an input from outside the recorded calls (rule ``source``, see
:mod:`pytest_msprobe.compare.diagnosis.sources`) that is a ``parameter``, a ``buffer`` or ``data``, it is the checklist
difference the dumps would have shown had they carried a checklist, named by the row (plain dumps carry no
parameter names) and pointing at its first reader (``call``). An input made by an operation that is not recorded
is no checklist kind: the first divergence names it.
"""

from __future__ import annotations

from collections.abc import Sequence

from pytest_msprobe.compare.checklist.differences import BUFFER, DATA, PARAMETER, Difference
from pytest_msprobe.compare.diagnosis import ALONE, CHANGED_SINCE, SOURCE, Divergence
from pytest_msprobe.compare.judging import ApiResult, RowResult

_WHAT = {PARAMETER: "a weight", BUFFER: "a running statistic", DATA: "an input"}  # the kinds a checklist has


def from_records(
    apis: Sequence[ApiResult], rows: Sequence[RowResult], fd: Divergence | None
) -> Difference | None:
    """The outside input the first divergence reads (see the module docstring), None when there is none."""
    if fd is None or fd.rule != SOURCE or fd.source not in _WHAT:
        return None
    api, row = apis[fd.api_index], rows[fd.row_index]
    t = row.target
    if t is None or t.shape is None:
        return None
    kind, what = fd.source, _WHAT[fd.source]
    origin = (
        f"at the start of step {api.step}, where all else the step starts with matches or differs {ALONE:g}x less: "
        f"{CHANGED_SINCE}"
        if fd.changed
        else "and no recorded call made it: it comes from outside the dumped calls"
    )
    detail = (
        f"{what} of {api.api} ({row.row}, {list(t.shape)} {str(t.dtype).removeprefix('torch.')}) differs "
        f"from the baseline's ({row.reason or 'near its tolerance'}) {origin} (read off the records; the dumps "
        "carry no checklist)"
    )
    where = f"before step {api.step}" if kind != DATA else f"step {api.step}"
    return Difference(
        kind, row.row, api.step, api.rank, "", "", detail, where=where, call=api.api, call_index=fd.api_index
    )
