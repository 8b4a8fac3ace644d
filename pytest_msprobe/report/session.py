"""The session's reports: ``summary.json`` and ``index.html`` in the msprobe output folder, over every msprobe
test the session checked, for CI artifacts and dashboards.

Each test's entry is made where the test ran (:func:`test_entry`, from its compare's result: a pytest-xdist
worker sends it with the test's report) and the session's files are written once, by the process that holds
the session (:func:`write_session_reports`); only the tests of this session are in them, whatever earlier runs
left in the folder. Report paths are relative to the output folder, as the index links them, so the folder
can be moved (downloaded as an artifact) whole.
"""

from __future__ import annotations

import contextlib
import datetime
import html
import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pytest_msprobe.compare.judging import SelfCheckResult
from pytest_msprobe.compare.result import CompareResult
from pytest_msprobe.errors import ReportError
from pytest_msprobe.format.files import atomic_path, write_text
from pytest_msprobe.report.html import REPORT_LABELS
from pytest_msprobe.report.links import relative_href
from pytest_msprobe.report.summary import first_divergence_dict
from pytest_msprobe.report.text import call_site, divergence_site

SUMMARY_JSON = "summary.json"
INDEX_HTML = "index.html"
SCHEMA = 1  # summary.json's "schema": raised when a field changes meaning or goes away
# verdicts of a test that did not pass, for the index's colours and the summary's "passed"
NOT_PASSING = ("failed", "missing", "error", "not compared")


def result_fields(result: CompareResult) -> dict[str, Any]:
    """A compared test's first divergence (with its source line) and counts."""
    first = first_divergence_dict(result)
    if first is not None:
        first = {**first, "text": result.verdict.text, "source": divergence_site(result)}
    c = result.counts()
    counts = {
        "calls": c["apis"],
        "breaching_calls": c["apis_error"],
        "error_rows": c["error"],
        "warnings": c["warning"],
        "unmatched": c["unmatched"],
    }
    trend = result.trend.first_step if result.trend is not None else None
    context = result.checklist.context_line() if result.checklist is not None else None
    across = None
    if result.across is not None:
        a = result.across
        judged = "their own errors" if a.own_errors else "evidence, values alone (no own errors)"
        across = f"across devices, {a.drift_calls} call(s) drift, judged by {judged}"
    return {
        "first_divergence": first,
        "counts": counts,
        "trend_first_step": trend,
        "context": context,
        "across": across,
    }


def self_check_fields(result: SelfCheckResult) -> dict[str, Any]:
    """A self-check's (without a baseline) first out-of-line call, or its first overflow, and counts."""
    first: dict[str, Any] | None = None
    if result.overflow is not None:
        ov = result.overflow
        stack = next((c.stack for c in result.calls if c.name == ov.api), ())
        first = {"kind": "overflow", "api": ov.api, "row": ov.row, "reason": ov.reason}
        first.update(step=ov.step, rank=ov.rank, source=call_site(stack), text=ov.api)
    elif result.out_of_line:
        call = result.out_of_line[0]
        first = {"kind": "out of line", "api": call.name, "row": None, "reason": call.own.reason}
        first.update(step=call.step, rank=call.rank, source=call_site(call.stack), text=call.name)
    counts = {
        "calls": len(result.calls),
        "breaching_calls": len(result.out_of_line),
        "error_rows": None,
        "warnings": None,
        "unmatched": None,
    }
    return {
        "first_divergence": first,
        "counts": counts,
        "trend_first_step": None,
        "context": None,
        "across": None,
    }


def test_entry(
    nodeid: str,
    verdict: str,
    *,
    reason: str = "",
    baseline: str | None = None,
    reports: Mapping[str, str] | None = None,
    message: str = "",
    report_only: bool = False,
    result: CompareResult | None = None,
    self_check: SelfCheckResult | None = None,
) -> dict[str, Any]:
    """One test's entry of the session summary, JSON-safe (it travels from an xdist worker as it is).

    ``reports`` holds absolute paths (:func:`session_summary` makes them relative); ``report_only``: the
    verdict did not fail the test."""
    fields: dict[str, Any] = {
        "first_divergence": None,
        "counts": None,
        "trend_first_step": None,
        "context": None,
        "across": None,
    }
    if result is not None:
        fields = result_fields(result)
    elif self_check is not None:
        fields = self_check_fields(self_check)
    return {
        "nodeid": nodeid,
        "verdict": verdict,
        "report_only": report_only,
        "reason": reason,
        **fields,
        "baseline": baseline,
        "reports": {key: os.path.abspath(path) for key, path in (reports or {}).items()},
        "message": message,
    }


def entry_detail(entry: Mapping[str, Any]) -> str:
    """The few words the terminal prints after a test's verdict: its first divergence (and rank), or why it
    compared nothing, or where its baseline is; then the checklist's context and the trend's first step."""
    first = entry.get("first_divergence")
    if first and first.get("kind") == "out of line":
        detail = f"first out of line {first['text']}"
    elif first and first.get("kind") == "overflow":  # (a compare's overflow is its first divergence's rule)
        detail = f"first overflow {first['text']}"
    elif first:
        detail = f"first divergence {first['text']}"
        if first.get("kind") in ("api", "setting") and first.get("rank") is not None:
            detail += f" on rank {first['rank']}"
    else:  # a test that compared nothing says why; a pass or a regeneration where its baseline is
        detail = entry.get("reason") or entry.get("baseline") or ""
    if entry.get("across"):
        detail += f"; {entry['across']}"
    if entry.get("context"):
        detail += f"; differs (context): {entry['context']}"
    step = entry.get("trend_first_step")
    if step is not None and "trend" not in detail:
        detail += f"; trend differs from step {step}"
    return detail


def session_summary(
    entries: Iterable[Mapping[str, Any]],
    out_dir: str | os.PathLike[str],
    *,
    baseline: str | None,
    regen: bool,
    report_only: bool,
    plugin: str,
) -> dict[str, Any]:
    """summary.json's content: the session (when, which baseline, which mode), the count of each verdict and
    the tests in node id order, their report paths relative to ``out_dir``."""
    tests = []
    for entry in sorted(entries, key=lambda e: str(e["nodeid"])):
        reports = {k: relative_href(v, out_dir) for k, v in (entry.get("reports") or {}).items()}
        tests.append({**entry, "reports": reports})
    verdicts = Counter(str(t["verdict"]) for t in tests)
    return {
        "schema": SCHEMA,
        "plugin": plugin,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": "regenerate" if regen else "compare" if baseline is not None else "self-check",
        "baseline": baseline,
        "report_only": report_only,
        # every verdict a pass (report-only tests included: their verdicts count here, not their outcome)
        "passed": not any(verdicts[v] for v in NOT_PASSING),
        "counts": {"tests": len(tests), **dict(sorted(verdicts.items()))},
        "tests": tests,
    }


_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; width: 100%; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: left; vertical-align: top; font-size: 14px; }
th { background: #f0f0f0; }
td.verdict { font-weight: bold; white-space: nowrap; }
tr.passed td.verdict { background: #c8f0c8; }
tr.regenerated td.verdict { background: #cfe2ff; }
tr.failed td.verdict, tr.error td.verdict, tr.not-compared td.verdict { background: #f7c6c6; }
tr.missing td.verdict { background: #ffe3b3; }
tr.skipped td.verdict { background: #e6e6e6; }
code { font-size: 13px; }
.report-only { font-weight: normal; font-size: 12px; }
"""


def _first_cell(first: Mapping[str, Any] | None) -> str:
    if not first:
        return ""
    where = ", ".join(f"{k} {first[k]}" for k in ("step", "rank") if first.get(k) is not None)
    text = f"<b>{html.escape(str(first.get('text') or first.get('api') or ''))}</b>"
    if where:
        text += f" ({html.escape(where)})"
    if first.get("source"):
        text += f"<br><code>{html.escape(str(first['source']))}</code>"
    if first.get("reason"):
        text += f"<br>{html.escape(str(first['reason']))}"
    return text


def _counts_cell(c: Mapping[str, Any] | None) -> str:
    if not c:
        return ""
    text = f"{c['breaching_calls']} of {c['calls']} calls breach"
    if c.get("error_rows") is not None:  # (a self-check without a baseline has no rows)
        text += f"; {c['error_rows']} error rows, {c['warnings']} warnings, {c['unmatched']} unmatched rows"
    return html.escape(text)


def _row(t: Mapping[str, Any]) -> str:
    verdict = str(t["verdict"])
    label = html.escape(verdict.upper())
    if t.get("report_only") and verdict in NOT_PASSING:
        label += '<br><span class="report-only">report-only: not failing the test</span>'
    test = f"<code>{html.escape(str(t['nodeid']))}</code>"
    if t.get("reason") and not t.get("first_divergence"):
        test += f"<br>{html.escape(str(t['reason']))}"
    links = " | ".join(
        f'<a href="{html.escape(href)}">{html.escape(REPORT_LABELS.get(k, k))}</a>'
        for k, href in (t.get("reports") or {}).items()
    )
    cells = (test, _first_cell(t.get("first_divergence")), _counts_cell(t.get("counts")), links)
    css = html.escape(verdict.replace(" ", "-"))
    return (
        f'<tr class="{css}"><td class="verdict">{label}</td>'
        + "".join(f"<td>{c}</td>" for c in cells)
        + "</tr>"
    )


def index_html(summary: Mapping[str, Any]) -> str:
    """index.html: a standalone page of the session's tests, verdicts coloured, with their first divergence
    and links to their reports (relative: the page works wherever the output folder is)."""
    counts = ", ".join(f"{n} {v}" for v, n in summary["counts"].items() if v != "tests")
    head = [html.escape(summary["created"]), f"mode {html.escape(summary['mode'])}"]
    if summary["report_only"]:
        head.append("report-only: precision verdicts do not fail the tests")
    head.append(f"baseline {html.escape(str(summary['baseline'] or 'none'))}")
    head.append(f"{summary['counts']['tests']} test(s)" + (f": {html.escape(counts)}" if counts else ""))
    rows = [_row(t) for t in summary["tests"]]
    if not rows:
        rows.append('<tr><td colspan="5">no msprobe test was checked in this session</td></tr>')
    body = "\n".join(rows)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>msprobe precision tests</title>
<style>{_CSS}</style>
</head>
<body>
<h1>msprobe precision tests</h1>
<p>{"; ".join(head)}. Machine-readable: <a href="{SUMMARY_JSON}">{SUMMARY_JSON}</a>.</p>
<table>
<tr><th>verdict</th><th>test</th><th>first divergence</th><th>counts</th><th>reports</th></tr>
{body}
</table>
</body>
</html>
"""


def write_session_reports(summary: Mapping[str, Any], out_dir: str | os.PathLike[str]) -> dict[str, str]:
    """Write summary.json and index.html into ``out_dir``, both or neither: ``{"summary": path, "index":
    path}``."""
    out = Path(out_dir)
    paths = {"summary": str(out / SUMMARY_JSON), "index": str(out / INDEX_HTML)}
    current = str(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as pending:  # each temporary file is renamed (or removed) on exit
            current = paths["summary"]
            write_text(pending.enter_context(atomic_path(current)), json.dumps(summary, indent=2) + "\n")
            current = paths["index"]
            write_text(pending.enter_context(atomic_path(current)), index_html(summary))
    except OSError as exc:
        raise ReportError(f"{current}: cannot write the session summary ({exc.strerror or exc})") from None
    return paths
