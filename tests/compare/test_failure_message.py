"""The failure message's first divergence (step, rank, the user's source line) and its worst-rows table (step
and rank columns, the first divergence's row first, each call's rows together, a tensor shown once, a dtype
change named as one), on msprobe's real dumps and on a dump whose dtype changed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from compare_helpers import dump_dir, tensor

from pytest_msprobe.compare import compare
from pytest_msprobe.compare.judging import RowResult
from pytest_msprobe.compare.result import CompareResult
from pytest_msprobe.report.text import failure_message


@pytest.fixture(scope="module", params=["8.3.3", "26.2.0"])
def relu_fault(request: pytest.FixtureRequest) -> CompareResult:
    version = request.param
    return compare(
        dump_dir(version, "npu", "stat_L1", 0), dump_dir(version, "bench", "stat_L1", 0), stack=True
    )


def _table(message: str) -> list[list[str]]:
    """The worst-rows table of a failure message: its header and rows, split into cells."""
    lines = message.splitlines()
    start = lines.index("worst rows:") + 1
    table = []
    for line in lines[start:]:
        if not line.startswith("  "):
            break
        table.append(line.split())
    return table


def _same_tensor(a: RowResult, b: RowResult) -> bool:
    def held(leaf: object) -> object:
        return leaf._replace(name="", suffix="", role="", data_name=None, requires_grad=None)  # type: ignore[attr-defined]

    return held(a.target) == held(b.target) and held(a.baseline) == held(b.baseline)


def test_the_first_divergence_says_step_rank_and_the_users_source_line(relu_fault: CompareResult) -> None:
    message = failure_message(relu_fault, {}, Path("bl"), "pytest 'x'")
    lines = message.splitlines()
    at = lines.index(
        "first divergence: Functional.relu.2.forward (step 0, rank 0), row Functional.relu.2.forward.output.0"
    )
    # the innermost frame of the user's code that made the call (msprobe recorded the stack in make_dumps.py)
    assert (
        lines[at + 1]
        == "  called from: File /workspace/make_dumps.py, line 49, in _forward, return F.relu(out)"
    )
    assert lines[at + 2].startswith("  its output differs")


def test_the_worst_rows_table_has_step_and_rank_and_leads_with_the_first_divergence(
    relu_fault: CompareResult,
) -> None:
    table = _table(failure_message(relu_fault, {}, Path("bl"), "pytest 'x'"))
    assert table[0] == ["step", "rank", "row", "metric", "value", "allowed"]
    assert table[1][:3] == ["0", "0", "Functional.relu.2.forward.output.0"]
    shown = [cells[2] for cells in table[1:]]
    assert shown == [r.row for r in relu_fault.worst_rows()]
    by_name = {r.row: r for r in relu_fault.rows}
    for cells in table[1:]:
        api = relu_fault.apis[by_name[cells[2]].api_index]
        assert (cells[0], cells[1]) == (str(api.step), str(api.rank))


def test_a_tensor_is_shown_once_though_the_next_call_takes_it_as_input(relu_fault: CompareResult) -> None:
    # the SGD update takes batch_norm's weight gradient as its input: one tensor, two rows with the same records
    grad = next(r for r in relu_fault.rows if r.row == "Functional.batch_norm.3.backward.output.2")
    again = next(r for r in relu_fault.rows if r.row == "Tensor.add_.17.forward.input.1")
    assert _same_tensor(grad, again) and again in relu_fault.ranked_errors[:5]
    rows = relu_fault.worst_rows(40)
    assert grad in rows and again not in rows
    assert not any(_same_tensor(a, b) for i, a in enumerate(rows) for b in rows[i + 1 :])


def test_each_calls_rows_stand_together(relu_fault: CompareResult) -> None:
    rows = relu_fault.worst_rows(40)
    calls = [r.api_index for r in rows]
    runs = [c for i, c in enumerate(calls) if i == 0 or calls[i - 1] != c]
    assert len(runs) == len(set(runs)), "a call's rows are split by another call's"
    assert any(calls.count(c) > 1 for c in set(calls)), "no call with several rows: nothing was grouped"
    assert rows[0] is relu_fault.rows[relu_fault.first_divergence.row_index]  # type: ignore[union-attr]


def test_a_dtype_change_is_named_as_a_dtype_change(make_dump: Callable[..., Path]) -> None:
    def data(dtype: str, hi: float) -> dict[str, object]:
        return {
            "Functional.linear.0.forward": {
                "input_args": [tensor([4, 8], -1.0, 1.0, 0.01, 3.0)],
                "input_kwargs": {},
                "output": [tensor([4, 8], -2.0, hi, 0.02, 6.0, dtype=dtype)],
            }
        }

    result = compare(
        make_dump("target", data("torch.bfloat16", 2.03)), make_dump("baseline", data("torch.float32", 2.0))
    )
    assert not result.passed
    table = _table(failure_message(result, {}, Path("bl"), "pytest 'x'"))
    row = " ".join(table[1])
    assert "Functional.linear.0.forward.output.0 dtype bfloat16 vs float32" in row
    assert "(scaled)" not in row


def test_unmatched_counts_say_whether_they_count_rows_or_calls(relu_fault: CompareResult) -> None:
    """The failure line counts unmatched rows, the advisor unmatched calls: each says which it counts, so that
    "4 unmatched" and "0 not matched" never read as two answers to one question."""
    from pytest_msprobe.report.advisor import advisor_text

    c = relu_fault.counts()
    message = failure_message(relu_fault, {}, Path("bl"), "pytest 'x'")
    assert f"{c['warning']} warnings, {c['unmatched']} unmatched rows; " in message.splitlines()[0]
    advisor = advisor_text(relu_fault)
    assert (
        f"{c['apis_unmatched']} call(s) not matched ({c['unmatched']} unmatched row(s): inputs and outputs "
        "present on one side only)." in advisor
    )
    assert " not matched." not in advisor
