"""PrecisionDebugger at level L1: API records, names and counters, layout, stacks, steps."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pytest_msprobe import PrecisionDebugger

pytestmark = pytest.mark.usefixtures("no_leftover_debugger")


def _dump_once(tmp_path: Path, body: Callable[[], Any], **kwargs: Any) -> dict[str, Any]:
    kwargs.setdefault("task", "statistics")
    debugger = PrecisionDebugger(dump_path=tmp_path, level="L1", **kwargs)
    debugger.start()
    try:
        body()
    finally:
        debugger.close()
    return json.loads((tmp_path / "step0" / "rank" / "dump.json").read_text())


def test_layout_and_header(tmp_path: Path) -> None:
    dump = _dump_once(tmp_path, lambda: F.relu(torch.ones(2)))
    folder = tmp_path / "step0" / "rank"
    # msprobe's three files, and our checklist and optimizer record beside them
    assert sorted(p.name for p in folder.iterdir()) == [
        "checklist.json",
        "construct.json",
        "dump.json",
        "optimizer.json",
        "stack.json",
    ]
    assert {k: v for k, v in dump.items() if k != "data"} == {
        "task": "statistics",
        "level": "L1",
        "framework": "pytorch",
        "dump_data_dir": None,
    }
    assert json.loads((folder / "construct.json").read_text()) == {}


def test_names_count_calls_per_api_and_namespace(tmp_path: Path) -> None:
    def body() -> None:
        x = torch.randn(3, 3)
        F.relu(x)
        F.relu(x)
        y = x + x  # Tensor.__add__
        y = y.add(1)
        torch.matmul(y, y)
        F.relu(y)

    data = _dump_once(tmp_path, body)["data"]
    assert list(data) == [
        "Torch.randn.0.forward",
        "Functional.relu.0.forward",
        "Functional.relu.1.forward",
        "Tensor.__add__.0.forward",
        "Tensor.add.0.forward",
        "Torch.matmul.0.forward",
        "Functional.relu.2.forward",
    ]


def test_calls_nested_in_a_captured_call_are_not_recorded(tmp_path: Path) -> None:
    # F.softmax and F.layer_norm call torch functions internally; only the outer call is a record
    data = _dump_once(tmp_path, lambda: F.layer_norm(F.softmax(torch.ones(2, 4), dim=-1), (4,)))["data"]
    assert list(data) == [
        "Torch.ones.0.forward",
        "Functional.softmax.0.forward",
        "Functional.layer_norm.0.forward",
    ]


def test_arguments_and_keyword_arguments(tmp_path: Path) -> None:
    def body() -> None:
        x = torch.arange(8.0).reshape(1, 2, 2, 2)
        F.conv2d(x, torch.ones(2, 2, 1, 1), None, (1, 1), 0, 1, 1)
        F.relu(x, inplace=False)

    data = _dump_once(tmp_path, body)["data"]
    conv = data["Functional.conv2d.0.forward"]
    assert conv["input_args"][2:] == [
        None,
        [{"type": "int", "value": 1}, {"type": "int", "value": 1}],
        {"type": "int", "value": 0},
        {"type": "int", "value": 1},
        {"type": "int", "value": 1},
    ]
    assert conv["input_kwargs"] == {}
    assert conv["output"][0]["shape"] == [1, 2, 2, 2] and conv["output"][0]["Max"] == 10.0
    relu = data["Functional.relu.0.forward"]
    assert relu["input_kwargs"] == {"inplace": {"type": "bool", "value": False}}
    assert list(relu) == ["input_args", "input_kwargs", "output"]


def test_in_place_call_records_inputs_before_and_outputs_after(tmp_path: Path) -> None:
    x = torch.zeros(4)

    def body() -> None:
        x.add_(2.0)
        y = x
        y += 1  # Tensor.__iadd__
        F.relu(y.sub_(10), inplace=True)

    data = _dump_once(tmp_path, body)["data"]
    add = data["Tensor.add_.0.forward"]
    assert add["input_args"][0]["Max"] == 0.0 and add["output"][0]["Max"] == 2.0
    iadd = data["Tensor.__iadd__.0.forward"]
    assert iadd["input_args"][0]["Max"] == 2.0 and iadd["output"][0]["Max"] == 3.0
    relu = data["Functional.relu.0.forward"]
    assert relu["input_args"][0]["Min"] == -7.0 and relu["output"][0]["Min"] == 0.0


def test_tuple_outputs_are_listed(tmp_path: Path) -> None:
    data = _dump_once(tmp_path, lambda: torch.max(torch.tensor([[1.0, 5.0], [7.0, 2.0]]), dim=1))["data"]
    out = data["Torch.max.0.forward"]["output"]
    assert [o["dtype"] for o in out] == ["torch.float32", "torch.int64"]
    assert out[0]["Max"] == 7.0 and out[1]["Max"] == 1


def test_stack_json_groups_names_and_points_at_the_caller(tmp_path: Path) -> None:
    def body() -> None:
        for _ in range(2):
            F.relu(torch.ones(1))  # run twice: one stack for all four records

    _dump_once(tmp_path, body)
    stack = json.loads((tmp_path / "step0" / "rank" / "stack.json").read_text())
    groups = {tuple(names): lines for names, lines in stack.values()}
    # the four calls of that line share one stack
    relu_lines = groups[
        (
            "Torch.ones.0.forward",
            "Functional.relu.0.forward",
            "Torch.ones.1.forward",
            "Functional.relu.1.forward",
        )
    ]
    assert relu_lines[0].startswith(f"File {__file__}, line ")
    assert "in body, \n F.relu(torch.ones(1))" in relu_lines[0]
    assert not any("pytest_msprobe/dump" in line for lines in groups.values() for line in lines)


def test_only_selected_steps_are_dumped(tmp_path: Path) -> None:
    debugger = PrecisionDebugger(dump_path=tmp_path, task="statistics", level="L1", step=[1])
    for _ in range(3):
        debugger.start()
        F.relu(torch.ones(1))
        debugger.stop()
        debugger.step()
    debugger.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step1"]
    assert debugger.current_step == 3


def test_restarting_within_a_step_rewrites_the_step_with_all_records(tmp_path: Path) -> None:
    debugger = PrecisionDebugger(dump_path=tmp_path, task="statistics", level="L1")
    debugger.start()
    F.relu(torch.ones(1))
    debugger.stop()
    torch.relu(torch.ones(1))  # not captured: between stop and start
    debugger.start()
    F.relu(torch.ones(1))
    debugger.close()
    data = json.loads((tmp_path / "step0" / "rank" / "dump.json").read_text())["data"]
    assert [n for n in data if "relu" in n] == ["Functional.relu.0.forward", "Functional.relu.1.forward"]


def test_forward_only_statistics_of_tinyresnet(tmp_path: Path, train: Any, dump_reader: Any) -> None:
    debugger = PrecisionDebugger(
        dump_path=tmp_path, task="statistics", level="L1", step=[0], data_mode=["forward"]
    )
    train(debugger, steps=1)
    data = dump_reader(tmp_path, 0)["data"]
    assert data and all(name.endswith(".forward") for name in data)
    assert "Functional.conv2d.0.forward" in data and "Functional.cross_entropy.0.forward" in data
    # num_batches_tracked += 1 inside BatchNorm comes before its F.batch_norm call, as in msprobe's dump
    names = list(data)
    assert names.index("Tensor.add_.0.forward") == names.index("Functional.batch_norm.0.forward") - 1
