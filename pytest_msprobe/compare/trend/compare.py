"""Two runs' trends compared step by step: :func:`compare_trend`.

Each step's loss and global gradient norm are held to a relative tolerance (``|t - b| / max(|t|, |b|)``),
by default the error tolerance of the training dtype in the threshold table (float32 1e-4: deterministic runs
on one device agree bit for bit, and a kernel 1e-3 off from step K moves the loss by about 1e-3 at K). A value
that is NaN or Inf on one side only differs whatever the tolerance. A spike is a step whose target gradient
norm is over ``SPIKE`` times the median of its earlier steps while the baseline's is not (msprobe's guide:
find the first step where the loss or the gradient norm jumps).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from pytest_msprobe.compare.trend.outcome import GRAD_NORM, LOSS, TrendResult, TrendRow
from pytest_msprobe.format.trendfile import TrendData
from pytest_msprobe.thresholds import DEFAULT_DTYPE_TOLERANCES, normalize_dtype

SPIKE = 10.0  # a gradient norm this many times the median of the earlier steps is a spike
_SPIKE_HISTORY = 3  # earlier steps a median needs


def trend_rtol(dtype: str | None) -> float:
    """The default tolerance of a training dtype: its error tolerance in the threshold table (float32's for an
    unknown or integer dtype)."""
    name = normalize_dtype(dtype) if dtype else None
    tol = DEFAULT_DTYPE_TOLERANCES.get(name or "float32")
    if tol is None or tol.error == 0:
        tol = DEFAULT_DTYPE_TOLERANCES["float32"]
    return tol.error


def _array(values: Sequence[float | None]) -> np.ndarray:
    return np.array([math.nan if v is None else v for v in values], dtype=np.float64)


def relative_difference(target: np.ndarray, baseline: np.ndarray) -> np.ndarray:
    """``|t - b| / max(|t|, |b|)`` per element: 0 where both are equal (both NaN, the same Inf, both 0), inf
    where one side only is not finite."""
    with np.errstate(invalid="ignore", divide="ignore"):
        scale = np.maximum(np.abs(target), np.abs(baseline))
        diff = np.abs(target - baseline) / scale
    same = (target == baseline) | (np.isnan(target) & np.isnan(baseline))
    one_side = np.isfinite(target) != np.isfinite(baseline)
    diff = np.where(same, 0.0, diff)
    return np.where(one_side & ~same, np.inf, diff)


def spikes(target: np.ndarray, baseline: np.ndarray, factor: float = SPIKE) -> list[int]:
    """Steps whose target value is over ``factor`` times the median of its earlier finite values while the
    baseline's is not."""

    def spiking(values: np.ndarray, i: int) -> bool:
        before = values[:i][np.isfinite(values[:i])]
        return len(before) >= _SPIKE_HISTORY and bool(values[i] > factor * np.median(before))

    return [i for i in range(len(target)) if spiking(target, i) and not spiking(baseline, i)]


def compare_trend(
    target: TrendData, baseline: TrendData, steps: int, rtol: float | None = None
) -> TrendResult:
    """Compare the first ``steps`` steps of two trends (the caller made sure both have them); ``rtol`` None
    takes the baseline's training dtype's tolerance (:func:`trend_rtol`)."""
    tol = trend_rtol(baseline.dtype or target.dtype) if rtol is None else rtol
    t_steps, b_steps = target.steps[:steps], baseline.steps[:steps]
    n = min(len(t_steps), len(b_steps))
    t_loss, b_loss = _array([s.loss for s in t_steps[:n]]), _array([s.loss for s in b_steps[:n]])
    t_norm = _array([s.grad_norm for s in t_steps[:n]])
    b_norm = _array([s.grad_norm for s in b_steps[:n]])
    loss_diff, norm_diff = relative_difference(t_loss, b_loss), relative_difference(t_norm, b_norm)
    one_side = (np.isfinite(t_loss) != np.isfinite(b_loss)) | (np.isfinite(t_norm) != np.isfinite(b_norm))
    rows = tuple(
        TrendRow(
            i,
            float(t_loss[i]),
            float(b_loss[i]),
            float(t_norm[i]),
            float(b_norm[i]),
            float(loss_diff[i]),
            float(norm_diff[i]),
        )
        for i in range(n)
    )
    over = np.flatnonzero((loss_diff > tol) | (norm_diff > tol))
    first = int(over[0]) if len(over) else None
    quantity = target_value = baseline_value = difference = None
    module = module_values = None
    if first is not None:
        loss_first = bool(loss_diff[first] > tol)
        quantity = LOSS if loss_first else GRAD_NORM
        target_value, baseline_value = (
            (rows[first].target_loss, rows[first].baseline_loss)
            if loss_first
            else (rows[first].target_grad_norm, rows[first].baseline_grad_norm)
        )
        difference = float(loss_diff[first] if loss_first else norm_diff[first])
        module, module_values = _first_module(target, baseline, first, tol)
    return TrendResult(
        steps=n,
        rtol=tol,
        dtype=baseline.dtype or target.dtype,
        first_step=first,
        quantity=quantity,
        target=target_value,
        baseline=baseline_value,
        difference=difference,
        rows=rows,
        spikes=tuple(spikes(t_norm, b_norm)),
        nan_steps=tuple(int(i) for i in np.flatnonzero(one_side)),
        module=module,
        module_values=module_values,
        rank=target.rank,
    )


def _first_module(
    target: TrendData, baseline: TrendData, step: int, tol: float
) -> tuple[str | None, tuple[float | None, float | None] | None]:
    """The first module (the model's order) whose gradient norm differs at ``step``, with both values."""
    theirs: Mapping[str, float | None] = dict(zip(baseline.modules, baseline.steps[step].modules))
    for name, mine in zip(target.modules, target.steps[step].modules):
        if name not in theirs:
            continue
        diff = relative_difference(_array([mine]), _array([theirs[name]]))[0]
        if diff > tol:
            return name, (mine, theirs[name])
    return None, None


def compare_trends(
    target: Mapping[int, TrendData], baseline: Mapping[int, TrendData], steps: int, rtol: float | None = None
) -> TrendResult:
    """Every rank's trend compared; the result of the rank that diverges first (rank 0's when none does)."""
    results = [compare_trend(target[r], baseline[r], steps, rtol) for r in sorted(target) if r in baseline]
    diverging = [r for r in results if r.first_step is not None]
    if diverging:
        return min(diverging, key=lambda r: (r.first_step, r.rank or 0))
    return results[0]
