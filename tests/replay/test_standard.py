"""The own error's figures, computed block by block (replay/figures.py), against the plain whole-array
definition they stand for: the same figures, exactly or to rounding, on every kind of tensor."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pytest_msprobe.replay import figures
from pytest_msprobe.replay.standard import own_error

_STANDARD = {
    "float64": (2.0**-14, 2.0**-30, 1e-3),
    "float32": (2.0**-14, 2.0**-30, 1e-3),
    "float16": (2.0**-11, 2.0**-16, 1e-2),
}
_NP = {"float32": np.float32, "float16": np.float16}


def plain(dumped: np.ndarray, replay: np.ndarray, dtype: str) -> dict[str, object]:
    """The definition, one whole-array numpy expression per figure."""
    small_bound, small_abs, rel_bound = _STANDARD[dtype]
    d = np.asarray(dumped, dtype=np.float64).ravel()
    r = np.asarray(replay, dtype=np.float64).ravel()
    finite = np.isfinite(d) & np.isfinite(r)
    same_special = (~np.isfinite(d)) & (~np.isfinite(r)) & ((d == r) | (np.isnan(d) & np.isnan(r)))
    mismatch = int(np.count_nonzero(~finite & ~same_special))
    d, r = d[finite], r[finite]
    diff = np.abs(d - r)
    floor = max(small_bound, 0.1 * float(np.median(np.abs(r)))) if r.size else small_bound
    rel = diff / np.maximum(np.abs(r), floor)
    ulp = None
    if dtype in _NP and r.size:
        spacing = np.spacing(np.abs(r).astype(_NP[dtype])).astype(np.float64)
        ulp = float(np.mean(diff / spacing))
    return {
        "max_abs": float(diff.max()) if diff.size else 0.0,
        "max_rel": float(rel.max()) if rel.size else 0.0,
        "mean_rel": float(rel.mean()) if rel.size else 0.0,
        "rmse": float(np.sqrt(np.mean(diff**2))) if diff.size else 0.0,
        "rel_share": float(np.count_nonzero(rel > rel_bound)) / rel.size if rel.size else 0.0,
        "shares": [
            float(np.count_nonzero(rel > b)) / rel.size if rel.size else 0.0 for b in (1e-2, 1e-3, 1e-4)
        ],
        "small_breaches": int(np.count_nonzero(diff[np.abs(r) < small_bound] > small_abs)),
        "ulp_mean": ulp,
        "nonfinite_mismatch": mismatch,
    }


def _same(got: object, want: object, rel: float = 1e-9) -> bool:
    if isinstance(want, list) and isinstance(got, list):
        return len(want) == len(got) and all(_same(a, b) for a, b in zip(got, want))
    if isinstance(want, float) and isinstance(got, float):
        return (math.isnan(want) and math.isnan(got)) or math.isclose(got, want, rel_tol=rel, abs_tol=1e-300)
    return got == want


def _cases() -> list[tuple[str, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(7)
    cases = []
    for n in (0, 1, 2, 5, 4097, 40_000, 300_001, 1 << 20):
        r = rng.standard_normal(n) * 10.0 ** rng.integers(-6, 3)
        cases.append((f"gauss {n}", r.astype(np.float32), r))  # rounding only
        noisy = r * (1 + 1e-3 * rng.standard_normal(n))
        cases.append((f"noisy {n}", noisy.astype(np.float32), r))  # out of line
    r = rng.standard_normal(500_000)
    r[::2] = 0.0  # relu-like: half zeros, the median among ties
    cases.append(("half zeros", r.astype(np.float32), r))
    exact = np.maximum(rng.standard_normal(300_000), 0).astype(np.float32)
    cases.append(("exact", exact, exact.astype(np.float64)))
    partly = exact.astype(np.float64)
    partly[-5:] *= 1.01  # equal but for the last block
    cases.append(("exact but the last block", exact, partly))
    r = rng.standard_normal(200_000)
    d = r.astype(np.float32)
    d[3], d[10], r[11], d[12], r[12], d[13], r[13] = np.inf, np.nan, np.nan, -np.inf, -np.inf, np.nan, np.nan
    cases.append(("non-finite", d, r))
    tiny = rng.standard_normal(100_000) * 1e-6  # below the small-value bound: absolute errors
    cases.append(("tiny", (tiny * (1 + 1e-2 * rng.standard_normal(tiny.size))).astype(np.float32), tiny))
    return cases


@pytest.mark.parametrize("threads", [1, 2])
def test_the_figures_are_the_definitions(threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the workers judging a large tensor's blocks: one, or two
    try:
        for label, d, r in _cases():
            for dtype in ("float32", "float16", "float64"):
                d_in = d.astype(np.float16) if dtype == "float16" else d
                with np.errstate(all="ignore"):
                    want = plain(d_in, r, dtype)
                got = own_error(d_in, r, dtype).to_dict()
                for key, value in want.items():
                    # (float32 ULPs from the float64 exponent: a value rounding up to a power of two differs)
                    rel = 1e-6 if key == "ulp_mean" else 1e-9
                    assert _same(got[key], value, rel), (label, dtype, key, got[key], value)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("lo", "hi", "least"),
    [
        (50.0, 60.0, False),  # nothing near the middle: every element under the floor it allows
        (0.0, 1e-9, True),  # "the median is tiny, so the floor is its least": it is not, all measured again
    ],
)
def test_a_median_the_sample_misses_is_found_the_plain_way(
    monkeypatch: pytest.MonkeyPatch, lo: float, hi: float, least: bool
) -> None:
    monkeypatch.setattr(
        figures, "_bracket", lambda r, floor_of: figures._Bracket(lo, hi, least, floor_of(hi))
    )
    rng = np.random.default_rng(3)
    r = rng.standard_normal(200_000)
    d = (r * (1 + 1e-4 * rng.standard_normal(r.size))).astype(np.float32)
    got = own_error(d, r, "float32").to_dict()
    want = plain(d, r, "float32")
    assert all(_same(got[k], v) for k, v in want.items()), (got, want)


def test_verdicts() -> None:
    rng = np.random.default_rng(5)
    r = rng.standard_normal(100_000)
    assert not own_error(r.astype(np.float32), r, "float32").out_of_line
    noisy = own_error((r * (1 + 1e-3 * rng.standard_normal(r.size))).astype(np.float32), r, "float32")
    assert noisy.out_of_line and "of its elements are more than 0.001 off" in noisy.reason
    d = r.astype(np.float32)
    d[7] = np.inf
    one = own_error(d, r, "float32")
    assert (
        one.out_of_line
        and one.nonfinite_mismatch == 1
        and one.reason == "1 element(s) finite on one side only"
    )


@pytest.mark.parametrize(
    "bracket",
    [None, (50.0, 60.0, False), (0.0, 1e-9, True)],
    ids=["sampled", "median-above-the-bracket", "median-above-a-least-floor"],
)
def test_the_figures_do_not_depend_on_the_workers(
    monkeypatch: pytest.MonkeyPatch, bracket: tuple[float, float, bool] | None
) -> None:
    """A large tensor's blocks are shared among as many workers as torch has threads: its figures (sums of
    squares, of relative errors, of ULPs) are the same to the last bit with one, two or three of them."""
    if bracket is not None:
        lo, hi, least = bracket
        monkeypatch.setattr(
            figures, "_bracket", lambda r, floor_of: figures._Bracket(lo, hi, least, floor_of(hi))
        )
    cases = [c for c in _cases() if c[1].size > 4 * figures.BLOCK]
    before = torch.get_num_threads()
    seen: dict[int, list[str]] = {}
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            seen[threads] = [
                repr(own_error(d.astype(np.float16) if dtype == "float16" else d, r, dtype))
                for _, d, r in cases
                for dtype in ("float32", "float16")
            ]
    finally:
        torch.set_num_threads(before)
    assert seen[2] == seen[1] and seen[3] == seen[1]
