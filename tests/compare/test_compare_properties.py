"""Property-based tests (hypothesis) of the metrics and of the alignment.

Metrics: the symmetries their definitions have, their bounds, invariance under scaling both sides by a power
of two (exact in floating point, so any change is a bug), perfect values for identical inputs, and the NaN/Inf
rules. Alignment: two call sequences built from one base sequence by inserting or removing calls on one side
only; every pair the alignment makes must be two records of the same base call, and the inserted (removed)
calls must stay unmatched.
"""

from __future__ import annotations

import math
from dataclasses import fields

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pytest_msprobe.compare.alignment import align
from pytest_msprobe.compare.dumps import TENSOR, ApiEntry, Leaf
from pytest_msprobe.compare.judging import TensorMetrics, stat_metrics, tensor_metrics

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# values away from the subnormal range, so that scaling by 2**k stays exact
_MAGNITUDE = st.floats(float(np.float32(1e-3)), 1e3, width=32)
_VALUE = st.one_of(st.just(0.0), _MAGNITUDE, _MAGNITUDE.map(lambda x: -x))
_DTYPES = st.sampled_from([np.float32, np.float64])


@st.composite
def pairs(draw: st.DrawFn, nonzero_baseline: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Two finite arrays of one shape and dtype; the second is often a small perturbation of the first."""
    dtype = draw(_DTYPES)
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=8))
    a = draw(hnp.arrays(dtype, shape, elements=_VALUE))
    how = draw(st.sampled_from(["independent", "perturbed", "equal"]))
    if how == "independent":
        b = draw(hnp.arrays(dtype, shape, elements=_VALUE))
    else:
        noise = draw(
            hnp.arrays(
                dtype, shape, elements=st.floats(-float(np.float32(1e-3)), float(np.float32(1e-3)), width=32)
            )
        )
        b = (a * (1 + noise)).astype(dtype) if how == "perturbed" else a.copy()
    if nonzero_baseline:
        b = np.where(b == 0, 1, b).astype(dtype)
    return a, b


def _close(x: float | None, y: float | None, rel: float = 1e-12) -> bool:
    if x is None or y is None:
        return x is None and y is None
    return math.isclose(x, y, rel_tol=rel, abs_tol=1e-300)


# ------------------------------------------------------------------------------------------------- metrics
@SETTINGS
@given(pairs())
def test_symmetric_metrics_do_not_care_which_side_is_which(pair: tuple[np.ndarray, np.ndarray]) -> None:
    a, b = pair
    ab, ba = tensor_metrics(a, b), tensor_metrics(b, a)
    for name in ("cosine", "euc_dist", "max_abs_err", "rel_l2", "scaled_max_abs"):
        assert _close(getattr(ab, name), getattr(ba, name)), name


@SETTINGS
@given(pairs())
def test_bounds(pair: tuple[np.ndarray, np.ndarray]) -> None:
    m = tensor_metrics(*pair)
    if m.cosine is not None:
        assert -1.0 <= m.cosine <= 1.0
    for name in ("euc_dist", "max_abs_err", "max_rel_err", "rel_l2", "scaled_max_abs"):
        value = getattr(m, name)
        assert value is not None and value >= 0, name
    assert m.one_thousandth is not None and m.five_thousandths is not None
    assert 0.0 <= m.one_thousandth <= m.five_thousandths <= 1.0
    # |a - b| <= |a| + |b| <= 2 max(|a|, |b|), for the 2-norm and for the largest element
    assert m.rel_l2 is not None and m.rel_l2 <= 2.0 * (1 + 1e-6)
    assert m.scaled_max_abs is not None and m.scaled_max_abs <= 2.0 * (1 + 1e-6)
    assert m.max_abs_err is not None and m.euc_dist is not None
    assert m.max_abs_err <= m.euc_dist * (1 + 1e-6) + 1e-30  # the largest difference is part of the sum


@SETTINGS
@given(pairs(nonzero_baseline=True), st.integers(-8, 8))
def test_scaling_both_sides_by_a_power_of_two_changes_no_relative_metric(
    pair: tuple[np.ndarray, np.ndarray], k: int
) -> None:
    a, b = pair
    factor = a.dtype.type(2.0**k)
    m, s = tensor_metrics(a, b), tensor_metrics(a * factor, b * factor)
    for name in ("cosine", "rel_l2", "scaled_max_abs", "max_rel_err", "one_thousandth", "five_thousandths"):
        assert _close(getattr(m, name), getattr(s, name), rel=1e-6), name
    for name in ("euc_dist", "max_abs_err"):  # the absolute ones scale with the data
        assert _close(getattr(s, name), getattr(m, name) * 2.0**k, rel=1e-6), name


@SETTINGS
@given(hnp.arrays(_DTYPES, hnp.array_shapes(min_dims=1, max_side=10), elements=_VALUE))
def test_identical_inputs_give_the_perfect_values(a: np.ndarray) -> None:
    m = tensor_metrics(a, a.copy())
    assert (m.euc_dist, m.max_abs_err, m.max_rel_err, m.rel_l2, m.scaled_max_abs) == (0, 0, 0, 0, 0)
    assert (m.one_thousandth, m.five_thousandths, m.nonfinite) == (1.0, 1.0, None)
    if a.size >= 2:
        assert m.cosine is not None and math.isclose(m.cosine, 1.0, abs_tol=1e-6)
    else:
        assert m.cosine is None  # one element has no direction


_SPECIAL = st.sampled_from([np.nan, np.inf, -np.inf])


@SETTINGS
@given(pairs(), st.data())
def test_nan_and_inf_at_the_same_places_are_left_out(
    pair: tuple[np.ndarray, np.ndarray], data: st.DataObject
) -> None:
    a, b = pair
    where = data.draw(hnp.arrays(np.bool_, a.shape))
    assume(where.any())
    special = data.draw(hnp.arrays(a.dtype, a.shape, elements=_SPECIAL))
    m = tensor_metrics(np.where(where, special, a), np.where(where, special, b))
    zeroed = tensor_metrics(np.where(where, 0, a).astype(a.dtype), np.where(where, 0, b).astype(b.dtype))
    assert m.nonfinite == "same"
    # a block with NaN/Inf is summed in float64, a float32 block in float32: the sums agree to float32's
    # precision, everything element-wise (maxima, ratios) exactly
    if m.cosine is None or zeroed.cosine is None:
        assert m.cosine is zeroed.cosine is None
    else:
        assert math.isclose(m.cosine, zeroed.cosine, abs_tol=1e-5)
    for name in ("euc_dist", "rel_l2", "rest_rel_l2"):
        assert _close(getattr(m, name), getattr(zeroed, name), rel=1e-5), name
    for f in fields(TensorMetrics):
        if f.name not in ("nonfinite", "note", "cosine", "euc_dist", "rel_l2", "rest_rel_l2"):
            assert getattr(m, f.name) == getattr(zeroed, f.name), f.name


@SETTINGS
@given(pairs(), st.data())
def test_nan_and_inf_at_different_places_give_no_metric(
    pair: tuple[np.ndarray, np.ndarray], data: st.DataObject
) -> None:
    a, b = pair
    where = data.draw(hnp.arrays(np.bool_, a.shape))
    assume(where.any())
    special = data.draw(_SPECIAL)
    moved = data.draw(st.integers(0, a.size - 1))
    a = np.where(where, special, a).astype(a.dtype)
    b = np.where(where, special, b).astype(b.dtype)
    flat = b.reshape(-1)
    if math.isfinite(flat[moved]):
        flat[moved] = special
    else:
        flat[moved] = 1.0  # the target keeps its NaN/Inf there, the baseline does not
    m = tensor_metrics(a, b)
    assert m.nonfinite == "different" and m.note
    assert all(
        getattr(m, name) is None for name in ("cosine", "euc_dist", "max_abs_err", "rel_l2", "max_rel_err")
    )


_FINITE = st.floats(1e-30, 1e6)  # no subnormals: scaling them by 2**k is not exact
_STAT = st.one_of(
    st.none(),
    st.just(0.0),
    _FINITE,
    _FINITE.map(lambda x: -x),
    st.sampled_from([math.nan, math.inf, -math.inf]),
)
_STATS = st.tuples(_STAT, _STAT, _STAT, _STAT)


@SETTINGS
@given(_STATS, _STATS)
def test_statistics_metrics_are_symmetric_bounded_and_follow_the_nan_rules(
    n: tuple[float | None, ...], b: tuple[float | None, ...]
) -> None:
    nb, bn = stat_metrics(n, b), stat_metrics(b, n)  # type: ignore[arg-type]
    assert nb.nonfinite == bn.nonfinite
    for i, (x, y) in enumerate(zip(n, b)):
        s, t = nb.scaled[i], bn.scaled[i]
        if x is None or y is None:
            assert s is None and nb.diff[i] is None
            continue
        assert s is not None and t is not None and s >= 0 and _close(s, t)
        if math.isfinite(x) and math.isfinite(y):
            continue
        same = (math.isnan(x) and math.isnan(y)) or x == y
        assert (s == 0.0) if same else math.isinf(s)
        assert nb.nonfinite in (("same", "different") if same else ("different",))


@SETTINGS
@given(_STATS, _STATS, st.integers(-8, 8))
def test_scaled_statistics_errors_do_not_change_with_a_power_of_two(
    n: tuple[float | None, ...], b: tuple[float | None, ...], k: int
) -> None:
    def scale(values: tuple[float | None, ...]) -> tuple[float | None, ...]:
        return tuple(None if v is None else v * 2.0**k for v in values)

    before, after = stat_metrics(n, b), stat_metrics(scale(n), scale(b))  # type: ignore[arg-type]
    for s, t in zip(before.scaled, after.scaled):
        assert _close(s, t, rel=1e-9) or (s is not None and t is not None and math.isinf(s) and math.isinf(t))


@SETTINGS
@given(_STATS)
def test_identical_statistics_have_no_error(n: tuple[float | None, ...]) -> None:
    m = stat_metrics(n, n)  # type: ignore[arg-type]
    assert all(s in (None, 0.0) for s in m.scaled) and m.nonfinite != "different"


# ----------------------------------------------------------------------------------------------- alignment
_APIS = ("Functional.relu", "Functional.conv2d", "Tensor.add_", "Functional.linear")


def _leaf(name: str, identity: int) -> Leaf:
    """One output tensor whose statistics say which call it is (what two records of one call share)."""
    span = 1.0 + identity
    return Leaf(f"{name}.output.0", ".output.0", "output", TENSOR, "torch.Tensor", "torch.float32", (4,),
                span, -span, identity / 7.0, 2.0 * span)  # fmt: skip


def _entries(calls: list[tuple[int, int, str]]) -> list[ApiEntry]:
    """(api, identity, direction) -> entries named as msprobe names them (per-API counters, in order)."""
    counters: dict[tuple[int, str], int] = {}
    out = []
    for index, (api, identity, direction) in enumerate(calls):
        n = counters.get((api, direction), 0)
        counters[(api, direction)] = n + 1
        name = f"{_APIS[api]}.{n}.{direction}"
        out.append(ApiEntry(name, index, (_leaf(name, identity),)))
    return out


_CALL = st.tuples(st.integers(0, len(_APIS) - 1), st.sampled_from(["forward", "backward"]))


@st.composite
def edited(draw: st.DrawFn) -> tuple[list[tuple[int, int, str]], list[tuple[int, int, str]]]:
    """A base sequence and a copy with calls inserted (ids >= 1000) or removed; which side has the edits
    is random."""
    base = [(api, i, d) for i, (api, d) in enumerate(draw(st.lists(_CALL, min_size=1, max_size=40)))]
    if draw(st.booleans()):
        other = list(base)
        for n, (api, d) in enumerate(draw(st.lists(_CALL, min_size=1, max_size=6))):
            other.insert(draw(st.integers(0, len(other))), (api, 1000 + n, d))
    else:
        drop = draw(st.sets(st.integers(0, len(base) - 1), min_size=1, max_size=max(1, len(base) // 3)))
        other = [c for i, c in enumerate(base) if i not in drop]
    return (base, other) if draw(st.booleans()) else (other, base)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edited(), st.booleans())
def test_alignment_never_misattributes(
    sequences: tuple[list[tuple[int, int, str]], list[tuple[int, int, str]]], fuzzy: bool
) -> None:
    target_calls, baseline_calls = sequences
    target, baseline = _entries(target_calls), _entries(baseline_calls)
    result = align(target, baseline, fuzzy=fuzzy)
    t_ids = [identity for _, identity, _ in target_calls]
    b_ids = [identity for _, identity, _ in baseline_calls]
    # every entry appears exactly once
    assert sorted(i for i, _ in result.pairs if i is not None) == list(range(len(target)))
    assert sorted(j for _, j in result.pairs if j is not None) == list(range(len(baseline)))
    matched = [(i, j) for i, j in result.pairs if i is not None and j is not None]
    for i, j in matched:
        assert t_ids[i] == b_ids[j], (target[i].name, baseline[j].name)
    # every call both sides have is paired; the inserted or removed ones are not
    assert {t_ids[i] for i, _ in matched} == set(t_ids) & set(b_ids)
