"""The compare table: msprobe 8.3.3's columns in its order for the mode, then ours.

Where msprobe printed a verdict (``Result``, ``Err_message``) the table holds ours; ``Accuracy Reached or
Not`` (tensor mode) holds msprobe 8.3.3's own rule, labelled as msprobe's wherever it disagrees with ours
(``Yes (msprobe's rule; error by ours: ...)``). The statistics relative errors are msprobe's percent strings
(``0.026424179449396738%``), the tensor metrics that are undefined msprobe's words (``unsupported``,
``shape unmatched``, ``Nan``, ``N/A``): :func:`stat_cells` and :func:`tensor_cells`, shared with the CSV
(:mod:`.msprobe_csv`). Rows are red (error), yellow (warning) or grey (not compared); the row of the first
divergence is bold.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pytest_msprobe.compare.judging import (
    ERROR,
    SHAPE,
    UNMATCHED,
    WARNING,
    RowResult,
    RowSide,
    is_none,
    is_tensor,
)
from pytest_msprobe.compare.result import CompareResult
from pytest_msprobe.report.xlsx import BOLD_RED, GREY, PLAIN, RED, YELLOW, Sheet
from pytest_msprobe.thresholds import is_integral

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
# msprobe's words for a tensor metric it does not give (its 26.2.0 and 8.3.3 compares write the same)
UNSUPPORTED, SHAPE_UNMATCHED, NAN_WORD = "unsupported", "shape unmatched", "Nan"


def extra_columns(mode: str) -> tuple[str, ...]:
    """Our columns, after msprobe's."""
    return (*TENSOR_EXTRA_COLUMNS, *EXTRA_COLUMNS) if mode == "tensor" else EXTRA_COLUMNS


def columns(mode: str) -> tuple[str, ...]:
    return (*MSPROBE_COLUMNS[mode], *extra_columns(mode))


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


def requires_grad_cell(leaf: RowSide) -> str:
    if leaf is None or leaf.requires_grad is None:
        return NA
    return str(leaf.requires_grad)


def _plain(value: Any) -> Any:
    """A plain value (not a tensor) as a cell can hold it, else as text."""
    return value if isinstance(value, (int, float, str, bool)) else str(value)


def _stat(value: float | None, dtype: str | None) -> Any:
    return NA if value is None else value


def _num(value: float | None) -> Any:
    return NA if value is None else value


def nonfinite_word(value: float) -> str:
    """msprobe's word for a NaN or an infinity: ``Nan``, ``inf``, ``-inf``."""
    return NAN_WORD if math.isnan(value) else ("inf" if value > 0 else "-inf")


def whole_number(value: float, *dtypes: str | None) -> float | int:
    """A statistic or a diff as msprobe writes it: a whole number where each of ``dtypes`` is an integer one."""
    return int(value) if all(is_integral(d) for d in dtypes) and value.is_integer() else value


def stat_cells(row: RowResult) -> tuple[list[Any], list[Any]]:
    """The Max/Min/Mean/L2norm diffs and relative errors of a statistics row, as msprobe 26.2.0 writes them.

    A diff is target - baseline (a whole number for integer dtypes), ``0`` where the two statistics are the
    same; a relative error is msprobe's percent string ``|diff / baseline| * 100`` + ``%``
    (``0.026424179449396738%``), ``0`` where the statistics are the same and ``inf`` where the baseline's is 0.
    Where they differ and a side is NaN or infinite, both cells are ``Nan``, ``inf`` or ``-inf`` (the diff's
    sign); two None items, or a statistic neither dump gives (an integer tensor's Mean), are the same (``0``);
    a side missing, or a statistic only one side gives, is ``N/A``. Read off :attr:`RowResult.stat`.
    """
    t, b = row.target, row.baseline
    if t is None or b is None:
        return [NA] * 4, [NA] * 4
    if not (is_tensor(t) and is_tensor(b)):
        same = is_tensor(t) == is_tensor(b) and is_none(t) == is_none(b) and str(t.value) == str(b.value)
        return ([0] * 4, ["0"] * 4) if same else ([NA] * 4, [NA] * 4)
    stat = row.stat
    diffs: list[Any] = []
    rels: list[Any] = []
    for i, (x, y) in enumerate(zip(t.stats, b.stats)):
        d = None if stat is None else stat.diff[i]
        if x is None or y is None or d is None:
            same = x is None and y is None
            diffs.append(0 if same else NA)
            rels.append("0" if same else NA)
        elif not math.isfinite(d):
            diffs.append(nonfinite_word(d))
            rels.append(nonfinite_word(d))
        elif d == 0:
            diffs.append(0)
            rels.append("0")
        else:
            diffs.append(whole_number(d, t.dtype, b.dtype))
            r = stat.rel[i] if stat is not None else None
            rels.append("inf" if r is None else f"{r * 100!r}%")
    return diffs, rels


def tensor_cells(row: RowResult) -> list[Any]:
    """Cosine, EucDist, MaxAbsErr, MaxRelativeErr and the two ratios of a tensor row, with msprobe's words where
    a metric is not given: ``unsupported`` (not two tensors, an empty tensor; Cosine with fewer than 2
    elements; EucDist and the ratios of a 0-d tensor), ``shape unmatched``, ``N/A`` (NaN/Inf at different
    places) and ``Nan`` (Cosine when one side is all zero). Read off :attr:`RowResult.tensor`."""
    m = row.tensor
    if m is not None and m.shape_differs:
        return [SHAPE_UNMATCHED] * 6
    if m is not None and m.nonfinite == "different":
        return [NA] * 6
    if m is None or m.numel == 0:
        return [UNSUPPORTED] * 6
    zero_d = any(is_tensor(side) and side.shape == () for side in (row.target, row.baseline))

    def given(value: float | None, defined: bool = True) -> Any:
        return value if value is not None and defined else UNSUPPORTED

    cosine = m.cosine if m.cosine is not None else (UNSUPPORTED if m.numel < 2 else NAN_WORD)
    return [
        cosine,
        given(m.euc_dist, not zero_d),
        given(m.max_abs_err),
        given(m.max_rel_err),
        given(m.one_thousandth, not zero_d),
        given(m.five_thousandths, not zero_d),
    ]


def consistent_cell(row: RowResult) -> bool:
    t, b = row.target, row.baseline
    if t is None or b is None or t.requires_grad is None or b.requires_grad is None:
        return True
    return t.requires_grad == b.requires_grad


def _accuracy(row: RowResult) -> str:
    """msprobe 8.3.3's verdict, said to be msprobe's where ours differs: a msprobe user filtering on "No" still
    finds its rows, and no row our verdict fails reads a plain "Yes"."""
    if row.status == UNMATCHED:
        return "Unmatched"
    accuracy = row.msprobe_accuracy
    if accuracy is None:
        return "Unmatched" if row.problem == SHAPE else NA
    if accuracy == "Yes" and row.status == ERROR:
        return (
            f"Yes (msprobe's rule; error by ours: {row.reason})"
            if row.reason
            else "Yes (msprobe's rule; error by ours)"
        )
    if accuracy == "No" and row.status != ERROR:
        return f"No (msprobe's rule; {row.status} by ours)"
    return accuracy


def data_name_cell(row: RowResult) -> str:
    t = (row.target.data_name or "-1") if row.target is not None else NA
    b = (row.baseline.data_name or "-1") if row.baseline is not None else NA
    return str([t, b])


def md5_cell(leaf: RowSide) -> str:
    if leaf is None or is_none(leaf):
        return NA
    if leaf.md5 is not None:
        return leaf.md5
    if not is_tensor(leaf):
        import zlib

        return f"{zlib.crc32(str(leaf.value).encode()):08x}"  # what msprobe shows for plain values
    return NA


def head_cells(row: RowResult, dtype: Callable[[RowSide], str], shape: Callable[[RowSide], str]) -> list[Any]:
    """The first cells of a row in the xlsx and the CSV: the two sides' names, dtypes, shapes and requires_grad
    (each spells a None item its own way, hence ``dtype`` and ``shape``)."""
    t, b = row.target, row.baseline
    return [
        row.row if t is not None else NA,
        row.bench_row if b is not None else NA,
        dtype(t),
        dtype(b),
        shape(t),
        shape(b),
        requires_grad_cell(t),
        requires_grad_cell(b),
    ]


@dataclass(frozen=True)
class Spelling:
    """The cells that msprobe 8.3.3's xlsx and 26.2.0's CSV write each its own way (:func:`row_cells`)."""

    dtype: Callable[[RowSide], str]
    shape: Callable[[RowSide], str]
    plain: Callable[[Any], Any]  # a plain value (not a tensor), each of its four statistics
    stat: Callable[[float | None, str | None], Any]  # a tensor's statistic, of its dtype
    metrics: Callable[[RowResult], list[Any]]  # a tensor row's Cosine ... Five Thousandths Err Ratio
    verdict: Callable[[RowResult, str], list[Any]]  # the cells after Requires_grad Consistent, by mode


def stats_cells(leaf: RowSide, spelling: Spelling) -> list[Any]:
    """A side's max, min, mean and l2norm: ``N/A`` for a missing side, ``None`` for a None item."""
    if leaf is None:
        return [NA] * 4
    if is_none(leaf):
        return ["None"] * 4
    if not is_tensor(leaf):
        return [spelling.plain(leaf.value)] * 4
    return [spelling.stat(v, leaf.dtype) for v in leaf.stats]


def row_cells(result: CompareResult, row: RowResult, stack: str, spelling: Spelling) -> list[Any]:
    """One row of the table: msprobe's columns for the mode as ``spelling`` writes them, then ours."""
    t, b = row.target, row.baseline
    values = head_cells(row, spelling.dtype, spelling.shape)
    verdict = spelling.verdict(row, result.mode)
    if result.mode == "statistics":
        diffs, rels = stat_cells(row)
        values += [*diffs, *rels, *stats_cells(t, spelling), *stats_cells(b, spelling)]
        values += [consistent_cell(row), *verdict, stack]
    elif result.mode == "tensor":
        values += [*spelling.metrics(row), *stats_cells(t, spelling), *stats_cells(b, spelling)]
        values += [consistent_cell(row), *verdict, stack, data_name_cell(row)]
    else:
        values += [md5_cell(t), md5_cell(b), consistent_cell(row), *verdict, stack]
    return values + extra_values(result, row)


def _verdict(row: RowResult, mode: str) -> list[Any]:
    """msprobe 8.3.3's Result (tensor mode: Accuracy Reached or Not) and Err_message (none in md5 mode)."""
    if mode == "tensor":
        return [_accuracy(row), row.reason]
    return [row.status, row.reason] if mode == "statistics" else [row.status]


XLSX = Spelling(_dtype, _shape, _plain, _stat, tensor_cells, _verdict)


def extra_values(result: CompareResult, row: RowResult) -> list[Any]:
    """The values of :func:`extra_columns` for a row."""
    api = result.apis[row.api_index]
    m = row.tensor
    ours = (
        ([NA, NA] if m is None else [_num(m.rel_l2), _num(m.scaled_max_abs)])
        if result.mode == "tensor"
        else []
    )
    return [
        *ours,
        _num(row.error),
        _num(row.allowed),
        row.status,
        row.reason,
        api.status,
        NA if api.step is None else api.step,
        NA if api.rank is None else api.rank,
    ]


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


def stack_cells(result: CompareResult) -> Iterator[str]:
    """NPU_Stack_Info of each row in order: its call's stack (from stack.json) on the call's first row, as
    msprobe writes it, N/A elsewhere."""
    first_rows = {api.row_start: api for api in result.apis}
    for i in range(len(result.rows)):
        api = first_rows.get(i)
        frames = result.stack_of(api) if api is not None else ()
        yield str(list(frames)) if frames else NA


def compare_sheet(result: CompareResult) -> Sheet:
    """The main sheet: one row per compared item."""
    header = columns(result.mode)

    def rows() -> Iterator[list[Any]]:
        for i, stack in enumerate(stack_cells(result)):
            yield row_cells(result, result.rows[i], stack, XLSX)

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
