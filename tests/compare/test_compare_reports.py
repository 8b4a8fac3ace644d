"""The reports, read back: xlsx (msprobe 8.3.3's columns, colours, frozen header), advisor, summary.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openpyxl
import pytest
from compare_helpers import DATA, dump_dir

from pytest_msprobe.compare import compare
from pytest_msprobe.compare.result import CompareResult
from pytest_msprobe.errors import ReportError
from pytest_msprobe.report import console_summary, summary_dict, write_reports
from pytest_msprobe.report import xlsx as xw
from pytest_msprobe.report.table import EXTRA_COLUMNS, TENSOR_EXTRA_COLUMNS, columns

KINDS = {"statistics": "stat_L1", "tensor": "tensor_L1", "md5": "md5_L1"}


@pytest.fixture(scope="module", params=sorted(KINDS))
def reported(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[CompareResult, dict[str, str]]:
    kind = KINDS[request.param]
    result = compare(dump_dir("8.3.3", "npu", kind, 0), dump_dir("8.3.3", "bench", kind, 0), stack=True)
    assert result.mode == request.param
    return result, write_reports(result, tmp_path_factory.mktemp(request.param))


def msprobe_header(kind: str) -> list[str]:
    (xlsx,) = (DATA / "msprobe-8.3.3" / "compare" / f"npu_vs_bench_{kind}_step0").glob("*.xlsx")
    return [c.value for c in openpyxl.load_workbook(xlsx).active[1]]


def test_xlsx_has_msprobes_columns_in_its_order_then_ours(
    reported: tuple[CompareResult, dict[str, str]],
) -> None:
    result, paths = reported
    assert Path(paths["xlsx"]).name == f"compare_result_{result.timestamp}.xlsx"
    sheet = openpyxl.load_workbook(paths["xlsx"])["compare_result"]
    header = [c.value for c in sheet[1]]
    ours = list(EXTRA_COLUMNS) if result.mode != "tensor" else [*TENSOR_EXTRA_COLUMNS, *EXTRA_COLUMNS]
    assert header == msprobe_header(KINDS[result.mode]) + ours
    assert header == list(columns(result.mode))
    assert sheet.max_row == len(result.rows) + 1
    assert [sheet.cell(i + 2, 1).value for i in range(len(result.rows))] == [r.row for r in result.rows]


def test_xlsx_rows_are_coloured_by_verdict(reported: tuple[CompareResult, dict[str, str]]) -> None:
    result, paths = reported
    sheet = openpyxl.load_workbook(paths["xlsx"])["compare_result"]
    fd = result.first_divergence
    assert fd is not None
    relu = sheet.cell(fd.row_index + 2, 1)
    assert relu.value == "Functional.relu.2.forward.output.0"
    assert relu.fill.fgColor.rgb == xw.RED_RGB and relu.font.b
    seen = set()
    for i, row in enumerate(result.rows):
        cell = sheet.cell(i + 2, 3)
        colour = cell.fill.fgColor.rgb if cell.fill.fill_type == "solid" else None
        expected = {"error": xw.RED_RGB, "warning": xw.YELLOW_RGB, "unmatched": xw.GREY_RGB}.get(row.status)
        assert colour == expected, (row.row, row.status, colour)
        seen.add(row.status)
    assert {"error", "pass"} <= seen


def test_xlsx_is_readable_a_frozen_header_widths_a_filter(
    reported: tuple[CompareResult, dict[str, str]],
) -> None:
    result, paths = reported
    book = openpyxl.load_workbook(paths["xlsx"])
    sheet = book["compare_result"]
    assert sheet.freeze_panes == "C2"  # header row and the two name columns stay in view
    assert sheet.column_dimensions["A"].width >= 40 and sheet.column_dimensions["C"].width >= 12
    assert sheet.auto_filter.ref == f"A1:{xw.column_letter(sheet.max_column)}{sheet.max_row}"
    assert all(c.font.b for c in sheet[1])
    apis = book["apis"]
    assert apis.max_row == len(result.apis) + 1 and apis.freeze_panes == "A2"
    orders = [apis.cell(r, 1).value for r in range(2, apis.max_row + 1)]
    assert orders == sorted(orders)


def test_statistics_cells_diffs_are_numbers_relative_errors_msprobes_percent_strings(tmp_path: Path) -> None:
    result = compare(dump_dir("8.3.3", "npu", "stat_L1", 0), dump_dir("8.3.3", "bench", "stat_L1", 0))
    sheet = openpyxl.load_workbook(write_reports(result, tmp_path)["xlsx"])["compare_result"]
    header = [c.value for c in sheet[1]]
    row = {h: sheet.cell(result.first_divergence.row_index + 2, i + 1).value for i, h in enumerate(header)}  # type: ignore[union-attr]
    assert row["Min diff"] == pytest.approx(-0.003332499647513)
    # percent strings, as msprobe writes them (8.3.3's xlsx has the same string for this row), not fractions
    assert row["MaxRelativeErr"] == "0.026424179449396738%"
    assert row["NormRelativeErr"] == "0.00035281844798692915%"
    assert row["MinRelativeErr"] == "inf"  # the baseline's Min is 0 (msprobe 26.2.0's word; 8.3.3 wrote N/A)
    assert row["Scaled Error"] == pytest.approx(5.58e-4, rel=1e-3)  # ours stays a number, in its own column
    assert row["NPU Tensor Shape"] == "[8, 8, 8, 8]" and row["NPU Requires_grad"] == "True"
    assert row["Result"] == "error" and row["Verdict"] == "error" and row["Step"] == 0
    assert row["Allowed"] == 1e-4
    same = {
        h: sheet.cell(2, i + 1).value for i, h in enumerate(header)
    }  # the first conv's input: no difference
    assert [same[f"{s}RelativeErr"] for s in ("Max", "Min", "Mean", "Norm")] == ["0"] * 4 and same[
        "Max diff"
    ] == 0
    plain = {
        h: sheet.cell(6, i + 1).value for i, h in enumerate(header)
    }  # Functional.conv2d.0.forward.input.3.0
    assert (
        plain["NPU Dtype"] == "<class 'int'>" and plain["NPU max"] == 1 and plain["NPU Tensor Shape"] == "[]"
    )
    none = {h: sheet.cell(4, i + 1).value for i, h in enumerate(header)}
    assert (none["NPU Dtype"], none["NPU max"], none["Result"]) == ("None", "None", "skipped")


def test_stack_info_on_each_calls_first_row(reported: tuple[CompareResult, dict[str, str]]) -> None:
    result, paths = reported
    sheet = openpyxl.load_workbook(paths["xlsx"])["compare_result"]
    col = [c.value for c in sheet[1]].index("NPU_Stack_Info") + 1
    first = {api.row_start for api in result.apis}
    filled = {i for i in range(len(result.rows)) if sheet.cell(i + 2, col).value != "N/A"}
    assert filled and filled <= first
    assert "make_dumps.py" in sheet.cell(result.apis[0].row_start + 2, col).value


def test_advisor_names_the_first_divergence(reported: tuple[CompareResult, dict[str, str]]) -> None:
    result, paths = reported
    text = Path(paths["advisor"]).read_text()
    lines = text.splitlines()
    assert lines[0] == f"Line: {result.first_divergence.row_index}"  # type: ignore[union-attr]
    assert lines[1] == "Suspect Nodes: Functional.relu.2.forward.output.0"
    advice = (
        "computes its output less precisely than its own inputs allow: against a float64 replay"
        if result.mode == "tensor"  # the tensors replayed: the relu's own error names it
        else "produces a different result from matching inputs"
    )
    assert lines[2].startswith(f"Expert Advice: Functional.relu.2.forward {advice}")
    if result.mode == "tensor":
        assert "Calls out of line (1;" in text and "  Functional.relu.2.forward (step 0, rank 0): " in text
    assert "make_dumps.py" in lines[2]  # where the call is in the user's code
    # msprobe's Line is the row's index under the header: the sheet's row Line + 2
    sheet = openpyxl.load_workbook(paths["xlsx"])["compare_result"]
    assert sheet.cell(int(lines[0].split()[1]) + 2, 1).value == "Functional.relu.2.forward.output.0"


def test_the_html_advisor_says_what_its_line_is(reported: tuple[CompareResult, dict[str, str]]) -> None:
    """The advisor file keeps msprobe's bare ``Line: N``; the HTML block says in words which row it is, under a
    heading, as prose (no preformatted block), its other lines as they are."""
    from pytest_msprobe.report.html import advisor_html, html_fragment

    result, paths = reported
    advisor = Path(paths["advisor"]).read_text()
    n = result.first_divergence.row_index  # type: ignore[union-attr]
    block = advisor_html(advisor)
    assert block.startswith('<div class="msprobe-advisor">\n<h4>Advisor')
    assert (
        f"Line {n}: row {n} of the comparison table, counted from 0 under its header as msprobe does "
        f"(row {n + 2} of the xlsx's compare_result sheet)" in block
    )
    assert "<p>Suspect Nodes: Functional.relu.2.forward.output.0</p>" in block
    assert "Line: " not in block and "<pre" not in block
    assert block in html_fragment(result, paths, advisor)
    # no suspect row, nothing to say about it
    assert "Line" not in advisor_html("Line: N/A\nSuspect Nodes: N/A\nExpert Advice: fine\n")


def test_advisor_when_everything_passes(tmp_path: Path) -> None:
    result = compare(dump_dir("8.3.3", "bench", "stat_L1", 0), dump_dir("26.2.0", "bench", "stat_L1", 0))
    text = Path(write_reports(result, tmp_path)["advisor"]).read_text().splitlines()
    assert text[:2] == ["Line: N/A", "Suspect Nodes: N/A"]
    assert text[2].startswith("Expert Advice: No API breaches the thresholds")


def test_summary_json_schema(reported: tuple[CompareResult, dict[str, str]]) -> None:
    result, paths = reported
    doc = json.loads(Path(paths["summary"]).read_text())
    assert set(doc) == {
        "passed", "first_divergence", "failures", "missing", "coverage", "set_aside", "ranks", "counts",
        "self_check", "overflow", "checklist", "trend", "across",
    }  # fmt: skip
    assert doc["overflow"] is None and "overflow" not in doc["first_divergence"]
    assert doc["across"] is None  # both runs on one device: the values judge
    assert doc["first_divergence"]["kind"] == "api"
    # these dumps are written without a model: no weights, the same batch and settings on both sides
    assert doc["checklist"]["passed"] is True and doc["checklist"]["failures"] == []
    # own errors where the tensors could be replayed; a statistics or md5 dump without self_check.json has none
    assert (doc["self_check"] is not None) == (result.mode == "tensor")
    assert doc["first_divergence"]["rule"] == ("out of line" if result.mode == "tensor" else "enters")
    assert doc["missing"] == []
    cov = doc["coverage"]
    assert (cov["passed"], cov["max_unmatched"], cov["reason"], cov["over"], cov["first_unmatched"]) == (
        True,
        0.05,
        None,
        [],
        [],
    )
    assert cov["baseline_rows"] == sum(1 for r in result.rows if r.baseline is not None)
    assert cov["unmatched_rows"] == sum(1 for r in result.rows if r.baseline is not None and r.target is None)
    assert doc["ranks"] == [
        {
            "rank": 0,
            "passed": False,
            "apis": len(result.apis),
            "apis_error": len(doc["failures"]),
            "first_error": "Functional.relu.2.forward",
        }
    ]
    assert doc["passed"] is False
    assert doc["first_divergence"] == {
        "kind": "api",
        "api": "Functional.relu.2.forward",
        "row": "Functional.relu.2.forward.output.0",
        "step": 0,
        "rank": 0,
        "reason": result.first_divergence.reason,  # type: ignore[union-attr]
        "rule": result.first_divergence.rule,  # type: ignore[union-attr]
    }
    assert doc["failures"] and all(
        set(f) == {"api", "row", "step", "rank", "reason"} for f in doc["failures"]
    )
    assert doc["failures"][0]["api"] == "Functional.relu.2.forward"  # execution order
    assert all(isinstance(v, int) for v in doc["counts"].values())
    c = doc["counts"]
    assert c["rows"] == sum(c[s] for s in ("pass", "warning", "error", "unmatched", "skipped"))
    assert c["apis_error"] == len(doc["failures"])


def test_summary_of_a_passing_compare(tmp_path: Path) -> None:
    again = shutil.copytree(dump_dir("8.3.3", "bench", "stat_L1"), tmp_path / "again")
    result = compare(again, dump_dir("8.3.3", "bench", "stat_L1"))
    doc = summary_dict(result)
    assert (doc["passed"], doc["first_divergence"], doc["failures"]) == (True, None, [])


def test_console_summary(reported: tuple[CompareResult, dict[str, str]]) -> None:
    result, paths = reported
    text = console_summary(result, paths)
    first = text.splitlines()[0]
    assert first.startswith("pytest-msprobe compare: FAILED (") and f"{result.counts()['rows']} rows" in first
    assert "first divergence: Functional.relu.2.forward (step 0, rank 0)" in text
    assert paths["xlsx"] in text and len(text.splitlines()) < 15


def test_reports_are_written_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    result = compare(dump_dir("8.3.3", "npu", "stat_L1", 0), dump_dir("8.3.3", "bench", "stat_L1", 0))
    paths = write_reports(result, tmp_path)
    before = Path(paths["xlsx"]).read_bytes()

    def broken(sheet: object, fh: object) -> None:
        fh.write(b"<worksheet>")  # type: ignore[attr-defined]
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(xw, "_sheet_xml", broken)
    with pytest.raises(ReportError) as info:
        write_reports(result, tmp_path)
    assert str(info.value).startswith(paths["xlsx"]) and "No space left" in str(info.value)
    assert Path(paths["xlsx"]).read_bytes() == before  # the old report, not half a new one
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(Path(p).name for p in paths.values())


def test_report_folder_that_cannot_be_made(tmp_path: Path) -> None:
    result = compare(dump_dir("8.3.3", "bench", "stat_L1", 0), dump_dir("26.2.0", "bench", "stat_L1", 0))
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ReportError, match="cannot write report"):
        write_reports(result, blocker / "out")


def test_xlsx_writer_edge_values(tmp_path: Path) -> None:
    rows = [[float("nan"), float("inf"), True, None, "=cmd|' /c calc'!A0", "a\x00b<c>&", "x" * 40000, 3]]
    path = tmp_path / "edge.xlsx"
    xw.write_xlsx(path, [xw.Sheet("s", ["a", "b", "c", "d", "e", "f", "g", "h"], rows, [xw.YELLOW])])
    sheet = openpyxl.load_workbook(path).active
    values = [c.value for c in sheet[2]]
    assert values[:4] == ["NaN", "inf", True, None]
    assert values[4] == "=cmd|' /c calc'!A0" and sheet.cell(2, 5).data_type == "s"  # text, never a formula
    assert values[5] == "ab<c>&" and len(values[6]) == xw.MAX_CELL and values[7] == 3
    assert sheet.cell(2, 1).fill.fgColor.rgb == xw.YELLOW_RGB
    assert xw.column_letter(1) == "A" and xw.column_letter(27) == "AA" and xw.column_letter(703) == "AAA"


def test_advisor_line_counts_as_msprobes(reported: tuple[CompareResult, dict[str, str]]) -> None:
    """msprobe 8.3.3's ``Line`` is the row's index under the header (its advisor's Line 86 names the row in
    spreadsheet row 88); ours counts the same way, and on this pair our table's rows are msprobe's."""
    result, paths = reported
    folder = DATA / "msprobe-8.3.3" / "compare" / f"npu_vs_bench_{KINDS[result.mode]}_step0"
    (their_advisor,) = folder.glob("advisor_*.txt")
    their_line, their_node = their_advisor.read_text().splitlines()[:2]
    index = int(their_line.removeprefix("Line: "))
    (their_xlsx,) = folder.glob("*.xlsx")
    assert openpyxl.load_workbook(their_xlsx).active.cell(index + 2, 1).value == their_node.split(": ")[1]
    ours = openpyxl.load_workbook(paths["xlsx"])["compare_result"]
    assert ours.cell(index + 2, 1).value == their_node.split(": ")[1]
    line, node = Path(paths["advisor"]).read_text().splitlines()[:2]
    assert ours.cell(int(line.removeprefix("Line: ")) + 2, 1).value == node.split(": ")[1]
    if result.mode == "statistics":  # both name the relu's output
        assert (
            (line, node)
            == (their_line, their_node)
            == ("Line: 86", "Suspect Nodes: Functional.relu.2.forward.output.0")
        )


def test_accuracy_column_never_says_a_plain_yes_on_our_error(tmp_path: Path) -> None:
    """Tensor mode: "Accuracy Reached or Not" is msprobe 8.3.3's rule; where ours disagrees the cell says whose
    rule it is, so a row our verdict fails never reads a plain "Yes"."""
    result = compare(dump_dir("8.3.3", "npu", "tensor_L1", 0), dump_dir("8.3.3", "bench", "tensor_L1", 0))
    sheet = openpyxl.load_workbook(write_reports(result, tmp_path)["xlsx"])["compare_result"]
    header = [c.value for c in sheet[1]]
    col, verdict = header.index("Accuracy Reached or Not") + 1, header.index("Verdict") + 1
    cells = {sheet.cell(i + 2, 1).value: (sheet.cell(i + 2, col).value, sheet.cell(i + 2, verdict).value)
             for i in range(len(result.rows))}  # fmt: skip
    relu = result.rows[result.first_divergence.row_index]  # type: ignore[union-attr]
    assert relu.msprobe_accuracy == "Yes" and relu.status == "error"  # msprobe's rule passes the noisy relu
    assert cells[relu.row][0] == f"Yes (msprobe's rule; error by ours: {relu.reason})"
    assert not [name for name, (accuracy, ours) in cells.items() if ours == "error" and accuracy == "Yes"]
    for accuracy, ours in cells.values():
        if accuracy.startswith("No"):
            assert (accuracy == "No") == (ours == "error"), accuracy
    assert cells["Functional.conv2d.0.forward.input.0"] == ("Yes", "pass")


def test_a_csv_that_cannot_be_written_leaves_the_old_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pytest_msprobe.report as report

    result = compare(dump_dir("8.3.3", "npu", "stat_L1", 0), dump_dir("8.3.3", "bench", "stat_L1", 0))
    paths = write_reports(result, tmp_path)
    before = {name: Path(p).read_bytes() for name, p in paths.items()}
    assert set(paths) == {"xlsx", "csv", "advisor", "summary", "model"}

    def broken(path: str, result: CompareResult) -> None:
        Path(path).write_text("NPU Name,Bench Name\n")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "write_csv", broken)
    with pytest.raises(ReportError, match="No space left") as info:
        write_reports(result, tmp_path)
    assert str(info.value).startswith(paths["csv"])
    assert {name: Path(p).read_bytes() for name, p in paths.items()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(Path(p).name for p in paths.values())
