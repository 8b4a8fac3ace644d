"""A weight that Adam updates from a gradient that is rounding noise drifts by what no device's precision decides."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from compare_helpers import tensor

from pytest_msprobe.compare import compare
from pytest_msprobe.compare.result import ERROR, PASS, WARNING


def _update(
    weight: dict[str, Any], moment: dict[str, Any], denom: dict[str, Any], out: dict[str, Any]
) -> Any:
    return {
        "input_args": [weight, moment, denom],
        "input_kwargs": {"value": {"type": "float", "value": -0.001}},
        "output": [out],
    }


def _step(
    bias_hi: float, m_hi: float, denom_hi: float, new_hi: float, grad_scale: float = 1.0
) -> dict[str, Any]:
    """One step's records of a key bias: its forward use, then Adam's update (moments of size grad_scale)."""
    bias = tensor([32], -0.17, bias_hi, 0.01, 0.55)
    return {
        "Functional.linear.1.forward": {
            "input_args": [
                tensor([4, 8, 32], -3.0, 3.0, 0.0, 32.0),
                tensor([32, 32], -0.17, 0.17, 0.0, 3.2),
                bias,
            ],
            "input_kwargs": {},
            "output": [tensor([4, 8, 32], -3.2, 3.3, 0.01, 33.0)],
        },
        "Tensor.addcdiv_.7.forward": _update(
            bias,
            tensor([32], -m_hi * grad_scale, m_hi * grad_scale, 0.0, 5 * m_hi * grad_scale),
            tensor([32], 1e-8, denom_hi * grad_scale, 1.02e-8 * grad_scale, 5.8e-8 * grad_scale),
            tensor([32], -0.17, new_hi, 0.01, 0.55),
        ),
    }


def test_a_weight_updated_from_rounding_noise_warns_and_passes(make_dump: Callable[..., Path]) -> None:
    # the first step: the bias matches; its moments are noise (1e-11, 1e-8) that differ below atol; the update
    # divides them, so the new bias differs by 2.3e-5, 1.3e-4 of its size
    first = compare(
        make_dump("t0", _step(0.17361, 4.4e-11, 1.0444e-8, 0.173633)),
        make_dump("b0", _step(0.17361, 2.3e-11, 1.0387e-8, 0.17361)),
    )
    assert first.passed, [r.reason for r in first.failures]
    row = next(r for r in first.rows if r.row == "Tensor.addcdiv_.7.forward.output.0")
    assert row.status == WARNING and "updates from rounding noise" in row.reason
    # a later step: the bias already differs where the linear reads it (its output does not: 1e-6 of it)
    later = compare(
        make_dump("t1", _step(0.173633, 4.4e-11, 1.0444e-8, 0.173660)),
        make_dump("b1", _step(0.17361, 2.3e-11, 1.0387e-8, 0.17361)),
    )
    assert later.passed, [r.reason for r in later.failures]
    use = next(r for r in later.rows if r.row == "Functional.linear.1.forward.input.2")
    assert use.status == WARNING and "Tensor.addcdiv_.7.forward updates from rounding noise" in use.reason
    assert next(r for r in later.rows if r.row == "Functional.linear.1.forward.output.0").status == PASS


def test_an_update_from_a_measured_gradient_still_fails(make_dump: Callable[..., Path]) -> None:
    """The same update with moments of a real gradient (1e-3) that differ: the new weight's difference is real."""
    result = compare(
        make_dump("t", _step(0.17361, 4.4e-11, 1.0444e-8, 0.173633, grad_scale=1e8)),
        make_dump("b", _step(0.17361, 2.3e-11, 1.0387e-8, 0.17361, grad_scale=1e8)),
    )
    assert not result.passed
    assert "Tensor.addcdiv_.7.forward.output.0" in {r.row for r in result.rows if r.status == ERROR}
    assert not any("rounding noise" in r.reason for r in result.rows)
