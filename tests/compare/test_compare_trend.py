"""The trend compare on synthetic trends: tolerance by dtype, NaN on one side, spikes, the first module; the
trend file's round trip and its refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from pytest_msprobe.compare.trend import GRAD_NORM, LOSS
from pytest_msprobe.compare.trend.compare import compare_trend, relative_difference, spikes, trend_rtol
from pytest_msprobe.errors import DumpFormatError
from pytest_msprobe.format.trendfile import TrendData, TrendStep, read_trend, read_trends, write_trend


def _trend(
    loss: list[float], norm: list[float] | None = None, dtype: str = "float32", modules=None
) -> TrendData:
    norm = norm if norm is not None else [1.0] * len(loss)
    modules = modules if modules is not None else [(n * 0.6, n * 0.8) for n in norm]
    return TrendData(
        dtype,
        ("conv", "fc"),
        tuple(TrendStep(i, v, g, tuple(m)) for i, (v, g, m) in enumerate(zip(loss, norm, modules))),
    )


LOSS_CURVE = [2.3 - 0.01 * i for i in range(40)]


def test_identical_trends_agree_and_the_rows_hold_both_curves() -> None:
    result = compare_trend(_trend(LOSS_CURVE), _trend(LOSS_CURVE), 40)
    assert result.passed and result.first_step is None and result.steps == 40
    assert result.rtol == 1e-4  # float32's error tolerance in the threshold table
    assert [r.step for r in result.rows] == list(range(40))
    assert result.rows[3].target_loss == result.rows[3].baseline_loss == LOSS_CURVE[3]
    assert result.headline == "40 steps agree within rel 1e-4 (loss and gradient norm)"


def test_the_first_step_beyond_the_tolerance_is_named_with_both_values() -> None:
    target = list(LOSS_CURVE)
    target[25] *= 1 + 1e-3
    target[26] *= 1 + 2e-3
    result = compare_trend(_trend(target), _trend(LOSS_CURVE), 40)
    assert result.first_step == 25 and result.quantity == LOSS
    assert result.target == target[25] and result.baseline == LOSS_CURVE[25]
    assert result.difference == pytest.approx(1e-3, rel=1e-3)
    assert result.headline.startswith("the loss first differs at step 25 (")
    assert result.headline.endswith("; allowed rel 1e-4)")


def test_a_difference_within_the_tolerance_passes_and_the_tolerance_is_the_dtypes() -> None:
    target = [v * (1 + 5e-5) for v in LOSS_CURVE]
    assert compare_trend(_trend(target), _trend(LOSS_CURVE), 40).passed
    assert not compare_trend(_trend(target), _trend(LOSS_CURVE), 40, rtol=1e-5).passed  # given: it holds
    bf16 = compare_trend(
        _trend([v * 1.01 for v in LOSS_CURVE], dtype="bfloat16"), _trend(LOSS_CURVE, dtype="bfloat16"), 40
    )
    assert bf16.passed and bf16.rtol == 2e-2
    assert trend_rtol("float16") == 5e-3 and trend_rtol("float64") == 1e-7 and trend_rtol(None) == 1e-4


def test_the_gradient_norm_counts_and_names_the_first_module_that_differs() -> None:
    norm = [1.0] * 10
    target_norm = list(norm)
    target_norm[4] = 1.01
    modules = [(0.6, 0.8)] * 10
    target_modules = list(modules)
    target_modules[4] = (0.6, 0.81)  # conv agrees, fc does not
    result = compare_trend(
        _trend(LOSS_CURVE[:10], target_norm, modules=target_modules),
        _trend(LOSS_CURVE[:10], norm, modules=modules),
        10,
    )
    assert result.first_step == 4 and result.quantity == GRAD_NORM
    assert result.module == "fc" and result.module_values == (0.81, 0.8)
    assert "the gradient norm first differs at step 4" in result.headline


def test_nan_on_one_side_differs_whatever_the_tolerance_and_nan_on_both_agrees() -> None:
    target = list(LOSS_CURVE[:10])
    target[6] = math.nan
    result = compare_trend(_trend(target), _trend(LOSS_CURVE[:10]), 10, rtol=1e9)
    assert result.first_step == 6 and result.nan_steps == (6,) and math.isnan(result.target or 0.0)
    both = compare_trend(_trend(target), _trend(target), 10)
    assert both.passed and both.nan_steps == ()
    inf = compare_trend(_trend([math.inf] * 3), _trend([math.inf] * 3), 3)
    assert inf.passed


def test_a_gradient_norm_spike_of_the_target_only_is_reported() -> None:
    norm = [1.0, 1.1, 0.9, 1.0, 1.05, 1.0]
    target = list(norm)
    target[4] = 20.0
    result = compare_trend(_trend(LOSS_CURVE[:6], target), _trend(LOSS_CURVE[:6], norm), 6)
    assert result.spikes == (4,) and result.first_step == 4
    # a spike on both sides is the model's, not a difference
    both = list(norm)
    both[4] = 20.0
    assert spikes(np.array(both), np.array(both)) == []
    assert spikes(np.array([1.0, 30.0]), np.array([1.0, 1.0])) == []  # too little history for a median


def test_relative_difference_is_symmetric_and_zero_where_equal() -> None:
    t, b = np.array([1.0, 0.0, 2.0, math.nan]), np.array([1.0, 0.0, 1.0, 1.0])
    diff = relative_difference(t, b)
    assert diff[0] == 0 and diff[1] == 0 and diff[2] == 0.5 and diff[3] == math.inf
    assert relative_difference(b[:3], t[:3]).tolist() == diff[:3].tolist()


def test_the_trend_file_round_trips_nan_and_inf_as_valid_json(tmp_path: Path) -> None:
    data = TrendData(
        "float32", ("conv",), (TrendStep(0, math.nan, math.inf, (-math.inf,)), TrendStep(1, 1.5, 2.0, (2.0,)))
    )
    write_trend(tmp_path / "trend.json", data)
    doc = json.loads((tmp_path / "trend.json").read_text())  # valid JSON: no NaN literal
    assert doc["steps"][0]["loss"] == "nan" and doc["steps"][0]["grad_norm"] == "inf"
    back = read_trend(tmp_path / "trend.json")
    assert math.isnan(back.steps[0].loss or 0.0) and back.steps[0].grad_norm == math.inf
    assert back.steps[0].modules == (-math.inf,) and back.steps[1] == data.steps[1]
    assert set(read_trends(tmp_path)) == {0}


@pytest.mark.parametrize(
    ("doc", "problem"),
    [
        ({"format": "other"}, "not a trend file"),
        ({"format": "pytest-msprobe trend", "modules": [], "steps": [{"step": 1}]}, "'step' must be 0"),
        (
            {"format": "pytest-msprobe trend", "modules": ["a"], "steps": [{"step": 0, "modules": []}]},
            "must hold 1 values",
        ),
        (
            {
                "format": "pytest-msprobe trend",
                "modules": [],
                "steps": [{"step": 0, "loss": "x", "modules": []}],
            },
            "expected a number",
        ),
    ],
)
def test_a_broken_trend_file_is_refused_naming_it(tmp_path: Path, doc: dict, problem: str) -> None:
    path = tmp_path / "trend.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(DumpFormatError, match=problem) as info:
        read_trend(path)
    assert str(path) in str(info.value)


def test_the_reports_show_the_trend_side_by_side_and_as_valid_json() -> None:
    from types import SimpleNamespace

    from pytest_msprobe.report.html import trend_html
    from pytest_msprobe.report.summary import trend_dict

    target = list(LOSS_CURVE)
    target[25] = math.nan
    trend = compare_trend(_trend(target), _trend(LOSS_CURVE), 40)
    fragment = trend_html(trend)
    assert "the loss first differs at step 25" in fragment
    pytest.importorskip("matplotlib")
    assert 'class="msprobe-trend-plot"' in fragment and "data:image/png;base64," in fragment
    summary = trend_dict(SimpleNamespace(trend=trend))  # type: ignore[arg-type]
    assert summary is not None
    assert summary["first_step"] == 25 and summary["target"] == "nan" and summary["nan_steps"] == [25]
    json.dumps(summary, allow_nan=False)
