"""A drift hidden under a mask fill, on dumps of a real transformer: in tensor mode it is named where it enters
(the masked_fill that writes the fill); in statistics mode the advisor says why the statistics cannot show it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from model_dumps import drift_under_added_mask, drift_under_mask, float64_matmul  # noqa: E402

from pytest_msprobe.compare import compare  # noqa: E402
from pytest_msprobe.report.advisor import advisor_text  # noqa: E402

FILLS = [-1e4, -1e9, float(torch.finfo(torch.float32).min)]


def drift() -> Any:
    return drift_under_mask(0, 0.0096)  # 0.96% of the first layer's unmasked scores


@pytest.mark.parametrize("fill", FILLS)
def test_a_drift_under_a_mask_fill_is_named_where_it_enters(dumps: Callable[..., Path], fill: float) -> None:
    baseline = dumps(f"clean{fill}", fill=fill, steps=1)
    target = dumps(f"drift{fill}", fill=fill, steps=1, variant=drift)
    # the thresholds alone (no replay: what a statistics-free rule of the rows sees), then with the replay
    replayed = compare(target, baseline, jobs=1).first_divergence
    assert replayed is not None and (replayed.api, replayed.rule) == (
        "Tensor.masked_fill.0.forward",
        "out of line",
    )
    result = compare(target, baseline, jobs=1, replay=False)
    fd = result.first_divergence
    assert not result.passed and fd is not None
    # (measured against the fill, the drift is 1e-6 of the tensor and under it: the error showed only at the
    # softmax after it)
    assert (fd.api, fd.row, fd.rule) == (
        "Tensor.masked_fill.0.forward",
        "Tensor.masked_fill.0.forward.output.0",
        "enters",
    )
    row = result.rows[fd.row_index]
    assert row.tensor is not None and row.tensor.fill == pytest.approx(fill)
    assert row.tensor.rel_l2 is not None and row.tensor.rel_l2 < 1e-5  # the whole tensor's error
    assert row.error == pytest.approx(0.0096 / 1.0096, rel=0.01)  # the values outside the fill
    assert "of the values outside the fill" in fd.reason


def test_in_statistics_mode_a_fill_does_not_hide_the_drift(dumps: Callable[..., Path]) -> None:
    """The scores' Min is the -1e4 fill on both sides: their Max and Mean are judged against the other values'
    size (the Max), so the masked_fill that made the drift is named, not the softmax after it."""
    baseline = dumps("clean-stat", task="statistics", steps=1)
    result = compare(dumps("drift-stat", task="statistics", steps=1, variant=drift), baseline, jobs=1)
    fd = result.first_divergence
    assert fd is not None and (fd.api, fd.rule) == ("Tensor.masked_fill.0.forward", "enters")
    assert "of the values outside the mask fill -1e+04 (the tensor's Min on both sides" in fd.reason
    row = result.rows[fd.row_index]
    assert row.stat is not None and row.stat.fill == -1e4
    assert row.error is not None and 0.004 < row.error < 0.02  # the 0.96% drift of the Max, not 1e-6 of 1e4
    assert "a mask fill (a sentinel value)" not in advisor_text(result)  # (nothing hidden: no such note)


def test_the_advisor_says_when_a_fill_hides_what_the_statistics_cannot_see(
    make_dump: Callable[..., Path],
) -> None:
    """A drift that moves neither the Max nor the Mean of the masked scores (the other values' Min moved)
    shows first at the softmax: the advisor says the scores' range is set by the fill."""
    from compare_helpers import tensor

    def data(lo: float) -> dict[str, Any]:
        scores = tensor([4, 8, 8], -1e4, 2.5, -3000.0, 6000.0)
        return {
            "Tensor.masked_fill.0.forward": {
                "input_args": [tensor([4, 8, 8], -2.0, 2.5, 0.1, 20.0), {"type": "float", "value": -1e4}],
                "input_kwargs": {},
                "output": [scores],
            },
            "Functional.softmax.0.forward": {
                "input_args": [scores],
                "input_kwargs": {},
                "output": [tensor([4, 8, 8], 0.0, 1.0, 0.125, lo)],
            },
        }

    result = compare(make_dump("t", data(3.9)), make_dump("b", data(4.0)))
    fd = result.first_divergence
    assert fd is not None and fd.api == "Functional.softmax.0.forward"
    assert (
        "Functional.softmax.0.forward.input.0 has Min -10000 on both sides, a mask fill (a sentinel value) that "
        "sets its range" in advisor_text(result)
    )


def test_float64_matmul_passes_under_the_fill(dumps: Callable[..., Path]) -> None:
    for task in ("tensor", "statistics"):
        baseline = dumps(f"clean-{task}-3", task=task)
        result = compare(dumps(f"float64-{task}-3", task=task, variant=float64_matmul), baseline, jobs=1)
        assert result.passed, [a.reason for a in result.failures]
        if task == "tensor":
            masked = [
                r
                for r in result.rows
                if r.row.startswith("Tensor.masked_fill.") and r.row.endswith(".forward.output.0")
            ]
            assert len(masked) == 2 * 3  # two layers, three steps
            for row in masked:
                assert row.tensor is not None and row.tensor.fill == -1e4
                assert (
                    row.error is not None and row.error < 1e-6
                )  # the scores' own rounding, outside the fill


def test_a_drift_under_an_added_mask_is_named_at_the_add(dumps: Callable[..., Path]) -> None:
    baseline = dumps("add-clean", mask="add", steps=1)
    faulty = dumps("add-drift", mask="add", steps=1, variant=lambda: drift_under_added_mask(0, 0.0096))
    result = compare(faulty, baseline, jobs=1)
    fd = result.first_divergence
    # (both sides hold tensors: the add is replayed, and its own error names it)
    assert fd is not None and (fd.api, fd.rule) == ("Tensor.__add__.0.forward", "out of line")
    fill = result.rows[fd.row_index].tensor
    assert fill is not None and fill.fill is not None and -1e4 - 10 < fill.fill < -1e4 + 10  # scores - 1e4
    benign = compare(dumps("add-float64", mask="add", steps=1, variant=float64_matmul), baseline, jobs=1)
    assert benign.passed, [a.reason for a in benign.failures]
    # statistics: the scores' Min is the mask's plus the smallest score, the same on both sides to 1e-6: the
    # add is named too
    baseline = dumps("add-clean-stat", mask="add", steps=1, task="statistics")
    faulty = dumps(
        "add-drift-stat",
        mask="add",
        steps=1,
        task="statistics",
        variant=lambda: drift_under_added_mask(0, 0.0096),
    )
    result = compare(faulty, baseline, jobs=1)
    fd = result.first_divergence
    assert fd is not None and (fd.api, fd.rule) == ("Tensor.__add__.0.forward", "enters")
    assert "of the values outside the mask fill -1" in fd.reason
