"""The text views of a compare: the console summary of ``pytest-msprobe compare`` and the failure message of a
breaching msprobe test, made of the same pieces (first divergence, ranks, coverage, worst rows, reports).

The failure message has one shape, every time:

headline with counts
what the compare could not check (a step or rank the target lacks, too little of the baseline paired)
the first divergence and why
the worst rows: row, metric, value, allowed
where the reports are
how to regenerate the baseline
"""

from __future__ import annotations

import re
from pathlib import Path

from pytest_msprobe.compare.alignment import UNMATCHED_CAUSES, unmatched_share
from pytest_msprobe.compare.checklist import SETTING
from pytest_msprobe.compare.diagnosis import Divergence
from pytest_msprobe.compare.judging import RowResult, SelfCheckResult, fmt_number, is_tensor, row_metric
from pytest_msprobe.compare.result import CompareResult
from pytest_msprobe.format.names import FORWARD, parse_name
from pytest_msprobe.options import BY_NAME
from pytest_msprobe.report.own_error_table import own_error_line
from pytest_msprobe.report.summary import rank_summaries
from pytest_msprobe.thresholds import normalize_dtype

# ------------------------------------------------------------------------------------------ shared pieces
_LIBRARY_FRAME = re.compile(r"site-packages|dist-packages|/torch/|/msprobe/|pytest_msprobe", re.IGNORECASE)


def call_site(frames: tuple[str, ...]) -> str | None:
    """The first stack frame in the user's code (not torch, msprobe or installed packages)."""
    for frame in frames:
        if not _LIBRARY_FRAME.search(frame):
            return " ".join(frame.split())
    return None


def api_site(result: CompareResult, api: str) -> str | None:
    """Where the user's code made a call: its stack's first frame outside the libraries (a backward call
    has its forward's stack: stack.json holds forward calls)."""
    frames = result.stacks.get(api) or result.stacks.get(parse_name(api).with_direction(FORWARD))
    return call_site(frames) if frames else None


def divergence_site(result: CompareResult) -> str | None:
    """The source line of the first divergence's call, or of the first call a setting that comes first changes
    (None for another checklist difference, or without a stack)."""
    fd, first = result.first_divergence, result.verdict.checklist
    if first is not None:
        return api_site(result, first.call) if first.call else None
    return api_site(result, fd.api) if fd is not None else None


def dtype_change(row: RowResult) -> str | None:
    """``dtype float32 vs bfloat16`` where the row's two tensors have other dtypes (its difference is then the
    cast's as much as the call's), None otherwise."""
    t, b = row.target, row.baseline
    if not (is_tensor(t) and is_tensor(b)) or normalize_dtype(t.dtype) == normalize_dtype(b.dtype):
        return None
    return f"dtype {normalize_dtype(t.dtype)} vs {normalize_dtype(b.dtype)}"


def row_what(row: RowResult) -> str:
    """What a row of the worst-rows tables measured: its dtype change where there is one, else its metric."""
    return dtype_change(row) or row_metric(row)


def place(value: int | None) -> str:
    """A step or a rank in a table (``-`` for none)."""
    return "-" if value is None else str(value)


def _steps_and_ranks(result: CompareResult) -> tuple[list[int], list[int]]:
    """The steps and the ranks of the dump pairs compared."""
    steps = sorted({p.step for p in result.pairs if p.step is not None})
    ranks = sorted({p.rank for p in result.pairs if p.rank is not None})
    return steps, ranks


def _divergence_lines(fd: Divergence, where: str, site: str | None) -> list[str]:
    """``first divergence: API (where), row ROW``, where the user's code made the call, and its reason."""
    called = [f"  called from: {site}"] if site else []
    return [f"first divergence: {fd.api} ({where}), row {fd.row}", *called, f"  {fd.reason}"]


def divergence_lines(result: CompareResult) -> list[str]:
    """The first divergence and why: a checklist difference (data, a weight, a setting, the structure) when
    it comes first, then the first breaching call it leads to; else the call where the error enters."""
    fd = result.first_divergence
    first = result.verdict.checklist
    lines: list[str] = []
    if first is not None:
        lines = [f"first divergence: {first.headline(result.several_ranks)}"]
        site = divergence_site(result)
        if site:  # a setting: where its first changed call is made
            lines.append(f"  called from: {site}")
        lines.append(f"  {first.meaning}")
        assert result.checklist is not None
        others = [d for d in (*result.checklist.failures, *result.checklist.drifts) if d is not first]
        if others:
            named = "; ".join(d.headline(result.several_ranks).split(": ", 1)[0] for d in others[:4])
            more = f" and {len(others) - 4} more" if len(others) > 4 else ""
            lines.append(f"  also differs before the calls: {named}{more}")
        if fd is not None:
            lines.append(f"  the first breaching call after it: {fd.api} ({_where(fd.step, fd.rank)})")
    elif fd is not None:
        where = f"step {fd.step}, rank {fd.rank}" if fd.step is not None else f"rank {fd.rank}"
        lines = _divergence_lines(fd, where, divergence_site(result))
        drifts = result.checklist.drifts if result.checklist is not None else []
        if drifts:
            named = "; ".join(d.headline(result.several_ranks).split(": ", 1)[0] for d in drifts[:3])
            more = f" and {len(drifts) - 3} more" if len(drifts) > 3 else ""
            lines.append(
                f"  weights already beyond their tolerance as the compared steps start: {named}{more}: the "
                "divergence may have begun in steps that were not compared"
            )
    context = result.checklist.context_line() if result.checklist is not None else None
    if context:
        lines.append(f"context (not failures): {context}")
    return lines


def checklist_headline(result: CompareResult) -> str:
    """``the runs differ before any call: 2 checklist differences (data, parameter); `` (empty for none)."""
    failures = result.checklist.failures if result.checklist is not None else []
    if not failures:
        return ""
    kinds = ", ".join(dict.fromkeys(d.kind for d in failures))
    n = len(failures)
    # a setting is no difference before the calls: it changes how they compute
    what = "in a numerics setting" if all(d.kind == SETTING for d in failures) else "before any call"
    return f"the runs differ {what}: {n} checklist difference{'s' if n > 1 else ''} ({kinds}); "


def _reports_lines(reports: dict[str, str] | None) -> list[str]:
    return ["reports: " + ", ".join(reports.values())] if reports else []


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
        f"{unmatched_share(cov)} of the baseline's rows)"
    )
    return lines


SET_ASIDE_SHOWN = 5  # set-aside lines the console and the failure message show (summary.json has them all)


def set_aside_lines(result: CompareResult) -> list[str]:
    """``set aside (not compared, not unmatched): step 0, rank 0: the baseline's optimizer (fused) records no
    update per parameter: ...``: what the compare left out on purpose, one line per dump pair and cause."""
    notes = result.set_aside
    if not notes:
        return []
    lines = ["set aside (not compared, not unmatched):", *(f"  {note}" for note in notes[:SET_ASIDE_SHOWN])]
    if len(notes) > SET_ASIDE_SHOWN:
        lines.append(f"  ... and {len(notes) - SET_ASIDE_SHOWN} more (summary.json: set_aside)")
    return lines


def _steps_text(steps: list[int] | tuple[int, ...]) -> str:
    return f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}"


def trend_lines(result: CompareResult) -> list[str]:
    """``trend: the loss first differs at step 25 (...; allowed rel 1e-4); steps 24, 25 dumped again and
    compared`` and its context (the first module whose gradient norm differs, spikes, NaN steps); none without
    a trend."""
    t = result.trend
    if t is None:
        return []
    line = f"trend: {t.headline}"
    if t.first_step is None:
        return [line]
    k = t.first_step
    around = [k - 1, k] if k > 0 else [0]
    if t.rerun_steps:
        line += f"; {_steps_text(t.rerun_steps)} dumped again and compared"
    elif k in _steps_and_ranks(result)[0]:
        line += f"; step {k} is dumped and compared"
    else:
        line += f"; dump {_steps_text(around)} (the backward of step {k - 1} and the forward of step {k}) to find the API"
    lines = [line]
    if t.module is not None and t.module_values is not None:
        a, b = t.module_values
        lines.append(
            f"  first module whose gradient norm differs at step {k}: {t.module} ({a:.6g} vs {b:.6g})"
        )
    if t.spikes:
        lines.append(
            f"  gradient-norm spikes of the target only (over 10x the median of its earlier steps): "
            f"{_steps_text(t.spikes)}"
        )
    if t.nan_steps:
        lines.append(f"  NaN/Inf on one side only: {_steps_text(t.nan_steps)}")
    return lines


def trend_only_lines(result: CompareResult, steps: list[int], scope: str) -> list[str]:
    """The head of the failure message of a trend that differs while the dumped steps agree."""
    t = result.trend
    assert t is not None and t.first_step is not None
    trend = trend_lines(result)
    compared = t.rerun_steps or tuple(steps)
    agree = f"the dumped {_steps_text(compared)} agree{'s' if len(compared) == 1 else ''} within the API thresholds"
    if t.rerun_steps or t.first_step in compared:
        why = (
            f"  {agree} ({scope}): the trend's difference builds up from rounding, or from what the dump does "
            f"not record; if the runs may differ this much, raise {BY_NAME['trend_rtol'].flag} (or the "
            "marker's trend_rtol=)"
        )
    else:  # not run again (several ranks): the user dumps the steps there
        why = f"  {agree} ({scope}); the test body was not run again (a test of several ranks is not)"
    return [f"msprobe: {trend[0]}", *trend[1:], why]


def _where_lines(result: CompareResult) -> list[str]:
    """The first divergence and why, the ranks where calls breach, and the calls whose own error is out of line:
    the middle of the console summary and of the failure message."""
    lines = divergence_lines(result)
    lines.extend(line for line in (rank_line(result), own_error_line(result)) if line)
    return lines


# ---------------------------------------------------------------------------------------------- the views
def console_summary(result: CompareResult, reports: dict[str, str] | None = None, worst: int = 5) -> str:
    """A few lines for the terminal: headline with counts, the first divergence, the worst rows, the reports."""
    c = result.counts()
    steps, ranks = _steps_and_ranks(result)
    scope = f"{len(result.pairs)} dump pair(s)"
    if steps:
        scope += f", step(s) {', '.join(map(str, steps))}"
    if ranks:
        scope += f", rank(s) {', '.join(map(str, ranks))}"
    status = "PASSED" if result.verdict.passed else "FAILED"
    lines = [
        f"pytest-msprobe compare: {status} ({result.mode} mode, {scope}): {c['rows']} rows: {c['pass']} pass, "
        f"{c['warning']} warning, {c['error']} error, {c['unmatched']} unmatched, {c['skipped']} skipped; "
        f"{c['apis_error']} of {c['apis']} API calls breach"
    ]
    lines.extend(coverage_lines(result, "--max-unmatched=SHARE"))
    if result.across is not None:
        lines.append(result.across.line())
    lines.append(compare_overflow_line(result))
    lines.extend(_where_lines(result))
    # the console ranks only rows with a measured error: its table is of numbers
    measured = [r for r in result.ranked_errors if r.error is not None]
    if measured:
        lines.append("worst rows (scaled error / allowed):")
        for r in measured[:worst]:
            lines.append(f"  {r.row:<60} {fmt_number(r.error):>9} / {fmt_number(r.allowed)}")
    for note in result.unpaired:
        lines.append(f"{'missing' if note in result.missing else 'not compared'}: {note}")
    lines.extend(set_aside_lines(result))
    lines.extend(_reports_lines(reports))
    return "\n".join(lines)


def failure_message(
    result: CompareResult, reports: dict[str, str], baseline: Path, regen_command: str
) -> str:
    """The failure message of a breaching msprobe test, in the shape this module's docstring gives."""
    c = result.counts()
    steps, ranks = _steps_and_ranks(result)
    lacking = (
        f"the target lacks {len(result.missing)} step/rank dump(s) of the baseline; "
        if result.missing
        else ""
    )
    scope = f", steps {', '.join(map(str, steps))}" if steps else ""
    if len(ranks) > 1:
        scope += f", ranks {', '.join(map(str, ranks))}"
    detail = f"({c['error']} error rows, {c['warning']} warnings, {c['unmatched']} unmatched rows; {result.mode} mode{scope})"
    counts = f"{c['apis_error']} of {c['apis']} API calls breach the thresholds {detail}"
    limit = BY_NAME["max_unmatched"]
    coverage = coverage_lines(result, f"{limit.flag}=SHARE or the marker's {limit.marker}=")
    if coverage:
        # what was not compared leads: the verdict of the rows that were says little about the run
        lines = [f"msprobe: {lacking}{coverage[0]}", *coverage[1:]]
        if not c["apis_error"]:
            lines.append(f"of what was compared, no API call breaches the thresholds {detail}")
        else:
            lines.append(f"of what was compared, {counts}")
        lines.extend(trend_lines(result))
    elif result.verdict.trend_only:  # the API compare passed: the trend's difference is the failure
        lines = trend_only_lines(result, steps, f"{c['apis']} API calls, {result.mode} mode")
    else:
        lines = [f"msprobe: {lacking}{checklist_headline(result)}{counts}", *trend_lines(result)]
    if result.across is not None:
        lines.append(result.across.line())
    if result.overflow is not None:
        lines.append(compare_overflow_line(result))
    lines.extend(_where_lines(result))
    if result.missing:
        lines.append(f"missing in the target ({len(result.missing)} dump(s) the baseline has):")
        lines.extend(f"  {note}" for note in result.missing[:5])
        if len(result.missing) > 5:
            lines.append(f"  ... and {len(result.missing) - 5} more")
    lines.extend(worst_rows_lines(result))
    lines.extend(set_aside_lines(result))
    lines.append(f"baseline: {baseline}")
    lines.extend(_reports_lines(reports))
    lines.append(f"if the new numbers are right, regenerate the baseline: {regen_command}")
    return "\n".join(lines)


def worst_rows_lines(result: CompareResult) -> list[str]:
    """The worst rows as a table: step, rank, row, what was measured, value, allowed (each call's rows
    together, the first divergence's first, a tensor shown once: :meth:`CompareResult.worst_rows`)."""
    rows = result.worst_rows()
    if not rows:
        return []
    width = max(len(r.row) for r in rows)
    what = [row_what(r) for r in rows]
    what_width = max(16, *(len(w) for w in what))
    lines = [
        "worst rows:",
        f"  {'step':>4} {'rank':>4}  {'row':<{width}}  {'metric':<{what_width}} {'value':>9}  {'allowed':>9}",
    ]
    for r, w in zip(rows, what):
        api = result.apis[r.api_index]
        lines.append(
            f"  {place(api.step):>4} {place(api.rank):>4}  {r.row:<{width}}  {w:<{what_width}} "
            f"{fmt_number(r.error):>9}  {fmt_number(r.allowed):>9}"
        )
    return lines


OVERFLOW_PLACE_TEXT = {
    "parameter": "a weight already holds it: look at the previous step's backward and optimizer update",
    "input": "an input no recorded call made holds it: a call that was not recorded made it",
    "output": "its inputs are finite: this call is the suspect",
}


def compare_overflow_line(result: CompareResult) -> str:
    """``overflow: X (step 0, rank 0) is the first call whose output holds inf/nan on the target and not on the
    baseline; where: output (...)``, that it could not be checked, or that none does."""
    ov = result.overflow
    if ov is None:
        tensors = [r.target for r in result.rows if is_tensor(r.target)]
        if tensors and all(t.max is None and t.min is None for t in tensors):
            return (
                "overflow: not checked: the target's records hold no statistics (Max, Min) to see inf/nan in "
                "(an md5 dump without them); dump with task statistics or overflow_check"
            )
        return (
            "overflow: none: no call's output is infinite or NaN on the target where the baseline's is finite"
        )
    return (
        f"overflow: {ov.api} ({_where(ov.step, ov.rank) or 'the dump'}) is the first call whose output holds "
        f"inf/nan on the target and not on the baseline; where: {ov.where} ({OVERFLOW_PLACE_TEXT[ov.where]})"
    )


def overflow_lines(result: SelfCheckResult) -> list[str]:
    """The lines naming the dump's first call whose output holds inf/nan (none when no call's does)."""
    ov = result.overflow
    if ov is None:
        return []
    where = _where(ov.step, ov.rank) or "the dump"
    lines = [
        f"msprobe self-check: {ov.api} ({where}) overflows: its output holds inf/nan",
        f"first overflow: {ov.api} ({where}), row {ov.row}; where: {ov.where} ({OVERFLOW_PLACE_TEXT[ov.where]})",
    ]
    stack = next((c.stack for c in result.calls if c.name == ov.api), ())
    site = call_site(stack)
    if site:
        lines.append(f"  called from: {site}")
    lines.append(f"  {ov.reason}")
    return lines


def self_check_message(result: SelfCheckResult, reports: dict[str, str] | None = None) -> str:
    """The failure message of a self-check without a baseline: the headline with counts, the first
    out-of-line call with where it is called from and why, the others, where the report is."""
    ool = result.out_of_line
    lines = overflow_lines(result)
    lines.append(
        f"{'also: ' if lines else 'msprobe self-check: '}{len(ool)} of {result.checked} replayed API calls are out "
        f"of line against the float64 replay of their own inputs ({result.skipped} not replayable)"
    )
    if ool:
        first = ool[0]
        lines.append(f"first out of line: {first.name} ({_where(first.step, first.rank) or 'the dump'})")
        site = call_site(first.stack)
        if site:
            lines.append(f"  called from: {site}")
        lines.append(f"  {first.own.reason}")
        if first.own.target is not None:
            t = first.own.target
            lines.append(
                f"  own error: max rel {t.max_rel:.3g}, mean rel {t.mean_rel:.3g}, RMSE {t.rmse:.3g}, "
                f"{t.rel_share:.3%} of {t.elements} elements off"
            )
        for other in ool[1:6]:
            lines.append(
                f"also out of line: {other.name} ({_where(other.step, other.rank)}): {other.own.reason}"
            )
        if len(ool) > 6:
            lines.append(f"  ... and {len(ool) - 6} more")
    if reports:
        lines.append("reports: " + ", ".join(reports.values()))
    return "\n".join(lines)
