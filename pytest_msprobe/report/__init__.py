"""Reports of a compare, all views of one :class:`~pytest_msprobe.compare.result.CompareResult`:

``compare_result_{timestamp}.xlsx`` (msprobe 8.3.3's columns, then ours; rows coloured by verdict),
``compare_result_{timestamp}.csv`` (msprobe 26.2.0's default output: its columns and conventions, then ours),
``advisor_{timestamp}.txt`` (where to look first and what to try), ``summary.json`` (the verdict for
machines) and ``model_{timestamp}.html`` (the model view: the module tree coloured by error, :mod:`.model`),
written atomically together; :func:`console_summary` is the terminal view (:mod:`.text` also makes the
failure message of a breaching test, :mod:`.html` pytest-html's fragment).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from pytest_msprobe.compare.judging import SelfCheckResult
from pytest_msprobe.compare.result import CompareResult
from pytest_msprobe.errors import ReportError
from pytest_msprobe.format.files import atomic_path, write_text
from pytest_msprobe.report.advisor import advisor_text
from pytest_msprobe.report.model import model_html
from pytest_msprobe.report.msprobe_csv import write_csv
from pytest_msprobe.report.own_error_table import (
    own_error_csv,
    own_error_rows,
    own_error_sheet,
    self_check_rows,
)
from pytest_msprobe.report.summary import summary_dict, summary_json
from pytest_msprobe.report.table import api_sheet, compare_sheet
from pytest_msprobe.report.text import console_summary
from pytest_msprobe.report.xlsx import write_xlsx

__all__ = ["ReportError", "console_summary", "summary_dict", "write_reports", "write_self_check_report"]


def write_reports(
    result: CompareResult, out_dir: str | os.PathLike[str], advisor: str | None = None
) -> dict[str, str]:
    """Write the xlsx, the CSV, the advisor, summary.json and the model view into ``out_dir`` (created if needed).

    ``advisor`` is the advisor's text where the caller already made it (a test run keeps it for its HTML
    fragment), made here otherwise.

    All or nothing: the reports are written to temporary files first and renamed into place only once all
    are complete, so a failure (disk full, a read-only folder) leaves no partial report behind.
    Returns ``{"xlsx": path, "csv": path, "advisor": path, "summary": path, "model": path}``, and
    ``"own_errors": path`` of ``own_errors.csv`` where calls have own errors (also the xlsx's ``own_errors``
    sheet).
    """
    out = Path(out_dir)
    paths = {
        "xlsx": str(out / f"compare_result_{result.timestamp}.xlsx"),
        "csv": str(out / f"compare_result_{result.timestamp}.csv"),
        "advisor": str(out / f"advisor_{result.timestamp}.txt"),
        "summary": str(out / "summary.json"),
        "model": str(out / f"model_{result.timestamp}.html"),
    }
    own = own_error_rows(result) if result.own else None
    if own is not None:
        paths["own_errors"] = str(out / OWN_CSV)
    current = str(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as pending:  # each temporary file is renamed (or removed) on exit
            current = paths["xlsx"]
            sheets = [
                compare_sheet(result),
                api_sheet(result),
                *([own_error_sheet(own)] if own is not None else []),
            ]
            write_xlsx(pending.enter_context(atomic_path(current)), sheets)
            current = paths["csv"]
            write_csv(pending.enter_context(atomic_path(current)), result)
            current = paths["advisor"]
            write_text(
                pending.enter_context(atomic_path(current)),
                advisor_text(result) if advisor is None else advisor,
            )
            current = paths["summary"]
            write_text(pending.enter_context(atomic_path(current)), summary_json(result))
            current = paths["model"]
            write_text(pending.enter_context(atomic_path(current)), model_html(result))
            if own is not None:
                current = paths["own_errors"]
                write_text(pending.enter_context(atomic_path(current)), own_error_csv(own))
    except OSError as exc:
        raise ReportError(f"{current}: cannot write report ({exc.strerror or exc})") from None
    return paths


OWN_CSV = "own_errors.csv"


def write_self_check_report(result: SelfCheckResult, out_dir: str | os.PathLike[str]) -> dict[str, str]:
    """Write ``own_errors.csv`` of a self-check without a baseline into ``out_dir``: ``{"own_errors": path}``."""
    path = Path(out_dir) / OWN_CSV
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, own_error_csv(self_check_rows(result)))
    except OSError as exc:
        raise ReportError(f"{path}: cannot write report ({exc.strerror or exc})") from None
    return {"own_errors": str(path)}
