"""The failure message of a breaching msprobe test: one shape, every time.

headline with counts
what the compare could not check (a step or rank the target lacks, too little of the baseline paired)
the first divergence and why
the worst rows: row, metric, value, allowed
where the reports are
how to regenerate the baseline
"""

from __future__ import annotations

from pathlib import Path

from pytest_msprobe.compare.judge import fmt_number
from pytest_msprobe.compare.metrics import STAT_NAMES
from pytest_msprobe.compare.result import ERROR, CompareResult, RowResult
from pytest_msprobe.report.summary import coverage_lines, rank_line


def row_metric(row: RowResult) -> str:
    """Which metric judged the row: the worst statistic in statistics mode, the scaled error otherwise."""
    if row.error is None and row.stat is None and row.tensor is None and row.status == ERROR:
        return "statistics"  # NaN or missing statistics: nothing measured
    if row.stat is not None and row.stat.worst is not None:
        return f"{STAT_NAMES[row.stat.worst]} (scaled)"
    if row.tensor is not None:
        t = row.tensor
        if t.rel_l2 is not None and t.scaled_max_abs is not None:
            return "RelL2Err" if t.rel_l2 >= t.scaled_max_abs else "ScaledMaxAbsErr"
        return "tensor"
    if row.target is not None and row.target.md5 is not None:
        return "md5"
    return "value"


def worst_rows(result: CompareResult, limit: int = 5) -> list[RowResult]:
    """The error rows furthest over their tolerance, the first divergence's row first."""
    flagged = [r for r in result.rows if r.status == ERROR]
    flagged.sort(key=lambda r: -((r.error or 0.0) / (r.allowed or 1e-300)) if r.error is not None else 0.0)
    fd = result.first_divergence
    if fd is not None:
        first = result.rows[fd.row_index]
        flagged = [first, *(r for r in flagged if r is not first)]
    return flagged[:limit]


def failure_message(
    result: CompareResult, reports: dict[str, str], baseline: Path, regen_command: str
) -> str:
    c = result.counts()
    steps = sorted({p.step for p in result.pairs if p.step is not None})
    lacking = (
        f"the target lacks {len(result.missing)} step/rank dump(s) of the baseline; "
        if result.missing
        else ""
    )
    ranks = sorted({p.rank for p in result.pairs if p.rank is not None})
    scope = f", steps {', '.join(map(str, steps))}" if steps else ""
    if len(ranks) > 1:
        scope += f", ranks {', '.join(map(str, ranks))}"
    detail = f"({c['error']} error rows, {c['warning']} warnings, {c['unmatched']} unmatched; {result.mode} mode{scope})"
    counts = f"{c['apis_error']} of {c['apis']} API calls breach the thresholds {detail}"
    coverage = coverage_lines(result, "--msprobe-max-unmatched=SHARE or the marker's max_unmatched=")
    if coverage:
        # what was not compared leads: the verdict of the rows that were says little about the run
        lines = [f"msprobe: {lacking}{coverage[0]}", *coverage[1:]]
        if not c["apis_error"]:
            lines.append(f"of what was compared, no API call breaches the thresholds {detail}")
        else:
            lines.append(f"of what was compared, {counts}")
    else:
        lines = [f"msprobe: {lacking}{counts}"]
    fd = result.first_divergence
    if fd is not None:
        lines.append(f"first divergence: {fd.api} (step {fd.step}, rank {fd.rank}), row {fd.row}")
        lines.append(f"  {fd.reason}")
    by_rank = rank_line(result)
    if by_rank:
        lines.append(by_rank)
    if result.missing:
        lines.append(f"missing in the target ({len(result.missing)} dump(s) the baseline has):")
        lines.extend(f"  {note}" for note in result.missing[:5])
        if len(result.missing) > 5:
            lines.append(f"  ... and {len(result.missing) - 5} more")
    rows = worst_rows(result)
    if rows:
        width = max(len(r.row) for r in rows)
        lines.append("worst rows:")
        lines.append(f"  {'row':<{width}}  {'metric':<16} {'value':>9}  {'allowed':>9}")
        for r in rows:
            lines.append(
                f"  {r.row:<{width}}  {row_metric(r):<16} {fmt_number(r.error):>9}  {fmt_number(r.allowed):>9}"
            )
    lines.append(f"baseline: {baseline}")
    if reports:
        lines.append("reports: " + ", ".join(reports.values()))
    lines.append(f"if the new numbers are right, regenerate the baseline: {regen_command}")
    return "\n".join(lines)
