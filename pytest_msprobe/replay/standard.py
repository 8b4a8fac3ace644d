"""A call's own error, and the precision standard it is judged by (the family of msprobe's pre-check standard).

The own error compares the call's dumped output with the float64 replay of its dumped inputs, element-wise:

- the relative error of an element is its difference over the replay's magnitude, floored at the dtype's
  small-value bound (2^-14 float32, 2^-11 float16, 2^-8 bfloat16) and at a tenth of the tensor's median
  magnitude: a value near zero, where the rounding of the terms that cancelled into it dominates (a weight
  gradient summed over 32K products), is judged by its absolute error against that floor;
- the share of elements whose relative error passes the dtype's bound must stay below that bound (msprobe's
  "double thousandths" for float32/float64, "double hundredths" for half types), and no element may be finite
  on one side only;
- RMSE, the largest and the mean relative error, the small values off by more than msprobe's absolute bound
  (2^-30 float32, 2^-16 half types: a figure for comparing two devices, too tight to gate one alone), and for
  float32 and half types the mean error in ULPs, are reported beside the verdict.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from pytest_msprobe.format.own_errors import SHARE_BOUNDS, OwnError
from pytest_msprobe.replay.arguments import out_of_memory
from pytest_msprobe.replay.figures import figures

# dtype -> (small-value bound, absolute error allowed on small values, relative-error bound and share bound)
_STANDARD = {
    "float64": (2.0**-14, 2.0**-30, 1e-3),
    "float32": (2.0**-14, 2.0**-30, 1e-3),
    "float16": (2.0**-11, 2.0**-16, 1e-2),
    "bfloat16": (2.0**-8, 2.0**-16, 1e-2),
}
_NP = {"float32": np.float32, "float16": np.float16, "float64": np.float64}
_WIDENED = (np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16))  # read as they are


def own_error(dumped: np.ndarray, replay: np.ndarray, dtype: str, floor: float = 0.0) -> OwnError:
    """The own error of one output: ``dumped`` as recorded (float32 and float16 are widened as they are read),
    ``replay`` in float64; ``floor``: a least floor of the relative errors' denominator (:func:`sum_floor`)."""
    small_bound, small_abs, rel_bound = _STANDARD.get(dtype, _STANDARD["float32"])
    d = np.asarray(dumped).ravel()
    if d.dtype not in _WIDENED:
        d = d.astype(np.float64)
    r = np.asarray(replay, dtype=np.float64).ravel()
    n = int(d.size)
    ulp_type = _NP[dtype] if dtype in ("float32", "float16") else None

    def floor_of(median: float) -> float:
        return max(small_bound, 0.1 * median, floor)

    judged = figures(d, r, (small_bound, small_abs), SHARE_BOUNDS, floor_of, ulp_type)
    mismatch = 0
    if not judged.finite:  # a value that is not finite on a side (or a difference that overflows)
        finite = np.isfinite(d) & np.isfinite(r)
        same_special = (~np.isfinite(d)) & (~np.isfinite(r)) & ((d == r) | (np.isnan(d) & np.isnan(r)))
        mismatch = int(np.count_nonzero(~finite & ~same_special))
        judged = figures(d[finite], r[finite], (small_bound, small_abs), SHARE_BOUNDS, floor_of, ulp_type)
    size = judged.size
    shares = tuple(over / size if size else 0.0 for over in judged.over)
    rel_share = shares[SHARE_BOUNDS.index(rel_bound)]
    reasons = []
    if mismatch:
        reasons.append(f"{mismatch} element(s) finite on one side only")
    if rel_share > rel_bound:
        reasons.append(
            f"{rel_share:.3%} of its elements are more than {rel_bound:g} off (at most {rel_bound:.1%})"
        )
    return OwnError(
        dtype=dtype,
        elements=n,
        max_abs=judged.max_abs,
        max_rel=judged.max_rel,
        mean_rel=judged.sum_rel / size if size else 0.0,
        rmse=math.sqrt(judged.sum_sq / size) if size else 0.0,
        rel_share=rel_share,
        small_breaches=judged.small_breaches,
        ulp_mean=judged.ulp_sum / size if ulp_type is not None and size else None,
        nonfinite_mismatch=mismatch,
        out_of_line=bool(reasons),
        reason="; ".join(reasons),
        shares=(shares[0], shares[1], shares[2]),
    )


def shape_error(dtype: str, got: tuple[int, ...], want: tuple[int, ...], elements: int) -> OwnError:
    """The own error of an output whose replay has another shape than its dump: out of line, by structure."""
    reason = f"the replay's shape {list(got)} is not the dumped {list(want)}"
    # every element counts as off: a re-judging by share bound keeps it out of line
    return OwnError(dtype, elements, 0.0, 0.0, 0.0, 0.0, 1.0, 0, None, 0, True, reason, (1.0, 1.0, 1.0))


def sum_floor(dtype: str, terms: float, scale: float) -> float:
    """The floor of the relative errors of a value summed from ``terms`` values of magnitude ``scale`` (a
    gradient reduced over the positions of its incoming one): ten times the rounding such a sum carries when
    accumulated in float32 (float64 for float64), over the dtype's bound. A sum that cancels to nothing (the
    bias gradient of a convolution before a batch norm) is rounding alone, and is judged against that."""
    if terms <= 1 or not scale:
        return 0.0
    eps = float(np.finfo(np.float64 if dtype == "float64" else np.float32).eps)
    rel_bound = _STANDARD.get(dtype, _STANDARD["float32"])[2]
    return 10 * eps * math.sqrt(terms) * scale / rel_bound


def judge_output(
    node: dict[str, Any], want: Any, got: Any, sum_to_shape: bool = False, floor: float = 0.0
) -> OwnError | None:
    """The own error of one recorded tensor (``node``, read as ``want``) against the replay's ``got``: out of
    line by structure when their shapes differ; None where nothing is judged (no tensor on a side, not a
    floating dtype). ``sum_to_shape``: a gradient of a
    broadcast input is summed to the input's shape first, as autograd does before the node's hooks see it.
    ``floor``: as :func:`own_error` takes it."""
    if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor):
        return None
    dtype = str(node.get("dtype")).removeprefix("torch.")
    if tuple(got.shape) != tuple(want.shape):
        try:
            if not sum_to_shape:
                raise RuntimeError
            got = got.sum_to_size(want.shape)
        except RuntimeError as exc:
            if out_of_memory(exc):
                raise
            return shape_error(dtype, tuple(got.shape), tuple(want.shape), want.numel())
    if not want.is_floating_point():
        return None
    return own_error(want.numpy(), got.detach().to(torch.float64).numpy(), dtype, floor)
