"""Overflow in every compare and in the self-check: the first call whose output holds inf/nan on the target
and not on the baseline is named as an overflow, with where it is first seen (parameter, input, output)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_msprobe.compare import compare
from pytest_msprobe.compare.judging import check_dump
from pytest_msprobe.report.advisor import advisor_text
from pytest_msprobe.report.summary import summary_dict
from pytest_msprobe.report.text import console_summary, failure_message, self_check_message
from tests.compare.overflow_models import dump

DATA = Path(__file__).resolve().parents[1] / "data" / "msprobe"


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("clean")
    return {task: dump(root / task, task=task) for task in ("statistics", "tensor", "md5")}


def _overflow(result: Any) -> tuple[str, str, str | None]:
    fd = result.first_divergence
    assert not result.passed and fd is not None and fd.rule == "overflow"
    return fd.api, fd.row, fd.overflow


@pytest.mark.parametrize("task", ["statistics", "tensor", "md5"])
def test_a_float16_mul_overflow_is_named_at_its_call_in_every_mode(
    task: str, clean: dict[str, Path], tmp_path: Path
) -> None:
    target = dump(tmp_path / "t", task=task, factor=1e5)
    result = compare(target, clean[task], jobs=1)
    assert result.mode == task
    api, row, where = _overflow(result)
    assert (api, row, where) == ("Tensor.__mul__.0.forward", "Tensor.__mul__.0.forward.output.0", "output")
    fd = result.first_divergence
    assert fd is not None and fd.step == 0
    assert fd.reason.startswith(
        "its output holds inf (.output.0: Max inf, float16) while its inputs are finite: the overflow happens "
        "here (float16's largest value is 65504); the baseline's is finite (Max "
    )
    summary = summary_dict(result)
    assert summary["first_divergence"]["rule"] == "overflow"
    assert summary["first_divergence"]["overflow"] == "output"
    assert summary["overflow"]["where"] == "output" and summary["overflow"]["dtype"] == "torch.float16"
    advice = advisor_text(result)
    assert "Suspect Nodes: Tensor.__mul__.0.forward.output.0" in advice
    assert "This call is the suspect" in advice and "float16 holds at most 65504" in advice
    assert "task='overflow_check'" in advice
    text = failure_message(result, {}, clean[task], "regen")
    assert "overflow: Tensor.__mul__.0.forward (step 0, rank 0) is the first call whose output holds" in text


def test_an_exp_overflow_is_named_at_the_exp(clean: dict[str, Path], tmp_path: Path) -> None:
    base = dump(tmp_path / "b", exp=True, factor=0.5)
    target = dump(tmp_path / "t", exp=True, factor=40.0)  # exp(> 11.1) passes float16's 65504
    assert _overflow(compare(target, base, jobs=1)) == (
        "Torch.exp.0.forward",
        "Torch.exp.0.forward.output.0",
        "output",
    )


def test_a_weight_set_to_inf_between_steps_is_a_parameter(clean: dict[str, Path], tmp_path: Path) -> None:
    def break_weight(step: int, model: Any) -> None:
        if step == 1:
            with torch.no_grad():
                model.fc2.weight[0, 0] = float("inf")

    target = dump(tmp_path / "t", before_step=break_weight)
    result = compare(target, clean["statistics"], jobs=1)
    api, row, where = _overflow(result)
    assert (api, row, where) == (
        "Functional.linear.1.forward",
        "Functional.linear.1.forward.input.1",
        "parameter",
    )
    fd = result.first_divergence
    assert fd is not None and fd.step == 1 and "previous step's backward or optimizer update" in fd.reason
    advice = advisor_text(result)
    assert "dump step 0, its backward and optimizer step" in advice


def test_a_weight_set_to_inf_is_a_parameter_at_level_mix_too(tmp_path: Path) -> None:
    def break_weight(step: int, model: Any) -> None:
        if step == 1:
            with torch.no_grad():
                model.fc1.weight[0, 0] = float("inf")

    base = dump(tmp_path / "b", level="mix")
    target = dump(tmp_path / "t", level="mix", before_step=break_weight)
    result = compare(target, base, jobs=1)
    api, _, where = _overflow(result)
    assert where == "parameter" and result.first_divergence is not None
    assert result.first_divergence.step == 1 and api in (
        "Functional.linear.0.forward",
        "Module.fc1.Linear.forward.0",
    )


def test_an_input_made_by_a_call_that_was_not_recorded_is_an_input(tmp_path: Path) -> None:
    # only the linear calls are recorded: the mul that overflows is not, the linear after it reads its inf
    base = dump(tmp_path / "b", list=["linear"])
    target = dump(tmp_path / "t", list=["linear"], factor=1e5)
    result = compare(target, base, jobs=1)
    assert _overflow(result) == (
        "Functional.linear.1.forward",
        "Functional.linear.1.forward.input.0",
        "input",
    )
    assert "a call that was not recorded made it" in result.first_divergence.reason  # type: ignore[union-attr]
    assert "dump step 0 again at level mix" in advisor_text(result)


def test_data_holding_inf_is_an_input(clean: dict[str, Path], tmp_path: Path) -> None:
    def poison(step: int, x: torch.Tensor) -> torch.Tensor:
        x[0, 0] = float("inf")
        return x

    result = compare(dump(tmp_path / "t", batch=poison), clean["statistics"], jobs=1)
    assert _overflow(result) == (
        "Functional.linear.0.forward",
        "Functional.linear.0.forward.input.0",
        "input",
    )


def test_a_nan_both_sides_have_is_no_overflow_of_the_target(tmp_path: Path) -> None:
    base = dump(tmp_path / "b", factor=1e5)
    target = dump(tmp_path / "t", factor=1e5)
    result = compare(target, base, jobs=1)
    assert result.overflow is None and (
        result.first_divergence is None or result.first_divergence.rule != "overflow"
    )
    assert "overflow: none: no call's output is infinite or NaN on the target" in console_summary(result)


def test_an_msprobe_dump_with_an_overflow_injected_is_named(tmp_path: Path) -> None:
    """A real msprobe 8.3.3 statistics dump whose third relu output holds inf (as msprobe writes it: a JSON
    Infinity, or the text "inf"), against the clean run."""
    for spelling in ("number", "text"):
        target = tmp_path / spelling
        shutil.copytree(DATA / "msprobe-8.3.3" / "dumps" / "bench" / "stat_L1", target)
        path = target / "step0" / "rank" / "dump.json"
        doc = json.loads(path.read_text())
        item = doc["data"]["Functional.relu.2.forward"]["output"][0]
        item["Max"] = math.inf if spelling == "number" else "inf"
        item["Norm"] = math.inf if spelling == "number" else "inf"
        path.write_text(json.dumps(doc))
        result = compare(target, DATA / "msprobe-8.3.3" / "dumps" / "bench" / "stat_L1", jobs=1)
        assert _overflow(result) == (
            "Functional.relu.2.forward",
            "Functional.relu.2.forward.output.0",
            "output",
        )


# ------------------------------------------------------------------------------------ the overflow_check task
def test_two_overflow_check_dumps_compare_and_say_what_they_found(tmp_path: Path) -> None:
    base = dump(tmp_path / "b", task="overflow_check", overflow_nums=-1)
    base2 = dump(tmp_path / "b2", task="overflow_check", overflow_nums=-1)
    target = dump(tmp_path / "t", task="overflow_check", overflow_nums=-1, factor=1e5)
    clean_result = compare(base2, base, jobs=1)
    assert clean_result.passed and clean_result.overflow is None
    assert "overflow: none: no call's output is infinite or NaN" in console_summary(clean_result)
    result = compare(target, base, jobs=1)
    assert _overflow(result) == ("Tensor.__mul__.0.forward", "Tensor.__mul__.0.forward.output.0", "output")
    assert result.counts()["apis_error"] == 1
    assert "overflow: Tensor.__mul__.0.forward (step 0, rank 0)" in console_summary(result)
    # the weights the first step's overflow broke: at step 1 the first overflow is a weight
    step1 = compare(target / "step1", base / "step1", jobs=1)
    assert _overflow(step1)[2] == "parameter"


# ------------------------------------------------------------------------------------------------ self-check
def test_the_self_check_names_the_first_overflow_and_fails(tmp_path: Path) -> None:
    for task in ("statistics", "overflow_check"):
        path = dump(tmp_path / task, task=task, factor=1e5, self_check=True, overflow_nums=-1)
        result = check_dump(path)
        assert not result.passed and result.overflow is not None
        assert (result.overflow.api, result.overflow.where) == ("Tensor.__mul__.0.forward", "output")
        message = self_check_message(result)
        assert message.startswith("msprobe self-check: Tensor.__mul__.0.forward (step 0, rank 0) overflows")
        assert "where: output (its inputs are finite: this call is the suspect)" in message
        assert "called from: File " in message and "h = h * self.factor" in message


def test_the_self_check_leaves_a_minus_inf_mask_fill_alone(tmp_path: Path) -> None:
    result = check_dump(dump(tmp_path / "m", mask=True, self_check=True))
    assert result.overflow is None
    nan = check_dump(dump(tmp_path / "n", mask=True, factor=1e5, self_check=True))
    assert nan.overflow is not None and nan.overflow.api == "Tensor.__mul__.0.forward"


def test_md5_records_without_statistics_say_the_overflow_was_not_checked(tmp_path: Path) -> None:
    def write(name: str, crc: str) -> Path:
        item = {"type": "torch.Tensor", "dtype": "torch.float16", "shape": [4], "Max": None, "Min": None}
        item.update({"Mean": None, "Norm": None, "requires_grad": False, "md5": crc})
        folder = tmp_path / name / "step0" / "rank"
        folder.mkdir(parents=True)
        data = {"Functional.relu.0.forward": {"input_args": [item], "input_kwargs": {}, "output": [item]}}
        (folder / "dump.json").write_text(json.dumps({"task": "statistics", "level": "L1", "data": data}))
        return tmp_path / name

    result = compare(write("t", "0000abcd"), write("b", "0000abcd"), jobs=1)
    assert result.overflow is None
    assert "overflow: not checked: the target's records hold no statistics" in console_summary(result)
