"""A baseline whose statistics are NaN or null for a non-empty tensor is an error row: it cannot be a reference.

Statistics a dump legitimately leaves null stay fine: Mean/Norm of bool and integer tensors, Mean/Norm of float64
and Norm of complex tensors in some versions, everything of an empty tensor.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from compare_helpers import DATA, tensor, write_dump

from pytest_msprobe.compare import compare
from pytest_msprobe.report.advisor import advisor_text
from pytest_msprobe.report.text import failure_message

NAN, INF = float("nan"), float("inf")
FINE = (2.0, -1.0, 0.5, 3.0)  # Max, Min, Mean, Norm


def _item(
    stats: tuple[Any, Any, Any, Any],
    dtype: str = "torch.float32",
    shape: list[int] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    hi, lo, mean, norm = stats
    return tensor([4, 4] if shape is None else shape, lo, hi, mean, norm, dtype=dtype, **extra)


def _dump(root: Path, name: str, out: dict[str, Any], task: str = "statistics") -> Path:
    """Three calls: a relu whose output is ``out``, before and after it clean ones."""
    clean = _item(FINE)
    data = {
        "Functional.conv2d.0.forward": {"input_args": [clean], "input_kwargs": {}, "output": [clean]},
        "Functional.relu.0.forward": {"input_args": [clean], "input_kwargs": {}, "output": [out]},
        "Functional.linear.0.forward": {"input_args": [clean], "input_kwargs": {}, "output": [clean]},
    }
    write_dump(root / name / "step0" / "rank", data, task=task)
    return root / name


def _row(result: Any, name: str = "Functional.relu.0.forward.output.0") -> Any:
    (row,) = [r for r in result.rows if r.row == name]
    return row


@pytest.mark.parametrize(
    ("stats", "why"),
    [
        ((NAN, NAN, NAN, NAN), "the baseline's Max, Min, Mean and Norm are NaN for this non-empty tensor"),
        ((2.0, -1.0, NAN, 3.0), "the baseline's Mean is NaN for this non-empty tensor"),
        (
            (None, None, None, None),
            "the baseline has no Max, Min, Mean and Norm (null) for this non-empty torch.float32",
        ),
        (
            (2.0, -1.0, None, None),
            "the baseline has no Mean and Norm (null) for this non-empty torch.float32 tensor",
        ),
    ],
)
def test_a_baseline_that_overflowed_or_lacks_statistics_fails(tmp_path: Path, stats: Any, why: str) -> None:
    """Whatever the target holds: the same NaN, the same nulls, or sound numbers."""
    baseline = _dump(tmp_path, "b", _item(stats))
    for name, target_stats in (("same", stats), ("sound", FINE)):
        result = compare(_dump(tmp_path, name, _item(target_stats)), baseline)
        row = _row(result)
        assert not result.passed and row.status == "error", (name, row.reason)
        assert row.reason.startswith(why)
        assert "cannot be a reference" in row.reason and "regenerate it" in row.reason
        assert row.error is None  # nothing measured: no error flows into the first-divergence rules
        if "NaN" in why:
            assert "the baseline itself overflowed" in row.reason


def test_md5_equal_crcs_of_an_overflowed_baseline_prove_nothing(tmp_path: Path) -> None:
    nan = _item((NAN, NAN, NAN, NAN), md5="0badf00d")
    result = compare(
        _dump(tmp_path, "t", nan, task="statistics"), _dump(tmp_path, "b", nan, task="statistics")
    )
    assert result.mode == "md5" and not result.passed
    assert _row(result).reason.startswith("the baseline's Max, Min, Mean and Norm are NaN")


def test_a_target_that_lacks_statistics_fails_naming_the_target(tmp_path: Path) -> None:
    result = compare(_dump(tmp_path, "t", _item((None, None, 0.5, 3.0))), _dump(tmp_path, "b", _item(FINE)))
    row = _row(result)
    assert not result.passed and row.status == "error"
    assert row.reason.startswith(
        "the target has no Max and Min (null) for this non-empty torch.float32 tensor"
    )


@pytest.mark.parametrize(
    ("item", "label"),
    [
        (_item((True, False, None, None), dtype="torch.bool"), "bool: any/all only"),
        (_item((7, 0, None, None), dtype="torch.int64"), "int64 without Mean/Norm (msprobe 26.x)"),
        (_item((2.0, -1.0, None, None), dtype="torch.float64"), "float64 without Mean/Norm"),
        (_item((2.0, 0.0, 1.0, None), dtype="torch.complex64"), "complex without Norm"),
        (_item((None, None, None, None), shape=[0, 4]), "empty"),
    ],
)
def test_statistics_a_dump_leaves_null_are_not_errors(
    tmp_path: Path, item: dict[str, Any], label: str
) -> None:
    result = compare(_dump(tmp_path, "t", item), _dump(tmp_path, "b", item))
    assert result.passed, (label, _row(result).reason)
    assert _row(result).status in ("pass", "skipped")


def test_the_same_inf_on_both_sides_still_passes(tmp_path: Path) -> None:
    """An attention mask's -inf is a value, not an overflow of the baseline."""
    masked = _item((0.0, -INF, -INF, INF))
    result = compare(_dump(tmp_path, "t", masked), _dump(tmp_path, "b", masked))
    assert result.passed and _row(result).status == "warning"


def test_real_msprobe_int64_rows_without_mean_and_norm_pass() -> None:
    """msprobe 26.2.0 leaves the Mean and Norm of int64 tensors null (8.3.3 gives them)."""
    for a, b in (("26.2.0", "8.3.3"), ("8.3.3", "26.2.0"), ("26.2.0", "26.2.0")):
        for kind in ("stat_L1", "md5_L1"):
            target = DATA / f"msprobe-{a}" / "dumps" / ("npu" if a == b else "bench") / kind
            result = compare(target, DATA / f"msprobe-{b}" / "dumps" / "bench" / kind)
            ints = [r for r in result.rows if r.baseline is not None and r.baseline.dtype == "torch.int64"]
            assert ints and all(r.status != "error" for r in ints)
            assert all(not r.reason.startswith(("the baseline", "the target has no")) for r in result.rows)
            assert result.passed == (a != b)


def test_tensor_mode_keeps_its_element_wise_rules(tmp_path: Path) -> None:
    """With tensor files the values decide: NaN at the same positions on both sides is a warning."""
    values = np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4)
    values[1, 2] = np.nan
    for name in ("t", "b"):
        folder = tmp_path / name / "step0" / "rank"
        (folder / "dump_tensor_data").mkdir(parents=True)
        np.save(folder / "dump_tensor_data" / "x.npy", values)
        item = _item((NAN, NAN, NAN, NAN), data_name="x.npy")
        write_dump(folder, {"Functional.relu.0.forward": {"input_args": [], "output": [item]}}, task="tensor")
    result = compare(tmp_path / "t", tmp_path / "b")
    assert result.mode == "tensor" and result.passed
    assert result.rows[0].status == "warning" and "NaN/Inf at the same positions" in result.rows[0].reason


def test_the_reports_say_to_regenerate_the_baseline(tmp_path: Path) -> None:
    baseline = _dump(tmp_path, "b", _item((NAN, NAN, NAN, NAN)))
    result = compare(_dump(tmp_path, "t", _item(FINE)), baseline)
    fd = result.first_divergence
    assert fd is not None and fd.api == "Functional.relu.0.forward" and fd.row.endswith(".output.0")
    assert fd.reason.startswith(
        "its output cannot be compared (.output.0: the baseline's Max, Min, Mean and Norm"
    )
    assert "differs" not in fd.reason and "nan" not in fd.reason
    advice = advisor_text(result).splitlines()[2]
    assert advice.startswith(
        "Expert Advice: Functional.relu.0.forward.output.0 cannot be compared: the baseline's"
    )
    assert "regenerate it from a run that does not overflow" in advice
    message = failure_message(result, {}, baseline, "pytest x --msprobe-regen-baseline")
    assert "Functional.relu.0.forward.output.0  statistics" in message
    assert not re.search(r"\bnan\b", message)  # the reason says NaN in words; no "nan" number is printed
