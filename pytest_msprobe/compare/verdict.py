"""Verdicts: of each row (pass / warning / error, with the reason), of each API call, and the first divergence.

A row check returns a :class:`Check`; the thresholds it uses come from :class:`Thresholds` (data, not code).

The **first divergence** is where the error enters, not where it shows. Over all compared API calls in
execution order (forward, then backward; steps; ranks ordered through the collectives they share, see
:mod:`pytest_msprobe.compare.rank_order`):

1. *enters*: the earliest call whose outputs breach while its inputs match (every input within a tenth of its
   tolerance: an input close to its line may have pushed the output over). The inputs of a backward call are
   the gradients flowing in plus the tensors its forward call saw (a backward kernel reads them); a module's
   ``parameters_grad`` has the inputs of the module's backward. The inputs of a collective are its inputs on
   every rank of its group: an all_reduce whose output differs on rank 0 while rank 0's own input matches
   does not let the error in when rank 1's input already differs.
2. *grows*: if every breaching call already has breaching inputs (errors flow in everywhere: a later step after
   an earlier fault moved the weights, a dump that starts mid-run), the earliest call whose output error is at
   least ``amplification`` (10) times its input error.
3. *inherited*: otherwise the earliest breaching call; its inputs already differ, so the error entered before
   this dump.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from pytest_msprobe.compare.metrics import STAT_NAMES, StatMetrics, TensorMetrics, stat_metrics
from pytest_msprobe.compare.records import INPUT, NONE, OUTPUT, PARAMETER, TENSOR, VALUE, Leaf
from pytest_msprobe.compare.result import (
    ERROR,
    PASS,
    SKIPPED,
    UNMATCHED,
    WARNING,
    ApiResult,
    Divergence,
    RowResult,
    worst,
)
from pytest_msprobe.compare.thresholds import Tolerance, is_integral, normalize_dtype


@dataclass(frozen=True)
class Check:
    """The verdict of one row."""

    status: str
    error: float | None = None
    allowed: float | None = None
    reason: str = ""
    stat: StatMetrics | None = None
    tensor: TensorMetrics | None = None
    msprobe_accuracy: str | None = None


def fmt_number(x: float | None) -> str:
    """A number for messages: three significant digits, ``n/a`` for none."""
    if x is None:
        return "n/a"
    if math.isinf(x) or math.isnan(x):
        return str(x)
    return f"{x:.3g}"


def _fmt6(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.6g}"


def _shape(leaf: Leaf) -> str:
    return str(list(leaf.shape or ()))


def _escalate(check: Check, status: str, note: str) -> Check:
    """Raise a check to at least ``status``, adding ``note`` to its reason."""
    reason = f"{check.reason}; {note}" if check.reason else note
    return Check(
        worst([check.status, status]),
        check.error,
        check.allowed,
        reason,
        check.stat,
        check.tensor,
        check.msprobe_accuracy,
    )


def _skip(check: Check, api: str) -> Check:
    if check.status in (ERROR, WARNING):
        reason = f"{check.reason} (not failing: {api} matches a skip rule)"
        return Check(
            SKIPPED, check.error, check.allowed, reason, check.stat, check.tensor, check.msprobe_accuracy
        )
    return check


# ---------------------------------------------------------------------------------------------- row checks
def check_unmatched(target: Leaf | None, baseline: Leaf | None) -> Check:
    if target is None:
        return Check(UNMATCHED, reason="only in the baseline: not compared")
    return Check(UNMATCHED, reason="only in the target: not compared")


def check_kinds(target: Leaf, baseline: Leaf) -> Check | None:
    """Rows that are not two tensors: None, plain values, or a mix. None when both are tensors."""
    if target.kind == TENSOR and baseline.kind == TENSOR:
        return None
    if target.kind == NONE and baseline.kind == NONE:
        return Check(SKIPPED, reason="None on both sides")
    if target.kind != baseline.kind:
        return Check(WARNING, reason=f"target is {_kind(target)}, baseline is {_kind(baseline)}")
    assert target.kind == VALUE
    if _same_value(target.value, baseline.value):
        return Check(PASS, error=0.0)
    return Check(WARNING, reason=f"argument differs: {target.value!r} vs {baseline.value!r}")


def _kind(leaf: Leaf) -> str:
    if leaf.kind == TENSOR:
        return f"a {leaf.dtype} tensor"
    if leaf.kind == NONE:
        return "None"
    return f"a {leaf.type} value"


def _same_value(x: object, y: object) -> bool:
    numbers = (int, float)
    if (isinstance(x, float) or isinstance(y, float)) and isinstance(x, numbers) and isinstance(y, numbers):
        if math.isnan(x) and math.isnan(y):
            return True
        # float arguments (a learning rate, an eps) may carry float noise from how they were computed
        return math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-12)
    return x == y


def _tensor_notes(check: Check, target: Leaf, baseline: Leaf) -> Check:
    if normalize_dtype(target.dtype) != normalize_dtype(baseline.dtype):
        check = _escalate(check, WARNING, f"dtype differs: {target.dtype} vs {baseline.dtype}")
    if (
        target.requires_grad is not None
        and baseline.requires_grad is not None
        and target.requires_grad != baseline.requires_grad
    ):
        check = _escalate(
            check, WARNING, f"requires_grad differs: {target.requires_grad} vs {baseline.requires_grad}"
        )
    return check


# statistics a dump may leave null for a non-empty tensor, by dtype: msprobe gives bool tensors only any/all (as
# Max/Min), integer tensors no Mean/Norm in 26.x, float64 tensors no Mean/Norm in some versions; complex ones
# get no Norm. Max and Min every dump gives (an empty tensor has none at all).
_MAX_MIN = (0, 1)
_ALL_FOUR = (0, 1, 2, 3)


def required_statistics(dtype: str | None) -> tuple[int, ...]:
    """Indices (into STAT_NAMES) of the statistics every dump gives a non-empty tensor of ``dtype``."""
    name = normalize_dtype(dtype)
    if name is None or is_integral(name) or name == "float64" or name.startswith("complex"):
        return _MAX_MIN
    if name.startswith(("float", "bfloat")):
        return _ALL_FOUR
    return _MAX_MIN  # a dtype we do not know: only what every dump gives


def _numel(leaf: Leaf) -> int | None:
    return None if leaf.shape is None else math.prod(leaf.shape)


def unusable_statistics(leaf: Leaf, side: str) -> str | None:
    """Why the statistics of a non-empty tensor record cannot be compared (None when they can): a statistic
    that is NaN, or one every dump gives that is null. ``side`` is "baseline" or "target"."""
    if not _numel(leaf):  # empty (or of unknown shape): nothing to summarise
        return None
    nan = [STAT_NAMES[i] for i, v in enumerate(leaf.stats) if v is not None and math.isnan(v)]
    missing = [STAT_NAMES[i] for i in required_statistics(leaf.dtype) if leaf.stats[i] is None]
    if side == "baseline":
        if nan:
            return (
                f"the baseline's {_names(nan)} {'is' if len(nan) == 1 else 'are'} NaN for this non-empty tensor: "
                "the baseline itself overflowed, so it cannot be a reference; regenerate it from a healthy run"
            )
        if missing:
            return (
                f"the baseline has no {_names(missing)} (null) for this non-empty {leaf.dtype} tensor: it lacks "
                "statistics, so it cannot be a reference; regenerate it"
            )
        return None
    if missing:  # (NaN in the target is a difference, judged as one)
        return (
            f"the target has no {_names(missing)} (null) for this non-empty {leaf.dtype} tensor: it lacks "
            "statistics, so it cannot be compared; dump it again"
        )
    return None


def _names(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _unusable(target: Leaf, baseline: Leaf, tol: Tolerance) -> Check | None:
    """An error check when either side's statistics cannot be compared (the baseline's first: a baseline that
    cannot be a reference is the problem to fix, whatever the target holds)."""
    why = unusable_statistics(baseline, "baseline") or unusable_statistics(target, "target")
    if why is None:
        return None
    # no error is measured: the row breaches without a number, and feeds no input/output error
    return _tensor_notes(Check(ERROR, None, tol.error, why), target, baseline)


def check_statistics(target: Leaf, baseline: Leaf, tol: Tolerance) -> Check:
    """Two tensors by their Max / Min / Mean / Norm."""
    if target.shape != baseline.shape:
        return _tensor_notes(
            Check(ERROR, math.inf, tol.error, f"shape differs: {_shape(target)} vs {_shape(baseline)}"),
            target,
            baseline,
        )
    unusable = _unusable(target, baseline, tol)
    if unusable is not None:
        return unusable
    metrics = stat_metrics(target.stats, baseline.stats)
    if metrics.error is None:
        return _tensor_notes(
            Check(SKIPPED, reason="no statistics to compare", stat=metrics), target, baseline
        )
    if metrics.nonfinite == "different":
        bad = [STAT_NAMES[i] for i, s in enumerate(metrics.scaled) if s is not None and math.isinf(s)]
        check = Check(
            ERROR,
            math.inf,
            tol.error,
            f"NaN/Inf on one side only ({', '.join(bad)}: {_stats_text(target, bad)} vs {_stats_text(baseline, bad)})",
            stat=metrics,
        )
        return _tensor_notes(check, target, baseline)

    error = 0.0
    status = PASS
    worst_i: int | None = None
    worst_margin = -math.inf
    for i, (d, s) in enumerate(zip(metrics.diff, metrics.scaled)):
        if d is None or s is None or abs(d) <= tol.atol:
            continue
        limit_error, limit_warning = tol.error, tol.warning
        error = max(error, s)
        if s > limit_error:
            status = worst([status, ERROR])
        elif s > limit_warning:
            status = worst([status, WARNING])
        margin = s / limit_error if limit_error > 0 else (math.inf if s > 0 else 0.0)
        if margin > worst_margin:
            worst_margin, worst_i = margin, i
    reason = ""
    if status != PASS and worst_i is not None:
        name = STAT_NAMES[worst_i]
        scaled = metrics.scaled[worst_i]
        values = f"{_fmt6(baseline.stats[worst_i])} -> {_fmt6(target.stats[worst_i])}"
        if scaled is not None and math.isinf(scaled):  # nothing finite to scale the difference by
            scale = "the Norms are not finite" if worst_i == 3 else "the tensor's Max and Min are not finite"
            reason = f"{name} differs ({values}; allowed {fmt_number(tol.error)} of a scale, and {scale})"
        else:
            scale = "its value" if worst_i == 3 else "the tensor's range"
            reason = f"{name} differs by {fmt_number(scaled)} of {scale} ({values}; allowed {fmt_number(tol.error)})"
    check = Check(status, error, tol.error, reason, stat=metrics)
    if metrics.nonfinite == "same":
        check = _escalate(check, WARNING, "NaN/Inf in the same statistics on both sides")
    return _tensor_notes(check, target, baseline)


def _stats_text(leaf: Leaf, names: list[str]) -> str:
    return ", ".join(fmt_number(leaf.stats[STAT_NAMES.index(n)]) for n in names)


def msprobe_accuracy(metrics: TensorMetrics) -> str | None:
    """msprobe 8.3.3's "Accuracy Reached or Not" of a tensor row: "Yes", "No", or None when not computed."""
    if metrics.max_abs_err is None:
        return None
    cos, mae = metrics.cosine, metrics.max_abs_err
    failed = mae > 1 or (cos is not None and ((cos < 0.99 and mae > 0.001) or cos < 0.9))
    return "No" if failed else "Yes"


def check_tensors(
    target: Leaf, baseline: Leaf, metrics: TensorMetrics, tol: Tolerance, msprobe_rule: bool
) -> Check:
    """Two tensors by their values."""
    accuracy = msprobe_accuracy(metrics)
    if metrics.note.startswith("shape differs"):
        return _tensor_notes(
            Check(ERROR, math.inf, tol.error, metrics.note, tensor=metrics), target, baseline
        )
    if metrics.numel == 0:
        return _tensor_notes(Check(SKIPPED, reason="empty tensor", tensor=metrics), target, baseline)
    if metrics.nonfinite == "different":
        check = Check(ERROR, math.inf, tol.error, metrics.note, tensor=metrics, msprobe_accuracy=accuracy)
        return _tensor_notes(check, target, baseline)
    error = metrics.error or 0.0
    if metrics.max_abs_err is not None and metrics.max_abs_err <= tol.atol:
        error = 0.0
    status = PASS
    reasons = []
    if error > tol.error:
        status = ERROR
    elif error > tol.warning:
        status = WARNING
    if status != PASS:
        reasons.append(
            f"RelL2Err {fmt_number(metrics.rel_l2)}, ScaledMaxAbsErr {fmt_number(metrics.scaled_max_abs)} "
            f"(MaxAbsErr {fmt_number(metrics.max_abs_err)}; allowed {fmt_number(tol.error)})"
        )
    if msprobe_rule and accuracy == "No":
        status = ERROR
        reasons.append(
            f"msprobe's accuracy rule fails (Cosine {fmt_number(metrics.cosine)}, MaxAbsErr {fmt_number(metrics.max_abs_err)})"
        )
    check = Check(status, error, tol.error, "; ".join(reasons), tensor=metrics, msprobe_accuracy=accuracy)
    if metrics.nonfinite == "same":
        check = _escalate(check, WARNING, "NaN/Inf at the same positions on both sides (set to 0)")
    return _tensor_notes(check, target, baseline)


def check_md5(target: Leaf, baseline: Leaf, tol: Tolerance) -> Check:
    """Two tensors by CRC32; the statistics tell a real difference from msprobe's racing CRC."""
    if target.md5 is None or baseline.md5 is None:
        return check_statistics(target, baseline, tol)
    if target.shape != baseline.shape:
        return check_statistics(target, baseline, tol)
    why = unusable_statistics(baseline, "baseline")  # equal CRCs of an overflowed baseline prove nothing
    if why is not None:
        return _tensor_notes(Check(ERROR, None, tol.error, why), target, baseline)
    if target.md5 == baseline.md5:
        return _tensor_notes(Check(PASS, 0.0, 0.0), target, baseline)
    metrics = stat_metrics(target.stats, baseline.stats)
    if metrics.error is not None and all(d == 0 for d in metrics.diff if d is not None):
        check = Check(
            WARNING,
            0.0,
            0.0,
            f"CRC differs ({baseline.md5} -> {target.md5}) but the statistics are identical: msprobe computes "
            "CRCs in the background, so an in-place op may have changed the tensor meanwhile",
            stat=metrics,
        )
        return _tensor_notes(check, target, baseline)
    error = metrics.error if metrics.error else math.inf
    check = Check(ERROR, error, 0.0, f"CRC differs: {baseline.md5} -> {target.md5}", stat=metrics)
    return _tensor_notes(check, target, baseline)


def finish(check: Check, skip: bool, api: str) -> Check:
    return _skip(check, api) if skip else check


# ----------------------------------------------------------------------------------------- API aggregation
@dataclass(frozen=True)
class ApiSummary:
    status: str
    reason: str
    input_error: float | None
    output_error: float | None
    input_breach: bool
    output_breach: bool
    worst_row: int | None


def _max(values: list[float]) -> float | None:
    return max(values) if values else None


def summarize_api(rows: Sequence[RowResult], first_index: int, only_one_side: bool) -> ApiSummary:
    """The verdict of a call from its rows (``first_index`` is the index of ``rows[0]``)."""
    if only_one_side:
        side = "baseline" if rows and rows[0].target is None else "target"
        return ApiSummary(UNMATCHED, f"only in the {side}: not compared", None, None, False, False, None)
    counted = [r for r in rows if r.status not in (SKIPPED, UNMATCHED) and r.error is not None]
    inputs = [r for r in counted if r.role in (INPUT, PARAMETER)]
    outputs = [r for r in counted if r.role == OUTPUT]
    # both sides made this call: a row only one side has (an extra output, say) is a warning about the call
    statuses = [WARNING if r.status == UNMATCHED else r.status for r in rows]
    status = worst(statuses)
    worst_row: int | None = None
    reason = ""
    if status in (ERROR, WARNING):
        # the reason is about the worst output row where there is one: outputs are what the call produced
        flagged = [(i, r) for i, r in enumerate(rows) if statuses[i] == status]
        flagged.sort(key=lambda t: (t[1].role != OUTPUT, -(t[1].error or 0.0)))
        i, r = flagged[0]
        worst_row = first_index + i
        reason = f"{r.row}: {r.reason}"
    return ApiSummary(
        status,
        reason,
        _max([r.error for r in inputs if r.error is not None]),
        _max([r.error for r in outputs if r.error is not None]),
        any(r.status == ERROR for r in rows if r.role in (INPUT, PARAMETER)),
        any(r.status == ERROR for r in rows if r.role == OUTPUT),
        worst_row,
    )


# ------------------------------------------------------------------------------------- first divergence
def _worst_output_row(api: ApiResult, rows: Sequence[RowResult]) -> int:
    candidates = [i for i in api.rows if rows[i].role == OUTPUT and rows[i].status == ERROR]
    if not candidates:
        candidates = [i for i in api.rows if rows[i].status == ERROR] or list(api.rows)
    return max(candidates, key=lambda i: (rows[i].error or 0.0, -i))


def other_shape(row: RowResult) -> bool:
    """Whether a row's two tensors have other shapes (never a matter of precision)."""
    t, b = row.target, row.baseline
    return t is not None and b is not None and t.kind == TENSOR and b.kind == TENSOR and t.shape != b.shape


def _suffix(api: ApiResult, rows: Sequence[RowResult], i: int) -> str:
    return rows[i].row[len(api.api) :] if rows[i].row.startswith(api.api) else rows[i].row


# an input whose error exceeds this fraction of its tolerance does not count as matching the baseline (the
# warning level of the default dtype table): an output can only be where the error enters if its inputs are clean
NEAR_FRACTION = 0.1


def first_divergence(
    apis: Sequence[ApiResult],
    rows: Sequence[RowResult],
    feeds: Mapping[int, Sequence[int]],
    amplification: float,
    opaque: Collection[int] = (),
    peers: Mapping[int, Sequence[int]] | None = None,
) -> Divergence | None:
    """Where the error enters (see the module docstring). ``feeds[i]`` are the calls whose tensors call ``i``
    also reads (a backward call's forward call; a parameters_grad's module backward); the inputs of the
    calls in ``opaque`` are unknown, so the error cannot be shown to enter there. ``peers[i]`` are the same
    collective as call ``i`` on the other ranks of its group: their inputs are inputs of call ``i`` too (an
    all_reduce sums every rank's input), their outputs are not (they are the same result, and differ when
    call ``i``'s does)."""
    peers = peers or {}
    compared = [(api.order, i) for i, api in enumerate(apis) if api.status != UNMATCHED]
    compared.sort()

    def near(j: int) -> bool:
        # within a tenth of its tolerance: a row this close to the line does not "match" the baseline
        r = rows[j]
        return r.error is not None and r.allowed is not None and r.error > r.allowed * NEAR_FRACTION

    def effective_inputs(i: int) -> tuple[float | None, bool, bool]:
        """(largest input error, whether an input breaches, whether an input is near or over its tolerance)."""
        api = apis[i]
        errors = [api.input_error] if api.input_error is not None else []
        breach = api.input_breach or i in opaque
        tainted = breach or any(near(j) for j in api.rows if rows[j].role != OUTPUT)
        for j in feeds.get(i, ()):
            other = apis[j]
            if other.status == UNMATCHED:
                continue
            errors.extend(e for e in (other.input_error, other.output_error) if e is not None)
            breach = breach or other.input_breach or other.output_breach
            tainted = tainted or breach or any(near(k) for k in other.rows)
        for j in peers.get(i, ()):
            other = apis[j]
            if other.status == UNMATCHED:
                continue
            if other.input_error is not None:
                errors.append(other.input_error)
            breach = breach or other.input_breach
            tainted = tainted or breach or any(near(k) for k in other.rows if rows[k].role != OUTPUT)
        return (max(errors) if errors else None), breach, tainted

    def make(i: int, rule: str, why: str) -> Divergence:
        api = apis[i]
        row = _worst_output_row(api, rows)
        return Divergence(api.api, rows[row].row, api.step, api.rank, why, rule, i, row)

    breaching = [i for _, i in compared if apis[i].output_breach]
    for i in breaching:
        _, _, in_tainted = effective_inputs(i)
        if not in_tainted:
            api = apis[i]
            row = _worst_output_row(api, rows)
            group = {apis[j].rank for j in peers.get(i, ())} | {api.rank}
            ranks = sorted(r for r in group if r is not None)
            inputs = f"its inputs on ranks {', '.join(map(str, ranks))}" if len(ranks) > 1 else "its inputs"
            if rows[row].error is None:  # not a measured difference: the record itself cannot be compared
                why = (
                    f"its output cannot be compared ({_suffix(api, rows, row)}: {rows[row].reason}) while {inputs} "
                    "match the baseline: the first row to fix is here"
                )
            else:
                why = (
                    f"its output differs ({_suffix(api, rows, row)}: {rows[row].reason}) while {inputs} match "
                    f"the baseline: the error enters here"
                )
            return make(i, "enters", why)
    for i in breaching:
        in_err, _, _ = effective_inputs(i)
        out_err = apis[i].output_error
        # a ratio means something only for a finite input error: inputs that differ beyond measure (another
        # shape, NaN/Inf on one side) cannot show the error growing
        if not in_err or not math.isfinite(in_err) or out_err is None or out_err < amplification * in_err:
            continue
        if math.isfinite(out_err):
            growth = (
                f"the output error {fmt_number(out_err)} is {out_err / in_err:.0f}x the input error "
                f"{fmt_number(in_err)}"
            )
        else:
            growth = (
                f"the output differs beyond measure (NaN/Inf on one side only, or another shape) while the input "
                f"error is {fmt_number(in_err)}"
            )
        why = f"errors already flow into every call; here {growth}: the error grows here"
        return make(i, "grows", why)
    inherited = breaching or [i for _, i in compared if apis[i].status == ERROR]
    if not inherited:
        return None
    i = inherited[0]
    if not any(rows[j].role != OUTPUT and rows[j].status == ERROR for j in apis[i].rows):
        # a collective whose own inputs match: the error came in with another rank's input to it
        for j in sorted(peers.get(i, ()), key=lambda j: apis[j].order):
            if apis[j].input_breach:
                i = j
                break
    api = apis[i]
    in_rows = [j for j in api.rows if rows[j].role != OUTPUT and rows[j].status == ERROR]
    if not in_rows:  # (its inputs are unknown)
        return make(
            i, "inherited", "its inputs cannot be compared, and no call's error is shown to enter later"
        )
    first_in = in_rows[0]
    reshaped = [j for j in in_rows if other_shape(rows[j])]
    if reshaped:  # a shape is not a matter of precision
        first_in = reshaped[0]
        why = (
            f"its inputs have other shapes ({rows[first_in].row}: {rows[first_in].reason}): the two dumps may not "
            "come from the same model or data (another architecture, other layer sizes, another batch), so no "
            "call's error can be shown to enter or grow"
        )
    elif all(rows[j].error is not None and math.isinf(rows[j].error or 0.0) for j in in_rows):
        why = (
            f"its inputs differ beyond measure ({rows[first_in].row}: {rows[first_in].reason}): one run "
            "overflowed before this dump (dump an earlier step), so no call's error can be shown to enter or grow"
        )
    else:
        why = (
            f"its inputs already differ ({rows[first_in].row}): the error entered before this dump (an earlier "
            f"step, the weights or the data), and no later call's output error is {amplification:g}x its input "
            "error"
        )
    # the row to look at is the input that already differs
    return Divergence(api.api, rows[first_in].row, api.step, api.rank, why, "inherited", i, first_in)
