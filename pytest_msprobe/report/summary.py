"""summary.json (the machine-readable verdict) and the short console summary."""

from __future__ import annotations

import json
from typing import Any

from pytest_msprobe.compare.judge import fmt_number
from pytest_msprobe.compare.result import ERROR, UNMATCHED_CAUSES, ApiResult, CompareResult
from pytest_msprobe.compare.thresholds import format_share


def _place(result: CompareResult, api: ApiResult, row: str, reason: str) -> dict[str, Any]:
    return {"api": api.api, "row": row, "step": api.step, "rank": api.rank, "reason": reason}


def rank_summaries(result: CompareResult) -> list[dict[str, Any]]:
    """Per rank of a multi-rank compare, in rank order: ``{rank, passed, apis, apis_error, first_error}``,
    ``first_error`` the rank's earliest breaching call (None when none breaches). Empty without ranks."""
    ranks: dict[int, list[ApiResult]] = {}
    for api in result.apis:
        if api.rank is not None:
            ranks.setdefault(api.rank, []).append(api)
    out = []
    for rank in sorted(ranks):
        failing = sorted((a for a in ranks[rank] if a.status == ERROR), key=lambda a: a.order)
        out.append(
            {
                "rank": rank,
                "passed": not failing,
                "apis": len(ranks[rank]),
                "apis_error": len(failing),
                "first_error": failing[0].api if failing else None,
            }
        )
    return out


def rank_line(result: CompareResult) -> str | None:
    """``by rank: rank 0: 2 of 40 calls breach, first ...; rank 1: passed`` for a compare of several ranks."""
    per_rank = rank_summaries(result)
    if len(per_rank) < 2:
        return None
    return "by rank: " + "; ".join(
        f"rank {r['rank']}: "
        + (
            f"{r['apis_error']} of {r['apis']} calls breach, first {r['first_error']}"
            if r["apis_error"]
            else "passed"
        )
        for r in per_rank
    )


def _where(step: int | None, rank: int | None) -> str:
    return ", ".join(
        x
        for x in (f"step {step}" if step is not None else "", f"rank {rank}" if rank is not None else "")
        if x
    )


def first_unmatched_text(result: CompareResult) -> str:
    """``A, B (step 0, rank 0), C (step 1, rank 0)``: the first baseline calls without a partner, in execution
    order, each run of calls followed by its step and rank."""
    calls = [result.apis[i] for i in result.coverage.first_unmatched]
    parts: list[str] = []
    for n, api in enumerate(calls):
        last = n + 1 == len(calls) or (calls[n + 1].step, calls[n + 1].rank) != (api.step, api.rank)
        where = _where(api.step, api.rank)
        parts.append(f"{api.api} ({where})" if last and where else api.api)
    return ", ".join(parts)


def coverage_lines(result: CompareResult, allow: str) -> list[str]:
    """The lines of a compare that paired too little of the baseline (none when it paired enough): the
    headline, the first calls left without a partner, the usual causes, and ``allow``, the setting that
    raises the limit (``--max-unmatched=SHARE`` on the command line; under pytest its ``--msprobe-`` form)."""
    cov = result.coverage
    if cov.headline is None:
        return []
    lines = [cov.headline]
    if cov.first_unmatched:
        lines.append(
            f"  first baseline calls without a partner (execution order): {first_unmatched_text(result)}"
        )
    lines.append(f"  usual causes: {'; '.join(UNMATCHED_CAUSES)}")
    lines.append(
        f"  if the two runs really make different calls, raise the limit with {allow} (unmatched now: "
        f"{format_share(cov.share)} of the baseline's rows)"
    )
    return lines


def coverage_dict(result: CompareResult) -> dict[str, Any]:
    """summary.json's ``coverage``: the limit, the counts, the pairs above the limit, the first unmatched calls."""
    cov = result.coverage
    return {
        "passed": cov.passed,
        "max_unmatched": cov.limit,
        "baseline_calls": cov.baseline_calls,
        "unmatched_calls": cov.unmatched_calls,
        "baseline_rows": cov.baseline_rows,
        "unmatched_rows": cov.unmatched_rows,
        "share": cov.share,
        "reason": cov.headline,
        "over": [
            {
                "step": cov.pairs[i].step,
                "rank": cov.pairs[i].rank,
                "baseline_calls": cov.pairs[i].baseline_calls,
                "unmatched_calls": cov.pairs[i].unmatched_calls,
                "baseline_rows": cov.pairs[i].baseline_rows,
                "unmatched_rows": cov.pairs[i].unmatched_rows,
                "share": cov.pairs[i].share,
            }
            for i in cov.over
        ],
        "first_unmatched": [
            {"api": result.apis[i].api, "step": result.apis[i].step, "rank": result.apis[i].rank}
            for i in cov.first_unmatched
        ],
    }


def summary_dict(result: CompareResult) -> dict[str, Any]:
    """``{"passed", "first_divergence": null | {api, row, step, rank, reason}, "failures": [...], "missing":
    [the baseline's steps/ranks the target lacks], "coverage": {passed, max_unmatched, baseline_calls,
    unmatched_calls, baseline_rows, unmatched_rows, share, reason, over, first_unmatched}, "ranks": [per rank:
    rank, passed, apis, apis_error, first_error], "counts"}``."""
    fd = result.first_divergence
    failures = []
    for api in result.failures:
        row = result.rows[api.worst_row].row if api.worst_row is not None else api.api
        failures.append(_place(result, api, row, api.reason))
    return {
        "passed": result.passed,
        "first_divergence": None
        if fd is None
        else {"api": fd.api, "row": fd.row, "step": fd.step, "rank": fd.rank, "reason": fd.reason},
        "failures": failures,
        "missing": list(result.missing),
        "coverage": coverage_dict(result),
        "ranks": rank_summaries(result),
        "counts": result.counts(),
    }


def summary_json(result: CompareResult) -> str:
    return json.dumps(summary_dict(result), indent=2) + "\n"


def console_summary(result: CompareResult, reports: dict[str, str] | None = None, worst: int = 5) -> str:
    """A few lines for the terminal: headline with counts, the first divergence, the worst rows, the reports."""
    c = result.counts()
    steps = sorted({p.step for p in result.pairs if p.step is not None})
    ranks = sorted({p.rank for p in result.pairs if p.rank is not None})
    scope = f"{len(result.pairs)} dump pair(s)"
    if steps:
        scope += f", step(s) {', '.join(map(str, steps))}"
    if ranks:
        scope += f", rank(s) {', '.join(map(str, ranks))}"
    status = "PASSED" if result.passed else "FAILED"
    lines = [
        f"pytest-msprobe compare: {status} ({result.mode} mode, {scope}): {c['rows']} rows: {c['pass']} pass, "
        f"{c['warning']} warning, {c['error']} error, {c['unmatched']} unmatched, {c['skipped']} skipped; "
        f"{c['apis_error']} of {c['apis']} API calls breach"
    ]
    lines.extend(coverage_lines(result, "--max-unmatched=SHARE"))
    fd = result.first_divergence
    if fd is not None:
        where = f"step {fd.step}, rank {fd.rank}" if fd.step is not None else f"rank {fd.rank}"
        lines.append(f"first divergence: {fd.api} ({where}), row {fd.row}")
        lines.append(f"  {fd.reason}")
    by_rank = rank_line(result)
    if by_rank:
        lines.append(by_rank)
    flagged = [r for r in result.rows if r.status == "error" and r.error is not None]
    flagged.sort(key=lambda r: -(r.error or 0.0) / (r.allowed or 1e-300))
    if flagged:
        lines.append("worst rows (scaled error / allowed):")
        for r in flagged[:worst]:
            lines.append(f"  {r.row:<60} {fmt_number(r.error):>9} / {fmt_number(r.allowed)}")
    for note in result.unpaired:
        lines.append(f"{'missing' if note in result.missing else 'not compared'}: {note}")
    if reports:
        lines.append("reports: " + ", ".join(reports.values()))
    return "\n".join(lines)
