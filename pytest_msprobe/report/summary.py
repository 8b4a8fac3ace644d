"""summary.json: the machine-readable verdict of a compare."""

from __future__ import annotations

import json
import math
from typing import Any

from pytest_msprobe.compare.judging import ERROR, ApiResult, Overflow
from pytest_msprobe.compare.result import CompareResult
from pytest_msprobe.report.own_error_table import self_check_dict


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


def overflow_dict(ov: Overflow | None) -> dict[str, Any] | None:
    """summary.json's ``overflow``: the first call that overflows on the target only, None when none does."""
    if ov is None:
        return None
    return _fields(
        ov, "api", "step", "rank", "where", "row", "output_row", "values", "dtype", "source", "reason"
    )


def _fields(obj: object, *names: str) -> dict[str, Any]:
    """Some of an object's attributes as summary.json's keys, in the order given."""
    return {name: getattr(obj, name) for name in names}


def _number(x: float | None) -> float | str | None:
    """A number for JSON: NaN and Inf as the texts "nan", "inf", "-inf" (JSON has no such numbers)."""
    if x is None or math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else "inf" if x > 0 else "-inf"


def trend_dict(result: CompareResult) -> dict[str, Any] | None:
    """summary.json's ``trend``: ``{passed, steps, dtype, rtol, first_step, quantity, target, baseline,
    difference, module, module_values, rank, spikes, nan_steps, rerun_steps}``; None without a trend."""
    t = result.trend
    if t is None:
        return None
    return {
        **_fields(t, "passed", "steps", "dtype", "rtol", "first_step", "quantity"),
        **{name: _number(getattr(t, name)) for name in ("target", "baseline", "difference")},
        "module": t.module,
        "module_values": None if t.module_values is None else [_number(v) for v in t.module_values],
        "rank": t.rank,
        "spikes": list(t.spikes),
        "nan_steps": list(t.nan_steps),
        "rerun_steps": list(t.rerun_steps),
    }


def summary_dict(result: CompareResult) -> dict[str, Any]:
    """``{"passed", "first_divergence": null | {api, row, step, rank, reason}, "failures": [...], "missing":
    [the baseline's steps/ranks the target lacks], "coverage": {passed, max_unmatched, baseline_calls,
    unmatched_calls, baseline_rows, unmatched_rows, share, reason, over, first_unmatched}, "set_aside": [one line
    per dump pair and cause of what was neither compared nor unmatched], "ranks": [per rank:
    rank, passed, apis, apis_error, first_error], "counts", "self_check": null | {gate, calls_checked,
    calls_not_replayed, out_of_line: [{api, step, rank, reason}]}, "checklist": null | {checked_dump_pairs,
    unchecked, passed, failures, context}, "overflow": null | {api, step, rank, where, row, output_row, values,
    dtype, source, reason}, "trend": null | {...} (see :func:`trend_dict`), "across": null | {why, own_errors,
    drift_calls, evidence_calls, rule} (runs on different devices: how the calls were judged)}``; ``first_divergence`` is
    :func:`first_divergence_dict`'s."""
    failures = []
    for api in result.failures:
        row = result.rows[api.worst_row].row if api.worst_row is not None else api.api
        failures.append(_place(result, api, row, api.reason))
    return {
        "passed": result.verdict.passed,
        "first_divergence": first_divergence_dict(result),
        "overflow": overflow_dict(result.overflow),
        "failures": failures,
        "missing": list(result.missing),
        "coverage": coverage_dict(result),
        "set_aside": list(result.set_aside),
        "ranks": rank_summaries(result),
        "counts": result.counts(),
        "self_check": self_check_dict(result),
        "trend": trend_dict(result),
        "checklist": result.checklist.to_dict() if result.checklist is not None else None,
        "across": result.across.to_dict() if result.across is not None else None,
    }


def first_divergence_dict(result: CompareResult) -> dict[str, Any] | None:
    """``{kind, api, row, step, rank, reason, rule}``: ``kind`` is ``api`` for a call (then ``rule`` says which
    rule placed it), or the checklist's kind (data, parameter, buffer, hyperparameter, structure, setting) with
    its ``name`` and ``where`` (and, for a setting, the first ``call`` it changes, at ``step`` and ``rank``). ``api``
    and ``row`` always name a call and a row where any call is compared: for a checklist difference, the first
    call that reads it (or that a setting changes), and the row where it shows (an input slot for a weight or
    the data). ``source`` is what an input from outside the recorded calls is, where one is the first
    divergence (parameter, buffer, data, unrecorded)."""
    verdict = result.verdict
    first, fd = verdict.checklist, verdict.divergence
    if first is not None:
        api, row = verdict.api, verdict.row
        return {
            "kind": first.kind,
            "name": first.name,
            "where": first.where,
            "call": first.call or None,
            "api": api,
            "row": row,
            "step": first.step,
            "rank": first.rank,
            "reason": first.detail,
            "rule": "checklist",
            "text": first.headline(result.several_ranks),
        }
    if fd is None:
        return None
    return {
        "kind": "api",
        "api": fd.api,
        "row": fd.row,
        "step": fd.step,
        "rank": fd.rank,
        "reason": fd.reason,
        "rule": fd.rule,
        **({"overflow": fd.overflow} if fd.overflow is not None else {}),
        **({"source": fd.source} if fd.source is not None else {}),
    }


def summary_json(result: CompareResult) -> str:
    return json.dumps(summary_dict(result), indent=2) + "\n"
