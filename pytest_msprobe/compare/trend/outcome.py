"""The result of a trend compare (two runs' loss and gradient norms step by step): :class:`TrendResult`, part of
:class:`~pytest_msprobe.compare.result.CompareResult`."""

from __future__ import annotations

import math
from dataclasses import dataclass

# what a trend's first divergence is about (TrendResult.quantity)
LOSS, GRAD_NORM = "loss", "grad_norm"
QUANTITY_NAMES = {LOSS: "the loss", GRAD_NORM: "the gradient norm"}


@dataclass(frozen=True)
class TrendRow:
    """One step of two trends: each side's loss and global gradient norm, and their relative differences."""

    step: int
    target_loss: float | None
    baseline_loss: float | None
    target_grad_norm: float | None
    baseline_grad_norm: float | None
    loss_diff: float | None  # |t - b| / max(|t|, |b|); inf where one side only is not finite
    grad_norm_diff: float | None


@dataclass(frozen=True)
class TrendResult:
    """Two runs' trends (loss and gradient norms per step) compared step by step.

    ``first_step`` is the first step where the loss or the global gradient norm differs by more than ``rtol``
    (relative), or is NaN/Inf on one side only; ``quantity`` (``loss`` or ``grad_norm``), ``target`` and
    ``baseline`` say what differs there. ``module`` is, as context, the first module whose gradient norm
    differs at that step. ``spikes``: steps whose target gradient norm is over 10x the median of its earlier
    steps while the baseline's is not; ``nan_steps``: steps with NaN/Inf on one side only. ``rerun_steps``:
    the steps dumped again (a re-run of the test) to find the API, when the trend diverged at a step that
    was not dumped."""

    steps: int
    rtol: float
    dtype: str | None
    first_step: int | None
    quantity: str | None
    target: float | None
    baseline: float | None
    difference: float | None
    rows: tuple[TrendRow, ...]
    spikes: tuple[int, ...] = ()
    nan_steps: tuple[int, ...] = ()
    module: str | None = None
    module_values: tuple[float | None, float | None] | None = None
    rank: int | None = None  # the rank diverging first (None: a run without ranks)
    rerun_steps: tuple[int, ...] = ()

    @property
    def passed(self) -> bool:
        return self.first_step is None

    @property
    def headline(self) -> str:
        """``the loss first differs at step 25 (2.30121 vs 2.30254; allowed rel 1e-4)``, or that all agree."""
        if self.first_step is None:
            return f"{self.steps} steps agree within rel {tolerance_text(self.rtol)} (loss and gradient norm)"
        what = QUANTITY_NAMES.get(self.quantity or "", self.quantity or "")
        rank = f", rank {self.rank}" if self.rank is not None else ""
        return (
            f"{what} first differs at step {self.first_step}{rank} ({_value(self.target)} vs "
            f"{_value(self.baseline)}; allowed rel {tolerance_text(self.rtol)})"
        )


def tolerance_text(x: float) -> str:
    """``1e-4`` for 0.0001, ``0.01`` for 0.01: tolerances as people write them."""
    if x == 0 or x >= 1e-3:
        return f"{x:g}"
    mantissa, exponent = f"{x:.3e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def _value(x: float | None) -> str:
    return "none" if x is None else str(x) if not math.isfinite(x) else f"{x:.6g}"
