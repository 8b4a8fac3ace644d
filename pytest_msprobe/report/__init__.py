"""Reports of a compare, all views of one :class:`~pytest_msprobe.compare.result.CompareResult`:

``compare_result_{timestamp}.xlsx`` (msprobe 8.3.3's columns, then ours; rows coloured by verdict),
``advisor_{timestamp}.txt`` (where to look first and what to try) and ``summary.json`` (the verdict for
machines), each written atomically; :func:`console_summary` is the terminal view (:mod:`.text` also makes the
failure message of a breaching test, :mod:`.html` pytest-html's fragment).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from pytest_msprobe.compare.result import CompareResult
from pytest_msprobe.errors import ReportError
from pytest_msprobe.format.files import atomic_path, write_text
from pytest_msprobe.report.advisor import advisor_text
from pytest_msprobe.report.summary import summary_dict, summary_json
from pytest_msprobe.report.table import api_sheet, compare_sheet
from pytest_msprobe.report.text import console_summary
from pytest_msprobe.report.xlsx import write_xlsx

__all__ = ["ReportError", "console_summary", "summary_dict", "write_reports"]


def write_reports(
    result: CompareResult, out_dir: str | os.PathLike[str], advisor: str | None = None
) -> dict[str, str]:
    """Write the xlsx, the advisor and summary.json into ``out_dir`` (created if needed).

    ``advisor`` is the advisor's text where the caller already made it (a test run keeps it for its HTML
    fragment), made here otherwise.

    All or nothing: the three are written to temporary files first and renamed into place only once all
    three are complete, so a failure (disk full, a read-only folder) leaves no partial report behind.
    Returns ``{"xlsx": path, "advisor": path, "summary": path}``.
    """
    out = Path(out_dir)
    paths = {
        "xlsx": str(out / f"compare_result_{result.timestamp}.xlsx"),
        "advisor": str(out / f"advisor_{result.timestamp}.txt"),
        "summary": str(out / "summary.json"),
    }
    current = str(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as pending:  # each temporary file is renamed (or removed) on exit
            current = paths["xlsx"]
            write_xlsx(
                pending.enter_context(atomic_path(current)), [compare_sheet(result), api_sheet(result)]
            )
            current = paths["advisor"]
            write_text(
                pending.enter_context(atomic_path(current)),
                advisor_text(result) if advisor is None else advisor,
            )
            current = paths["summary"]
            write_text(pending.enter_context(atomic_path(current)), summary_json(result))
    except OSError as exc:
        raise ReportError(f"{current}: cannot write report ({exc.strerror or exc})") from None
    return paths
