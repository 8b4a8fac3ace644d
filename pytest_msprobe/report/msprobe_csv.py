"""The compare table as msprobe 26.2.0's CSV (``compare_result_{timestamp}.csv``), its default output.

msprobe's columns for the mode in its order, written as it writes them, then ours (those of the xlsx after
msprobe's: the scaled error, its tolerance, our verdict and reason, the call's verdict, Step and Rank), so a
msprobe user's tooling (``pandas.read_csv(...)["Result"]``, a column by position) reads it unchanged:

- ``Result`` is our verdict in msprobe's words: ``pass``, ``warning`` or ``error``; a row only one side has
  (our ``unmatched``) is a ``warning``, a row not compared (``skipped``: a None, an empty tensor) a ``pass``;
  ``Verdict`` keeps ours as it is. ``Err_message`` is msprobe's JSON list (``[]``, ``["error: <reason>"]``).
- A None item's dtype and shape are ``N/A``, its statistics ``None``; a missing side is ``N/A`` throughout.
  Statistics are written as the dumps hold them (integer tensors' as whole numbers, bool tensors' as
  ``True``/``False``, a statistic the dump does not give as ``None``); diffs and relative errors as
  :func:`~pytest_msprobe.report.table.stat_cells` says, tensor metrics as
  :func:`~pytest_msprobe.report.table.tensor_cells` says, rounded as msprobe rounds them (to 12 decimals, a
  Cosine above 0.9999 to 6; our RelL2Err and ScaledMaxAbsErr, and the xlsx, keep every digit).

One file holds every dump pair (step, rank) of the compare, the rows of each pair in msprobe's order and the
pairs in (step, rank) order; the ``Step`` and ``Rank`` columns say whose a row is (msprobe writes one file per
rank folder of one step). Written in one pass, one row at a time; unlike the xlsx it has no row limit.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Iterator
from typing import Any

from pytest_msprobe.compare import judging
from pytest_msprobe.compare.judging import RowResult, RowSide, is_none, is_tensor
from pytest_msprobe.compare.result import CompareResult
from pytest_msprobe.report.table import (
    MSPROBE_COLUMNS,
    NA,
    Spelling,
    extra_columns,
    nonfinite_word,
    row_cells,
    stack_cells,
    tensor_cells,
    whole_number,
)

# msprobe 26.x's columns: 8.3.3's (the xlsx's), its verdict column named Result in every mode, and md5's
# with an Err_message too
CSV_COLUMNS = {
    "statistics": MSPROBE_COLUMNS["statistics"],
    "tensor": tuple("Result" if c == "Accuracy Reached or Not" else c for c in MSPROBE_COLUMNS["tensor"]),
    "md5": (*MSPROBE_COLUMNS["md5"][:-1], "Err_message", MSPROBE_COLUMNS["md5"][-1]),
}
"""msprobe 26.2.0's header for each mode (its CSVs in tests/data/msprobe/msprobe-26.2.0/compare)."""

# our row verdict in msprobe's three words
RESULT = {
    judging.PASS: "pass",
    judging.WARNING: "warning",
    judging.ERROR: "error",
    judging.UNMATCHED: "warning",
    judging.SKIPPED: "pass",
}


def csv_columns(mode: str) -> tuple[str, ...]:
    """msprobe 26.2.0's columns for the mode, then ours."""
    return (*CSV_COLUMNS[mode], *extra_columns(mode))


def _dtype(leaf: RowSide) -> str:
    if leaf is None or is_none(leaf):
        return NA
    return str(leaf.dtype) if is_tensor(leaf) else f"<class '{leaf.type}'>"


def _shape(leaf: RowSide) -> str:
    if leaf is None or is_none(leaf):
        return NA
    return str(list(leaf.shape or ()))


def _stat(value: float | None, dtype: str | None) -> Any:
    if value is None:
        return "None"
    if not math.isfinite(value):
        return nonfinite_word(value)
    if dtype in ("torch.bool", "bool"):
        return value != 0
    return whole_number(value, dtype)


COSINE_ROUNDED = 0.9999  # a Cosine above it msprobe gives to 6 decimals


def _rounded(cells: list[Any]) -> list[Any]:
    """The tensor metrics as msprobe shows them: to 12 decimals (all but EucDist), a Cosine above
    :data:`COSINE_ROUNDED` to 6 (1 - 2e-7 reads 1.0)."""
    out = list(cells)
    for i in (0, 2, 3, 4, 5):
        value = out[i]
        if isinstance(value, float) and math.isfinite(value):
            value = float(f"{value:.12f}")
            out[i] = round(value, 6) if i == 0 and value > COSINE_ROUNDED else value
    return out


def _err_message(row: RowResult, result_word: str) -> str:
    if result_word == "pass" or not row.reason:
        return "[]"
    return json.dumps([f"{result_word}: {row.reason}"], ensure_ascii=False)


def _verdict(row: RowResult, mode: str) -> list[Any]:
    """Result and Err_message, in every mode."""
    word = RESULT[row.status]
    return [word, _err_message(row, word)]


def _plain(value: Any) -> Any:
    """A plain value (not a tensor) as the dump holds it."""
    return value


CSV = Spelling(_dtype, _shape, _plain, _stat, lambda row: _rounded(tensor_cells(row)), _verdict)


def csv_rows(result: CompareResult) -> Iterator[list[Any]]:
    """Every row of the CSV after the header, in the compare's row order."""
    for row, stack in zip(result.rows, stack_cells(result)):
        yield row_cells(result, row, stack, CSV)


def write_csv(path: str | os.PathLike[str], result: CompareResult) -> None:
    """Write the CSV to ``path`` (the caller makes it atomic)."""
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(csv_columns(result.mode))
        writer.writerows(csv_rows(result))
