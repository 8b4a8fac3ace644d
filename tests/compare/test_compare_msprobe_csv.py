"""The CSV report (msprobe 26.2.0's default output), read back with the csv module and held against the CSV
msprobe 26.2.0 wrote for the same dump pair (tests/data/msprobe/msprobe-26.2.0/compare)."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openpyxl
import pytest
from compare_helpers import DATA, dump_dir

from pytest_msprobe.cli import main
from pytest_msprobe.report.msprobe_csv import CSV_COLUMNS, RESULT, csv_columns
from pytest_msprobe.report.table import extra_columns

MSPROBE = DATA / "msprobe-26.2.0" / "compare"
PAIRS = {  # dump kind -> (mode, msprobe's compare folder of step 0)
    "stat_L1": ("statistics", "npu_vs_bench_stat_L1_step0"),
    "tensor_L1": ("tensor", "npu_vs_bench_tensor_L1_step0"),
    "md5_L1": ("md5", "npu_vs_bench_md5_L1_step0"),
    "stat_mix": ("statistics", "npu_vs_bench_stat_mix_step0"),
}
# msprobe's columns whose cells hold a verdict (ours, in msprobe's words) or a metric we compute ourselves
VERDICT = {"Result", "Err_message"}
METRICS = {
    "Cosine",
    "EucDist",
    "MaxAbsErr",
    "MaxRelativeErr",
    "One Thousandth Err Ratio",
    "Five Thousandths Err Ratio",
}


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.reader(fh)
        header = next(reader)
        return header, [dict(zip(header, row, strict=True)) for row in reader]


def msprobes_csv(folder: str) -> tuple[list[str], list[dict[str, str]]]:
    (path,) = (MSPROBE / folder).glob("compare_result_*.csv")
    return read_csv(path)


def ours(out: Path) -> tuple[list[str], list[dict[str, str]]]:
    (path,) = out.glob("compare_result_*.csv")
    assert path.name == next(out.glob("compare_result_*.xlsx")).with_suffix(".csv").name
    return read_csv(path)


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, Any]]:
    """Our CSV of a real msprobe 26.2.0 dump pair (compared through msprobe 26's command line) and msprobe's
    own CSV of it, by dump kind; each pair compared once."""
    done: dict[str, dict[str, Any]] = {}

    def get(kind: str) -> dict[str, Any]:
        if kind not in done:
            out = tmp_path_factory.mktemp(kind)
            npu, bench = dump_dir("26.2.0", "npu", kind, 0), dump_dir("26.2.0", "bench", kind, 0)
            assert main(["compare", "-tp", str(npu), "-gp", str(bench), "-o", str(out), "-q"]) == 1
            header, rows = ours(out)
            their_header, theirs = msprobes_csv(PAIRS[kind][1])
            done[kind] = {
                "mode": PAIRS[kind][0],
                "out": out,
                "header": header,
                "rows": rows,
                "their_header": their_header,
                "theirs": theirs,
            }
        return done[kind]

    return get


@pytest.fixture(params=sorted(PAIRS))
def pair(request: pytest.FixtureRequest, compared: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    return compared(request.param)


@pytest.fixture(params=["stat_L1", "stat_mix"])
def stat_pair(request: pytest.FixtureRequest, compared: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    return compared(request.param)


def test_header_is_msprobes_then_ours(pair: dict) -> None:
    mode, header, theirs = pair["mode"], pair["header"], pair["their_header"]
    assert header[: len(theirs)] == theirs == list(CSV_COLUMNS[mode])
    assert header[len(theirs) :] == list(extra_columns(mode))
    assert header[len(theirs) :][-2:] == ["Step", "Rank"] and header == list(csv_columns(mode))


def test_rows_are_msprobes_rows_in_its_order(pair: dict) -> None:
    rows, theirs = pair["rows"], pair["theirs"]
    assert [r["NPU Name"] for r in rows] == [r["NPU Name"] for r in theirs]
    assert [r["Bench Name"] for r in rows] == [r["Bench Name"] for r in theirs]
    assert {(r["Step"], r["Rank"]) for r in rows} == {("0", "0")}


def test_cells_are_written_as_msprobe_writes_them(pair: dict) -> None:
    """Every cell of msprobe's columns but the verdict's is msprobe's own string: dtypes, shapes (N/A for a None
    item), requires_grad, the statistics (None where a dump gives none, whole numbers for integer tensors,
    True/False for bool ones), the diffs and percent relative errors (0, inf), MD5s, stacks, Data_name. Tensor
    metrics hold msprobe's words where it has no number, and numbers within float32 rounding elsewhere."""
    rows, theirs = pair["rows"], pair["theirs"]
    exact = [
        h for h in pair["their_header"] if h not in VERDICT | (METRICS if pair["mode"] == "tensor" else set())
    ]
    for mine, msprobe in zip(rows, theirs, strict=True):
        assert {h: mine[h] for h in exact} == {h: msprobe[h] for h in exact}, mine["NPU Name"]
    if pair["mode"] != "tensor":
        return
    words = 0
    for mine, msprobe in zip(rows, theirs, strict=True):
        for h in METRICS:
            try:
                expected = float(msprobe[h])
            except ValueError:  # unsupported, shape unmatched, Nan, N/A
                assert mine[h] == msprobe[h], (mine["NPU Name"], h)
                words += 1
                continue
            assert math.isclose(float(mine[h]), expected, rel_tol=2e-6, abs_tol=1e-9), (mine["NPU Name"], h)
    assert words > 100  # None items, plain values, 0-d tensors, the unmatched row


def test_statistics_relative_errors_are_percent_strings(stat_pair: dict) -> None:
    relu = next(r for r in stat_pair["rows"] if r["NPU Name"] == "Functional.relu.2.forward.output.0")
    assert relu["MaxRelativeErr"] == "0.026424179449396738%" and relu["MinRelativeErr"] == "inf"
    assert relu["Max diff"] == "-0.0015783309936523438"
    cells = [r[f"{s}RelativeErr"] for r in stat_pair["rows"] for s in ("Max", "Min", "Mean", "Norm")]
    assert {c for c in cells if not c.endswith("%")} == {"0", "inf", "N/A"}
    assert all(float(c[:-1]) >= 0 for c in cells if c.endswith("%"))


def test_result_is_our_verdict_in_msprobes_words(pair: dict) -> None:
    rows = pair["rows"]
    assert {r["Result"] for r in rows} <= {"pass", "warning", "error"}
    for r in rows:
        assert r["Result"] == RESULT[r["Verdict"]]
        message = json.loads(r["Err_message"])
        assert message == ([] if r["Result"] == "pass" else [f"{r['Result']}: {r['Reason']}"]), r["NPU Name"]
    relu = next(r for r in rows if r["NPU Name"] == "Functional.relu.2.forward.output.0")
    assert (
        relu["Result"] == relu["Verdict"] == "error"
    )  # msprobe 26.2.0 passed it in statistics and tensor mode
    assert relu["Err_message"].startswith('["error: ')
    unmatched = next(r for r in rows if r["NPU Name"] == "Functional.relu.2.backward.output.1")
    assert (unmatched["Bench Name"], unmatched["Verdict"], unmatched["Result"]) == (
        "N/A",
        "unmatched",
        "warning",
    )
    assert unmatched["Err_message"] == '["warning: only in the target: not compared"]'
    none = next(r for r in rows if r["NPU Name"] == "Functional.conv2d.0.forward.input.2")
    assert (none["NPU Dtype"], none["NPU Tensor Shape"], none["Verdict"], none["Result"]) == (
        "N/A",
        "N/A",
        "skipped",
        "pass",
    )
    assert none.get("NPU max", "None") == "None"  # (md5 mode has no statistics columns)


def test_xlsx_holds_the_same_percent_strings(stat_pair: dict) -> None:
    """The xlsx's relative-error columns hold msprobe's percent strings too (read back with openpyxl)."""
    (xlsx,) = stat_pair["out"].glob("compare_result_*.xlsx")
    sheet = openpyxl.load_workbook(xlsx, read_only=True)["compare_result"]
    table = sheet.iter_rows(values_only=True)
    header = list(next(table))
    names = ("MaxRelativeErr", "MinRelativeErr", "MeanRelativeErr", "NormRelativeErr")
    cols = [header.index(n) for n in names]
    diff = header.index("Max diff")
    for cells, mine, msprobe in zip(table, stat_pair["rows"], stat_pair["theirs"], strict=True):
        assert [cells[c] for c in cols] == [msprobe[n] for n in names] == [mine[n] for n in names]
        assert cells[diff] == (float(mine["Max diff"]) if mine["Max diff"] != "N/A" else "N/A")


def test_advisor_line_indexes_the_csv_and_the_xlsx(pair: dict) -> None:
    out = pair["out"]
    (advisor,) = out.glob("advisor_*.txt")
    line, node = advisor.read_text().splitlines()[:2]
    index = int(line.removeprefix("Line: "))
    assert pair["rows"][index]["NPU Name"] == node.removeprefix("Suspect Nodes: ")
    sheet = openpyxl.load_workbook(next(out.glob("compare_result_*.xlsx")))["compare_result"]
    assert sheet.cell(index + 2, 1).value == pair["rows"][index]["NPU Name"]


def test_steps_of_a_dump_root_in_one_csv(tmp_path: Path) -> None:
    """A compare of several steps writes one CSV whose Step column says whose each row is; each step's rows are
    those of msprobe's CSV of that step, in its order (msprobe writes one file per step and rank folder)."""
    npu, bench = dump_dir("26.2.0", "npu", "stat_L1"), dump_dir("26.2.0", "bench", "stat_L1")
    assert main(["compare", "-tp", str(npu), "-gp", str(bench), "-o", str(tmp_path), "-q"]) == 1
    _, rows = ours(tmp_path)
    for step in (0, 1):
        their_header, theirs = msprobes_csv(f"npu_vs_bench_stat_L1_step{step}")
        mine = [r for r in rows if r["Step"] == str(step)]
        assert [r["NPU Name"] for r in mine] == [r["NPU Name"] for r in theirs]
        same = [h for h in their_header if h not in VERDICT]
        assert [[r[h] for h in same] for r in mine] == [[r[h] for h in same] for r in theirs]
    assert [r["Step"] for r in rows] == sorted(r["Step"] for r in rows)  # steps in order, not interleaved
