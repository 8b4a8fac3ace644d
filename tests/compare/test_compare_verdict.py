"""Row verdicts, API verdicts and the first divergence, on synthetic rows and calls."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from compare_helpers import tensor, write_dump

from pytest_msprobe.compare import compare
from pytest_msprobe.compare.diagnosis import first_divergence
from pytest_msprobe.compare.dumps.reader import OUTPUT, Leaf, flatten_entry
from pytest_msprobe.compare.judging import (
    ERROR,
    PASS,
    SKIPPED,
    UNMATCHED,
    WARNING,
    ApiResult,
    RowResult,
    row_metric,
    tensor_metrics,
)
from pytest_msprobe.compare.judging.judge import (
    Check,
    check_kinds,
    check_md5,
    check_statistics,
    check_tensors,
    msprobe_accuracy,
)
from pytest_msprobe.thresholds import ApiRule, Thresholds, Tolerance

F32 = Tolerance(1e-4, 1e-5, 1e-12)


def leaf(item: dict[str, Any] | None, name: str = "A.op.0.forward") -> Leaf:
    (only,) = flatten_entry(name, {"output": [item]})
    return only


def stats_check(n: tuple[float, ...], b: tuple[float, ...], **kw: Any) -> Check:
    t = leaf(tensor([8], n[1], n[0], n[2], n[3], **kw))
    base = leaf(tensor([8], b[1], b[0], b[2], b[3]))
    return check_statistics(t, base, F32)


def test_statistics_within_noise_pass() -> None:
    c = stats_check((3.0, -2.0, 0.1, 10.0), (3.0 * (1 + 1e-6), -2.0, 0.1, 10.0))
    assert c.status == PASS and c.error == pytest.approx(1e-6, rel=1e-4)


def test_statistics_warning_and_error_bands() -> None:
    assert stats_check((3.0, -2.0, 0.1, 10.0), (3.00006, -2.0, 0.1, 10.0)).status == WARNING
    c = stats_check((3.0, -2.0, 0.1, 10.0), (3.003, -2.0, 0.1, 10.0))
    assert c.status == ERROR
    assert c.reason.startswith("Max differs by 0.000999 of the tensor's range (3.003 -> 3;")


def test_a_relu_output_going_negative_is_an_error() -> None:
    c = stats_check((5.971, -0.00333, 1.17, 99.47), (5.973, 0.0, 1.17, 99.47))
    assert c.status == ERROR and "Min differs" in c.reason


def test_near_zero_means_do_not_raise_alarms() -> None:
    assert stats_check((3.49, -3.63, -4e-9, 64.0), (3.49, -3.63, 1.9e-9, 64.0)).status == PASS


def test_differences_below_atol_never_count() -> None:
    # all-zero on one side, 1e-14 on the other: below float32's atol
    assert stats_check((1e-14, 0.0, 1e-15, 1e-14), (0.0, 0.0, 0.0, 0.0)).status == PASS


def test_statistics_shape_dtype_requires_grad_nonfinite() -> None:
    t = leaf(tensor([8], 0.0, 1.0, 0.5, 1.0))
    b = leaf(tensor([4], 0.0, 1.0, 0.5, 1.0))
    c = check_statistics(t, b, F32)
    assert c.status == ERROR and c.error == math.inf and c.reason == "shape differs: [8] vs [4]"
    half = leaf(tensor([8], 0.0, 1.0, 0.5, 1.0, dtype="torch.float16"))
    c = check_statistics(half, t, F32)
    # another floating format breaches at the call that makes it, whatever its values measure
    assert c.status == ERROR and "dtype differs: torch.float16 vs torch.float32" in c.reason
    assert c.problem == "dtype"
    ints = leaf(tensor([8], 0.0, 1.0, 0.5, 1.0, dtype="torch.int32"))
    longs = leaf(tensor([8], 0.0, 1.0, 0.5, 1.0, dtype="torch.int64"))
    c = check_statistics(ints, longs, F32)  # an index's integer width is not a precision
    assert c.status == WARNING and "dtype differs: torch.int32 vs torch.int64" in c.reason
    grad = leaf(tensor([8], 0.0, 1.0, 0.5, 1.0, requires_grad=True))
    assert "requires_grad differs" in check_statistics(grad, t, F32).reason
    nan = leaf(tensor([8], float("nan"), float("nan"), float("nan"), float("nan")))
    c = check_statistics(nan, t, F32)
    assert c.status == ERROR and c.reason.startswith("NaN/Inf on one side only")
    c = check_statistics(nan, nan, F32)  # a baseline that overflowed is no reference, whatever the target
    assert c.status == ERROR and c.reason.startswith("the baseline's Max, Min, Mean and Norm are NaN")
    inf = leaf(tensor([8], 0.0, float("inf"), float("inf"), float("inf")))
    c = check_statistics(inf, inf, F32)
    assert c.status == WARNING and "both sides" in c.reason


def test_none_and_plain_values() -> None:
    none = leaf(None)
    one, two = leaf({"type": "int", "value": 1}), leaf({"type": "int", "value": 2})
    t = leaf(tensor([8], 0.0, 1.0, 0.5, 1.0))
    assert getattr(check_kinds(none, none), "status", None) == SKIPPED
    assert getattr(check_kinds(one, one), "status", None) == PASS
    c = check_kinds(one, two)
    assert c is not None and c.status == WARNING and c.reason == "argument differs: 1 vs 2"
    c = check_kinds(none, t)
    assert c is not None and c.status == WARNING and "target is None" in c.reason
    assert check_kinds(t, t) is None
    lr, lr_noisy = leaf({"type": "float", "value": 0.1}), leaf({"type": "float", "value": 0.1 * (1 + 1e-7)})
    assert getattr(check_kinds(lr, lr_noisy), "status", None) == PASS


def test_tensor_rows() -> None:
    t, b = leaf(tensor([3], 0.0, 1.0, 0.5, 1.0)), leaf(tensor([3], 0.0, 1.0, 0.5, 1.0))
    base = np.array([1.0, 2.0, 3.0], np.float32)
    same = check_tensors(t, b, tensor_metrics(base, base), F32, True)
    assert same.status == PASS and same.msprobe_accuracy == "Yes"
    off = check_tensors(t, b, tensor_metrics(base * 1.001, base), F32, True)
    assert off.status == ERROR and off.msprobe_accuracy == "Yes"  # cosine 1.0: msprobe would pass it
    assert off.reason.startswith("RelL2Err 0.000999, ScaledMaxAbsErr 0.000999 (MaxAbsErr 0.003")
    far = tensor_metrics(np.array([1.0, -2.0, 3.0], np.float32), base)
    c = check_tensors(t, b, far, Tolerance(1.0, 1.0), True)
    assert c.status == ERROR and "msprobe's accuracy rule fails" in c.reason
    assert check_tensors(t, b, far, Tolerance(10.0, 10.0), False).status == PASS
    empty = tensor_metrics(np.zeros(0, np.float32), np.zeros(0, np.float32))
    assert check_tensors(t, b, empty, F32, True).status == SKIPPED
    nan = tensor_metrics(np.array([1, np.nan], np.float32), np.array([1, 2], np.float32))
    assert check_tensors(t, b, nan, F32, True).status == ERROR


def test_a_few_elements_off_while_the_tensor_agrees_is_a_warning() -> None:
    rng = np.random.default_rng(2)
    base = rng.standard_normal(16384).astype(np.float32)
    t, b = leaf(tensor([16384], -4.0, 4.0, 0.0, 128.0)), leaf(tensor([16384], -4.0, 4.0, 0.0, 128.0))
    one = base.copy()
    one[77] += np.float32(3e-4 * np.abs(base).max())  # (Adam's update of a weight whose gradient is noise)
    check = check_tensors(t, b, tensor_metrics(one, base), F32, True)
    assert check.status == WARNING and check.error is not None and check.error < 1e-4
    assert check.reason.startswith("a few elements differ more than the tensor as a whole: RelL2Err")
    # the same size of error in every element fails
    dense = (base * (1 + 1e-3 * rng.standard_normal(base.size))).astype(np.float32)
    assert check_tensors(t, b, tensor_metrics(dense, base), F32, True).status == ERROR


def test_a_tensor_row_with_a_mask_fill_is_judged_outside_it() -> None:
    rng = np.random.default_rng(1)
    scores = (0.4 * rng.standard_normal((8, 16))).astype(np.float32)
    masked = rng.random((8, 16)) < 0.5
    base = np.where(masked, np.float32(-1e4), scores).astype(np.float32)
    drift = np.where(masked, base, base * np.float32(1.0096)).astype(np.float32)
    t, b = leaf(tensor([8, 16], -1e4, 1.0, -5e3, 1e5)), leaf(tensor([8, 16], -1e4, 1.0, -5e3, 1e5))
    check = check_tensors(t, b, tensor_metrics(drift, base), F32, True)
    assert check.status == ERROR and check.error == pytest.approx(0.0096 / 1.0096, rel=1e-3)
    assert check.reason.startswith(
        "RelL2Err 0.00951, ScaledMaxAbsErr 0.00951 of the values outside the fill -1e+04 ("
    )
    assert "the fill, in 64 of 128 elements, sets the whole tensor's scale" in check.reason
    row = RowResult("A.op.0.forward.output.0", None, 0, OUTPUT, t, b, *check)
    assert row_metric(row) == "RelL2Err (outside the fill)"


@pytest.mark.parametrize(
    "cos, mae, expected",
    [(0.999, 0.5, "Yes"), (0.98, 0.002, "No"), (0.98, 0.0009, "Yes"), (0.89, 0.0001, "No"), (1.0, 1.5, "No")],
)
def test_msprobe_8_3_3_accuracy_rule(cos: float, mae: float, expected: str) -> None:
    from pytest_msprobe.compare.judging import TensorMetrics

    assert msprobe_accuracy(TensorMetrics(cosine=cos, max_abs_err=mae)) == expected


def test_md5_rows() -> None:
    t = leaf(tensor([8], 0.0, 1.0, 0.5, 1.0, md5="aaaa0000"))
    same = leaf(tensor([8], 0.0, 1.0, 0.5, 1.0, md5="aaaa0000"))
    racing = leaf(tensor([8], 0.0, 1.0, 0.5, 1.0, md5="bbbb1111"))
    real = leaf(tensor([8], 0.0, 1.0, 0.6, 1.0, md5="bbbb1111"))
    assert check_md5(t, same, F32).status == PASS
    assert check_md5(t, racing, F32).status == WARNING
    c = check_md5(t, real, F32)
    assert c.status == ERROR and c.reason == "CRC differs: bbbb1111 -> aaaa0000"
    tiny = leaf(tensor([8], 0.0, 1.0, 0.5 + 1e-9, 1.0, md5="bbbb1111"))
    assert check_md5(t, tiny, F32).status == ERROR  # bits differ: md5 is exact


# ----------------------------------------------------------------------------------------- first divergence
def call(
    i: int,
    in_err: float | None,
    out_err: float | None,
    tol: float = 1e-4,
    direction: str = "forward",
    name: str | None = None,
) -> tuple[ApiResult, list[RowResult]]:
    api = name or f"A.op{i}.0.{direction}"
    rows = []
    for role, err in (("input", in_err), (OUTPUT, out_err)):
        status = PASS if err is None or err <= tol else ERROR
        rows.append(
            RowResult(f"{api}.{role}.0", f"{api}.{role}.0", i, role, None, None, status, err, tol, "r")
        )
    in_breach, out_breach = rows[0].status == ERROR, rows[1].status == ERROR
    status = ERROR if in_breach or out_breach else PASS
    result = ApiResult(
        api,
        api,
        0,
        0,
        i,
        direction,
        status,
        "",
        in_err,
        out_err,
        in_breach,
        out_breach,
        2 * i,
        2 * i + 2,
        None,
    )
    return result, rows


def build(*calls: tuple[ApiResult, list[RowResult]]) -> tuple[list[ApiResult], list[RowResult]]:
    return [c[0] for c in calls], [r for c in calls for r in c[1]]


def test_the_error_enters_where_outputs_breach_and_inputs_do_not() -> None:
    apis, rows = build(call(0, 0.0, 0.0), call(1, 0.0, 5e-4), call(2, 5e-4, 9e-3), call(3, 9e-3, 1e-2))
    fd = first_divergence(apis, rows, {}, 10.0)
    assert fd is not None and (fd.api, fd.rule, fd.row) == (
        "A.op1.0.forward",
        "enters",
        "A.op1.0.forward.output.0",
    )


def test_when_errors_flow_in_everywhere_it_is_where_they_grow() -> None:
    apis, rows = build(call(0, 2e-4, 3e-4), call(1, 3e-4, 6e-4), call(2, 6e-4, 9e-3), call(3, 9e-3, 1e-2))
    fd = first_divergence(apis, rows, {}, 10.0)
    assert fd is not None and (fd.api, fd.rule) == ("A.op2.0.forward", "grows")
    assert "15x the input error" in fd.reason


def test_otherwise_the_first_breach_with_inherited_errors() -> None:
    apis, rows = build(call(0, 2e-4, 3e-4), call(1, 3e-4, 6e-4))
    fd = first_divergence(apis, rows, {}, 10.0)
    assert fd is not None and (fd.api, fd.rule) == ("A.op0.0.forward", "inherited")
    assert fd.row == "A.op0.0.forward.input.0" and "A.op0.0.forward.input.0" in fd.reason


def test_nothing_breaches() -> None:
    apis, rows = build(call(0, 0.0, 1e-6), call(1, 1e-6, 2e-6))
    assert first_divergence(apis, rows, {}, 10.0) is None


def test_a_backward_call_reads_its_forward_calls_tensors() -> None:
    # forward op0 already has an output error; its backward's grads differ although the incoming grads match
    fwd = call(0, 0.0, 5e-4)
    bwd = call(1, 0.0, 5e-3, direction="backward", name="A.op0.0.backward")
    apis, rows = build(fwd, bwd)
    fd = first_divergence(apis, rows, {1: [0]}, 10.0)
    assert fd is not None and fd.api == "A.op0.0.forward"
    # without the link the backward would look like where the error enters (it is not)
    apis, rows = build(call(0, 0.0, 0.0), call(1, 0.0, 5e-3, direction="backward", name="A.op0.0.backward"))
    fd = first_divergence(apis, rows, {1: [0]}, 10.0)
    assert fd is not None and (fd.api, fd.rule) == ("A.op0.0.backward", "enters")


def test_calls_with_unknown_inputs_cannot_be_where_the_error_enters() -> None:
    apis, rows = build(call(0, None, 5e-3, name="Module.m.C.parameters_grad"), call(1, 0.0, 5e-4))
    fd = first_divergence(apis, rows, {}, 10.0, opaque={0})
    assert fd is not None and fd.api == "A.op1.0.forward"


def test_unmatched_calls_are_never_candidates() -> None:
    ghost, ghost_rows = call(0, 0.0, 1.0)
    ghost = ApiResult(**{**ghost.__dict__, "status": UNMATCHED})
    apis, rows = build((ghost, ghost_rows), call(1, 0.0, 5e-4))
    fd = first_divergence(apis, rows, {}, 10.0)
    assert fd is not None and fd.api == "A.op1.0.forward"


def test_skip_rules_report_but_do_not_fail(tmp_path: Path) -> None:
    base = tmp_path
    good = {
        "Functional.dropout.0.forward": {
            "input_args": [],
            "input_kwargs": {},
            "output": [tensor([8], 0.0, 1.0, 0.5, 2.0)],
        }
    }
    bad = {
        "Functional.dropout.0.forward": {
            "input_args": [],
            "input_kwargs": {},
            "output": [tensor([8], 0.0, 1.5, 0.5, 2.0)],
        }
    }
    write_dump(base / "t", bad)
    write_dump(base / "b", good)
    assert not compare(base / "t", base / "b").passed
    result = compare(
        base / "t", base / "b", thresholds=Thresholds(apis=(ApiRule("Functional.dropout.*", skip=True),))
    )
    assert result.passed
    (row,) = result.rows
    assert row.status == SKIPPED and "skip rule" in row.reason and row.error == pytest.approx(1 / 3)


def test_a_call_with_an_extra_output_on_one_side_is_a_warning(tmp_path: Path) -> None:
    out = tensor([8], 0.0, 1.0, 0.5, 2.0)
    write_dump(tmp_path / "t", {"Functional.relu.0.backward": {"input": [out], "output": [out, None]}})
    write_dump(tmp_path / "b", {"Functional.relu.0.backward": {"input": [out], "output": [out]}})
    result = compare(tmp_path / "t", tmp_path / "b")
    (api,) = result.apis
    assert [r.status for r in result.rows] == [PASS, PASS, UNMATCHED]
    assert api.status == WARNING and api.reason.endswith("output.1: only in the target: not compared")
    assert result.passed


def test_a_float32_tensor_made_by_a_half_type_is_held_to_its_tolerance() -> None:
    """A float32 gradient summed from bfloat16 ones keeps few significant bits at its extremes: a rerun that
    rounds its bfloat16 gradients otherwise moves its Min by a bfloat16 step, which float32's tolerance fails."""
    from pytest_msprobe.compare.judging import carried_dtype

    t = leaf(tensor([32, 16], 0.018646240234375, -0.02117919921875, 3.0324e-4, 0.1014088))
    b = leaf(tensor([32, 16], 0.018646240234375, -0.021240234375, 3.0353e-4, 0.1014474))
    assert carried_dtype(t, b) == "bfloat16"
    made = leaf(tensor([32, 16], 0.018646241, -0.021179199, 3.0324e-4, 0.1014088))  # float32's own values
    assert carried_dtype(made, b) is None
    zeros = leaf(tensor([8], 0.0, 0.0, 0.0, 0.0))
    ones = leaf(tensor([8], 1.0, 0.5, 0.75, 2.0))
    assert carried_dtype(zeros, zeros) is None and carried_dtype(ones, zeros) is None  # nothing to tell it by


def test_the_verdict_is_worked_out_once_and_names_what_comes_first(tmp_path: Path) -> None:
    import shutil

    from compare_helpers import dump_dir

    from pytest_msprobe.compare.result import CAUSE_CALL, Verdict

    bench = dump_dir("8.3.3", "bench", "stat_L1", 0)
    faulty = compare(dump_dir("8.3.3", "npu", "stat_L1", 0), bench)
    verdict = faulty.verdict
    assert isinstance(verdict, Verdict) and faulty.verdict is verdict  # cached: every report reads this one
    fd = faulty.first_divergence
    assert fd is not None and not verdict.passed and verdict.cause == CAUSE_CALL
    assert (verdict.text, verdict.api, verdict.row, verdict.divergence) == (fd.api, fd.api, fd.row, fd)
    assert verdict.checklist is None and not verdict.trend_only and faulty.passed is verdict.passed
    clean = compare(shutil.copytree(bench, tmp_path / "copy"), bench).verdict
    assert clean.passed and clean.cause is None and clean.text == "" and clean.api is None
