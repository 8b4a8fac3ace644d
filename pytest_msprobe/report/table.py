"""The compare table: msprobe 8.3.3's columns in its order for the mode, then ours.

Where msprobe printed a verdict (``Result``, ``Err_message``) the table holds ours; ``Accuracy Reached or
Not`` (tensor mode) holds msprobe 8.3.3's own rule, so the two can be told apart. Relative errors are
numbers (fractions), not "%" strings. Rows are red (error), yellow (warning) or grey (not compared); the row
of the first divergence is bold.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from pytest_msprobe.compare.result import (
    ERROR,
    SHAPE,
    UNMATCHED,
    WARNING,
    CompareResult,
    RowResult,
    RowSide,
    is_none,
    is_tensor,
)
from pytest_msprobe.report.xlsx import BOLD_RED, GREY, PLAIN, RED, YELLOW, Sheet

BASE_COLUMNS = (
    "NPU Name",
    "Bench Name",
    "NPU Dtype",
    "Bench Dtype",
    "NPU Tensor Shape",
    "Bench Tensor Shape",
    "NPU Requires_grad",
    "Bench Requires_grad",
)
_STATS_VALUES = (
    "NPU max",
    "NPU min",
    "NPU mean",
    "NPU l2norm",
    "Bench max",
    "Bench min",
    "Bench mean",
    "Bench l2norm",
)
MSPROBE_COLUMNS = {
    "statistics": (
        *BASE_COLUMNS,
        "Max diff",
        "Min diff",
        "Mean diff",
        "L2norm diff",
        "MaxRelativeErr",
        "MinRelativeErr",
        "MeanRelativeErr",
        "NormRelativeErr",
        *_STATS_VALUES,
        "Requires_grad Consistent",
        "Result",
        "Err_message",
        "NPU_Stack_Info",
    ),
    "tensor": (
        *BASE_COLUMNS,
        "Cosine",
        "EucDist",
        "MaxAbsErr",
        "MaxRelativeErr",
        "One Thousandth Err Ratio",
        "Five Thousandths Err Ratio",
        *_STATS_VALUES,
        "Requires_grad Consistent",
        "Accuracy Reached or Not",
        "Err_message",
        "NPU_Stack_Info",
        "Data_name",
    ),
    "md5": (*BASE_COLUMNS, "NPU MD5", "BENCH MD5", "Requires_grad Consistent", "Result", "NPU_Stack_Info"),
}
EXTRA_COLUMNS = ("Scaled Error", "Allowed", "Verdict", "Reason", "API Verdict", "Step", "Rank")
TENSOR_EXTRA_COLUMNS = ("RelL2Err", "ScaledMaxAbsErr")
NA = "N/A"


def columns(mode: str) -> tuple[str, ...]:
    extra = (*TENSOR_EXTRA_COLUMNS, *EXTRA_COLUMNS) if mode == "tensor" else EXTRA_COLUMNS
    return (*MSPROBE_COLUMNS[mode], *extra)


def _dtype(leaf: RowSide) -> str:
    if leaf is None:
        return NA
    if is_tensor(leaf):
        return str(leaf.dtype)
    if is_none(leaf):
        return "None"
    return f"<class '{leaf.type}'>"


def _shape(leaf: RowSide) -> str:
    if leaf is None:
        return NA
    if is_none(leaf):
        return "None"
    return str(list(leaf.shape or ()))


def _grad(leaf: RowSide) -> str:
    if leaf is None or leaf.requires_grad is None:
        return NA
    return str(leaf.requires_grad)


def _stat_values(leaf: RowSide) -> list[Any]:
    if leaf is None:
        return [NA] * 4
    if is_none(leaf):
        return ["None"] * 4
    if not is_tensor(leaf):
        value = leaf.value if isinstance(leaf.value, (int, float, str, bool)) else str(leaf.value)
        return [value] * 4
    return [NA if v is None else v for v in leaf.stats]


def _num(value: float | None) -> Any:
    return NA if value is None else value


def _consistent(row: RowResult) -> bool:
    t, b = row.target, row.baseline
    if t is None or b is None or t.requires_grad is None or b.requires_grad is None:
        return True
    return t.requires_grad == b.requires_grad


def _accuracy(row: RowResult) -> str:
    if row.status == UNMATCHED:
        return "Unmatched"
    if row.msprobe_accuracy is not None:
        return row.msprobe_accuracy
    if row.problem == SHAPE:
        return "Unmatched"
    return NA


def _data_name(row: RowResult) -> str:
    t = (row.target.data_name or "-1") if row.target is not None else NA
    b = (row.baseline.data_name or "-1") if row.baseline is not None else NA
    return str([t, b])


def _md5(leaf: RowSide) -> str:
    if leaf is None or is_none(leaf):
        return NA
    if leaf.md5 is not None:
        return leaf.md5
    if not is_tensor(leaf):
        import zlib

        return f"{zlib.crc32(str(leaf.value).encode()):08x}"  # what msprobe shows for plain values
    return NA


def row_values(result: CompareResult, index: int, stack: str) -> list[Any]:
    row = result.rows[index]
    api = result.apis[row.api_index]
    t, b = row.target, row.baseline
    values: list[Any] = [
        row.row if t is not None else NA,
        row.bench_row if b is not None else NA,
        _dtype(t),
        _dtype(b),
        _shape(t),
        _shape(b),
        _grad(t),
        _grad(b),
    ]
    mode = result.mode
    if mode == "statistics":
        stat = row.stat
        diffs = [NA] * 4 if stat is None else [_num(x) for x in stat.diff]
        rels = [NA] * 4 if stat is None else [_num(x) for x in stat.rel]
        values += diffs + rels + _stat_values(t) + _stat_values(b)
        values += [_consistent(row), row.status, row.reason, stack]
    elif mode == "tensor":
        m = row.tensor
        if m is not None:
            values += [
                _num(m.cosine),
                _num(m.euc_dist),
                _num(m.max_abs_err),
                _num(m.max_rel_err),
                _num(m.one_thousandth),
                _num(m.five_thousandths),
            ]
        else:
            values += [NA] * 6
        values += _stat_values(t) + _stat_values(b)
        values += [_consistent(row), _accuracy(row), row.reason, stack, _data_name(row)]
        values += [NA, NA] if m is None else [_num(m.rel_l2), _num(m.scaled_max_abs)]
    else:
        values += [_md5(t), _md5(b), _consistent(row), row.status, stack]
    values += [
        _num(row.error),
        _num(row.allowed),
        row.status,
        row.reason,
        api.status,
        NA if api.step is None else api.step,
        NA if api.rank is None else api.rank,
    ]
    return values


def _row_style(result: CompareResult, index: int) -> int:
    fd = result.first_divergence
    if fd is not None and fd.row_index == index:
        return BOLD_RED
    status = result.rows[index].status
    return {ERROR: RED, WARNING: YELLOW, UNMATCHED: GREY}.get(status, PLAIN)


def _widths(header: Sequence[str]) -> list[float]:
    wide = {
        "NPU Name": 48,
        "Bench Name": 48,
        "Err_message": 60,
        "Reason": 60,
        "NPU_Stack_Info": 50,
        "Data_name": 40,
    }
    mid = {"NPU Dtype": 15, "Bench Dtype": 15, "NPU Tensor Shape": 17, "Bench Tensor Shape": 17}
    return [float(wide.get(h, mid.get(h, 13))) for h in header]


def compare_sheet(result: CompareResult) -> Sheet:
    """The main sheet: one row per compared item."""
    header = columns(result.mode)
    first_rows = {api.row_start: api for api in result.apis}

    def rows() -> Iterator[list[Any]]:
        for i in range(len(result.rows)):
            stack = NA
            api = first_rows.get(i)
            if api is not None and api.api in result.stacks:
                stack = str(list(result.stacks[api.api]))
            yield row_values(result, i, stack)

    styles = (_row_style(result, i) for i in range(len(result.rows)))
    return Sheet("compare_result", header, rows(), styles, _widths(header), freeze_cols=2)


API_COLUMNS = (
    "Order",
    "Step",
    "Rank",
    "API",
    "Bench API",
    "Direction",
    "Verdict",
    "Input Error",
    "Output Error",
    "Reason",
    "First Row",
)


def api_sheet(result: CompareResult) -> Sheet:
    """One row per API call, in execution order, with its verdict and where its rows are."""
    apis = sorted(result.apis, key=lambda a: a.order)
    fd = result.first_divergence
    fd_api = result.apis[fd.api_index] if fd is not None else None

    def rows() -> Iterator[list[Any]]:
        for a in apis:
            yield [
                a.order,
                NA if a.step is None else a.step,
                NA if a.rank is None else a.rank,
                a.api,
                a.bench_api or NA,
                a.direction or NA,
                a.status,
                _num(a.input_error),
                _num(a.output_error),
                a.reason,
                a.row_start + 2,  # spreadsheet row of its first row in the compare_result sheet
            ]

    def styles() -> Iterator[int]:
        for a in apis:
            if a is fd_api:
                yield BOLD_RED
            else:
                yield {ERROR: RED, WARNING: YELLOW, UNMATCHED: GREY}.get(a.status, PLAIN)

    widths = [8, 6, 6, 48, 48, 10, 10, 13, 13, 80, 10]
    return Sheet("apis", API_COLUMNS, rows(), styles(), widths, freeze_cols=0)
