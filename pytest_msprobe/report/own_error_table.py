"""The self-check's views: each call's own error (its output against the float64 replay of its own inputs).

One table, in execution order, both sides side by side (``own_errors`` sheet of the xlsx and
``own_errors.csv``), the out-of-line calls for summary.json and the HTML fragment, and the failure message of a
self-check without a baseline (:func:`pytest_msprobe.report.text.self_check_message`).
"""

from __future__ import annotations

import csv
import html
import io
from collections.abc import Iterator, Sequence
from typing import Any

from pytest_msprobe.compare.judging import OwnErrorVerdict, SelfCheckResult
from pytest_msprobe.compare.result import CompareResult
from pytest_msprobe.format.own_errors import OwnError
from pytest_msprobe.report.xlsx import PLAIN, RED, Sheet

_SIDE = ("Own Err Ratio", "Own MaxRelErr", "Own MeanRelErr", "Own RMSE", "Own ULP Mean", "Own Small Err")
OWN_COLUMNS = (
    "Order",
    "Step",
    "Rank",
    "API",
    "Bench API",
    "Dtype",
    *(f"NPU {c}" for c in _SIDE),
    *(f"Bench {c}" for c in _SIDE),
    "Out of Line",
    "Reason",
)
NA = "N/A"


def _side(err: OwnError | None) -> list[Any]:
    if err is None:
        return [NA] * len(_SIDE)
    ulp = NA if err.ulp_mean is None else err.ulp_mean
    return [err.rel_share, err.max_rel, err.mean_rel, err.rmse, ulp, err.small_breaches]


def _row(order: Any, step: Any, rank: Any, api: str, bench: str, v: OwnErrorVerdict) -> list[Any]:
    dtype = v.target.dtype if v.target is not None else NA
    reason = f"not replayed: {v.skipped}" if v.skipped else v.reason
    return [
        order,
        NA if step is None else step,
        NA if rank is None else rank,
        api,
        bench,
        dtype,
        *_side(v.target),
        *_side(v.baseline),
        "Yes" if v.out_of_line else ("N/A" if v.skipped else "No"),
        reason,
    ]


def own_error_rows(result: CompareResult) -> list[list[Any]]:
    """One row per call with own errors (or the reason it was not replayed), in execution order."""
    calls = sorted(result.own.items(), key=lambda item: result.apis[item[0]].order)
    return [
        _row(a.order, a.step, a.rank, a.api, a.bench_api or NA, v)
        for a, v in ((result.apis[i], v) for i, v in calls)
    ]


def self_check_rows(result: SelfCheckResult) -> list[list[Any]]:
    """The rows of a self-check without a baseline (no Bench API, no baseline own error)."""
    return [_row(n, c.step, c.rank, c.name, NA, c.own) for n, c in enumerate(result.calls)]


def own_error_sheet(rows: Sequence[Sequence[Any]]) -> Sheet:
    def styles() -> Iterator[int]:
        for row in rows:
            yield RED if row[-2] == "Yes" else PLAIN

    widths = [8, 6, 6, 48, 48, 10, *([13] * (2 * len(_SIDE))), 10, 80]
    return Sheet("own_errors", OWN_COLUMNS, rows, styles(), widths, freeze_cols=4)


def own_error_csv(rows: Sequence[Sequence[Any]]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(OWN_COLUMNS)
    writer.writerows(rows)
    return buf.getvalue()


def self_check_dict(result: CompareResult) -> dict[str, Any] | None:
    """summary.json's ``self_check``: whether out-of-line calls fail the compare, the counts, and the
    out-of-line calls (api, step, rank, reason); None when no call has own errors."""
    if not result.own:
        return None
    index = {id(a): i for i, a in enumerate(result.apis)}
    return {
        "gate": result.self_check,
        "calls_checked": sum(1 for v in result.own.values() if not v.skipped),
        "calls_not_replayed": sum(1 for v in result.own.values() if v.skipped),
        "out_of_line": [
            {"api": a.api, "step": a.step, "rank": a.rank, "reason": result.own[index[id(a)]].reason}
            for a in result.out_of_line
        ],
    }


def own_error_line(result: CompareResult) -> str | None:
    """``own errors: 120 calls replayed, 1 out of line (first: X, step 0, rank 0)`` (None without own errors)."""
    summary = self_check_dict(result)
    if summary is None:
        return None
    ool = summary["out_of_line"]
    text = f"own errors: {summary['calls_checked']} calls replayed, {len(ool)} out of line"
    if ool:
        where = ", ".join(f"{k} {ool[0][k]}" for k in ("step", "rank") if ool[0][k] is not None)
        text += f" (first: {ool[0]['api']}{', ' + where if where else ''})"
    return text


def own_error_html(result: CompareResult, limit: int = 10) -> str:
    """The HTML fragment's table of the out-of-line calls ("" when none is)."""
    calls = result.out_of_line
    if not calls:
        return ""
    index = {id(a): i for i, a in enumerate(result.apis)}
    parts = [
        f"<p><b>{len(calls)} call(s) out of line</b> (own error against the float64 replay of their own "
        "inputs):</p>",
        '<table class="msprobe-own" border="1" cellpadding="3" style="border-collapse: collapse">',
        "<tr><th>call</th><th>step</th><th>rank</th><th>why</th></tr>",
    ]
    for a in calls[:limit]:
        parts.append(
            f"<tr><td><code>{html.escape(a.api)}</code></td><td>{a.step}</td><td>{a.rank}</td>"
            f"<td>{html.escape(result.own[index[id(a)]].reason)}</td></tr>"
        )
    parts.append("</table>")
    return "\n".join(parts)
