"""The session's view of the msprobe tests: the terminal summary, and ``summary.json`` / ``index.html`` in the
output folder (:mod:`pytest_msprobe.report.session`).

Each checked test's entry travels on its report (attribute :data:`ENTRY`, JSON-safe), so that under
pytest-xdist the controller, which runs no test, collects every worker's; the files are written once, at the
end of the session, by the process that holds it: never by an xdist worker or a rank process of a multi-rank
test. A session that compares (a baseline given) always writes them, with an empty list when no test was
checked, so that an earlier session's summary is never taken for this one's; a session without a baseline
writes them only when a test ran the self-check, and otherwise leaves the output folder alone.
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_msprobe.errors import ReportError
from pytest_msprobe.options import BASELINE, REPORT_ONLY
from pytest_msprobe.report.session import NOT_PASSING, entry_detail, session_summary, write_session_reports
from pytest_msprobe.run.baseline import dump_root_above
from pytest_msprobe.settings import SessionSettings
from pytest_msprobe.version import __version__

ENTRY = "msprobe_entry"  # TestReport attribute: the test's entry of the session summary
VERDICT = "msprobe_verdict"  # user property: passed, failed, missing, regenerated, error, or inactive


class SessionReports:
    """Collects the entries of the session's tests (on the xdist controller too) and reports them."""

    def __init__(self, session: SessionSettings, writes: bool) -> None:
        self.session = session
        self.writes = writes  # this process holds the session (not an xdist worker, not a rank process)
        self.entries: dict[str, dict[str, Any]] = {}
        self.unchecked = 0  # msprobe tests that ran without dumping or comparing
        self.written: dict[str, str] = {}
        self.problem: str | None = None

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        entry = getattr(report, ENTRY, None)
        if entry is None:
            if report.when == "call" and dict(report.user_properties).get(VERDICT) == "inactive":
                self.unchecked += 1
            return
        failed = report.failed and (report.when != "call" or entry["verdict"] == "error")
        self.entries[report.nodeid] = {
            **entry,
            "outcome": "error" if failed else report.outcome,  # pytest's, beside the verdict
            "duration": round(report.duration, 3) if report.when == "call" else None,
        }

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not self.writes or not (self.entries or self.session.active):
            return
        summary = session_summary(
            self.entries.values(),
            self.session.output,
            baseline=str(self.session.baseline) if self.session.baseline is not None else None,
            regen=self.session.regen,
            report_only=self.session.report_only,
            plugin=__version__,
        )
        inside = dump_root_above(self.session.output)  # through a linked baseline folder (its tests erred)
        if inside is not None:
            self.problem = (
                f"the session summary is not written: the output folder {self.session.output} lies inside the "
                f"dump folder {inside} (a baseline?)"
            )
            return
        try:
            self.written = write_session_reports(summary, self.session.output)
        except ReportError as exc:
            self.problem = str(exc)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.entries and not self.session.active and not self.unchecked:
            return
        tr = terminalreporter
        tr.section("msprobe")
        if not self.session.active and not self.entries:
            tr.write_line(f"no {BASELINE.flag}: msprobe tests ran their training steps without comparing")
            return
        lenient = 0
        for nodeid, entry in self.entries.items():
            verdict = str(entry["verdict"]).upper()
            if entry.get("report_only") and entry["verdict"] in NOT_PASSING and entry["outcome"] == "passed":
                verdict += " (report-only: not failing the test)"
                lenient += 1
            detail = entry_detail(entry)
            tr.write_line(f"{verdict:<12} {nodeid}" + (f"  ({detail})" if detail else ""))
        if self.session.regen:
            written = sum(1 for e in self.entries.values() if e["verdict"] == "regenerated")
            tr.write_line(f"{written} baseline(s) written to {self.session.baseline}")
        if self.session.report_only or any(e.get("report_only") for e in self.entries.values()):
            tr.write_line(
                f"report-only mode ({REPORT_ONLY.flag}, ini {REPORT_ONLY.ini} or the marker's "
                f"{REPORT_ONLY.marker}=): precision verdicts are recorded, not enforced; {lenient} test(s) "
                "passed with a failing verdict",
                yellow=True,
                bold=True,
            )
        if self.written:
            tr.write_line(f"session summary: {self.written['summary']} (index: {self.written['index']})")
        if self.problem:
            tr.write_line(f"msprobe: {self.problem}", red=True, bold=True)
