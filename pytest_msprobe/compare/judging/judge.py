"""Row checks: the verdict of each compared row (pass, warning, error or skipped, with the reason).

A row check returns a :class:`Check`; the thresholds it uses come from :class:`Thresholds` (data, not code).
A check that fails for a reason no tolerance could change (other shapes, NaN/Inf on one side only,
statistics that cannot be compared) says so in its ``problem`` (see :mod:`pytest_msprobe.compare.result`),
so that nothing downstream reads it back out of the reason.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from pytest_msprobe.compare.dumps import NONE, TENSOR, VALUE, Leaf
from pytest_msprobe.compare.judging.metrics import STAT_NAMES, StatMetrics, TensorMetrics, stat_metrics
from pytest_msprobe.compare.judging.rows import (
    DTYPE,
    ERROR,
    NONFINITE,
    PASS,
    SHAPE,
    SKIPPED,
    UNMATCHED,
    UNUSABLE,
    WARNING,
    fmt_number,
    worst,
)
from pytest_msprobe.thresholds import Tolerance, is_integral, normalize_dtype


class Check(NamedTuple):
    """The verdict of one row: the fields of its :class:`~pytest_msprobe.compare.result.RowResult` after
    the row's identity, in their order. A named tuple: a large compare makes millions of them."""

    status: str
    error: float | None = None
    allowed: float | None = None
    reason: str = ""
    stat: StatMetrics | None = None
    tensor: TensorMetrics | None = None
    msprobe_accuracy: str | None = None
    problem: str | None = None  # SHAPE, NONFINITE, UNUSABLE or None


def _fmt6(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.6g}"


def _shape(leaf: Leaf) -> str:
    return str(list(leaf.shape or ()))


def amend(check: Check, note: str, status: str | None = None) -> Check:
    """``check`` with ``note`` added to its reason and, when given, ``status`` in place of its own."""
    reason = f"{check.reason}; {note}" if check.reason else note
    return check._replace(status=check.status if status is None else status, reason=reason)


def _warn(check: Check, note: str) -> Check:
    """``check`` raised to at least a warning, with ``note``."""
    return amend(check, note, worst([check.status, WARNING]))


def _skip(check: Check, api: str) -> Check:
    if check.status in (ERROR, WARNING):
        return check._replace(
            status=SKIPPED, reason=f"{check.reason} (not failing: {api} matches a skip rule)"
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


def _floating(dtype: str | None) -> bool:
    return dtype is not None and "float" in dtype


# a float32 value made in float32 keeps 24 significant bits (16 or fewer by chance once in 256); a half type's
# value keeps 8 (bfloat16) or 11 (float16), and a sum of a few of them (gradients accumulated over micro-batches)
# a few more
_CARRIED_BITS = 16


def _significant_bits(value: float) -> int:
    mantissa, _ = math.frexp(value)
    bits = 0
    while not mantissa.is_integer() and bits < 60:
        mantissa *= 2
        bits += 1
    return bits


def carried_dtype(target: Leaf, baseline: Leaf) -> str | None:
    """``bfloat16`` for a float32 tensor whose values a half type made: both sides' Max and Min keep at most
    :data:`_CARRIED_BITS` significant bits (None otherwise). A float32 gradient summed from bfloat16 gradients
    under autocast carries bfloat16's precision, and holding it to float32's tolerance fails a rerun that rounds
    otherwise; the chance that a float32 tensor made in float32 has four such extremes is about 2e-10. Zeros and
    powers of two, short in every format, tell nothing: at least two of the four values must say it."""
    if normalize_dtype(baseline.dtype) != "float32" or normalize_dtype(target.dtype) != "float32":
        return None
    values = [target.max, target.min, baseline.max, baseline.min]
    if any(v is None or not math.isfinite(v) for v in values):
        return None
    bits = [_significant_bits(v) for v in values]  # type: ignore[arg-type]
    if max(bits) > _CARRIED_BITS or sum(b > 1 for b in bits) < 2:
        return None
    return "bfloat16"


def _tensor_notes(check: Check, target: Leaf, baseline: Leaf) -> Check:
    t_dtype, b_dtype = normalize_dtype(target.dtype), normalize_dtype(baseline.dtype)
    if t_dtype != b_dtype and _floating(t_dtype) and _floating(b_dtype):
        # another floating format: its values are rounded otherwise from here on, whatever they measure now
        # (float16 for bfloat16 agrees with it to bfloat16's tolerance), so the call that makes it breaches
        check = amend(check, f"dtype differs: {target.dtype} vs {baseline.dtype}", ERROR)._replace(
            problem=check.problem or DTYPE
        )
    elif t_dtype != b_dtype:
        check = _warn(check, f"dtype differs: {target.dtype} vs {baseline.dtype}")
    if (
        target.requires_grad is not None
        and baseline.requires_grad is not None
        and target.requires_grad != baseline.requires_grad
    ):
        check = _warn(check, f"requires_grad differs: {target.requires_grad} vs {baseline.requires_grad}")
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
    return _tensor_notes(Check(ERROR, None, tol.error, why, problem=UNUSABLE), target, baseline)


def check_statistics(target: Leaf, baseline: Leaf, tol: Tolerance) -> Check:
    """Two tensors by their Max / Min / Mean / Norm."""
    if target.shape != baseline.shape:
        return _tensor_notes(
            Check(
                ERROR,
                math.inf,
                tol.error,
                f"shape differs: {_shape(target)} vs {_shape(baseline)}",
                problem=SHAPE,
            ),
            target,
            baseline,
        )
    unusable = _unusable(target, baseline, tol)
    if unusable is not None:
        return unusable
    metrics = stat_metrics(target.stats, baseline.stats, baseline.dtype)
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
            problem=NONFINITE,
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
            if (
                metrics.fill is not None
                and worst_i in (0, 1, 2)
                and not _is_fill_stat(metrics, baseline, worst_i)
            ):
                scale = (
                    f"the values outside the mask fill {fmt_number(metrics.fill)} (the tensor's "
                    f"{'Min' if baseline.stats[1] == metrics.fill else 'Max'} on both sides, which sets its range)"
                )
            reason = f"{name} differs by {fmt_number(scaled)} of {scale} ({values}; allowed {fmt_number(tol.error)})"
    check = Check(status, error, tol.error, reason, stat=metrics)
    if metrics.nonfinite == "same":
        check = _warn(check, "NaN/Inf in the same statistics on both sides")
    return _tensor_notes(check, target, baseline)


def _is_fill_stat(metrics: StatMetrics, baseline: Leaf, i: int) -> bool:
    """Whether statistic ``i`` is the mask fill itself (scaled by the tensor's range as usual)."""
    return baseline.stats[i] == metrics.fill


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
    if metrics.shape_differs:
        return _tensor_notes(
            Check(ERROR, math.inf, tol.error, metrics.note, tensor=metrics, problem=SHAPE), target, baseline
        )
    if metrics.numel == 0:
        return _tensor_notes(Check(SKIPPED, reason="empty tensor", tensor=metrics), target, baseline)
    if metrics.nonfinite == "different":
        check = Check(
            ERROR,
            math.inf,
            tol.error,
            metrics.note,
            tensor=metrics,
            msprobe_accuracy=accuracy,
            problem=NONFINITE,
        )
        return _tensor_notes(check, target, baseline)
    error, peak = metrics.error or 0.0, metrics.peak or 0.0
    if metrics.max_abs_err is not None and metrics.max_abs_err <= tol.atol:
        error = peak = 0.0
    status = PASS
    reasons = []
    if error > tol.error:
        status = ERROR
    elif error > tol.warning:
        status = WARNING
    if status != PASS:
        reasons.append(_tensor_errors(metrics, tol))
    elif peak > tol.error:
        # the tensor agrees as a whole and a few elements do not: what an element-wise division by a value near
        # zero makes of rounding on any two devices (Adam's update of a weight whose gradient is rounding noise)
        status = WARNING
        reasons.append(
            f"a few elements differ more than the tensor as a whole: {_tensor_errors(metrics, tol)}"
        )
    if msprobe_rule and accuracy == "No":
        status = ERROR
        reasons.append(
            f"msprobe's accuracy rule fails (Cosine {fmt_number(metrics.cosine)}, MaxAbsErr {fmt_number(metrics.max_abs_err)})"
        )
    check = Check(status, error, tol.error, "; ".join(reasons), tensor=metrics, msprobe_accuracy=accuracy)
    if metrics.nonfinite == "same":
        check = _warn(check, "NaN/Inf at the same positions on both sides (set to 0)")
    return _tensor_notes(check, target, baseline)


def _tensor_errors(metrics: TensorMetrics, tol: Tolerance) -> str:
    """``RelL2Err .., ScaledMaxAbsErr .. (MaxAbsErr ..; allowed ..)``, of the values outside a fill when the
    tensor has one (with the fill and the whole tensor's RelL2Err)."""
    limits = f"MaxAbsErr {fmt_number(metrics.max_abs_err)}; allowed {fmt_number(tol.error)}"
    if metrics.rest_rel_l2 is None:
        return f"RelL2Err {fmt_number(metrics.rel_l2)}, ScaledMaxAbsErr {fmt_number(metrics.scaled_max_abs)} ({limits})"
    return (
        f"RelL2Err {fmt_number(metrics.rest_rel_l2)}, ScaledMaxAbsErr {fmt_number(metrics.rest_scaled_max_abs)} "
        f"of the values outside the fill {fmt_number(metrics.fill)} ({limits}; the fill, in {metrics.fill_count} "
        f"of {metrics.numel} elements, sets the whole tensor's scale: RelL2Err {fmt_number(metrics.rel_l2)} of "
        "all of it)"
    )


def check_md5(target: Leaf, baseline: Leaf, tol: Tolerance) -> Check:
    """Two tensors by CRC32; the statistics tell a real difference from msprobe's racing CRC."""
    if target.md5 is None or baseline.md5 is None:
        return check_statistics(target, baseline, tol)
    if target.shape != baseline.shape:
        return check_statistics(target, baseline, tol)
    why = unusable_statistics(baseline, "baseline")  # equal CRCs of an overflowed baseline prove nothing
    if why is not None:
        return _tensor_notes(Check(ERROR, None, tol.error, why, problem=UNUSABLE), target, baseline)
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
    """The check of a row that an API rule may skip: an error or warning then reported, never failing."""
    return _skip(check, api) if skip else check
