"""CompareResult.to_pandas(): the compared rows as a DataFrame, on real msprobe dumps."""

from __future__ import annotations

import math
import sys

import pandas
import pytest
from compare_helpers import dump_dir

from pytest_msprobe.compare import compare
from pytest_msprobe.compare.frame import ROW_COLUMNS
from pytest_msprobe.compare.judging import ERROR


@pytest.mark.parametrize("kind", ["stat_L1", "tensor_L1"])
def test_one_frame_row_per_compared_row_with_the_results_values(kind: str) -> None:
    result = compare(dump_dir("26.2.0", "npu", kind, 0), dump_dir("26.2.0", "bench", kind, 0), jobs=1)
    frame = result.to_pandas()
    assert list(frame.columns) == list(ROW_COLUMNS) and len(set(ROW_COLUMNS)) == len(ROW_COLUMNS)
    assert len(frame) == len(result.rows) > 100
    # the values are the result's own, row for row
    for index in (0, len(result.rows) // 2, len(result.rows) - 1):
        row, got = result.rows[index], frame.iloc[index]
        assert got["row"] == row.row and got["status"] == row.status
        api = result.apis[row.api_index]
        assert got["api"] == api.api and got["step"] == api.step and got["order"] == api.order
        assert (row.error is None and (got["error"] is None or math.isnan(got["error"]))) or got[
            "error"
        ] == pytest.approx(row.error)
    # one row is the first divergence, the one the result names
    fd = result.first_divergence
    assert fd is not None
    flagged = frame[frame.first_divergence.astype(bool)]
    assert list(flagged.row) == [result.rows[fd.row_index].row]
    assert fd.api == "Functional.relu.2.forward"
    # analysis as pandas users do it: the breaching calls, worst first
    worst = frame[frame.status == ERROR].groupby("api").error.max().sort_values(ascending=False)
    assert set(worst.index) == {a.api for a in result.apis if a.status == ERROR}
    if kind == "tensor_L1":
        measured = frame.dropna(subset=["cosine"])
        assert len(measured) > 50 and measured.cosine.between(-1.0000001, 1.0000001).all()
        assert frame.stat_max_diff.isna().all()  # statistics differences belong to the statistics mode
    else:
        assert frame.dropna(subset=["stat_max_diff"]).shape[0] > 50 and frame.cosine.isna().all()


def test_without_pandas_the_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    result = compare(
        dump_dir("26.2.0", "npu", "stat_L1", 0), dump_dir("26.2.0", "bench", "stat_L1", 0), jobs=1
    )
    monkeypatch.setitem(sys.modules, "pandas", None)  # an import of it raises ImportError
    with pytest.raises(ImportError, match=r"pytest-msprobe\[pandas\]"):
        result.to_pandas()
    assert pandas.__name__ == "pandas"
