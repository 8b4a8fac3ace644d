"""Metrics on synthetic arrays: msprobe's definitions (checked against msprobe 26.2.0's own values) and every
edge case."""

from __future__ import annotations

import ast
import math
import re

import numpy as np
import pytest
from compare_helpers import DATA

from pytest_msprobe.compare.judging.metrics import (
    EPS,
    StatMetrics,
    TensorMetrics,
    stat_metrics,
    tensor_metrics,
)

f32, f16 = np.float32, np.float16
NAN, INF = float("nan"), float("inf")

# the arrays behind each line of metrics_edge_cases.txt (msprobe 26.2.0's values on them)
EDGE_CASES: dict[str, tuple[np.ndarray, np.ndarray]] = {
    "identical f32": (np.array([1, 2, 3], f32), np.array([1, 2, 3], f32)),
    "rel err ~1e-3 on 1 of 3": (np.array([1.001, 2, 3], f32), np.array([1, 2, 3], f32)),
    "both all-zero": (np.zeros(3, f32), np.zeros(3, f32)),
    "npu all-zero": (np.zeros(4, f32), np.ones(4, f32)),
    "bench all-zero, npu 1e-6": (np.full(4, 1e-6, f32), np.zeros(4, f32)),
    "nan at same position": (np.array([1, NAN, 3], f32), np.array([1, NAN, 3], f32)),
    "nan at different position": (np.array([1, NAN, 3], f32), np.array([NAN, 2, 3], f32)),
    "inf same pos, other differs": (np.array([1, INF, 2], f32), np.array([1, INF, 3], f32)),
    "int64": (np.array([1, 2, 3], np.int64), np.array([1, 2, 4], np.int64)),
    "bool": (np.array([True, False, True]), np.array([True, True, True])),
    "f16 vs f32": (np.array([1, 2, 3], f16), np.array([1, 2, 3.001], f32)),
    "shape mismatch": (np.zeros(3, f32), np.zeros(4, f32)),
    "1 element": (np.array([1], f32), np.array([2], f32)),
    "0-d": (np.array(1, f32), np.array(2, f32)),
    "empty": (np.zeros(0, f32), np.zeros(0, f32)),
    "sign flipped": (np.array([1, 1], f32), np.array([-1, -1], f32)),
}
FIELDS = ("cosine", "euc_dist", "max_abs_err", "max_rel_err", "one_thousandth", "five_thousandths")
# Our definitions differ from msprobe's in one place: a 0-d tensor is one element, so its EucDist and ratios
# are defined (msprobe leaves them "unsupported").
DEVIATIONS = {("0-d", "euc_dist"): 1.0, ("0-d", "one_thousandth"): 0.0, ("0-d", "five_thousandths"): 0.0}


def msprobe_values() -> dict[str, list[object]]:
    out = {}
    for line in (DATA / "metrics_edge_cases.txt").read_text().splitlines():
        m = re.match(r"^(\S.*?)\s{2,}(\[.*\]) \|", line)
        if m:
            out[m.group(1)] = ast.literal_eval(m.group(2))
    return out


def test_every_msprobe_edge_case_is_covered() -> None:
    assert set(msprobe_values()) == set(EDGE_CASES)


@pytest.mark.parametrize("case", sorted(EDGE_CASES))
def test_metrics_match_msprobe(case: str) -> None:
    n, b = EDGE_CASES[case]
    ours = tensor_metrics(n, b)
    for field, theirs in zip(FIELDS, msprobe_values()[case]):
        mine = getattr(ours, field)
        if (case, field) in DEVIATIONS:
            assert mine == pytest.approx(DEVIATIONS[case, field])
        elif isinstance(theirs, str):  # 'Nan', 'N/A', 'unsupported', 'shape unmatched': undefined
            assert mine is None, (case, field, mine)
        else:
            assert mine == pytest.approx(theirs, rel=1e-6, abs=1e-12), (case, field)


def test_edge_case_notes_and_flags() -> None:
    assert tensor_metrics(*EDGE_CASES["shape mismatch"]).note == "shape differs: [3] vs [4]"
    assert tensor_metrics(*EDGE_CASES["empty"]).note == "empty tensor"
    assert "target is all zero" in tensor_metrics(*EDGE_CASES["npu all-zero"]).note
    assert "baseline is all zero" in tensor_metrics(*EDGE_CASES["bench all-zero, npu 1e-6"]).note
    assert tensor_metrics(*EDGE_CASES["nan at same position"]).nonfinite == "same"
    assert tensor_metrics(*EDGE_CASES["nan at different position"]).nonfinite == "different"
    assert "at least 2 elements" in tensor_metrics(*EDGE_CASES["0-d"]).note


def test_our_scaled_errors() -> None:
    m = tensor_metrics(np.array([1.001, 2, 3], f32), np.array([1, 2, 3], f32))
    d = np.float32(1.001) - np.float32(1)
    assert m.rel_l2 == pytest.approx(d / math.sqrt(1.001**2 + 4 + 9), rel=1e-6)
    assert m.scaled_max_abs == pytest.approx(d / 3, rel=1e-6)
    assert (m.error, m.peak) == (m.rel_l2, m.scaled_max_abs)  # the verdict's error: the tensor's as a whole
    zeros = tensor_metrics(np.zeros(3, f32), np.zeros(3, f32))
    assert (zeros.rel_l2, zeros.scaled_max_abs, zeros.error, zeros.peak) == (0.0, 0.0, 0.0, 0.0)
    one_side = tensor_metrics(np.full(4, 1e-6, f32), np.zeros(4, f32))
    assert (one_side.rel_l2, one_side.scaled_max_abs) == (1.0, 1.0)  # all of it differs


def test_inf_with_other_sign_at_the_same_position_is_a_difference() -> None:
    m = tensor_metrics(np.array([1, INF], f32), np.array([1, -INF], f32))
    assert m.nonfinite == "different" and m.cosine is None


def test_relative_error_uses_eps_where_the_baseline_is_zero() -> None:
    m = tensor_metrics(np.array([3e-7, 1], f32), np.array([0, 1], f32))
    assert m.max_rel_err == pytest.approx(3e-7 / EPS, rel=1e-5)


def reference(n: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """msprobe's definitions written plainly in float64."""
    n64, b64 = n.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    d = n64 - b64
    rel = np.abs(d) / np.where(b64 == 0, EPS, np.abs(b64))
    return {
        "cosine": float(n64 @ b64 / (np.linalg.norm(n64) * np.linalg.norm(b64))),
        "euc_dist": float(np.linalg.norm(d)),
        "max_abs_err": float(np.abs(d).max()),
        "max_rel_err": float(rel.max()),
        "one_thousandth": float(np.mean(rel < 0.001)),
        "five_thousandths": float(np.mean(rel < 0.005)),
    }


@pytest.mark.parametrize("block", [7, 1000, 1 << 16])
def test_blockwise_float32_agrees_with_a_float64_reference(block: int) -> None:
    rng = np.random.default_rng(5)
    b = rng.standard_normal(100_003).astype(f32)
    b[::97] = 0  # exact zeros in the baseline: relative error through eps
    n = (b * (1 + 1e-3 * rng.standard_normal(b.size))).astype(f32)
    n[::1001] += 0.01
    ours = tensor_metrics(n, b, block=block)
    ref = reference(n, b)
    for field in FIELDS:
        assert getattr(ours, field) == pytest.approx(ref[field], rel=2e-6), field


def test_cosine_of_tiny_noise_keeps_its_digits() -> None:
    rng = np.random.default_rng(6)
    b = rng.standard_normal(1_000_000).astype(f32)
    n = (b + 1e-3 * rng.standard_normal(b.size)).astype(f32)
    ref = reference(n, b)
    ours = tensor_metrics(n, b)
    assert 1 - (ours.cosine or 0) == pytest.approx(1 - ref["cosine"], rel=1e-3)
    assert ours.euc_dist == pytest.approx(ref["euc_dist"], rel=1e-6)


def test_nan_in_a_later_block_at_different_positions() -> None:
    n = np.ones(1000, f32)
    b = np.ones(1000, f32)
    n[900], b[901] = NAN, NAN
    m = tensor_metrics(n, b, block=100)
    assert m.nonfinite == "different" and m.euc_dist is None


def test_nan_at_the_same_positions_across_blocks_is_ignored() -> None:
    n = np.arange(1000, dtype=f32)
    b = n.copy()
    n[[5, 500, 999]] = b[[5, 500, 999]] = NAN
    n[10] += 1
    m = tensor_metrics(n, b, block=64)
    assert m.nonfinite == "same"
    assert m.max_abs_err == 1.0 and m.euc_dist == pytest.approx(1.0)


def test_values_whose_squares_overflow_float32() -> None:
    n = np.array([3e20, -2e20, 1e20], f32)
    b = np.array([3e20, -2e20, 1.5e20], f32)
    m = tensor_metrics(n, b)
    assert m.nonfinite is None
    assert m.euc_dist == pytest.approx(5e19, rel=1e-6)
    assert m.rel_l2 == pytest.approx(5e19 / math.sqrt(9e40 + 4e40 + 2.25e40), rel=1e-5)


def test_float64_and_int_inputs_are_compared_in_float64() -> None:
    big = np.array([2**40 + 1, 2**40], np.int64)
    m = tensor_metrics(big, np.array([2**40, 2**40], np.int64))
    assert m.max_abs_err == 1.0  # float32 would lose the 1
    m = tensor_metrics(np.array([1.0, 1 + 1e-12]), np.array([1.0, 1.0]))
    assert m.max_abs_err == pytest.approx(1e-12, rel=1e-3)


def test_complex_values_compare_real_and_imaginary_parts() -> None:
    n = np.array([1 + 1j, 2 - 1j], np.complex64)
    m = tensor_metrics(n, np.array([1 + 1j, 2 + 1j], np.complex64))
    assert m.max_abs_err == 2.0 and m.numel == 4  # values compared: real and imaginary parts


def test_tensor_metrics_is_a_frozen_model() -> None:
    m = TensorMetrics()
    with pytest.raises(AttributeError):
        m.cosine = 1.0  # type: ignore[misc]


# ------------------------------------------------------------------------------------------------ statistics
def test_statistics_differences_and_relative_errors() -> None:
    m = stat_metrics((5.971, -0.00333, 1.1737, 99.4707), (5.973, 0.0, 1.1737, 99.471))
    assert m.diff[0] == pytest.approx(-0.002)
    assert m.rel[0] == pytest.approx(0.002 / 5.973)
    assert m.rel[1] is None  # baseline Min is 0: msprobe's relative error is undefined
    assert m.scaled[1] == pytest.approx(0.00333 / 5.973)  # scaled by the tensor's range instead
    assert m.scaled[3] == pytest.approx(0.0003 / 99.471, rel=1e-3)
    assert m.error == m.scaled[1] and m.worst == 1


def test_a_near_zero_mean_is_scaled_by_the_range_not_by_itself() -> None:
    # the mean of a normalised output: 1.9e-9 vs -3.1e-9 is a 260% "relative error" and means nothing
    m = stat_metrics((3.49, -3.63, -3.1e-9, 64.0), (3.49, -3.63, 1.9e-9, 64.0))
    assert m.rel[2] == pytest.approx(5e-9 / 1.9e-9)
    assert m.scaled[2] == pytest.approx(5e-9 / 3.63)
    assert m.error is not None and m.error < 1e-8


def test_a_mask_fill_at_the_min_leaves_the_max_and_mean_to_the_other_values() -> None:
    # attention scores masked with -1e4: a 0.4% drift of their Max is 1e-6 of the fill, and 0.4% of the Max
    masked = stat_metrics((3.012, -1e4, -2500.0, 5000.0), (3.0, -1e4, -2500.001, 5000.0), "torch.float32")
    assert masked.fill == -1e4
    assert masked.scaled[0] == pytest.approx(0.012 / 3.012)
    assert masked.scaled[2] == pytest.approx(0.001 / 3.012, rel=1e-3)
    assert masked.scaled[1] == 0.0 and masked.scaled[3] == 0.0
    # the fill must be the same on both sides, a known fill value, and of the other sign than the other extreme
    moved = stat_metrics((3.012, -9000.0, -2500.0, 5000.0), (3.0, -1e4, -2500.0, 5000.0), "torch.float32")
    assert moved.fill is None and moved.scaled[0] == pytest.approx(0.012 / 1e4)
    outlier = stat_metrics((3.012, -700.0, 1.0, 800.0), (3.0, -700.0, 1.0, 800.0), "torch.float32")
    assert outlier.fill is None
    positive = stat_metrics((1e4, 0.1, 5.0, 1e4), (1e4, 0.1001, 5.0, 1e4), "torch.float32")  # Min is no fill
    assert positive.fill is None and positive.scaled[1] == pytest.approx(1e-4 / 1e4)
    half = stat_metrics((1.5, -65504.0, -3.0, 9e4), (1.5, -65504.0, -3.0, 9e4), "torch.float16")
    assert half.fill == -65504.0  # the dtype's extreme


def test_statistics_edge_cases() -> None:
    zeros = stat_metrics((0.0, 0.0, 0.0, 0.0), (0.0, 0.0, 0.0, 0.0))
    assert zeros.error == 0.0 and zeros.rel == (None, None, None, None)
    missing = stat_metrics((None, None, None, None), (1.0, 0.0, 0.5, 1.0))
    assert missing.error is None and missing.worst is None
    same_nan = stat_metrics((NAN, 0.0, NAN, NAN), (NAN, 0.0, NAN, NAN))
    assert same_nan.nonfinite == "same" and same_nan.error == 0.0
    same_inf = stat_metrics((INF, -1.0, INF, INF), (INF, -1.0, INF, INF))
    assert same_inf.nonfinite == "same" and same_inf.error == 0.0
    one_side = stat_metrics((NAN, 0.0, NAN, NAN), (1.0, 0.0, 0.5, 1.0))
    assert one_side.nonfinite == "different" and one_side.error == math.inf
    flipped_inf = stat_metrics((INF, 0.0, 1.0, 1.0), (-INF, 0.0, 1.0, 1.0))
    assert flipped_inf.nonfinite == "different"
    inconsistent = stat_metrics((0.0, 0.0, 1e-30, 0.0), (0.0, 0.0, 0.0, 0.0))
    assert inconsistent.scaled[2] == math.inf  # a mean outside a zero range cannot be scaled


def test_stat_metrics_is_a_frozen_model() -> None:
    m = stat_metrics((1.0, 0.0, 0.5, 1.0), (1.0, 0.0, 0.5, 1.0))
    assert isinstance(m, StatMetrics)
    with pytest.raises(AttributeError):
        m.diff = (0.0,) * 4  # type: ignore[misc]


@pytest.mark.parametrize("ratio", [1e3, 1e5, 1e7])
def test_cosine_of_parallel_tensors_of_very_different_sizes(ratio: float) -> None:
    """The distance form of 1 - cos cancels when one tensor is much larger: float32 once gave 0.84 here."""
    a = np.array([0, 0, 3, 4], f32)
    m = tensor_metrics(a, a * f32(ratio))
    assert m.cosine is not None and math.isclose(m.cosine, 1.0, abs_tol=1e-6)
    assert tensor_metrics(a, -a * f32(ratio)).cosine == pytest.approx(-1.0, abs=1e-6)


# --------------------------------------------------------------------------------------- a fill sets the scale
def _scores(
    fill: float, drift: float = 0.0, heads: int = 6, length: int = 40
) -> tuple[np.ndarray, np.ndarray]:
    """Causally masked attention scores (target, baseline): the unmasked ones of the target drift by ``drift``."""
    rng = np.random.default_rng(3)
    scores = (0.4 * rng.standard_normal((heads, length, length))).astype(f32)
    masked = np.triu(np.ones((length, length), bool), 1)
    baseline = np.where(masked, f32(fill), scores).astype(f32)
    target = np.where(masked, f32(fill), scores * f32(1 + drift)).astype(f32)
    return target, baseline


@pytest.mark.parametrize("fill", [-1e4, -1e9, float(np.finfo(f32).min)])
@pytest.mark.parametrize("block", [100, 1 << 16])
def test_a_mask_fill_does_not_hide_a_drift_of_the_other_values(fill: float, block: int) -> None:
    target, baseline = _scores(fill, drift=0.0096)
    m = tensor_metrics(target, baseline, block=block)
    assert m.rel_l2 is not None and m.rel_l2 < 1e-6  # the whole tensor's scale is the fill's
    assert (m.fill, m.fill_count) == (float(f32(fill)), 6 * 40 * 39 // 2)
    assert m.rest_rel_l2 == pytest.approx(0.0096, rel=0.02)
    assert m.rest_scaled_max_abs == pytest.approx(0.0096, rel=0.02)
    assert m.error is not None and m.error > 1e-4  # the float32 tolerance


def test_values_outside_a_fill_are_measured_like_any_tensor() -> None:
    target, baseline = _scores(-1e4)
    rng = np.random.default_rng(4)
    noisy = np.where(target == f32(-1e4), target, target * (1 + 1e-7 * rng.standard_normal(target.shape)))
    m = tensor_metrics(noisy.astype(f32), baseline)
    assert m.fill == -1e4 and m.rest_rel_l2 is not None and m.rest_rel_l2 < 2e-7
    assert tensor_metrics(baseline, baseline.copy()).error == 0.0


def test_a_minus_inf_mask_is_left_out_with_the_other_nonfinite_values() -> None:
    target, baseline = _scores(-math.inf, drift=0.0096)
    m = tensor_metrics(target, baseline)
    assert m.nonfinite == "same" and m.fill is None
    assert m.rel_l2 == pytest.approx(0.0096, rel=0.02)


@pytest.mark.parametrize(
    "target, baseline",
    [
        # values near the top that vary more than a factor 2
        ([-1e4, -3e3, 0.5, 0.25], [-1e4, -3e3, 0.501, 0.25]),
        # something between the top and the rest
        ([-1e4, -1e4, 200.0, 0.25], [-1e4, -1e4, 200.0, 0.251]),
        # a saturated activation (relu6): the fill does not dominate the rest
        ([6.0, 6.0, 5.5, 1.0], [6.0, 6.0, 5.5, 1.001]),
        # one large value is an outlier, not a fill
        ([1e4, 0.5, 0.25, 0.125], [1e4, 0.5, 0.25, 0.126]),
        # a large target value where the baseline has none
        ([1e4, 1e4, 2e4, 0.25], [1e4, 1e4, 0.5, 0.25]),
        # legitimate values over three orders of magnitude and rounding noise below them (the bias gradient of
        # a fused qkv projection: the key's part is zero): no fill
        ([1e-3, -4e-4, 2e-5, 3e-6, 1e-10, -2e-10], [1e-3, -4e-4, 2e-5, 3e-6, 3e-10, 1e-10]),
    ],
)
def test_what_is_not_a_fill(target: list[float], baseline: list[float]) -> None:
    m = tensor_metrics(np.array(target, f32), np.array(baseline, f32))
    assert (m.fill, m.rest_rel_l2, m.rest_scaled_max_abs) == (None, None, None)


def test_an_additive_mask_is_a_fill_and_its_own_rounding_stays_in_the_whole_tensor() -> None:
    rng = np.random.default_rng(8)
    scores = (0.4 * rng.standard_normal((6, 40, 40))).astype(f32)
    mask = np.where(np.triu(np.ones((40, 40), bool), 1), f32(-1e4), f32(0))
    baseline = (scores + mask).astype(f32)  # -1e4 + s: values that vary near the fill
    noisy = (scores * (1 + 1e-7 * rng.standard_normal(scores.shape)).astype(f32) + mask).astype(f32)
    m = tensor_metrics(noisy, baseline)
    assert m.fill is not None and -1e4 - 2 < m.fill < -1e4 + 2 and m.fill_count == 6 * 40 * 39 // 2
    assert m.rest_rel_l2 is not None and m.rest_rel_l2 < 3e-7  # the scores' rounding, against the scores
    assert m.error is not None and m.error < 1e-6  # (an ulp of 1e4 on the masked ones: 1e-7 of the fill)
    drifted = ((scores * f32(1.0096)) + mask).astype(f32)  # the drift reaches the masked ones too
    m = tensor_metrics(drifted, baseline)
    assert m.rest_rel_l2 == pytest.approx(0.0096 / 1.0096, rel=0.01)
    assert m.rel_l2 is not None and m.rel_l2 < 1e-5


def test_a_fill_found_in_a_later_block_sets_the_earlier_ones_apart_too() -> None:
    rng = np.random.default_rng(6)
    baseline = rng.standard_normal(1000).astype(f32)
    baseline[600:] = -1e4  # the fill only in the later blocks
    target = baseline.copy()
    target[:600] *= f32(1.01)
    m = tensor_metrics(target, baseline, block=128)
    assert m.fill == -1e4 and m.fill_count == 400
    assert m.rest_rel_l2 == pytest.approx(0.01 / 1.01, rel=1e-3)
    # a larger fill after it: the first one is one of the other values then
    later = np.concatenate([baseline, np.full(200, -1e9, f32)]).astype(f32)
    moved = np.concatenate([target, np.full(200, -1e9, f32)]).astype(f32)
    m = tensor_metrics(moved, later, block=128)
    assert (m.fill, m.fill_count) == (-1e9, 200)
    assert m.rest_rel_l2 is not None and m.rest_rel_l2 < 1e-5  # measured against the -1e4 values too
